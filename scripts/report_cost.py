# SPDX-License-Identifier: Apache-2.0
"""What `jobprobe report` costs on a big job: frames of N nodes for S seconds at 1 s (made with the real frame
builder, shaped like standard collection's, with one straggler period), written to one file per node; then the
report generated from them. Prints the time and the page's size.

    python scripts/report_cost.py [--nodes 8] [--seconds 3600] [--dir DIR]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.cluster import report  # noqa: E402
from jobprobe.core.frame import FrameBuilder, encode  # noqa: E402


def make(dir_: Path, nodes: int, seconds: int) -> list[str]:
    dir_.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    t0 = time.time() - seconds
    paths = []
    for n in range(nodes):
        node = f"node-{n:02d}"
        fb = FrameBuilder(node=node, job="big-job", run=f"r{n}")
        path = dir_ / f"{node}.mpk"
        slow = n == 2
        with open(path, "wb") as f:
            for s in range(seconds):
                t = t0 + s
                bad = slow and seconds // 3 <= s < seconds // 2
                probes = {
                    "cgroup": {"cpu_user_ns": int(rng.uniform(6e9, 7e9)), "cpu_system_ns": int(4e8),
                               "cpu_throttled_ns": int(6e8) if bad else 0, "mem_bytes": int(40e9 + s * 1e6),
                               "io_read_bytes": rng.randint(0, 50 << 20), "io_write_bytes": 0},
                    "sched": {"runq_lat_ns": int(rng.uniform(1e7, 3e7)), **{f"offcpu_{r}_ns": int(rng.uniform(1e8, 1e9))
                                                                              for r in report.OFFCPU}},
                    "net": {"tcp_tx_bytes": rng.randint(1 << 28, 1 << 29),
                            "tcp_rx_bytes": rng.randint(1 << 28, 1 << 29)},
                    "gpu": {"gpus": [{"index": i, "util_gpu_pct": rng.randint(30, 50) if bad else rng.randint(90, 99)}
                                     for i in range(8)]},
                    "self": {"cpu_cores": 0.004, "rss_bytes": 30 << 20}}
                f.write(encode(fb.sample(t, 1.0, probes, {p: "ok" for p in probes})))
            if slow:
                f.write(encode(fb.event(t0 + seconds // 3 + 15, "straggler", straggler=node, causes=["cpu_throttled"],
                                        since=t0 + seconds // 3, reason=f"{node}: CPU throttled 60%",
                                        evidence={"wait_s_per_s": 0.1, "peers_wait_s_per_s": 0.9})))
                f.write(encode(fb.event(t0 + seconds // 2 + 15, "straggler_end", straggler=node)))
        paths.append(str(path))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=3600)
    ap.add_argument("--dir", default=None, help="where the frames and the report go (default: a new private "
                    "directory, printed)")
    a = ap.parse_args()
    if a.dir is None:
        a.dir = tempfile.mkdtemp(prefix="jobprobe-report-cost-")
        print(f"frames and report in {a.dir}")
    paths = make(Path(a.dir), a.nodes, a.seconds)
    t = time.monotonic()
    size = report.write(report.from_files(paths), str(Path(a.dir) / "report.html"))
    print(f"{a.nodes} nodes x {a.seconds} s: report in {time.monotonic() - t:.2f} s, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
