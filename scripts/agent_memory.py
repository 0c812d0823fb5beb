#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What the agent's RSS is made of: a real `jobprobe agent` (standard collection, 1 s, frames to files) with N idle
jobs (a cgroup2 group each with one sleeping process), its /proc/PID/smaps summed by mapping after the jobs have
ticked a while. As root: `python scripts/agent_memory.py 1 64` (docs/ARCHITECTURE.md, "Memory")."""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.bench.agent import AgentUnderTest, JobGroups  # noqa: E402
from jobprobe.kernel.host import find_cgroup2_mount  # noqa: E402


def by_mapping(pid: int) -> collections.Counter:
    """RSS in KiB per mapping: a library by its file name, [heap], [anon], [stack]…"""
    out: collections.Counter = collections.Counter()
    cur = "?"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
                cur = os.path.basename(name) if name.startswith("/") else name
            elif parts and parts[0] == "Rss:":
                out[cur] += int(parts[1])
    return out


def measure(n: int, settle: float) -> collections.Counter:
    jobs = JobGroups(Path(find_cgroup2_mount(), "jobprobe-bench", f"memory-{os.getpid()}"))
    try:
        groups = [jobs.add(f"job-{i}", ["sleep", "1000000"]) for i in range(n)]
        with tempfile.TemporaryDirectory(prefix="jobprobe-memory-") as work:
            agent = AgentUnderTest(Path(work), "std", 1.0)
            try:
                for i, g in enumerate(groups):
                    agent.ctl(cmd="attach", cgroup=str(g), job=f"idle-{i}")
                time.sleep(settle)
                return by_mapping(agent.proc.pid)
            finally:
                agent.close()
    finally:
        jobs.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jobs", type=int, nargs="+", help="numbers of idle jobs, one agent each")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of ticks before reading (default 10)")
    args = ap.parse_args()
    for n in args.jobs:
        rss = measure(n, args.settle)
        print(f"{n} idle jobs: RSS {sum(rss.values()) / 1024:.1f} MiB")
        for name, kib in rss.most_common(6):
            print(f"  {kib / 1024:6.2f} MiB  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
