#!/usr/bin/env python3
"""Waiting for peers against the job's own clocks: the real three-rank DDP job (jobprobe/bench/ddp.py — PyTorch,
gloo, each rank in its own network namespace with its own agent, a controller over NATS; tests/test_stragglers.py's
job), 20 s in step, then a rank's CPU limited to 0.25 cores three times (rank 1 twice, rank 2 once; 12–20 s each),
each until the controller names it and ends its episode. Root.

    .venv/bin/python scripts/peers_truth.py [--runs 2] [--keep DIR]
    .venv/bin/python scripts/peers_truth.py --replay DIR/run*      # kept runs through the current summary code

Per episode and waiting rank: its `waiting_for_peers` (`jobprobe summary`'s per-node bucket, the intervals inside
the episode) against two clocks — the progress the job lost in the episode by rank 0's own step count, against its
pace around the limit (the mean of its rates over the 6 s before the limit and over 6 s from 2 s after it went: the
job's pace drifts a few % a minute), and the rank's own main thread's time blocked in collectives above its rate
before the limit (`scripts/ddp_job.py`: its schedstat around the all-reduced backward pass; not all a rank loses
to its peers: a lower bound).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from jobprobe.cluster import report  # noqa: E402
from jobprobe.cluster import summary as S  # noqa: E402
from jobprobe.core.timeuse import decompose, usable  # noqa: E402

LIMITS = ((1, 3.0), (1, 7.0), (2, 11.0))    # (rank, seconds held after it was named)
NODES = ("node-a", "node-b", "node-c")


def run(d: Path) -> None:
    """The job and its limits, into d: the store, the ranks' logs, marks.json (when each limit came and went)."""
    from jobprobe.bench.ddp import PROBES, Cluster, DdpJob
    from jobprobe.bench.local import until
    from jobprobe.kernel.host import find_cgroup2_mount
    d.mkdir(parents=True, exist_ok=True)
    ddp = DdpJob(find_cgroup2_mount(), seconds=400, data_mb=128, gpu_ms=6)
    cluster = Cluster(d, ddp, probes=PROBES + ",gpu", partitions=1)
    marks: dict[str, list] = {"limits": []}
    try:
        cluster.start_agents()
        ddp.start(d)
        cluster.attach()
        until(lambda: len(ddp.rates(0)) >= 3, 60, "the job to train")
        until(lambda: len({n for n, *_ in cluster.samples()}) == 3, 30, "frames of the three nodes")
        time.sleep(20)
        for rank, hold in LIMITS:
            before = len(cluster.events("straggler"))
            t0 = time.time()
            ddp.throttle(rank, 0.25)
            until(lambda: cluster.events("straggler")[before:], 30, "the straggler named")
            time.sleep(hold)
            t1 = time.time()
            ddp.throttle(rank, None)
            until(lambda: len(cluster.events("straggler_end")) > before, 30, "its end")
            marks["limits"].append([rank, t0, t1])
            time.sleep(10)                          # the pace after it (to 8 s)
        (d / "marks.json").write_text(json.dumps(marks))
    finally:
        cluster.close()
        ddp.close()


def progress(d: Path, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A rank's prints: UNIX times, steps so far, seconds blocked in collectives so far."""
    rows = [(float(m[3]), float(m[1]), float(m[2])) for m in re.finditer(
        r"step (\d+): [\d.]+ steps/s, blocked in collectives ([\d.]+) s at ([\d.]+)", (d / f"rank{rank}.log").read_text())]
    return tuple(np.array(c) for c in zip(*rows))          # type: ignore[return-value]


def score(d: Path) -> list[dict]:
    """Per episode and waiting node: its bucket and the two clocks."""
    frames = S.frames_of_store(d / "store.db", "ddp")
    by_node: dict[str, list[dict]] = {}
    hellos: dict[str, list[dict]] = {}
    for f in frames:
        if usable(f):
            by_node.setdefault(f["node"], []).append(f)
        elif f.get("kind") == "hello":
            hellos.setdefault(f["node"], []).append(f)
    nodes = {n: decompose(hellos.get(n, []) + fs, intervals=True) for n, fs in sorted(by_node.items())}
    events = sorted((f for f in frames if f.get("kind") == "event"), key=lambda e: e["t"])
    ends = [f["t"] for fs in by_node.values() for f in fs]
    periods = [{**p, "node": str(p["node"])} for p in report.straggler_periods(S.Episodes(events, max(ends)))]
    S.to_peers(nodes, periods)
    limits = json.loads((d / "marks.json").read_text())["limits"]
    t, k, _ = progress(d, 0)

    def steps(a: float, z: float) -> float:
        return float(np.interp(z, t, k) - np.interp(a, t, k))
    out = []
    for p, (rank, t0, t1) in zip(periods, limits):
        pace = (steps(t0 - 6.5, t0 - 0.5) + steps(t1 + 2, t1 + 8)) / 12
        a, z = p["start"], min(p["end"], t1 + 2)
        lost = z - a - steps(a, z) / pace
        for r, n in enumerate(NODES):
            if n == p["node"]:
                continue
            tb, _, b = progress(d, r)

            def blocked(x: float, y: float) -> float:
                return float(np.interp(y, tb, b) - np.interp(x, tb, b))
            own = blocked(p["start"], p["end"]) - blocked(t0 - 6.5, t0 - 0.5) / 6 * (p["end"] - p["start"])
            w = sum(i["buckets"].get("waiting_for_peers", 0.0) for i in nodes[n]["intervals"]
                    if p["start"] <= i["t"] - i["dt"] / 2 <= p["end"])
            out.append({"run": d.name, "straggler": p["node"], "node": n, "episode_s": round(p["end"] - p["start"], 1),
                        "bucket": w, "lost": lost, "own": own})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="keep each run (its store, logs, marks) here")
    ap.add_argument("--replay", type=Path, nargs="+", help="kept runs to read instead of running the job")
    a = ap.parse_args()
    dirs = a.replay or []
    if not dirs:
        root = a.keep or Path(tempfile.mkdtemp(prefix="jobprobe-peers-"))
        for i in range(a.runs):
            run(root / f"run{i}")
            dirs.append(root / f"run{i}")
    rows = [r for d in dirs for r in score(d)]
    for r in rows:
        print(f"{r['run']} {r['straggler']} ({r['episode_s']} s): {r['node']} waiting_for_peers {r['bucket']:.2f} s; "
              f"the job lost {r['lost']:.2f} s of progress ({r['bucket'] / r['lost']:.2f}x); its own time blocked in "
              f"collectives {r['own']:.2f} s ({r['bucket'] / r['own']:.2f}x)")
    x = [r["bucket"] / r["lost"] for r in rows]
    y = [r["bucket"] / r["own"] for r in rows]
    print(f"{len(rows)} episodes x waiting ranks: against lost progress {min(x):.2f}-{max(x):.2f}x "
          f"(median {np.median(x):.2f}), against their own blocked time {min(y):.2f}-{max(y):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
