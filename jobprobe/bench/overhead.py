# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench overhead`: what each probe configuration costs a job, measured as paired runs.

For each pair the kit runs the job once without jobprobe and once with a configuration, in random order. Both runs
start the job the same way — the kit itself spawns it into a fresh cgroup2 group and times it from spawn to exit —
so the only difference is a `jobprobe run --cgroup` attached to that group (started, with its probes attached,
before the job starts). The job's peak RSS comes from wait4(); the collector's CPU, memory and bytes written come
from its own `self` probe frames.

The kit runs as root: its scratch files go to a directory of its own (mkdtemp: 0700, a name nobody can guess or
make first), removed with everything in it when the kit ends (`scratch`).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator

from jobprobe.bench.stats import Series, median
from jobprobe.core.errors import BadInput
from jobprobe.core.frame import StreamReader
from jobprobe.kernel.host import find_cgroup2_mount


def config_probes(config: str) -> str | None:
    """A config name → a --probes spec. 'std' → standard set; 'std+pystacks-perf' → '+pystacks,-perf';
    anything else ('sched', 'cgroup,perf', 'all') is a --probes spec as it is."""
    if config in ("std", "standard"):
        return None
    if config.startswith("std") and config[3:4] in ("+", "-"):
        rest, edits, cur = config[3:], [], ""
        for ch in rest:
            if ch in "+-" and cur:
                edits.append(cur)
                cur = ""
            cur += ch
        edits.append(cur)
        return ",".join(edits)
    return config


# An always-true rule that ends 5 s after it fires and may fire again at once: it asks for a deep-trace window every
# ~6 s, and the tracer's own budget (60 s cooldown, 30% duty cap) decides which open — "traced when a rule fired".
FIRE_RULE = """[[rule]]
name = "bench_fire"
summary = "fires all the time (the overhead kit's deep-trace config)"
when = "rate(cgroup.cpu_user_ns) >= 0"
clear = "rate(cgroup.cpu_user_ns) >= 0"
window = 1
hold = 0
cooldown = 0
clear_after = 1
action = "trace"
"""


def config_options(config: str, workdir: Path) -> tuple[str, list[str]]:
    """A config's probe part and the extra `jobprobe run` flags of its @options: @rules (the default rules, no
    window opened on a steady job: the agent loaded, not tracing), @fire[=S] (a rule asking for a window — of S s,
    default 25 — all the time: traced when a rule fired, within the tracer's budget), @every=S (a 25 s window
    every S s, as requests are)."""
    base, _, opts = config.partition("@")
    argv: list[str] = []
    for opt in filter(None, opts.split("@")):
        if opt == "rules":
            argv += ["--rules", "default"]
        elif opt == "fire" or opt.startswith("fire="):
            secs = opt.partition("=")[2]
            path = workdir / f"fire-rule{secs}.toml"
            path.write_text(FIRE_RULE + (f"trace_s = {float(secs):g}\n" if secs else ""))
            argv += ["--rules", str(path)]
        elif opt.startswith("every="):
            argv += ["--trace-every", opt[len("every="):]]
        else:
            raise BadInput(f"config {config!r}: unknown option @{opt} (known: @rules, @fire[=S], @every=S)")
    if argv:
        argv += ["--trace-dir", str(workdir / "traces")]
    return base or "std", argv


@dataclass
class Run:
    seconds: float
    job_maxrss: int                       # bytes, the job's largest process (wait4 ru_maxrss)
    collector: dict | None = None         # cores, peak_bytes, written_bps (runs with jobprobe only)


class OverheadBench:
    def __init__(self, cmd: list[str], configs: list[str], interval: float = 1.0, max_runs: int = 40,
                 max_minutes: float = 30.0, min_pairs: int = 3, tol: float = 0.005, warmup: int = 1,
                 precision: float | None = None,
                 seed: int | None = None, workdir: str | None = None, jobprobe: list[str] | None = None,
                 progress: IO[str] | None = None, clock: Callable[[], float] = time.monotonic):
        if not cmd:
            raise BadInput("nothing to run after --")
        self.cmd, self.configs = cmd, list(dict.fromkeys(configs or ["std"]))
        self.interval, self.max_runs, self.max_minutes = interval, max_runs, max_minutes
        self.min_pairs, self.tol, self.warmup, self.precision = min_pairs, tol, warmup, precision
        self.rng = random.Random(seed)
        self.mount = find_cgroup2_mount()
        if self.mount is None:
            raise BadInput("no cgroup2 hierarchy mounted: the overhead kit runs each job in a cgroup2 group")
        self.given_workdir = workdir
        self.workdir: Path | None = None     # the scratch directory, there while run() runs
        self.jobprobe = jobprobe or [sys.executable, "-m", "jobprobe.cli"]
        self.progress = progress if progress is not None else sys.stderr
        self.clock = clock
        self.series = {c: Series(c) for c in self.configs}
        self.runs: dict[str, list[Run]] = {c: [] for c in self.configs}
        self.plain: list[Run] = []
        self.nruns = 0
        self.t0 = clock()
        self.stopped_by = ""

    # ---- one run -------------------------------------------------------------------------------------------
    def _group(self) -> Path:
        g = Path(self.mount, "jobprobe-bench", f"run-{os.getpid()}-{self.nruns}")
        g.mkdir(parents=True)
        return g

    def _job(self, group: Path) -> Run:
        procs = group / "cgroup.procs"
        t = time.monotonic()
        with open(self.workdir / "job.log", "ab") as log:
            child = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     preexec_fn=lambda: procs.write_text(str(os.getpid())))
        _, status, ru = os.wait4(child.pid, 0)
        seconds = time.monotonic() - t
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            raise BadInput(f"the job exited with code {child.returncode}: {' '.join(self.cmd)}; its output ends: "
                           f"{tail(self.workdir / 'job.log')!r}")
        return Run(seconds, ru.ru_maxrss * 1024)

    def run_plain(self) -> Run:
        g = self._group()
        try:
            return self._job(g)
        finally:
            _rmdir(g)

    def run_with(self, config: str) -> Run:
        g = self._group()
        out = self.workdir / f"run-{self.nruns}.mpk"
        base, extra = config_options(config, self.workdir)
        argv = [*self.jobprobe, "run", "--cgroup", str(g), "--interval", str(self.interval), "--out", str(out), *extra]
        spec = config_probes(base)
        if spec is not None:
            # the kit reads the collector's cost from its `self` probe: keep it on unless the config drops it
            if "self" not in spec.replace("-self", "").split(",") and "-self" not in spec and \
                    any(x and x[0] not in "+-" and x != "all" for x in spec.split(",")):
                spec += ",+self"
            argv += [f"--probes={spec}"]
        agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_for_hello(out, agent)
            run = self._job(g)
        finally:
            agent.send_signal(signal.SIGINT)
            err = agent.stderr.read()
            # its whole CPU, children it waited for included (eBPF loaders, py-spy recorders of trace windows)
            _, status, ru = os.wait4(agent.pid, 0)
            agent.returncode = os.waitstatus_to_exitcode(status)
            _rmdir(g)
        if agent.returncode != 0:
            raise BadInput(f"jobprobe failed with config {config!r}: {err.decode().strip()}")
        run.collector = collector_stats(out)
        run.collector["cores_all"] = (ru.ru_utime + ru.ru_stime) / run.seconds if run.seconds > 0 else 0.0
        out.unlink()
        return run

    # ---- the loop ------------------------------------------------------------------------------------------
    def budget_left(self) -> bool:
        if self.nruns >= self.max_runs:
            self.stopped_by = f"run budget ({self.max_runs} runs)"
            return False
        if (self.clock() - self.t0) / 60 >= self.max_minutes:
            self.stopped_by = f"time budget ({self.max_minutes:g} min)"
            return False
        return True

    def pair(self, config: str) -> None:
        order = ["without", "with"]
        self.rng.shuffle(order)
        got: dict[str, Run] = {}
        for side in order:
            got[side] = self.run_plain() if side == "without" else self.run_with(config)
            self.nruns += 1
        self.plain.append(got["without"])
        self.runs[config].append(got["with"])
        self.series[config].add(got["without"].seconds, got["with"].seconds)
        self._report()

    def run(self) -> dict:
        with scratch(self.given_workdir, "jobprobe-bench-") as self.workdir:
            try:
                return self._run()
            finally:
                self.workdir = None

    def _run(self) -> dict:
        for _ in range(self.warmup):       # the first runs of a job are the slowest (caches, page cache)
            self.run_plain()
        while self.budget_left():
            todo = [c for c in self.configs if not self._settled(c)]
            if not todo:
                self.stopped_by = "every estimate settled"
                break
            self.rng.shuffle(todo)
            for c in todo:
                if not self.budget_left():
                    break
                self.pair(c)
        if self.progress is not None:
            self.progress.write("\n")
        return self.result()

    def _settled(self, config: str) -> bool:
        return self.series[config].settled(tol=self.tol, min_pairs=self.min_pairs, precision=self.precision)

    def _report(self) -> None:
        if self.progress is None:
            return
        done = min(1.0, self.nruns / self.max_runs)
        bar = "#" * int(done * 20) + "-" * (20 - int(done * 20))
        ests = "  ".join(f"{c}: {s.estimate().pct()}" for c, s in self.series.items() if s.history)
        mins = (self.clock() - self.t0) / 60
        end = "\r" if getattr(self.progress, "isatty", lambda: False)() else "\n"
        self.progress.write(f"[{bar}] {self.nruns}/{self.max_runs} runs {mins:.1f} min  {ests}{end}")
        self.progress.flush()

    def result(self) -> dict:
        base_rss = median([r.job_maxrss for r in self.plain])
        configs = {}
        for c, s in self.series.items():
            est = s.estimate()
            col = [r.collector for r in self.runs[c] if r.collector]
            configs[c] = {
                "probes": config_probes(config_options(c, self.workdir)[0]) or "standard",
                "options": config_options(c, self.workdir)[1],
                "traced_share": median([x.get("traced_share", 0.0) for x in col]),
                "pairs": est.n, "slowdown": est.mean, "lo": est.lo, "hi": est.hi,
                "settled": self._settled(c),
                "seconds_without": s.without, "seconds_with": s.with_,
                "collector_cores": median([x["cores"] for x in col]),
                "collector_cores_all": median([x.get("cores_all", 0.0) for x in col]),
                "collector_peak_bytes": max([x["peak_bytes"] for x in col], default=0),
                "collector_written_bps": median([x["written_bps"] for x in col]),
                "job_memory_added_bytes": median([r.job_maxrss for r in self.runs[c]]) - base_rss,
                "network_sent_bps": 0.0,   # no network sink in these runs: frames go to a file
            }
        return {"command": self.cmd, "interval": self.interval, "runs": self.nruns, "stopped_by": self.stopped_by,
                "minutes": round((self.clock() - self.t0) / 60, 2), "job_seconds_median": median(
                    [r.seconds for r in self.plain]), "node": platform.node(), "kernel": platform.release(),
                "cpus": os.cpu_count(), "configs": configs}


def _wait_for_hello(out: Path, agent: subprocess.Popen, timeout: float = 60.0) -> None:
    """The agent writes its hello frame once every probe is attached: only then may the job start."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if out.exists() and out.stat().st_size > 0:
            return
        if agent.poll() is not None:
            raise BadInput(f"jobprobe exited before attaching: {agent.stderr.read().decode().strip()}")
        time.sleep(0.02)
    raise BadInput("jobprobe did not attach within 60 s")


def collector_stats(path: Path) -> dict:
    with open(path, "rb") as fp:
        frames = list(StreamReader(fp))
    samples = [f for f in frames if f["kind"] == "sample" and "self" in f.get("probes", {})]
    full = samples[1:-1] or samples   # the first and last intervals are partial
    dt = sum(f["dt"] for f in samples) or 1.0
    return {"cores": median([f["probes"]["self"]["cpu_cores"] for f in full]),
            "peak_bytes": max((f["probes"]["self"]["rss_peak_bytes"] for f in samples), default=0),
            "written_bps": sum(f["probes"]["self"]["written_bytes"] for f in samples) / dt,
            "traced_share": traced_share(frames)}


def traced_share(frames: list[dict]) -> float:
    """The share of the run inside deep-trace windows (a window cut short by the job's end counts to there)."""
    samples = [f for f in frames if f["kind"] == "sample"]
    if len(samples) < 2:
        return 0.0
    t0, t1 = samples[0]["t"] - samples[0]["dt"], samples[-1]["t"]
    traced = sum(max(0.0, min(f["start"] + f["duration_s"], t1) - max(f["start"], t0))
                 for f in frames if f["kind"] == "trace" and isinstance(f.get("start"), (int, float)))
    return traced / (t1 - t0) if t1 > t0 else 0.0


def free_port() -> int:
    """A loopback TCP port free now (the kit's servers: nats-server, a peer's endpoint, iperf3)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def scratch(workdir: str | Path | None, prefix: str) -> Iterator[Path]:
    """The kit's working directory: `workdir` when one is given (made if missing, and left as it is after: the
    caller's), else a fresh one from mkdtemp in the temp directory — 0700, with a name no other user can guess and
    plant a link at first — removed with everything in it at the end, whatever the end."""
    if workdir:
        path = Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def tail(path: Path, size: int = 2000) -> str:
    """The end of a log, for an error message: the scratch directory holding it is gone by the time it is read."""
    try:
        with open(path, "rb") as fp:
            fp.seek(max(0, os.fstat(fp.fileno()).st_size - size))
            return fp.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _rmdir(g: Path) -> None:
    """A bench's group, gone (its processes may take a moment to leave); then its parent `jobprobe-bench` too when
    nothing else is in it (another bench's group keeps it: EBUSY, left)."""
    for _ in range(100):
        try:
            g.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
    if g.parent.name == "jobprobe-bench":
        try:
            g.parent.rmdir()
        except OSError:
            pass


# ---- reporting ----------------------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / (1 << 20):.0f} MiB" if abs(b) >= (1 << 20) else "none"


def markdown(res: dict) -> str:
    lines = [f"Job: `{' '.join(res['command'])}`, {res['job_seconds_median']:.1f} s without jobprobe (median); "
             f"{res['runs']} runs in {res['minutes']} min on {res['cpus']} CPUs, kernel {res['kernel']}; "
             f"interval {res['interval']:g} s; stopped by {res['stopped_by']}.", "",
             "| What was on | Job time | 95% interval | Pairs | Settled | Run traced |", "| - | - | - | - | - | - |"]
    for c, r in res["configs"].items():
        lo = "n/a" if r["pairs"] < 2 else f"{r['lo'] * 100:+.2f} to {r['hi'] * 100:+.2f}"
        lines.append(f"| {c} | {r['slowdown'] * 100:+.2f}% | {lo} | {r['pairs']} | {'yes' if r['settled'] else 'no'} | "
                     f"{r.get('traced_share', 0) * 100:.0f}% |")
    lines += ["", "| What was on | Collector CPU | With its children, per job second | Collector memory, peak | "
              "Memory added to the job | Network sent | Disk written |", "| - | - | - | - | - | - | - |"]
    for c, r in res["configs"].items():
        lines.append(f"| {c} | {r['collector_cores']:.4f} cores | {r.get('collector_cores_all', 0):.4f} cores | "
                     f"{r['collector_peak_bytes'] / (1 << 20):.0f} MiB | "
                     f"{_mib(r['job_memory_added_bytes'])} | {r['network_sent_bps']:.0f} B/s | "
                     f"{r['collector_written_bps'] / 1024:.2f} KiB/s |")
    return "\n".join(lines)


def write_outputs(res: dict, json_path: str | None, md_path: str | None) -> str:
    md = markdown(res)
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1))
    if md_path:
        Path(md_path).write_text(md + "\n")
    return md
