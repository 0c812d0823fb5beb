# SPDX-License-Identifier: Apache-2.0
"""Where a job's seconds went: its wall time split into buckets, from its sample frames alone (no code in the job).

One node's samples of one job, interval by interval (docs/TIMEUSE.md defines every bucket):

- The job's **pace** in an interval is its compute rate: GPUs busy (the `gpu` probe: the job's own SM share, else
  the GPU's utilization, summed over its GPUs) where it has GPUs, else CPU cores of its lead processes (the `cgroup`
  probe's user + system time over dt, less its helpers': forked DataLoader workers; all of it where the lead
  processes do under LEAD_MIN of the work or the frames do not say). Its **steady pace** is the 0.97 quantile of
  the intervals' *wanted* paces — the pace plus the threads' wait for a CPU (`sched.runq_lat_ns`), up to the CPUs
  the job may use (its limit, cpuset or node): how fast it goes when nothing holds it back (a neighbour there the
  whole run is not its pace).
- **startup**: from the first interval to the first one at 3/4 of the steady pace or more (of that one, what ran at
  the pace of the interval before it: `switched`).
- **checkpointing**: in an interval that wrote ≥ 1 MiB more than twice the job's median interval
  (`cgroup.io_write_bytes`), the writing thread's system CPU (`cgroup.cpu_system_ns`: copies into the page cache)
  above the job's usual share of system to user time, and its uninterruptible waits (`sched.offcpu_io_ns`: fsync)
  above their median over the other intervals — a synchronous checkpoint stops training while one thread writes.
- **computing**: each later interval's dt × its pace (less a checkpoint's CPU) over the steady pace, at most what
  the checkpoint left of dt. Goodput = computing / wall.
- The rest of each interval (its **shortfall**) is split by what its threads did instead, each figure taken above its
  own usual level (its median over the intervals at 90% of the steady pace or more) — a figure that did not move is
  never evidence:
  - *starved*: first the interval's wait for a CPU as it is (dt × (wanted pace − pace) / steady pace), then of
    the rest, CPU-limit stops (`cgroup.cpu_throttled_ns`, the whole group: × the steady pace in threads) and memory
    stalls (`pressure.mem_some_ns`);
  - *waiting_for_input*: uninterruptible waits outside a checkpoint, sleeps and socket/pipe waits
    (`sched.offcpu_sleep_ns`, `offcpu_wait_ns`: a loader's read, the trainer's wait on its queue);
  - futex waits (`offcpu_lock_ns`: the trainer's thread pool idling behind its main thread) say how much of the
    shortfall the threads spent waiting, not on what: they add to the covered share, split as the others are; the
    threads' whole blocked time above its usual level (`offcpu_ns` less `runq_lat_ns`) covers as far as that or further.
  The shortfall is given out in the proportion of those figures, as far as they cover it (in thread-seconds: the
  shortfall × the steady pace); what they do not cover is *gpu_idle* for a GPU-paced job, else *other*.
- *lost*: where the job started again (a new agent run whose hello says its processes were new: a SLURM requeue, a
  restarted pod), or ended badly (its last frame's `end`: an exit code other than 0, a signal), the computing of that
  run since its last checkpoint (all of it, without one); each run has its own startup.
- *teardown*: a run whose last frame says it ended (`end`): its trailing intervals below STARTED of the steady pace,
  without a checkpoint, whose shortfall no figure explains — its exit after its last step, not computing.
- *waiting_for_peers* is never given from one node's frames: the controller gives it from who waited for whom
  across the job's nodes.

The buckets of an interval sum to its dt; the job's buckets sum to its wall time (the sum of the intervals' dt).
Beside them, `gpu`: the job's OFU (`gpu.gpus[].ofu_pct`: tensor activity at the clock it ran, over the clock's
maximum) and GPM SM activity, averaged over its GPUs and its intervals after startup, where the GPUs report them.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

from jobprobe.core.ends import failed

BUCKETS = ("startup", "computing", "waiting_for_input", "waiting_for_peers", "starved", "checkpointing", "gpu_idle",
           "lost", "teardown", "other")
STEADY_PCT = 0.97          # the steady pace: this percentile of the intervals' paces (a job held back in most of
                           # its intervals — a stall every few seconds — has few clean ones: the 90th read 7% low)
STARTED = 0.75             # startup ends at the first interval at this share of the steady pace (imports
                           # and set-up run on one thread: a job of two or more runs them below it)
CLEAN = 0.9                # intervals at this share of the steady pace or more give each figure's usual level
LEAD_MIN = 0.1            # a CPU job is paced by its lead processes, not its helpers, unless they do less than this
                          # share of its work (a parent that forked its workers and waits: the workers are the job)
NOISE = 0.01               # an interval within this share of the steady pace is at it: a one-thread job's CPU plus its
                           # wait for a CPU reads 0.992-1.008 of its interval (the two probes' reads), the steady pace
                           # (0.97 quantile) 1.005, and each interval at it left 0.5% to `other` (0.5 s of 24 once)
STARVED_BY = ("own_threads", "cpu_limit", "neighbours", "memory")   # starved, by cause (docs/TIMEUSE.md)
WRITE_BURST = 1 << 20      # a checkpoint's interval writes at least this many bytes more than usual, and twice as much


def num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def usable(f: Any) -> bool:
    """A sample frame with a time and an interval (frames from files are hostile until checked)."""
    return isinstance(f, dict) and f.get("kind") == "sample" and num(f, "t") is not None and \
        (num(f, "dt") or 0.0) >= 0 and isinstance(f.get("probes", {}), dict)


def _gpu_busy(gpu: Any) -> float | None:
    """GPUs busy in the interval (0..n): the job's own SM share where NVML gives it, else the GPU's utilization."""
    gpus = gpu.get("gpus") if isinstance(gpu, dict) else None
    if not isinstance(gpus, list) or not gpus:
        return None
    busy, seen = 0.0, False
    for g in gpus:
        pct = num(g, "job_sm_pct")
        pct = num(g, "util_gpu_pct") if pct is None else pct
        if pct is not None:
            busy, seen = busy + min(max(pct, 0.0), 100.0) / 100.0, True
    return busy if seen else None


class Tick:
    """One interval's figures: t, dt, pace (GPUs busy or CPU cores), the evidence (thread-ns, bytes)."""

    __slots__ = ("t", "dt", "pace", "fig", "gpu", "cores", "busy", "grant", "lead", "helper", "runq", "want", "cpus")

    def __init__(self, frame: dict, by: str):
        self.t = num(frame, "t") or 0.0
        self.dt = max(0.0, num(frame, "dt") or 0.0)
        p = frame.get("probes") if isinstance(frame.get("probes"), dict) else {}
        cg, sc, pr = p.get("cgroup", {}), p.get("sched", {}), p.get("pressure", {})
        u, s = num(cg, "cpu_user_ns"), num(cg, "cpu_system_ns")
        cpu = max(u or 0.0, 0.0) + max(s or 0.0, 0.0) if u is not None or s is not None else None
        dcg, dsc = self.read_dt(frame, "cgroup"), self.read_dt(frame, "sched")
        self.cores = (cpu / 1e9 / dcg if self.dt > 0 else 0.0) if cpu is not None else None
        # the helper processes' share of it (DataLoader workers: cgroup.helper_cpu_*), where the frames have it
        hu, hs = (max(0.0, num(cg, f"helper_cpu_{m}_ns") or 0.0) for m in ("user", "system"))
        self.helper = (hu, hs) if cpu is not None and isinstance(cg, dict) and \
            ("helper_cpu_user_ns" in cg or "helper_cpu_system_ns" in cg) else None
        self.lead = max(0.0, self.cores - (hu + hs) / 1e9 / dcg) if self.helper and self.dt > 0 else self.cores
        self.busy = _gpu_busy(p.get("gpu"))
        self.pace = self.busy if by == "gpu_busy" else self.cores
        gpu = p.get("gpu") if isinstance(p.get("gpu"), dict) else {}
        self.grant = {k: v for k, v in (("cpu_cores", num(cg, "cpu_limit_cores") or num(cg, "cpus_allowed")),
                                        ("mem_limit_bytes", num(cg, "mem_limit_bytes")),
                                        ("mem_peak_bytes", num(cg, "mem_peak_bytes")),
                                        ("gpus", num(gpu, "ngpus"))) if v is not None and v > 0}
        self.gpu = gpu_means(p.get("gpu"))
        self.cpus = num(cg, "cpus_online")     # the node's: the most a job with no limit or cpuset can use
        # the threads' wait for a CPU, in cores (thread-seconds per second): a CPU job wanted to compute then
        rq = num(sc, "runq_lat_ns")
        self.runq = max(0.0, rq) / 1e9 / dsc if rq is not None and self.dt > 0 and by != "gpu_busy" else 0.0
        self.want = self.wanted()
        self.fig: dict[str, float] = {}
        for name, d in (("sched", sc), ("cgroup", cg), ("pressure", pr)):
            for k in ("runq_lat_ns", "offcpu_io_ns", "offcpu_sleep_ns", "offcpu_wait_ns", "offcpu_lock_ns", "offcpu_ns",
                      "cpu_throttled_ns", "io_write_bytes", "mem_some_ns", "cpu_system_ns", "cpu_user_ns"):
                v = num(d, k)
                if v is not None:
                    self.fig[f"{name}.{k}"] = max(v, 0.0)
        # the threads' time off CPU holds their wait for one (preempted, or woken and not yet run: runq_lat_ns),
        # which is the starved bucket's, not a wait of theirs: the rest is what they spent blocked
        if "sched.offcpu_ns" in self.fig:
            self.fig["sched.offcpu_ns"] = max(0.0, self.fig["sched.offcpu_ns"] - self.fig.get("sched.runq_lat_ns", 0.0))

    def read_dt(self, frame: dict, probe: str) -> float:
        """The seconds the probe's counters cover (`read_dt`: its last read to this one), where the frame says so
        and it is within half and twice dt; else dt. A tick whose probes were read late covers more than its dt:
        its rates over dt read high (a one-thread job's CPU and wait for a CPU 1.008 s in a 0.975 s interval)."""
        rd = frame.get("read_dt")
        v = num(rd, probe) if isinstance(rd, dict) else None
        return v if v is not None and 0.5 * self.dt <= v <= 2 * self.dt else self.dt

    def wanted(self) -> float | None:
        """The pace the job would have had without its wait for a CPU: its pace and that wait, up to the CPUs it
        may use (its CPU limit, else its cpuset, else the node's online CPUs) — beyond them it waits for its own
        threads, not for a neighbour."""
        if self.pace is None:
            return None
        return max(self.pace, min(self.pace + self.runq, self.cap()))

    def own_share(self) -> float:
        """Of the interval's wait for a CPU, the share its own threads made: the job's whole demand (its CPU, its
        helpers' too, and all its threads' wait) beyond the CPUs it may use — its threads queued behind each other.
        A job that wanted fewer CPUs than it may use and still waited was kept off them by other work: neighbours."""
        rq = self.fig.get("sched.runq_lat_ns", 0.0) / 1e9 / self.dt if self.dt > 0 else 0.0
        if rq <= 0 or self.cores is None:
            return 0.0
        return min(1.0, max(0.0, self.cores + rq - self.cap()) / rq)

    def cap(self) -> float:
        """The CPUs the job may use: its CPU limit, else its cpuset, else the node's online CPUs (else no bound)."""
        return self.grant.get("cpu_cores") or (self.cpus if self.cpus and self.cpus > 0 else math.inf)

    def by_lead(self) -> None:
        """Paced by the lead processes' CPU: the helpers' CPU is neither the pace nor the evidence (their share of
        the wait for a CPU is taken as their share of the CPU)."""
        if self.cores and self.lead is not None:
            self.runq *= self.lead / self.cores
        self.pace = self.lead
        self.want = self.wanted()
        if self.helper is not None:
            for m, v in zip(("user", "system"), self.helper):
                if f"cgroup.cpu_{m}_ns" in self.fig:
                    self.fig[f"cgroup.cpu_{m}_ns"] = max(0.0, self.fig[f"cgroup.cpu_{m}_ns"] - v)


def gpu_means(gpu: Any) -> dict[str, float]:
    """The interval's OFU and GPM SM activity, averaged over the job's GPUs that report them."""
    gpus = gpu.get("gpus") if isinstance(gpu, dict) else None
    out = {}
    for key in ("ofu_pct", "gpm_sm_active_pct"):
        vals = [v for g in gpus or () if (v := num(g, key)) is not None] if isinstance(gpus, list) else []
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def paced_by(samples: list[dict]) -> str:
    """'gpu_busy' where the job's GPUs report utilization in most intervals and were busy in some, else 'cpu_cores'
    (a CPU job on a node whose GPUs it holds but never uses is paced by its CPU, not read as all `other`)."""
    busy = [b for f in samples if (b := _gpu_busy((f.get("probes") or {}).get("gpu"))) is not None]
    return "gpu_busy" if samples and len(busy) * 2 >= len(samples) and max(busy) > 0 else "cpu_cores"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile between the nearest ranks (numpy's default). The steady pace's: over a run of under 34
    intervals the nearest rank at 0.97 is the largest — one interval whose counters were read a few ms late (and its
    neighbour's as much early: 1.024 and 0.973 cores of a one-thread job) set the steady pace, and every interval
    left 2.4% of its time to `other`."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    at = q * (len(xs) - 1)
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def _median(xs: list[float]) -> float:
    return _pct(xs, 0.5)


def decompose(frames: Iterable[dict], intervals: bool = False) -> dict:
    """The time use of one node's samples of one job (other kinds of frame are skipped): wall_s, goodput (0..1),
    buckets (seconds, every name of BUCKETS), pace (what it was measured in and the steady figure), startup_end (the
    UNIX time startup ended; None if it never did) and, with `intervals`, each interval's t, dt and buckets."""
    frames = frames if isinstance(frames, list) else list(frames)
    samples = sorted((f for f in frames if usable(f)), key=lambda f: num(f, "t") or 0.0)
    by = paced_by(samples)
    ticks = [Tick(f, by) for f in samples]
    if by == "cpu_cores" and any(k.helper for k in ticks) and \
            _pct([k.lead for k in ticks if k.lead is not None], STEADY_PCT) >= \
            LEAD_MIN * _pct([k.cores for k in ticks if k.cores is not None], STEADY_PCT):
        by = "lead_cpu_cores"
        for k in ticks:
            k.by_lead()
    out: dict[str, Any] = {"wall_s": sum(k.dt for k in ticks), "buckets": dict.fromkeys(BUCKETS, 0.0),
                           "pace": {"of": by, "steady": None}, "startup_end": None, "goodput": 0.0, "restarts": 0,
                           "disruptions": 0}
    paced = [k.want for k in ticks if k.want is not None]
    steady = _quantile(paced, STEADY_PCT)
    if not paced or steady <= 0:
        out["buckets"]["other"] = out["wall_s"]
        if intervals:
            out["intervals"] = [{"t": k.t, "dt": k.dt, "buckets": {"other": k.dt}} for k in ticks]
        return out
    out["pace"]["steady"] = steady
    clean = [k for k in ticks if k.want is not None and k.want >= CLEAN * steady]
    usual = {f: _median([k.fig.get(f, 0.0) for k in clean]) for f in {f for k in ticks for f in k.fig}}
    runs = segments(frames, samples)
    out["restarts"] = len(runs) - 1
    # runs cut short: each one the job started again after, and the last where it ended badly (the peers' goodput
    # reports' "disruptions")
    out["disruptions"] = len(runs) - 1 + int(failed(samples[runs[-1][-1]].get("end")))
    # each run's startup ends at its first interval at STARTED of the steady pace (a run that never got there: all
    # of it); the checkpoints are looked for after them
    firsts = [next((i for i in run if (ticks[i].want or 0.0) >= STARTED * steady), run[-1] + 1) for run in runs]
    after = [ticks[i] for run, first in zip(runs, firsts) for i in run if i > first]
    bursts = Bursts(after)
    per = []
    parts = dict.fromkeys(STARVED_BY, 0.0)

    def share_of(i: int) -> float:
        return min(1.0, (ticks[i].pace or 0.0) / steady)
    for run, first in zip(runs, firsts):
        for i in run:
            k = ticks[i]
            b = dict.fromkeys(BUCKETS, 0.0)
            share = share_of(i)
            if i == first:
                if out["startup_end"] is None:
                    out["startup_end"] = k.t
                # the interval startup ends in ran at startup's pace (the interval before's) until it did not
                b["computing"] = k.dt * switched(share, share_of(i - 1) if i > run[0] else 0.0)
                b["startup"] = k.dt - b["computing"]
            elif i < first:
                b["startup"] = k.dt
            else:
                pace = k.pace or 0.0
                ck, cpu = bursts.checkpoint(k)
                # an interval that wanted within NOISE of the steady pace was at it: its own wanted pace is the
                # measure (the steady pace is a high quantile of figures each ±0.5% from the counters' reads)
                ref = k.want if k.want is not None and (1 - NOISE) * steady <= k.want < steady else steady
                share = min(1.0, max(0.0, pace - (cpu / k.dt if by != "gpu_busy" and k.dt > 0 else 0.0)) / ref)
                b["checkpointing"] = ck
                b["computing"] = min(k.dt - ck, k.dt * share)
                # its wait for a CPU is starved as it is (the steady pace counts it as wanted), the rest by votes
                short = k.dt - ck - b["computing"]
                b["starved"] = min(short, k.dt * max(0.0, (k.want or 0.0) - pace) / ref)
                # whose wait: a group stopped by its CPU limit waited for the limit (throttled above its usual
                # level), else its own threads beyond its CPUs, else other work's
                if k.fig.get("cgroup.cpu_throttled_ns", 0.0) > usual.get("cgroup.cpu_throttled_ns", 0.0):
                    parts["cpu_limit"] += b["starved"]
                else:
                    own = b["starved"] * k.own_share()
                    parts["own_threads"] += own
                    parts["neighbours"] += b["starved"] - own
                split(k, short - b["starved"], steady, usual, by, b, parts, ck > 0)
            per.append(b)
    for run, first in zip(runs, firsts):
        if isinstance(samples[run[-1]].get("end"), dict):
            teardown(run, first, ticks, per, steady)
    for run in runs[:-1] + [r for r in runs[-1:] if failed(samples[r[-1]].get("end"))]:
        # a run the job started again after, or one that ended badly (its last frame's `end`: an exit code other
        # than 0, a signal): its work since its last checkpoint was lost (all of it, without one)
        last = max((i for i in run if per[i]["checkpointing"] > 0), default=run[0] - 1)
        for i in run:
            if i > last:
                per[i]["lost"] += per[i]["computing"]
                per[i]["computing"] = 0.0
    for b in per:
        for name, v in b.items():
            out["buckets"][name] += v
    if intervals:
        out["intervals"] = [{"t": k.t, "dt": k.dt, "buckets": {n: v for n, v in b.items() if v}}
                            for k, b in zip(ticks, per)]
    # starved, by cause (a run's lost or torn-down intervals gave theirs up: the parts scaled to what is left)
    total = sum(parts.values())
    out["starved_by"] = {n: v * out["buckets"]["starved"] / total if total > 0 else 0.0 for n, v in parts.items()}
    if out["wall_s"] > 0:
        out["goodput"] = out["buckets"]["computing"] / out["wall_s"]
    after = after or ticks
    out["used"], out["granted"] = used_and_granted(ticks, after)
    for key in ("ofu_pct", "gpm_sm_active_pct"):      # over the job after its startup, weighted by dt
        mean = _mean_by_dt([(k.gpu[key], k.dt) for k in after if key in k.gpu])
        if mean is not None:
            out.setdefault("gpu", {})[key] = mean
    return out


def teardown(run: list[int], first: int, ticks: list[Tick], per: list[dict[str, float]], steady: float) -> None:
    """A run that ended (its last frame says so: its processes exited) tears down from its last step: its trailing
    intervals below STARTED of the steady pace, without a checkpoint, whose shortfall no figure explains (half of it
    or more `other`: the interpreter's exit, its workers joined) are `teardown`, not computing at a low pace."""
    j = run[-1]
    while j > first and (ticks[j].want or 0.0) < STARTED * steady and per[j]["checkpointing"] == 0 and \
            per[j]["other"] >= 0.5 * (ticks[j].dt - per[j]["computing"]) > 0:
        per[j] = dict.fromkeys(BUCKETS, 0.0) | {"teardown": ticks[j].dt}
        j -= 1


def switched(share: float, other: float) -> float:
    """The share x of an interval at the steady pace, where it ran at `other`'s share of it (startup's) for the
    rest: share = x + (1 - x) × other."""
    other = min(max(other, 0.0), share)
    return min(1.0, max(0.0, (share - other) / (1.0 - other))) if other < 1.0 else 1.0


def _mean_by_dt(had: list[tuple[float, float]]) -> float | None:
    """The mean of (value, dt) pairs weighted by dt; None without any time."""
    total = sum(dt for _, dt in had)
    return sum(v * dt for v, dt in had) / total if total > 0 else None


def segments(frames: list[dict], samples: list[dict]) -> list[list[int]]:
    """The indexes of `samples` (in time order) by run of the job: a new run starts at the first sample of an agent
    run (`run`) whose hello says the job's processes were new (`from_start`, or a command it launched itself:
    `target.command`) — the job started again (a SLURM requeue, a restarted pod, `jobprobe run` again), not an
    agent that came back to a job still running."""
    fresh = {f.get("run") for f in frames if isinstance(f, dict) and f.get("kind") == "hello"
             and (f.get("from_start") is True or (isinstance(f.get("target"), dict) and "command" in f["target"]))
             and isinstance(f.get("run"), str)}
    out: list[list[int]] = []
    seen: set = set()
    for i, f in enumerate(samples):
        run = f.get("run") if isinstance(f.get("run"), str) else None
        if not out or (run not in seen and run in fresh):
            out.append([])
        seen.add(run)
        out[-1].append(i)
    return out or [[]]


class Bursts:
    """Checkpoints: intervals that wrote at least WRITE_BURST bytes more than twice the job's median interval after
    its startup. A checkpoint stops training while one thread writes: its seconds are that thread's system CPU
    (copying into the page cache) and uninterruptible waits (fsync) above their median over the other intervals."""

    def __init__(self, ticks: list[Tick]):
        self.floor = WRITE_BURST + 2 * _median([k.fig.get("cgroup.io_write_bytes", 0.0) for k in ticks])
        calm = [k for k in ticks if not self.is_burst(k)]
        # the job's own system time grows with its work (allocations, faults): its share of user time
        user = sum(k.fig.get("cgroup.cpu_user_ns", 0.0) for k in calm)
        self.sys_per_user = sum(k.fig.get("cgroup.cpu_system_ns", 0.0) for k in calm) / user if user > 0 else 0.0
        self.io = _median([k.fig.get("sched.offcpu_io_ns", 0.0) for k in calm])
        # a checkpoint's fsync that crosses a tick: its bytes are counted as they go to the disk, so the wait for the
        # last of them can fall in the next interval — one right after a burst whose uninterruptible waits are still
        # above their median is the checkpoint's too (else its wait reads as input)
        self.ends = {id(k) for prev, k in zip(ticks, ticks[1:]) if self.is_burst(prev) and not self.is_burst(k)
                     and k.fig.get("sched.offcpu_io_ns", 0.0) > self.io}

    def is_burst(self, k: Tick) -> bool:
        return k.fig.get("cgroup.io_write_bytes", 0.0) >= self.floor

    def checkpoint(self, k: Tick) -> tuple[float, float]:
        """(seconds of the interval spent checkpointing, of which on CPU); (0, 0) outside a burst and its end."""
        if not self.is_burst(k) and id(k) not in self.ends:
            return 0.0, 0.0
        usual = k.fig.get("cgroup.cpu_user_ns", 0.0) * self.sys_per_user
        cpu = min(k.dt, max(0.0, k.fig.get("cgroup.cpu_system_ns", 0.0) - usual) / 1e9)
        wait = max(0.0, k.fig.get("sched.offcpu_io_ns", 0.0) - self.io) / 1e9
        return min(k.dt, cpu + wait), cpu


def used_and_granted(ticks: list[Tick], after: list[Tick]) -> tuple[dict[str, float], dict[str, float]]:
    """What the job used (CPU cores and GPUs busy: means over its intervals after startup, weighted by dt; its memory
    peak) and what it was granted (the latest CPU limit or cpuset, memory limit and GPU count seen)."""
    used: dict[str, float] = {}
    for key, attr in (("cpu_cores", "cores"), ("gpus_busy", "busy")):
        mean = _mean_by_dt([(getattr(k, attr), k.dt) for k in after if getattr(k, attr) is not None])
        if mean is not None:
            used[key] = mean
    peaks = [k.grant["mem_peak_bytes"] for k in ticks if "mem_peak_bytes" in k.grant]
    if peaks:
        used["mem_peak_bytes"] = max(peaks)
    granted: dict[str, float] = {}
    for k in ticks:
        granted.update({g: v for g, v in k.grant.items() if g != "mem_peak_bytes"})
    return used, granted


def split(k: Tick, short: float, steady: float, usual: dict[str, float], by: str, b: dict[str, float],
          parts: dict[str, float], burst: bool = False) -> None:
    """Give an interval's shortfall (`short` seconds) to the buckets its figures above their usual level vote for
    (in a checkpoint's interval its uninterruptible waits were the checkpoint's: no vote); `starved`'s share by
    cause into `parts` too."""
    if short <= 0:
        return

    def above(f: str) -> float:
        return max(0.0, k.fig.get(f, 0.0) - usual.get(f, 0.0))
    threads = max(steady, 1.0)    # the threads (or, GPU-paced, the processes driving the GPUs) that fell short
    votes = {   # a starved part (STARVED_BY) votes for `starved`
        "cpu_limit": above("cgroup.cpu_throttled_ns") * threads,
        "memory": above("pressure.mem_some_ns"),
        "waiting_for_input": (0.0 if burst else above("sched.offcpu_io_ns")) + above("sched.offcpu_sleep_ns")
        + above("sched.offcpu_wait_ns"),
    }
    cast = sum(votes.values())
    # what the threads did off CPU instead, in all: the wait and sleep figures above their usual levels one by one,
    # or the whole of the threads' off-CPU time above its usual level (a loader that sleeps where it usually waits
    # on its queue moves time between two figures: the whole does not count it)
    off = max(cast + above("sched.offcpu_lock_ns"), above("sched.offcpu_ns"))
    covered = min(1.0, off / (short * 1e9 * threads)) if cast > 0 else 0.0
    for name, v in votes.items():
        got = short * covered * v / cast if cast > 0 else 0.0
        if name in STARVED_BY:
            b["starved"] += got
            parts[name] += got
        else:
            b[name] += got
    b["gpu_idle" if by == "gpu_busy" else "other"] += short * (1 - covered)
