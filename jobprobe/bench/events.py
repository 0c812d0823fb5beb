# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench events`: what an eBPF probe adds per kernel event (ns per context switch, per syscall), probe on
vs off, interleaved, with bcc's own tool for the same job as a peer in the same run.

Each round runs a micro-workload (jobprobe.bench.micro) in a fresh cgroup2 group once per mode, in random order:
`off` (nothing attached), the probe alone in a `jobprobe run --cgroup` on that group (the job is watched: the
costlier path through the program), the probe watching another, empty group (`<probe>, other job`: the workload is
then what every task outside the job costs, the path most of a node's events take), and the peer tool
(system-wide, as it ships). The added cost of a mode in a
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
from pathlib import Path

from jobprobe.bench.overhead import _rmdir, _wait_for_hello, scratch
from jobprobe.bench.stats import estimate, median
from jobprobe.core.child import stop_child
from jobprobe.core.errors import BadInput
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel.host import find_cgroup2_mount

# probe → (micro-workload, peer tool from Debian's bpfcc-tools measuring the same events, its argv)
CASES = {
    "sched": ("pingpong", ["runqlat-bpfcc", "3600", "1"]),
}


class Collector:
    """A collector running during one workload run: our agent on the group, or a peer tool."""

    def __init__(self, argv: list[str], ready: str | None = None, out: Path | None = None,
                 stop_signal: int = signal.SIGTERM):
        self.argv, self.ready, self.out, self.stop_signal = argv, ready, out, stop_signal
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        if self.out is not None:
            self.out.unlink(missing_ok=True)
        # stderr to a file, not a pipe nobody drains while the workload runs (a chatty tool would block on it)
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL if self.out is None else subprocess.PIPE)
        if self.out is not None:
            _wait_for_hello(self.out, self.proc)
        else:
            # a bcc tool prints its banner ("Tracing ...") once its programs are attached
            line = self.proc.stdout.readline().decode()
            if self.ready not in line:
                raise BadInput(f"{self.argv[0]} did not start: {line.strip()}")
        return self

    def __exit__(self, *exc):
        # Our agent stops on SIGINT (it installs its own handler). A peer tool is stopped with SIGTERM: a Python
        # tool started from a background shell inherits SIGINT ignored and would never see Ctrl-C.
        if self.proc:
            stop_child(self.proc, 30, self.stop_signal)


def program_stats() -> dict[int, tuple[str, int, int]]:
    """Every BPF program on the node: id → (name, run_time_ns, run_cnt). The counters only move while stats are
    enabled (jobprobe.kernel.bpf.stats_enabled)."""
    out: dict[int, tuple[str, int, int]] = {}
    attr = _bpf.IdAttr(id=0)
    while True:
        try:
            _bpf.sys_bpf(_bpf.PROG_GET_NEXT_ID, attr)
        except OSError:
            return out    # ENOENT: no more programs
        attr.id = attr.next_id
        try:
            fd = _bpf.prog_fd_by_id(attr.id)
        except OSError:
            continue      # unloaded meanwhile
        try:
            info = _bpf.prog_info(fd)
            out[attr.id] = (info.name.decode(errors="replace"), info.run_time_ns, info.run_cnt)
        finally:
            os.close(fd)


def per_program_cost(collector, workload: str, n: int, group: Path) -> dict[str, dict]:
    """ns per run of each program the collector loaded, measured by the kernel (bpf_stats) over one workload run:
    the most direct per-event figure, free of wall-clock noise."""
    before = set(program_stats())
    with collector():
        ours = {i for i in program_stats() if i not in before}
        with _bpf.stats_enabled():
            start = {i: v for i, v in program_stats().items() if i in ours}
            run_workload(workload, n, group)
            end = program_stats()
    out = {}
    for i, (name, t0, c0) in start.items():
        if i in end:
            _, t1, c1 = end[i]
            if c1 > c0:
                out[name] = {"ns_per_run": (t1 - t0) / (c1 - c0), "runs": c1 - c0}
    return out


def run_workload(workload: str, n: int, group: Path) -> dict:
    procs = group / "cgroup.procs"
    res = subprocess.run([sys.executable, "-m", "jobprobe.bench.micro", workload, str(n)], capture_output=True,
                         text=True, preexec_fn=lambda: procs.write_text(str(os.getpid())), timeout=600)
    if res.returncode != 0:
        raise BadInput(f"micro-workload {workload} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def bench_events(probe: str = "sched", rounds: int = 15, n: int = 100_000, peer: bool = True,
                 seed: int | None = None, workdir: Path | None = None, progress=None) -> dict:
    """`workdir`: where the collector's frames go (default: a scratch directory, removed at the end)."""
    if probe not in CASES:
        raise BadInput(f"no per-event benchmark for probe {probe!r}; there is one for: {', '.join(CASES)}")
    mount = find_cgroup2_mount()
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted")
    with scratch(workdir, "jobprobe-bench-events-") as work:
        return _bench_events(probe, rounds, n, peer, seed, work, Path(mount), progress)


def _bench_events(probe: str, rounds: int, n: int, peer: bool, seed: int | None, workdir: Path, mount: Path,
                  progress) -> dict:
    workload, peer_argv = CASES[probe]
    group = Path(mount, "jobprobe-bench", f"events-{os.getpid()}")
    group.mkdir(parents=True, exist_ok=True)
    other = Path(mount, "jobprobe-bench", f"events-other-{os.getpid()}")
    other.mkdir(parents=True, exist_ok=True)
    out = workdir / "events.mpk"

    def ours(watched: Path):
        return lambda: Collector([sys.executable, "-m", "jobprobe.cli", "run", "--cgroup", str(watched),
                                  f"--probes={probe}", "--out", str(out)], out=out, stop_signal=signal.SIGINT)
    modes = {"off": None, probe: ours(group), f"{probe}, other job": ours(other)}
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
        programs = {m: per_program_cost(modes[m], workload, n, group) for m in modes if modes[m] is not None}
    finally:
        _rmdir(group)
        _rmdir(other)
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
                              "ratio": median(times[m]) / median(times["off"]), "programs": programs[m]}
    return result


def markdown(res: dict) -> str:
    plural = res["unit"] + ("es" if res["unit"].endswith("h") else "s")
    lines = [f"`{res['workload']}` micro-workload, {res['events_per_run']:.0f} {plural} per run, "
             f"{res['rounds']} interleaved rounds; {res['off_ns_per_event']:.0f} ns per {res['unit']} with nothing "
             f"attached.", "",
             f"| What was on | Added per {res['unit']} | 95% interval | Workload time ratio |", "| - | - | - | - |"]
    for m, r in res["modes"].items():
        lines.append(f"| {m} | {r['added_ns']:+.0f} ns | {r['lo']:+.0f} to {r['hi']:+.0f} ns | {r['ratio']:.3f} |")
    lines += ["", "Per program, measured by the kernel (bpf_stats) over one more run of the workload:", "",
              "| What was on | Program | ns per run | Runs |", "| - | - | - | - |"]
    for m, r in res["modes"].items():
        for name, p in sorted(r["programs"].items(), key=lambda kv: -kv[1]["runs"]):
            lines.append(f"| {m} | `{name}` | {p['ns_per_run']:.0f} | {p['runs']} |")
    return "\n".join(lines)
