#!/usr/bin/env python3
"""Replay a job's stored sample frames through the straggler detector and print what it decided, comparison by
comparison: per node its waited-for gap against its bound, its CPU against its own baseline, the verdict, whether a
hold is building, and the events. For finding why a fault was named late or not at all (a baseline that learnt the
fault, a bound the signal never reached) on a run's own frames, without running the job again.

    python scripts/straggler_replay.py --store STORE.db --job ddp [--node node-b] [--since UNIX_S]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.cluster import stragglers as S  # noqa: E402
from jobprobe.cluster.store import Store  # noqa: E402


class Traced(S.StragglerWatch):
    """The detector, its per-node verdicts printed (the decision itself unchanged)."""

    def __init__(self, out, node: str | None, since: float):
        super().__init__()
        self.out, self.node, self.since, self.t = out, node, since, 0.0

    def _verdict(self, n, w, recent, everyone, mine, nt, waits, someone_waited_for):
        kind, found = super()._verdict(n, w, recent, everyone, mine, nt, waits, someone_waited_for)
        if self.node in (None, n):
            gap, med = waits.gap.get(n, (0.0, 0.0))
            cpu, base = mine.get("cpu"), nt.baseline("cpu")
            print(f"{self.t - self.since:7.1f} {n} gap {gap:+.3f} (bound {max(S.WAITED_S, S.WAITED_SHARE * med):.3f}) "
                  f"waited {waits.waited_for(n)} waiting {waits.waiting(n)} cpu {cpu if cpu is not None else 0:.3f} "
                  f"base {base or 0:.3f} share {mine.get('cpu_share') or 0:.3f} "
                  f"usual {nt.baseline('cpu_share') or 0:.3f} "
                  f"verdict {kind or '-'} causes {[c.name for c in found]} holding "
                  f"{nt.kind or '-'}", file=self.out)
        return kind, found


def replay(store: str, job: str, node: str | None = None, since: float | None = None, out=sys.stdout) -> list:
    st = Store(store, readonly=True)
    try:
        _, rows = st.sql("SELECT body FROM samples WHERE job = ? ORDER BY t", (job,))
    finally:
        st.close()
    frames = [json.loads(b) for (b,) in rows]
    watch = Traced(out, node, since if since is not None else (frames[0]["t"] if frames else 0.0))
    events = []
    for f in frames:
        watch.t = f["t"]
        for ev in watch.feed([f]):
            events.append(ev)
            print(f"{f['t'] - watch.since:7.1f} EVENT {ev[2]} {ev[0]}: {ev[3].get('reason', '')}", file=out)
    return events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--node", help="print this node's verdicts only")
    ap.add_argument("--since", type=float, help="times printed from this UNIX time (default: the first frame)")
    a = ap.parse_args()
    replay(a.store, a.job, a.node, a.since)
    return 0


if __name__ == "__main__":
    sys.exit(main())
