#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the known-badput job's seconds went, against its own clock of each one: the reference job
(scripts/train_cpu.py, PyTorch on 2 threads, 2 loader workers, a 4 s startup, a 1.5 s loader stall every 24 batches,
a 768 MiB fsync'd checkpoint every 30 steps — tests/test_timeuse.py's known-badput run) under `jobprobe run --probes
cgroup,sched`, with --timeline: the UNIX times of each of its waits for a batch and each checkpoint. Root.

    .venv/bin/python scripts/timeuse_truth.py [--runs 5] [--steps 130] [--stall-every N] [--checkpoint-every K]
        [--checkpoint-mib M] [--hogs N] [--keep DIR] [--intervals]

Prints per run the steady pace and, per bucket, ours against the job's own total (input, checkpointing, computing
from its first step to its last); --hogs N runs N CPU hogs at nice 5 outside the job for the whole run (noisy
neighbours on its CPUs); --intervals adds each interval's truth beside its buckets. --keep DIR keeps each
run's frames and timeline (DIR/runN/job.mpk, tl.json) for a replay through a changed jobprobe/core/timeuse.py:
`--replay DIR/run*` reads them instead of running the job."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgpack

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from jobprobe.core.timeuse import decompose  # noqa: E402

HOG = "while True:\n    pass\n"


def run(d: Path, steps: int, stall_every: int, ck_every: int, ck_mib: int, hogs: int = 0) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.mpk").unlink(missing_ok=True)
    neighbours = [subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        r = job(d, steps, stall_every, ck_every, ck_mib)
    finally:
        for h in neighbours:
            h.kill()
            h.wait()
    if r.returncode:
        raise SystemExit(f"timeuse_truth: the job failed: {r.stderr[-500:]}")
    (d / "checkpoint.bin").unlink(missing_ok=True)


def job(d: Path, steps: int, stall_every: int, ck_every: int, ck_mib: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,sched", "--out",
                           str(d / "job.mpk"), "--", sys.executable, str(REPO / "scripts" / "train_cpu.py"), "--steps",
                           str(steps), "--seconds", "90", "--startup-s", "4", "--loader-workers", "2",
                           "--stall-every", str(stall_every), "--stall-s", "1.5", "--checkpoint-every",
                           str(ck_every), "--checkpoint-mib", str(ck_mib), "--checkpoint-dir", str(d), "--threads",
                           "2", "--timeline", str(d / "tl.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def counted(span: list[float]) -> float:
    """A span's seconds as the job counted them: an input span's blocked part (its third figure), else all of it."""
    return span[2] if len(span) > 2 else span[1] - span[0]


def overlap(spans: list[list[float]], a: float, b: float) -> float:
    """The spans' counted seconds inside [a, b] (a span's blocked part spread evenly over it)."""
    return sum(max(0.0, min(b, s[1]) - max(a, s[0])) * counted(s) / (s[1] - s[0]) for s in spans if s[1] > s[0])


def report(d: Path, intervals: bool) -> dict[str, float]:
    with open(d / "job.mpk", "rb") as f:
        frames = list(msgpack.Unpacker(f, raw=False))
    tl = json.loads((d / "tl.json").read_text())
    out = decompose(frames, intervals=intervals)
    b = out["buckets"]
    truth = {"waiting_for_input": sum(map(counted, tl["input"])), "checkpointing": sum(map(counted, tl["checkpoint"]))}
    truth["computing"] = tl["last"] - tl["first_step"] - truth["waiting_for_input"] - truth["checkpointing"]
    err = {k: b[k] / v - 1 for k, v in truth.items() if v > 0}
    print(f"{d.name}: steady {out['pace']['steady']:.3f} {out['pace']['of']}; " +
          "; ".join(f"{k} {b[k]:.2f} s / own {truth[k]:.2f} s ({err[k]:+.1%})" for k in truth) +
          f"; starved {b['starved']:.2f} s, other {b['other']:.2f} s")
    for i in out.get("intervals", []):
        lo, hi = i["t"] - i["dt"], i["t"]
        print(f"  {lo:.2f}+{i['dt']:.2f}: own input {overlap(tl['input'], lo, hi):.2f} checkpoint "
              f"{overlap(tl['checkpoint'], lo, hi):.2f} | " +
              " ".join(f"{k} {v:.2f}" for k, v in i["buckets"].items()))
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=130, help="the job's steps (its data: it ends when they are read)")
    ap.add_argument("--stall-every", type=int, default=24, help="a loader stall every N batches (default 24)")
    ap.add_argument("--checkpoint-every", type=int, default=30, help="a checkpoint every K steps (default 30)")
    ap.add_argument("--checkpoint-mib", type=int, default=768, help="of M MiB (default 768)")
    ap.add_argument("--hogs", type=int, default=0, help="N CPU hogs at nice 5 beside the job (default none)")
    ap.add_argument("--keep", type=Path, help="keep each run's frames and timeline here")
    ap.add_argument("--intervals", action="store_true", help="each interval's truth beside its buckets")
    ap.add_argument("--replay", type=Path, nargs="+", help="kept runs to read instead of running the job")
    a = ap.parse_args()
    dirs = a.replay or []
    if not dirs:
        base = a.keep or Path(tempfile.mkdtemp(prefix="timeuse-truth-"))
        for n in range(a.runs):
            run(base / f"run{n}", a.steps, a.stall_every, a.checkpoint_every, a.checkpoint_mib, a.hogs)
            dirs.append(base / f"run{n}")
    errs = [report(d, a.intervals) for d in dirs]
    if not a.replay and not a.keep:
        shutil.rmtree(dirs[0].parent)
    for k in errs[0]:
        xs = [e[k] for e in errs if k in e]
        print(f"{k}: {min(xs):+.1%} … {max(xs):+.1%} over {len(xs)} runs")


if __name__ == "__main__":
    main()
