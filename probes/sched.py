"""sched — what the scheduler does to the job: context switches, off-CPU time, run-queue latency.

Measures, per interval, for the job's threads: voluntary and involuntary context switches, time spent off CPU
(switch-out to next switch-in), and run-queue latency (runnable to running) as a log2 µs histogram with p50/p99.
Hooks: eBPF on tracepoints sched:sched_switch, sched_wakeup, sched_wakeup_new, sched_process_fork,
sched_process_exit (bpf/sched.c, bpf/common.h); only tracepoint arguments are read, never task_struct.
Oldest kernel: 4.18. Aggregation is in the kernel (one per-CPU struct per job slot); a tick reads one map element.
Cost: measured in the 6.18 VM with bpf_stats (Loaded.prog_stats): on every context switch of the node ~190 ns
when neither task is the job's, 240-450 ns averaged over a node where a training job switches; ~110-200 ns per
wakeup. Start: ~0.4-0.6 s to compile in a loader subprocess (probes/_bpf.py), which holds bcc/LLVM and exits, so
the agent never maps them (agent RSS ~19 MB instead of ~141 MB). sample(): one per-CPU map lookup, ~50 µs.
Off-CPU time is added when a thread runs again, so a long sleep lands in the interval where it ends.
"""
from __future__ import annotations

import contextlib
import ctypes as ct
import importlib.util
from pathlib import Path
from typing import Any

from jobprobe.errors import ProbeUnavailable, TargetGone
from jobprobe.host import Host
from jobprobe.probe import Field, Probe, delta, log2_percentile
from jobprobe.target import Target
from probes import _bpf
from probes._bpf import trim_log  # noqa: F401  (re-exported: the probe's error messages are trimmed with it)

NBUCKETS = 27   # bpf/sched.c NBUCKETS
COUNTERS = ("voluntary", "involuntary", "offcpu_ns", "runq_ns", "runq_events")
# (tracepoint, handler in bpf/common.h or bpf/sched.c). Membership first: forks are followed before we register.
HANDLERS = (
    ("sched:sched_process_fork", "job_fork"),
    ("sched:sched_process_exit", "job_exit"),
    ("sched:sched_switch", "on_switch"),
    ("sched:sched_wakeup", "on_wakeup"),
    ("sched:sched_wakeup_new", "on_wakeup_new"),
)


class SlotStats(ct.Structure):
    """bpf/sched.c struct slot_stats, one per job slot and CPU (the map checks the size at start)."""
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS] + [("runq_hist", ct.c_uint64 * NBUCKETS)]


def exit_has_group_dead(sys_root: str = "/sys") -> bool:
    """Whether sched_process_exit carries group_dead (recent kernels), read from the tracepoint's format file."""
    for base in ("kernel/tracing", "kernel/debug/tracing"):
        try:
            return "group_dead" in Path(sys_root, base, "events/sched/sched_process_exit/format").read_text()
        except OSError:
            continue
    return False


def proc_gone(proc: str, pid: int) -> bool:
    """True when pid has exited: no /proc entry, or a zombie/dead task (its exit tracepoint has fired)."""
    try:
        stat = Path(proc, str(pid), "stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


def interval(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """This interval's fields from two cumulative readings {counter: int, "hist": [int]*NBUCKETS}."""
    d = {k: delta(now[k], before[k]) for k in COUNTERS}
    hist = [delta(a, b) for a, b in zip(now["hist"], before["hist"])]
    return {
        "voluntary_switches": d["voluntary"],
        "involuntary_switches": d["involuntary"],
        "offcpu_ns": d["offcpu_ns"],
        "runq_lat_ns": d["runq_ns"],
        "runq_events": d["runq_events"],
        "runq_lat_us_log2": hist,
        "runq_lat_p50_us": log2_percentile(hist, 0.50),
        "runq_lat_p99_us": log2_percentile(hist, 0.99),
    }


def zero_reading() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, "hist": [0] * NBUCKETS}


class SchedProbe(Probe):
    name = "sched"
    default = True
    needs_root = True
    summary = "context switches, off-CPU time and run-queue latency of the job's threads (eBPF, sched tracepoints)"
    fields = {
        "voluntary_switches": Field("int", "count", "switches out of the job's threads that went to sleep"),
        "involuntary_switches": Field("int", "count", "switches out of the job's threads that were still runnable "
                                      "(preempted, or yielded)"),
        "offcpu_ns": Field("int", "ns", "time the job's threads spent off CPU (asleep or waiting for a CPU), "
                           "counted when each thread ran again"),
        "runq_lat_us_log2": Field("list[int]", "count", f"run-queue latency histogram: bucket i counts waits of "
                                  f"[2^i, 2^(i+1)) µs (bucket 0: [0, 2)), {NBUCKETS} buckets, the last open-ended"),
        "runq_lat_ns": Field("int", "ns", "total run-queue latency of the interval's events"),
        "runq_lat_p50_us": Field("float", "us", "median run-queue latency (from the histogram; None if no events)"),
        "runq_lat_p99_us": Field("float", "us", "99th percentile run-queue latency (from the histogram; None if "
                                 "no events)"),
        "runq_events": Field("int", "count", "times a job thread went from runnable to running"),
    }

    def __init__(self, host: Host | None = None, slot: int = 0):
        super().__init__(host)
        self.slot = slot          # job slot in the shared maps (one job per probe instance for now)
        self.loaded: _bpf.Loaded | None = None   # fds of programs, attachments and maps while started
        self.target: Target | None = None
        self._cg_ids: set[int] = set()
        self._last = zero_reading()

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        missing = [tp for tp, _ in HANDLERS if not host.tracepoint_exists(*tp.split(":"))]
        if missing:
            return f"tracepoint {missing[0]} not found in tracefs"
        if importlib.util.find_spec("bcc") is None:
            return "bcc (python3-bpfcc) is not importable"
        return None

    def start(self, target: Target) -> None:
        cflags = ["-w"]
        if exit_has_group_dead(self.host.sys):
            cflags.append("-DJOB_EXIT_HAS_GROUP_DEAD")
        self.target = target
        try:
            # Compiled and attached in a loader subprocess; ProbeUnavailable carries the compiler/verifier's words.
            self.loaded = _bpf.load("sched", cflags, HANDLERS, sys_root=self.host.sys)
            maps = self.loaded.maps
            maps["job_of_cgroup"].typed(ct.c_uint64, ct.c_uint32)
            maps["job_of_tgid"].typed(ct.c_uint32, ct.c_uint32)
            maps["start"].typed(ct.c_uint32)
            maps["stats"].typed(ct.c_uint32, SlotStats)
            self._register()
            self._last = self._reading()
        except ProbeUnavailable:
            self.stop()
            raise
        except (OSError, KeyError, ValueError) as err:  # /proc and /sys; a full map (E2BIG); a layout mismatch
            self.stop()
            raise ProbeUnavailable(f"cannot register the job with the sched probe: {err}") from err

    def _register(self) -> None:
        """Put the job's cgroups or processes in the membership maps. For a PID tree, the in-kernel fork handler
        follows forks only of processes already in the map, so the tree is scanned again afterwards to catch
        children forked between the first scan and the insert."""
        target = self.target
        if target is None:
            return
        if target.kind == "cgroup":
            self._sync_cgroups()
            return
        self._add_pids(target.pids())
        with contextlib.suppress(TargetGone):  # every process already exited: nothing more to add
            target.refresh()
        self._add_pids(target.pids())

    def _sync_cgroups(self) -> None:
        """Add ids of groups created since the last call (new steps, sub-containers), drop those removed."""
        table = self.loaded.maps["job_of_cgroup"]
        ids = set(self.target.cgroup_ids())
        for cg in ids - self._cg_ids:
            table.update(cg, self.slot)
        for cg in self._cg_ids - ids:
            table.delete(cg)
        self._cg_ids = ids

    def _add_pids(self, pids: list[int]) -> None:
        table = self.loaded.maps["job_of_tgid"]
        for pid in pids:
            if pid in table:
                continue
            table.update(pid, self.slot)
            # Insert first, then look: a process that exits after the look finds its key and deletes it in the
            # kernel; one that exited before it is removed here. Either way no stale key stays.
            if proc_gone(self.host.proc, pid):
                table.delete(pid)

    def members(self) -> set[int]:
        """tgids (and member threads' tids) in the kernel's job_of_tgid map for this probe's slot."""
        if self.loaded is None:
            return set()
        return {k for k, v in self.loaded.maps["job_of_tgid"].items() if v == self.slot}

    def _reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs."""
        per_cpu = self.loaded.maps["stats"].lookup(self.slot)
        out = {k: sum(getattr(s, k) for s in per_cpu) for k in COUNTERS}
        out["hist"] = [sum(s.runq_hist[i] for s in per_cpu) for i in range(NBUCKETS)]
        return out

    def sample(self) -> dict[str, Any]:
        if self.loaded is None:
            return {}
        # Processes the kernel cannot see arrive (a cgroup made after attach, a SLURM step started by slurmstepd
        # outside the tree): the target has been refreshed by the sampler; add what is new.
        if self.target is not None:
            if self.target.kind == "cgroup":
                self._sync_cgroups()
            else:
                self._add_pids(self.target.pids())
        now = self._reading()
        out = interval(now, self._last)
        self._last = now
        return out

    def stop(self) -> None:
        """Detach every tracepoint, close program and map fds. Idempotent."""
        loaded, self.loaded = self.loaded, None
        self._cg_ids, self.target = set(), None
        if loaded is not None:
            loaded.close()
