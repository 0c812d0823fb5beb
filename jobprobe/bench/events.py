"""`jobprobe bench events`: what an eBPF probe adds per kernel event (ns per context switch, per syscall), probe on
vs off, interleaved, with bcc's own tool for the same job as a peer in the same run.

Each round runs a micro-workload (jobprobe.bench.micro) in a fresh cgroup2 group once per mode, in random order:
`off` (nothing attached), the probe alone in a `jobprobe run --cgroup` on that group (the job is watched: the
costlier path through the program), and the peer tool (system-wide, as it ships). The added cost of a mode in a
round is (its time - the `off` time of that round) / events; the estimate is the mean over rounds with a 95%
interval. Times are wall time of the whole workload, so this is the cost the job feels, not only the program's.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jobprobe.bench.overhead import _rmdir, _wait_for_hello
from jobprobe.bench.stats import estimate, median
from jobprobe.errors import BadInput
from jobprobe.host import find_cgroup2_mount

# probe → (micro-workload, peer tool from Debian's bpfcc-tools measuring the same events, its argv)
CASES = {
    "sched": ("pingpong", ["runqlat-bpfcc", "3600", "1"]),
}


class Collector:
    """A collector running during one workload run: our agent on the group, or a peer tool."""

    def __init__(self, argv: list[str], ready: str | None = None, out: Path | None = None):
        self.argv, self.ready, self.out = argv, ready, out
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        if self.out is not None:
            self.out.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        if self.out is not None:
            _wait_for_hello(self.out, self.proc)
        else:
            # a bcc tool prints its banner ("Tracing ...") once its programs are attached
            line = self.proc.stdout.readline().decode()
            if self.ready not in line:
                raise BadInput(f"{self.argv[0]} did not start: {line.strip()} {self.proc.stderr.read().decode()}")
        return self

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


def run_workload(workload: str, n: int, group: Path) -> dict:
    procs = group / "cgroup.procs"
    res = subprocess.run([sys.executable, "-m", "jobprobe.bench.micro", workload, str(n)], capture_output=True,
                         text=True, preexec_fn=lambda: procs.write_text(str(os.getpid())), timeout=600)
    if res.returncode != 0:
        raise BadInput(f"micro-workload {workload} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def bench_events(probe: str = "sched", rounds: int = 15, n: int = 100_000, peer: bool = True,
                 seed: int | None = None, workdir: Path | None = None, progress=None) -> dict:
    if probe not in CASES:
        raise BadInput(f"no per-event benchmark for probe {probe!r}; there is one for: {', '.join(CASES)}")
    workload, peer_argv = CASES[probe]
    mount = find_cgroup2_mount()
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted")
    workdir = workdir or Path(f"/tmp/jobprobe-bench-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    group = Path(mount, "jobprobe-bench", f"events-{os.getpid()}")
    group.mkdir(parents=True, exist_ok=True)
    out = workdir / "events.mpk"
    modes = {"off": None,
             probe: lambda: Collector([sys.executable, "-m", "jobprobe.cli", "run", "--cgroup", str(group),
                                       f"--probes={probe}", "--out", str(out)], out=out)}
    if peer and shutil.which(peer_argv[0]):
        modes[peer_argv[0]] = lambda: Collector(peer_argv, ready="Tracing")
    rng = random.Random(seed)
    times: dict[str, list[float]] = {m: [] for m in modes}
    events: list[int] = []
    try:
        run_workload(workload, n // 10, group)   # warm-up
        for r in range(rounds):
            order = list(modes)
            rng.shuffle(order)
            for m in order:
                if modes[m] is None:
                    res = run_workload(workload, n, group)
                else:
                    with modes[m]():
                        res = run_workload(workload, n, group)
                times[m].append(res["ns"])
                if m == "off":
                    events.append(res["events"])
            if progress is not None:
                progress.write(f"round {r + 1}/{rounds}: " + "  ".join(
                    f"{m} {times[m][-1] / events[-1]:.0f} ns/{res['unit']}" for m in modes) + "\n")
                progress.flush()
    finally:
        _rmdir(group)
        out.unlink(missing_ok=True)
    unit = res["unit"]
    result = {"probe": probe, "workload": workload, "n": n, "rounds": rounds, "unit": unit,
              "events_per_run": median(events), "off_ns_per_event": median(
                  [t / e for t, e in zip(times["off"], events)]), "modes": {}}
    for m in modes:
        if m == "off":
            continue
        added = [(t - b) / e for t, b, e in zip(times[m], times["off"], events)]
        est = estimate(added)
        result["modes"][m] = {"added_ns": est.mean, "lo": est.lo, "hi": est.hi,
                              "ratio": median(times[m]) / median(times["off"])}
    return result


def markdown(res: dict) -> str:
    plural = res["unit"] + ("es" if res["unit"].endswith("h") else "s")
    lines = [f"`{res['workload']}` micro-workload, {res['events_per_run']:.0f} {plural} per run, "
             f"{res['rounds']} interleaved rounds; {res['off_ns_per_event']:.0f} ns per {res['unit']} with nothing "
             f"attached.", "",
             f"| What was on | Added per {res['unit']} | 95% interval | Workload time ratio |", "| - | - | - | - |"]
    for m, r in res["modes"].items():
        lines.append(f"| {m} | {r['added_ns']:+.0f} ns | {r['lo']:+.0f} to {r['hi']:+.0f} ns | {r['ratio']:.3f} |")
    return "\n".join(lines)
