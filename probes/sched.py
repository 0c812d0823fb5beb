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

import ctypes as ct
from typing import Any

from jobprobe.probe import Field, delta, log2_percentile
from probes._bpf import trim_log  # noqa: F401  (re-exported: the probe's error messages are trimmed with it)
from probes._bpfprobe import BpfProbe, exit_has_group_dead, proc_gone  # noqa: F401  (re-exported for tests)

NBUCKETS = 27   # bpf/sched.c NBUCKETS
COUNTERS = ("voluntary", "involuntary", "offcpu_ns", "runq_ns", "runq_events")
# (tracepoint, handler in bpf/sched.c); the membership handlers of bpf/common.h come first (BpfProbe).
HANDLERS = (
    ("sched:sched_switch", "on_switch"),
    ("sched:sched_wakeup", "on_wakeup"),
    ("sched:sched_wakeup_new", "on_wakeup_new"),
)


class SlotStats(ct.Structure):
    """bpf/sched.c struct slot_stats, one per job slot and CPU (the map checks the size at start)."""
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS] + [("runq_hist", ct.c_uint64 * NBUCKETS)]


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


class SchedProbe(BpfProbe):
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

    bpf_name = "sched"
    handlers = HANDLERS
    map_types = {"start": (ct.c_uint32, None), "stats": (ct.c_uint32, SlotStats)}

    def reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs."""
        per_cpu = self.loaded.maps["stats"].lookup(self.slot)
        out = {k: sum(getattr(s, k) for s in per_cpu) for k in COUNTERS}
        out["hist"] = [sum(s.runq_hist[i] for s in per_cpu) for i in range(NBUCKETS)]
        return out

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return interval(now, before)
