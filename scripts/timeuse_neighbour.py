#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where a job's seconds went beside a noisy neighbour: the reference job (scripts/train_cpu.py, one thread) and a CPU
hog pinned to the same CPU, the hog there for part of the run or all of it, under `jobprobe run --probes
cgroup,sched`; the summary's `starved` and `computing` against the job's own account: its threads' wait for a CPU by
the kernel's count (schedstat run_delay, to the process's exit: tests/workloads.py `reaped` reads it once the job has
exited, its teardown after its last line included) and its steps' time less their main thread's wait for a CPU in
them (one thread). Root.

    .venv/bin/python scripts/timeuse_neighbour.py [--runs 3] [--seconds 16] [--cpu 1] [--keep DIR]

Prints one line per run and case; --keep DIR keeps each run's frames (DIR/run<i>-<case>.mpk)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from train_cpu import own_clock  # noqa: E402

HOG = "import time\nwhile True:\n    pass\n"


def run(out: Path, cpu: int, seconds: float, hog_from: float, hog_to: float) -> dict:
    out.unlink(missing_ok=True)
    job = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,sched", "--out", str(out),
                            "--", "taskset", "-c", str(cpu), sys.executable, str(REPO / "tests" / "workloads.py"),
                            "reaped", sys.executable, str(REPO / "scripts" / "train_cpu.py"),
                            "--steps", "1000000", "--seconds", str(seconds), "--threads", "1"],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    time.sleep(hog_from)
    hog = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", HOG])
    time.sleep(max(0.0, t0 + hog_to - time.monotonic()))
    hog.kill()
    hog.wait()
    stdout, stderr = job.communicate(timeout=seconds + 120)
    if job.returncode != 0:
        raise SystemExit(f"timeuse_neighbour: the job failed: {stderr[-500:]}")
    s = json.loads(subprocess.run([sys.executable, "-m", "jobprobe.cli", "summary", "--format", "json", str(out)],
                                  cwd=REPO, capture_output=True, text=True, check=True).stdout)
    own = own_clock(stdout)
    return {"starved": s["buckets"]["starved"], "computing": s["buckets"]["computing"], "other": s["buckets"]["other"],
            "own_run_delay": own["run_delay_to_exit_s"], "own_compute": own["compute_s"] - own["steps_run_delay_s"],
            "wall": s["wall_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=16)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="keep each run's frames here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("timeuse_neighbour: run it as root (the probes load BPF programs)", file=sys.stderr)
        return 2
    startup = 4.0                                   # the job's imports, before its first step
    cases = {"hog for the middle third": (startup + (a.seconds) / 3, startup + 2 * a.seconds / 3),
             "hog from about the first step to the end": (startup, startup + a.seconds + 2),
             "hog from the job's start to its end": (0.0, startup + a.seconds + 2)}
    with tempfile.TemporaryDirectory(prefix="jobprobe-neighbour-") as d:
        keep = a.keep or Path(d)
        keep.mkdir(parents=True, exist_ok=True)
        for i in range(a.runs):
            for k, (name, (t1, t2)) in enumerate(cases.items()):
                r = run(keep / f"run{i + 1}-{k + 1}.mpk", a.cpu, a.seconds, t1, t2)
                print(f"run {i + 1} {name}: starved {r['starved']:.2f} s (the job's own wait for a CPU "
                      f"{r['own_run_delay']:.2f} s), computing {r['computing']:.2f} s (its steps less their wait "
                      f"{r['own_compute']:.2f} s), other {r['other']:.2f} s, wall {r['wall']:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
