#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Replay a job's stored sample frames through the straggler detector and print what it decided, comparison by
comparison: per node its waited-for gap against its bound, its CPU against its own baseline, the verdict, whether a
hold is building, and the events. For finding why a fault was named late or not at all (a baseline that learnt the
fault, a bound the signal never reached) on a run's own frames, without running the job again.

    python scripts/straggler_replay.py --store STORE.db --job ddp [--node node-b] [--since UNIX_S]

With `--bench RESULT.json` (a `jobprobe bench stragglers --json` run kept with JOBPROBE_KEEP=1, whose trials hold
their fault's time and rank), the replay is scored instead, trial by trial as the bench scores a run: named or not,
time from the fault to the frame that named it, false names — for the detector as it is or with its settings changed
(`--set OPEN_S=5 --set CLOSE_S=3`: a module constant of cluster/stragglers.py, causes.py or waits.py), so that a setting
can be weighed on many recorded faults before a bench run confirms it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.cluster import causes as C  # noqa: E402
from jobprobe.cluster import stragglers as S  # noqa: E402
from jobprobe.cluster import waits as W  # noqa: E402
from jobprobe.cluster.store import Store  # noqa: E402

WATCH_ARGS = {"WINDOW_S": "window", "EVERY_S": "every", "SLICE_S": "slice_s", "OPEN_S": "open_s", "CLOSE_S": "close_s"}


class Traced(S.StragglerWatch):
    """The detector, its per-node verdicts printed (the decision itself unchanged)."""
    trace_all = True

    def __init__(self, out, node: str | None, since: float, **kw):
        super().__init__(**kw)
        self.out, self.node, self.since, self.t = out, node, since, 0.0

    def _verdict(self, n, w, recent, everyone, mine, nt, waits, someone_waited_for):
        kind, found = super()._verdict(n, w, recent, everyone, mine, nt, waits, someone_waited_for)
        if self.node in (None, n):
            gap, med = waits.gap.get(n, (0.0, 0.0))
            cpu, base = mine.get("cpu"), nt.baseline("cpu")
            print(f"{self.t - self.since:7.1f} {n} gap {gap:+.3f} (bound {max(W.WAITED_S, W.WAITED_SHARE * med):.3f}) "
                  f"waited {waits.waited_for(n)} waiting {waits.waiting(n)} cpu {cpu if cpu is not None else 0:.3f} "
                  f"base {base or 0:.3f} share {mine.get('cpu_share') or 0:.3f} "
                  f"usual {nt.baseline('cpu_share') or 0:.3f} "
                  f"verdict {kind or '-'} causes {[c.name for c in found]} holding "
                  f"{nt.kind or '-'}", file=self.out)
        return kind, found


def frames_of(store: str, job: str) -> list[dict]:
    """The job's sample frames, raw and compacted, in time order."""
    st = Store(store, readonly=True)
    try:
        return st.samples_of(job)
    finally:
        st.close()


def replay(store: str, job: str, node: str | None = None, since: float | None = None, out=sys.stdout,
           frames: list[dict] | None = None, **kw) -> list:
    """The detector fed the stored frames in order; the events as (node, job, event, body, frame time)."""
    frames = frames_of(store, job) if frames is None else frames
    watch = Traced(out, node, since if since is not None else (frames[0]["t"] if frames else 0.0), **kw)
    events = []
    for f in frames:
        watch.t = f["t"]
        for ev in watch.feed([f]):
            events.append((*ev, f["t"]))
            print(f"{f['t'] - watch.since:7.1f} EVENT {ev[2]} {ev[0]}: {ev[3].get('reason', '')}", file=out)
    return events


def settings(pairs: list[str]) -> dict:
    """`NAME=VALUE` pairs applied: the detector's constructor arguments returned, module constants set."""
    kw = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        mods = [m for m in (S, C, W) if hasattr(m, name)]   # (stragglers.py holds the names it imports too)
        if not mods or not value:
            raise SystemExit(f"straggler_replay: no setting {name!r} in cluster/stragglers.py, causes.py or waits.py")
        v = type(getattr(mods[0], name))(value)
        for mod in mods:
            setattr(mod, name, v)
        if name in WATCH_ARGS:
            kw[WATCH_ARGS[name]] = v
    return kw


def score(events: list, trials: list[dict]) -> dict:
    """The replay's events scored against the bench's trials as the bench scores its own (bench.stragglers.judge):
    per trial the events from its fault until the next trial's, and the delay of the first if it is the right one."""
    from jobprobe.bench.stragglers import FAULTS, judge, summarize
    named = [e for e in events if e[2] in ("straggler", "imbalance")]
    out = []
    for i, tr in enumerate(trials):
        end = trials[i + 1]["t_fault"] if i + 1 < len(trials) else float("inf")
        mine = [e for e in named if tr["t_fault"] <= e[4] < end]
        bodies = [{**e[3], "event": e[2]} for e in mine]
        verdict = judge(tr["fault"], tr["node"], bodies, bodies[0] if bodies else None)
        out.append({**tr, **verdict,
                    "latency_s": round(mine[0][4] - tr["t_fault"], 1) if verdict["detected"] else None})
    return summarize(out, max((sum(t["fault"] == f for t in trials) for f in FAULTS), default=0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--node", help="print this node's verdicts only")
    ap.add_argument("--since", type=float, help="times printed from this UNIX time (default: the first frame)")
    ap.add_argument("--bench", metavar="RESULT.json", help="score the replay against this bench run's trials")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a detector setting changed")
    a = ap.parse_args()
    kw = settings(a.set)
    if not a.bench:
        replay(a.store, a.job, a.node, a.since, **kw)
        return 0
    from jobprobe.bench.stragglers import markdown
    trials = json.loads(Path(a.bench).read_text())["trials"]
    if not all("t_fault" in t for t in trials):
        raise SystemExit("straggler_replay: the bench's trials hold no fault times (a run from before they did)")
    with open(os.devnull, "w") as quiet:
        events = replay(a.store, a.job, out=quiet, **kw)
    print(markdown(score(events, trials)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
