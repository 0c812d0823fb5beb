# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench accuracy`: each figure a job's frames sum to, beside an independent count of the same thing.

Each reference workload runs N times as `jobprobe run --probes P --interval S --stdout json -- WORKLOAD` (the real
command line, in a subprocess), beside a neighbour load started outside the job, and the figure summed over the
job's sample frames is compared with what the workload itself says it did: dd's "N bytes copied", the process's
own getrusage, the number of calls its loop made. docs/ACCURACY.md says why each bound is what it is.

Error of a run = (figure + counted loss - reference) / reference, where the counted loss is what the probe itself
reported as missed in the same unit (blockio's *_lost_bytes, inflight_expired); a run whose figure plus counted loss
falls short of the reference by more than the bound is a *silent shortfall*: missed, and not said. A row passes
with no silent shortfall and every run's |error| within the bound; a run with a counted loss is listed, not failed.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from jobprobe.bench.overhead import free_port, scratch
from jobprobe.bench.stats import median
from jobprobe.core.errors import BadInput

ROOT = Path(__file__).resolve().parents[2]
BS = 64 * 1024
SHORT_MIB = 16            # one dd of this size ends well within one 0.5 s tick (~0.1 s here)
LONG_MIB = 192            # several ticks (1-3 s here; longer beside --load cpu+io)
SYSCALL_N = 300_000
FORKS = 200
LOADS = ("none", "cpu", "cpu+io", "net")
JOB_TIMEOUT_S = 180

# Workloads that report their own counts, as JSON, to the file named by their last argument (the job's stdout
# carries jobprobe's frames). RUSAGE_SELF covers the whole process from its fork: all that the job group can hold;
# the CPU workloads leave with _exit right after writing it, because the interpreter's teardown after the reading
# (10-20 ms of CPU, more beside a CPU hog) is CPU the job spent and the reference did not see: +1.2% p50 and +2.9%
# worst over 20 runs beside cpu+io before they did.
BURN = """import json, os, resource, sys, time
end = time.monotonic() + float(sys.argv[1])
x = 0
while time.monotonic() < end:
    for i in range(2000):
        x += i * i
r = resource.getrusage(resource.RUSAGE_SELF)
with open(sys.argv[2], "w") as f:
    json.dump({"cpu_ns": round((r.ru_utime + r.ru_stime) * 1e9)}, f)
os._exit(0)
"""
GETPPID = """import json, os, sys
n = int(sys.argv[1])
f = os.getppid
for _ in range(n):
    f()
json.dump({"calls": n}, open(sys.argv[2], "w"))
"""
# Each child burns a little CPU and leaves with _exit (no interpreter teardown); the parent waits for all, so
# RUSAGE_CHILDREN holds every one of them.
FORK = """import json, os, resource, sys, time
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 0.004
        while time.monotonic() < end:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[2], "w") as f:
    json.dump({"cpu_ns": round((s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime) * 1e9)}, f)
os._exit(0)
"""
DD_BYTES = re.compile(r"^(\d+) bytes .* copied", re.M)


@dataclass(frozen=True)
class Figure:
    """One figure of one probe, summed over a job's frames, against one reference quantity of the workload."""

    name: str                  # "blockio.read_bytes"; a sum of fields is written "cgroup.cpu_user_ns+cpu_system_ns"
    probe: str
    fields: tuple[str, ...]
    ref: str                   # key of the workload's reference dict
    bound: float               # largest |error| accepted, as a fraction
    lost: tuple[str, ...] = ()        # fields of the same unit the probe counts as missed: added back
    flags: tuple[str, ...] = ()       # count fields that say "something was missed" (other unit): listed only


@dataclass(frozen=True)
class Case:
    name: str
    probes: str
    figures: tuple[Figure, ...]
    prepare: Callable[[Path], None]              # outside the job, before each run: files, a warm page cache
    argv: Callable[[Path, Path], list[str]]      # (scratch, report file) -> the workload
    reference: Callable[[str, Path], dict]       # (the job's stderr, report file) -> reference quantities


# ---- the reference workloads -------------------------------------------------------------------------------------
def _dd_file(d: Path, mib: int) -> Path:
    """A data file written once (outside the job) and kept for every run: reads find it on disk, and overwrites
    with notrunc touch no extent or size, so the job's writes are its data alone (no metadata of its own)."""
    f = d / f"dd-{mib}.dat"
    if not f.exists() or f.stat().st_size != mib << 20:
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", f"bs={BS}", f"count={(mib << 20) // BS}", "oflag=direct",
                        "conv=fsync"], check=True, capture_output=True, timeout=120)
    # dd itself once outside the job: its binary and libraries are paged in then, not read by the job
    subprocess.run(["dd", f"if={f}", "of=/dev/null", f"bs={BS}", "count=1", "iflag=direct"], check=True,
                   capture_output=True, timeout=60)
    return f


def dd_reference(stderr: str, _report: Path) -> dict:
    m = DD_BYTES.findall(stderr)
    if not m:
        raise ValueError("no 'N bytes copied' line from dd")
    n = int(m[-1])
    return {"bytes": n, "requests": n / BS}


def report_reference(_stderr: str, report: Path) -> dict:
    return json.loads(report.read_text())


def _io_figures(d: str) -> tuple[Figure, ...]:
    # 1%: the job's own reads are its O_DIRECT reads only once dd is paged in; what is left is a few 4 KiB pages
    # (e.g. locale files) — 0.3% of the short job. Requests: dd issues one 64 KiB request at a time (no merges).
    return (Figure(f"cgroup.io_{d}_bytes", "cgroup", (f"io_{d}_bytes",), "bytes", 0.01),
            Figure(f"blockio.{d}_bytes", "blockio", (f"{d}_bytes",), "bytes", 0.01, lost=(f"{d}_lost_bytes",)),
            Figure(f"blockio.{d}_requests", "blockio", (f"{d}_requests",), "requests", 0.02,
                   lost=("inflight_expired",)))


def dd_case(name: str, d: str, mib: int) -> Case:
    if d == "read":
        def argv(s: Path, _r: Path) -> list[str]:
            return ["dd", f"if={s / f'dd-{mib}.dat'}", "of=/dev/null", f"bs={BS}", "iflag=direct"]
    else:
        def argv(s: Path, _r: Path) -> list[str]:
            return ["dd", "if=/dev/zero", f"of={s / f'dd-{mib}.dat'}", f"bs={BS}", f"count={(mib << 20) // BS}",
                    "oflag=direct", "conv=fsync,notrunc"]
    return Case(name, "cgroup,blockio", _io_figures(d), lambda s: _dd_file(s, mib) and None, argv, dd_reference)


CPU = ("cpu_user_ns", "cpu_system_ns")
# 2%: rusage's user+sys sum is the scheduler's exact runtime (the tick only splits it); the probe reads the same
# runtime from /proc in 10 ms clock ticks while the job runs and from the exit record (µs) at the end, so the
# error left is a few ticks over the whole run (1.5 s: ~0.7% a tick) — 2% is three ticks.
CASES: dict[str, Case] = {c.name: c for c in (
    dd_case("dd-read-short", "read", SHORT_MIB),
    dd_case("dd-read-long", "read", LONG_MIB),
    dd_case("dd-write-short", "write", SHORT_MIB),
    dd_case("dd-write-long", "write", LONG_MIB),
    Case("cpu-burn", "cgroup", (Figure("cgroup.cpu_user_ns+cpu_system_ns", "cgroup", CPU, "cpu_ns", 0.02),),
         lambda s: None, lambda s, r: [sys.executable, "-c", BURN, "1.5", str(r)], report_reference),
    # a call returns in the interval it ends: every getppid of the loop is in some frame. `other` holds getppid and
    # the interpreter's own other-class calls (rt_sigaction, getrandom...: ~100, measured in docs/ACCURACY.md),
    # a +0.03% bias at 300k calls; 0.5% is the bound.
    Case("syscall-getppid", "syscalls", (Figure("syscalls.other_calls", "syscalls", ("other_calls",), "calls",
                                                0.005),),
         lambda s: None, lambda s, r: [sys.executable, "-c", GETPPID, str(SYSCALL_N), str(r)], report_reference),
    # No probe counts forks or exits (cgroup has nprocs now and exits_uncounted): the figure where exits can lose
    # something is CPU, each child's last stretch being in its exit record only. Flagged by exits_uncounted.
    Case("fork-exit", "cgroup", (Figure("cgroup.cpu_user_ns+cpu_system_ns", "cgroup", CPU, "cpu_ns", 0.02,
                                        flags=("exits_uncounted",)),),
         lambda s: None, lambda s, r: [sys.executable, "-c", FORK, str(FORKS), str(r)], report_reference),
)}


# ---- running one job ---------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    ok: bool
    sums: dict[str, dict[str, int]] = field(default_factory=dict)   # probe -> field -> sum over sample frames
    status: dict[str, str] = field(default_factory=dict)            # probe -> its last status
    reference: dict = field(default_factory=dict)
    why: str = ""


def sum_frames(lines: Iterable[str]) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Each numeric field of each probe summed over the sample frames, and each probe's last status."""
    sums: dict[str, dict[str, int]] = {}
    status: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            continue
        frame = json.loads(line)
        if frame.get("kind") not in ("hello", "sample"):
            continue
        status.update((frame.get("status") if frame["kind"] == "sample" else frame.get("probes")) or {})
        if frame["kind"] != "sample":
            continue
        for probe, values in (frame.get("probes") or {}).items():
            acc = sums.setdefault(probe, {})
            for k, v in (values or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    acc[k] = acc.get(k, 0) + v
    return sums, status


def run_job(case: Case, d: Path, interval: float) -> RunResult:
    report = d / "report.json"
    report.unlink(missing_ok=True)
    case.prepare(d)
    cmd = [sys.executable, "-m", "jobprobe.cli", "run", "--probes", case.probes, "--interval", str(interval),
           "--stdout", "json", "--", *case.argv(d, report)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return RunResult(False, why=f"the job ran past {JOB_TIMEOUT_S} s")
    if res.returncode != 0:
        return RunResult(False, why=f"exit {res.returncode}: {res.stderr.strip()[-300:]}")
    sums, status = sum_frames(res.stdout.splitlines())
    try:
        ref = case.reference(res.stderr, report)
    except (OSError, ValueError) as err:
        return RunResult(False, sums, status, why=f"no reference: {err}")
    return RunResult(True, sums, status, ref)


# ---- comparing ---------------------------------------------------------------------------------------------------
@dataclass
class Obs:
    """One run of one figure."""

    figure: float
    lost: float
    flagged: int
    reference: float

    @property
    def error(self) -> float:
        return (self.figure + self.lost - self.reference) / self.reference if self.reference else math.nan

    @property
    def raw_error(self) -> float:
        return (self.figure - self.reference) / self.reference if self.reference else math.nan

    def silent(self, bound: float) -> bool:
        return self.figure + self.lost < self.reference * (1 - bound)

    @property
    def counted(self) -> bool:
        return self.lost > 0 or self.flagged > 0


def observe(fig: Figure, run: RunResult) -> Obs | str:
    """The run's observation of this figure, or why there is none (probe not ok, field absent)."""
    st = run.status.get(fig.probe)
    if st is not None and st != "ok":
        return f"{fig.probe}: {st}"
    vals = run.sums.get(fig.probe)
    if vals is None or any(f not in vals for f in fig.fields):
        return f"{fig.probe} sent no {'/'.join(fig.fields)}"
    return Obs(sum(vals[f] for f in fig.fields), sum(vals.get(f, 0) for f in fig.lost),
               int(sum(vals.get(f, 0) for f in fig.flags)), float(run.reference[fig.ref]))


def row(case: str, fig: Figure, obs: list[Obs], missing: list[str]) -> dict:
    """The table row of one figure: its runs' errors, silent shortfalls, counted losses, and the verdict."""
    errs = [o.error for o in obs]
    silent = sum(o.silent(fig.bound) for o in obs)
    worst = max((abs(e) for e in errs), default=math.nan)
    ok = bool(obs) and silent == 0 and worst <= fig.bound and not missing
    return {"case": case, "figure": fig.name, "runs": len(obs), "error_p50": median(errs), "worst_abs_error": worst,
            "worst_raw_error": max((o.raw_error for o in obs), key=abs, default=math.nan), "bound": fig.bound,
            "silent_shortfalls": silent, "counted_losses": sum(o.counted for o in obs),
            "missing": len(missing), "why_missing": sorted(set(missing))[:3], "pass": ok,
            "errors": [round(e, 6) for e in errs]}


# ---- neighbour load ----------------------------------------------------------------------------------------------
class Load:
    """A neighbour load outside the job, started before the first run and stopped after the last (stop() is
    idempotent; a start that fails stops what it started)."""

    def __init__(self, kind: str, d: Path):
        if kind not in LOADS:
            raise BadInput(f"--load: one of {', '.join(LOADS)}")
        self.kind, self.d, self.procs = kind, d, []

    def _spawn(self, argv: list[str]) -> None:
        if shutil.which(argv[0]) is None:
            raise BadInput(f"--load {self.kind} needs {argv[0]}")
        self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True))

    def __enter__(self) -> "Load":
        try:
            ncpu = os.cpu_count() or 1
            if self.kind in ("cpu", "cpu+io"):
                io = ["--hdd", "1", "--hdd-opts", "direct", "--temp-path", str(self.d)] if self.kind == "cpu+io" \
                    else []
                self._spawn(["stress-ng", "--cpu", str(ncpu), *io, "--quiet"])
            elif self.kind == "net":
                port = str(free_port())
                self._spawn(["iperf3", "-s", "-p", port, "-B", "127.0.0.1"])
                time.sleep(0.5)
                self._spawn(["iperf3", "-c", "127.0.0.1", "-p", port, "-t", "86400"])
            time.sleep(1.0)                           # the load at full tilt before the first run
            for p in self.procs:
                if p.poll() is not None:
                    raise BadInput(f"the {self.kind} load ({p.args[0]}) exited at once ({p.returncode})")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Each load process's session is ended, client before server (stress-ng's workers are in its session)."""
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
        self.procs = []


# ---- the harness -------------------------------------------------------------------------------------------------
def select(only: list[str] | None) -> list[Case]:
    names = [n for spec in only or [] for n in spec.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise BadInput(f"--only: no case {unknown[0]!r}; cases: {', '.join(CASES)}")
    return [CASES[n] for n in names] if names else list(CASES.values())


def bench_accuracy(runs: int = 20, load: str = "none", interval: float = 0.5, only: list[str] | None = None,
                   workdir: str | None = None, progress=None) -> dict:
    if runs < 1:
        raise BadInput("--runs: at least 1")
    cases = select(only)
    t0 = time.monotonic()
    rows = []
    with scratch(workdir, "jobprobe-accuracy-") as d, Load(load, d):
        for case in cases:
            obs: dict[str, list[Obs]] = {f.name: [] for f in case.figures}
            missing: dict[str, list[str]] = {f.name: [] for f in case.figures}
            for i in range(runs):
                run = run_job(case, d, interval)
                for fig in case.figures:
                    got = observe(fig, run) if run.ok else run.why
                    (obs if isinstance(got, Obs) else missing)[fig.name].append(got)
                if progress:
                    print(f"{case.name} {i + 1}/{runs}" + ("" if run.ok else f": {run.why}"), file=progress,
                          flush=True)
            rows += [row(case.name, f, obs[f.name], missing[f.name]) for f in case.figures]
    return {"load": load, "runs": runs, "interval": interval, "cpus": os.cpu_count(), "kernel": os.uname().release,
            "seconds": round(time.monotonic() - t0, 1), "rows": rows, "pass": all(r["pass"] for r in rows)}


def _pct(x: float) -> str:
    return "—" if x is None or math.isnan(x) else f"{x * 100:+.3f}%"


def markdown(res: dict) -> str:
    out = [f"load {res['load']}, {res['runs']} runs per case, interval {res['interval']} s, {res['cpus']} CPUs, "
           f"kernel {res['kernel']}, {res['seconds']} s", "",
           "| case | figure | runs | error p50 | worst \\|error\\| | bound | silent shortfalls | counted losses | "
           "worst, counted loss not added | result |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        verdict = "pass" if r["pass"] else "FAIL"
        if r["missing"]:
            verdict += f" ({r['missing']} runs without the figure: {'; '.join(r['why_missing'])})"
        out.append(f"| {r['case']} | {r['figure']} | {r['runs']} | {_pct(r['error_p50'])} | "
                   f"{_pct(r['worst_abs_error']).lstrip('+')} | {r['bound'] * 100:g}% | {r['silent_shortfalls']} | "
                   f"{r['counted_losses']} | {_pct(r['worst_raw_error'])} | {verdict} |")
    return "\n".join(out)
