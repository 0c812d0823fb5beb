#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Waiting for peers against the job's own clocks: the real three-rank DDP job (jobprobe/bench/ddp.py — PyTorch,
gloo, each rank in its own network namespace with its own agent, a controller over NATS; tests/test_stragglers.py's
job), 20 s in step, then a rank's CPU limited to 0.1 cores three times (rank 1 twice, rank 2 once; 12–20 s each),
each until the controller names it and ends its episode. Root.

    .venv/bin/python scripts/peers_truth.py [--runs 2] [--cores 0.1] [--keep DIR]
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
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from jobprobe.bench.ddpclock import lost_progress, lost_progress_band, more_blocked, progress  # noqa: E402
from jobprobe.cluster import summary as S  # noqa: E402

LIMITS = ((1, 3.0), (1, 7.0), (2, 11.0))    # (rank, seconds held after it was named)
NODES = ("node-a", "node-b", "node-c")


def run(d: Path, cores: float = 0.1) -> None:
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
            ddp.throttle(rank, cores)
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


def score(d: Path) -> list[dict]:
    """Per episode and waiting node: its bucket and the two clocks."""
    _, nodes, periods = S.split(S.frames_of_store(d / "store.db", "ddp"))
    S.to_peers(nodes, periods)
    limits = json.loads((d / "marks.json").read_text())["limits"]
    clocks = [progress(d / f"rank{r}.log") for r in range(len(NODES))]
    out = []
    for p, (_, t0, t1) in zip(periods, limits):
        steps, span = [(t, k) for t, k, _ in clocks[0]], (p["start"], min(p["end"], t1 + 2))
        lost, band = lost_progress(steps, (t0, t1), span), lost_progress_band(steps, (t0, t1), span)
        for r, n in enumerate(NODES):
            if n == p["node"]:
                continue
            own = more_blocked([(t, b) for t, _, b in clocks[r]], (t0 - 6.5, t0 - 0.5), (p["start"], p["end"]))
            w = sum(i["buckets"].get("waiting_for_peers", 0.0) for i in nodes[n]["intervals"]
                    if p["start"] <= i["t"] - i["dt"] / 2 <= p["end"])
            out.append({"run": d.name, "straggler": p["node"], "node": n, "episode_s": round(p["end"] - p["start"], 1),
                        "bucket": w, "lost": lost, "band": band, "own": own})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cores", type=float, default=0.1,
                    help="the limited rank's CPU (cores; at 0.25 the progress lost is a third of the episode or less, "
                         "and the job's own pace, which moves 5-10%% a minute here, blurs the reference by up to 12%%)")
    ap.add_argument("--keep", type=Path, help="keep each run (its store, logs, marks) here")
    ap.add_argument("--replay", type=Path, nargs="+", help="kept runs to read instead of running the job")
    a = ap.parse_args()
    dirs = a.replay or []
    if not dirs:
        root = a.keep or Path(tempfile.mkdtemp(prefix="jobprobe-peers-"))
        for i in range(a.runs):
            run(root / f"run{i}", a.cores)
            dirs.append(root / f"run{i}")
    rows = [r for d in dirs for r in score(d)]
    for r in rows:
        print(f"{r['run']} {r['straggler']} ({r['episode_s']} s): {r['node']} waiting_for_peers {r['bucket']:.2f} s; "
              f"the job lost {r['lost']:.2f} s of progress ({r['bucket'] / r['lost']:.2f}x; "
              f"{r['band'][0]:.2f}-{r['band'][1]:.2f} s by the pace before or after alone); its own time blocked in "
              f"collectives {r['own']:.2f} s ({r['bucket'] / r['own']:.2f}x)")
    x = [r["bucket"] / r["lost"] for r in rows]
    y = [r["bucket"] / r["own"] for r in rows]
    near = sum(abs(v - 1) <= 0.1 for v in x)
    banded = sum(0.9 * r["band"][0] <= r["bucket"] <= 1.1 * r["band"][1] for r in rows)
    print(f"{len(rows)} episodes x waiting ranks: against lost progress {min(x):.2f}-{max(x):.2f}x "
          f"(median {np.median(x):.2f}; {near} within 10%, {banded} within 10% of the band the pace before and "
          f"after each give), against their own blocked time {min(y):.2f}-{max(y):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
