# SPDX-License-Identifier: Apache-2.0
"""What naming stragglers costs the controller: per job per tick, for jobs of N nodes, on frames shaped like real
ones (cgroup, sched, net, nic, gpu sections). Prints one line per size. `--jobs J`: J jobs of that size, their
frames fed together each tick, as a controller's batch holds every job's.

    python scripts/straggler_cost.py [--nodes 2,8,64] [--ticks 600] [--jobs 1]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.cluster.stragglers import StragglerWatch  # noqa: E402


def frame(node: str, t: float, rng: random.Random, job: str = "big") -> dict:
    return {"v": 1, "kind": "sample", "node": node, "job": job, "run": "r", "seq": int(t), "t": t, "dt": 1.0,
            "probes": {
                "cgroup": {"cpu_user_ns": int(rng.uniform(7e9, 8e9)), "cpu_system_ns": int(5e8),
                           "cpu_throttled_ns": 0},
                "sched": {"runq_lat_ns": int(rng.uniform(1e7, 2e7)), "offcpu_lock_ns": int(rng.uniform(1e9, 2e9)),
                          "offcpu_wait_ns": int(3e8)},
                "net": {"tcp_tx_bytes": 1 << 30, "tcp_rx_bytes": 1 << 30, "tcp_retransmits": 0,
                        "tcp_srtt_us": 80.0, "tcp_tx_packets": 700000},
                "nic": {"nics": [{"name": f"eth{i}", "qdisc_overlimits": 0, "qdisc_drops": 0, "tx_dropped": 0}
                                 for i in range(2)]},
                "gpu": {"gpus": [{"util_gpu_pct": rng.randint(90, 99), "sm_clock_mhz": 1980,
                                  "clock_event_reasons": 0} for _ in range(8)]}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="2,8,64")
    ap.add_argument("--ticks", type=int, default=600)
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args()
    for n in map(int, a.nodes.split(",")):
        rng = random.Random(n)
        nodes = [(f"j{j}", f"n{j}-{i}") for j in range(a.jobs) for i in range(n)]
        ticks = [[frame(x, 1000.0 + s, rng, job) for job, x in nodes] for s in range(a.ticks)]
        w = StragglerWatch()
        t0 = time.process_time()
        for batch in ticks:
            w.feed(batch)
        cpu = time.process_time() - t0
        per = cpu / a.ticks / a.jobs
        print(f"{n} nodes{f' x {a.jobs} jobs' if a.jobs > 1 else ''}: {per * 1e3:.3f} ms CPU per job-tick "
              f"({per / n * 1e6:.1f} µs per node-frame), {w.evaluations} comparisons in {a.ticks} ticks")


if __name__ == "__main__":
    main()
