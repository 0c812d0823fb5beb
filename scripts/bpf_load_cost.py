#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What a probe's start costs with its module compiled (a loader, bcc, LLVM) and loaded from its record
(jobprobe/kernel/bpfcache.py): `jobprobe run --probes P -- true` as a whole (interpreter, agent, the node's
membership module, the probe's module), its CPU time (user + system, every process it started) and wall time, in
interleaved pairs. Root.

    .venv/bin/python scripts/bpf_load_cost.py [--pairs 5] [--probes sched,net,blockio,syscalls]

Prints one line per probe: the median of each, the ratio of the medians and the range of the pairs' ratios."""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def once(probe: str, cache: str) -> tuple[float, float]:
    """(CPU s, wall s) of one start."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", probe, "--stdout", "json", "--", "true"],
                   cwd=REPO, env={**os.environ, "JOBPROBE_BPF_CACHE": cache}, check=True, capture_output=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--probes", default="sched,net,blockio,syscalls")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bpf_load_cost: run it as root (it loads BPF programs)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="jobprobe-load-cost-") as d:
        cache = str(Path(d, "records"))
        print(f"{'probe':10} {'compiled CPU s':>15} {'record CPU s':>13} {'ratio':>6} {'range':>13} "
              f"{'compiled wall s':>16} {'record wall s':>14}")
        for probe in args.probes.split(","):
            once(probe, cache)                      # its records written
            compiled, recorded = [], []
            for _ in range(args.pairs):
                compiled.append(once(probe, "off"))
                recorded.append(once(probe, cache))
            ratios = [r[0] / c[0] for c, r in zip(compiled, recorded)]
            cc, rc = statistics.median(c[0] for c in compiled), statistics.median(r[0] for r in recorded)
            print(f"{probe:10} {cc:15.2f} {rc:13.2f} {rc / cc:6.2f} {min(ratios):6.2f}-{max(ratios):<6.2f} "
                  f"{statistics.median(c[1] for c in compiled):16.2f} "
                  f"{statistics.median(r[1] for r in recorded):14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
