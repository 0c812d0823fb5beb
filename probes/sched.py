"""sched — what the scheduler does to the job: context switches, off-CPU time, run-queue latency.

Measures, per interval, for the job's threads: voluntary and involuntary context switches, time spent off CPU
(switch-out to next switch-in), and run-queue latency (runnable to running) as a log2 µs histogram with p50/p99.
Hooks: eBPF on tracepoints sched:sched_switch, sched_wakeup, sched_wakeup_new, sched_process_fork,
sched_process_exit (bpf/sched.c, bpf/common.h); only tracepoint arguments are read, never task_struct.
Oldest kernel: 4.18. Aggregation is in the kernel (one per-CPU struct per job slot); a tick reads one map element.
Cost: measured in the 6.18 VM with kernel.bpf_stats_enabled: ~150 ns per context switch and ~70 ns per wakeup
on the whole node (job or not); ~0.3-0.5 s to compile at start, and bcc/LLVM in-process holds ~120 MiB of RSS
(DESIGN.md: load from a short-lived subprocess instead).
Off-CPU time is added when a thread runs again, so a long sleep lands in the interval where it ends.
"""
from __future__ import annotations

import contextlib
import ctypes as ct
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import bpf
from jobprobe.errors import ProbeUnavailable, TargetGone
from jobprobe.host import Host
from jobprobe.probe import Field, Probe, delta, log2_percentile
from jobprobe.target import Target

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


def trim_log(text: str, lines: int = 6) -> str:
    """The last non-empty lines of a compiler or verifier log: the reason is at the end, the rest is noise."""
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])


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


@contextlib.contextmanager
def stderr_captured() -> Iterator[Any]:
    """Send fd 2 to a temporary file for the duration: libbcc prints compiler and verifier logs there, not into
    the exception. (Other threads' stderr is captured too for those ~0.3 s.)"""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield tmp
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def read_captured(tmp: Any) -> str:
    tmp.seek(0)
    return tmp.read().decode(errors="replace")


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
        self.bpf: Any = None      # the bcc BPF object while started
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
        try:
            from bcc import BPF
        except ImportError as err:
            raise ProbeUnavailable(f"bcc is not importable: {err}") from err
        cflags = ["-w"]
        if exit_has_group_dead(self.host.sys):
            cflags.append("-DJOB_EXIT_HAS_GROUP_DEAD")
        self.target = target
        try:
            with stderr_captured() as log:
                try:
                    # Compiles and creates the maps; loads no program (none has an auto-attach name).
                    self.bpf = BPF(text=bpf.source("sched").encode(), cflags=cflags)
                    for tp, fn in HANDLERS:
                        self.bpf.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
                except Exception as err:  # bcc raises bare Exception for compile, verifier and attach errors
                    why = trim_log(read_captured(log))
                    raise ProbeUnavailable(f"cannot load bpf/sched.c: {err}" + (f": {why}" if why else "")) from err
            self._register()
            self._last = self._reading()
        except ProbeUnavailable:
            self.stop()
            raise
        except Exception as err:  # OSError from /proc and /sys, bare Exception from bcc's map updates (map full)
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
        table = self.bpf[b"job_of_cgroup"]
        ids = set(self.target.cgroup_ids())
        for cg in ids - self._cg_ids:
            table[ct.c_uint64(cg)] = ct.c_uint32(self.slot)
        for cg in self._cg_ids - ids:
            with contextlib.suppress(KeyError):
                del table[ct.c_uint64(cg)]
        self._cg_ids = ids

    def _add_pids(self, pids: list[int]) -> None:
        table = self.bpf[b"job_of_tgid"]
        for pid in pids:
            key = ct.c_uint32(pid)
            if key in table:
                continue
            table[key] = ct.c_uint32(self.slot)
            # Insert first, then look: a process that exits after the look finds its key and deletes it in the
            # kernel; one that exited before it is removed here. Either way no stale key stays.
            if proc_gone(self.host.proc, pid):
                with contextlib.suppress(KeyError):
                    del table[key]

    def members(self) -> set[int]:
        """tgids (and member threads' tids) in the kernel's job_of_tgid map for this probe's slot."""
        if self.bpf is None:
            return set()
        return {k.value for k, v in self.bpf[b"job_of_tgid"].items() if v.value == self.slot}

    def _reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs."""
        per_cpu = self.bpf[b"stats"][ct.c_int(self.slot)]
        out = {k: sum(getattr(s, k) for s in per_cpu) for k in COUNTERS}
        out["hist"] = [sum(s.runq_hist[i] for s in per_cpu) for i in range(NBUCKETS)]
        return out

    def sample(self) -> dict[str, Any]:
        if self.bpf is None:
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
        b, self.bpf = self.bpf, None
        self._cg_ids, self.target = set(), None
        if b is not None:
            b.cleanup()
