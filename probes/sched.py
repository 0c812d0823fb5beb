# SPDX-License-Identifier: Apache-2.0
"""sched — what the scheduler does to the job: context switches, off-CPU time and why, run-queue latency.

Per interval, for the job's threads: voluntary and involuntary switches; time off CPU split by why the thread left
it — preempted (waiting for a CPU), I/O (state D), lock (a futex wait), sleep (nanosleep), wait (any other sleep) —
with a sleeper's wakeup-to-run time apart (`offcpu_wakeup_ns`), the parts summing to `offcpu_ns`; run-queue latency
as a log2 µs histogram with p50/p99. Times are the part of each period inside the interval (periods still open at
the tick included), so the intervals sum to the periods.

Hooks: sched:sched_switch, sched_wakeup, sched_wakeup_new (raw tracepoints where the kernel has them),
sched_process_fork/exit (bpf/sched.c, bpf/common.h); lock vs sleep vs wait from the thread's saved syscall register
(5.15+ with BTF), else a raw_syscalls:sys_enter hook (`syscall_reasons`). Aggregation is in the kernel, one per-CPU
struct per job slot; a reading torn by a CPU's write is retried, then held and counted (`torn_reads`), one no
interval can hold is held and counted (`impossible`). Oldest kernel: 4.18.

What it costs and how it was measured, the kernels' differences and every case that reads short: docs/PROBES.md,
"sched" (numbers live there and in docs/PERFORMANCE.md, with the command that produced them, not here).
"""
from __future__ import annotations

import array
import ctypes as ct
import os
import platform
import time
from typing import Any

from jobprobe.contract import tickmemo
from jobprobe.contract.bpfprobe import BpfProbe
from jobprobe.contract.probe import Field
from jobprobe.core.counters import delta, log2_percentile
from jobprobe.kernel.bpfmap import possible_cpus
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node
from jobprobe.kernel.procfs import read_maps
from jobprobe.kernel.schedread import (
    COUNTERS,
    HELD,
    NBUCKETS,
    NTIMES,
    READ_TRIES,
    WORDS,
    SlotStats,
    node_threads,
    settle,
    slot_columns,
    time_totals,
    torn_cpus,
)
from jobprobe.kernel.symbols import KernelSymbols, UserSymbols

REASONS = ("preempt", "io", "lock", "sleep", "wait", "stopped")
# bpf/sched.c's category of each index: T_RUNQ, R_PREEMPT..R_WAIT, T_WAKEUP, R_STOPPED
TIMES = ("runq", *REASONS[:5], "wakeup", "stopped")
REASON_OF = {TIMES.index(r): r for r in REASONS}  # a record's R_* → its name
SYSCALL_REASONS = ("lock", "sleep")   # told apart from wait only where the syscall a sleeper is in is known
# (tracepoint, handler in bpf/sched.c); the membership handlers of bpf/common.h come first (BpfProbe).
HANDLERS = (
    ("sched:sched_switch", "on_switch"),
    ("sched:sched_wakeup", "on_wakeup"),
    ("sched:sched_wakeup_new", "on_wakeup_new"),
)
# Linux 5.18+ (sched_switch has prev_state as an argument): the same hooks as raw tracepoint programs.
RAW_HANDLERS = (
    ("raw:sched:sched_switch", "on_switch_raw"),
    ("raw:sched:sched_wakeup", "on_wakeup_raw"),
    ("raw:sched:sched_wakeup_new", "on_wakeup_new_raw"),
)
# With the kernel's BTF: BTF tracepoint programs (tp_btf), their records in task storage (bpf/sched.c BTF_SCHED).
BTF_HANDLERS = (
    ("btf:sched:sched_switch", "on_switch_btf"),
    ("btf:sched:sched_wakeup", "on_wakeup_btf"),
    ("btf:sched:sched_wakeup_new", "on_wakeup_new_btf"),
)
# Members the BTF programs read directly, at the running kernel's offsets: (define, struct.member, size, needed).
# The run queue's clock (a member's switch-out instant without a clock read) is optional: without
# CONFIG_FAIR_GROUP_SCHED there is no se.cfs_rq, and the clock is read instead.
BTF_OFFSETS = (("TASK_PID_OFF", "task_struct.pid", 4, True), ("TASK_CGROUPS_OFF", "task_struct.cgroups", 8, True),
               ("TASK_CFS_RQ_OFF", "task_struct.se.cfs_rq", 8, False), ("CFS_RQ_RQ_OFF", "cfs_rq.rq", 8, False),
               ("RQ_CLOCK_OFF", "rq.clock", 8, False), ("RQ_CPU_OFF", "rq.cpu", 4, False),
               ("TASK_LAST_ARRIVAL_OFF", "task_struct.sched_info.last_arrival", 8, False))
SYSCALL_HANDLERS = (("raw_syscalls:sys_enter", "on_sys_enter"),)
# With RAW_SCHED the syscall hook is a raw tracepoint program too: a classic one returning 0 hides every
# raw_syscalls:sys_enter of the node from perf users (`perf trace`, `perf stat -e raw_syscalls:*`).
RAW_SYSCALL_HANDLERS = (("raw:raw_syscalls:sys_enter", "on_sys_enter_raw"),)
# Where the second syscall argument sits in struct pt_regs (the uapi layout): x86_64 si, arm64 regs[1]; and the
# syscall number, read as 32 bits: x86_64 orig_ax (little-endian), arm64 syscallno (after regs[31], sp, pc, pstate,
# orig_x0).
SYSCALL_ARG2_OFF = {"x86_64": 13 * 8, "aarch64": 8}
SYSCALL_NR_OFF = {"x86_64": 15 * 8, "aarch64": 35 * 8}
# asm/unistd.h of each architecture: futex, futex_waitv (5.16), futex_wait (6.7), nanosleep, clock_nanosleep.
SYSCALL_NRS = {
    "x86_64": {"FUTEX": 202, "FUTEX_WAITV": 449, "FUTEX_WAIT": 455, "NANOSLEEP": 35, "CLOCK_NANOSLEEP": 230},
    "aarch64": {"FUTEX": 98, "FUTEX_WAITV": 449, "FUTEX_WAIT": 455, "NANOSLEEP": 101, "CLOCK_NANOSLEEP": 115},
}


class OffRec(ct.Structure):
    """bpf/sched.c struct off_rec, the value of `start` (one per job thread off CPU or seen leaving it)."""
    _fields_ = [("out_ns", ct.c_uint64), ("enq_ns", ct.c_uint64), ("slot", ct.c_uint32), ("reason", ct.c_uint32),
                ("tid", ct.c_uint32), ("tgid", ct.c_uint32), ("kstack", ct.c_int32), ("ustack", ct.c_int32),
                ("epoch", ct.c_uint32), ("mslot", ct.c_int32), ("mgen", ct.c_uint32), ("pad", ct.c_uint32),
                ("css", ct.c_uint64)]


class OffcpuEvent(ct.Structure):
    """bpf/sched.c struct offcpu_event: one off-CPU period of a traced job's thread (deep-trace windows)."""
    _fields_ = [("kind", ct.c_uint32), ("slot", ct.c_uint32), ("tid", ct.c_uint32), ("tgid", ct.c_uint32),
                ("out_ns", ct.c_uint64), ("enq_ns", ct.c_uint64), ("in_ns", ct.c_uint64), ("reason", ct.c_uint32),
                ("kstack", ct.c_int32), ("ustack", ct.c_int32), ("pad", ct.c_uint32)]


# Why a record has no stack (a trace event then says so: `kernel_stack_lost`, `user_stack_lost`): bpf_get_stack
# could not read it, trace_stacks had no room for one more thread, or it was emptied before the period ended.
STACK_ERRORS = {14: "could not be read", 12: "no room", 2: "not found"}


def record_stacks(r: Any) -> tuple[list[int], list[int]]:
    """The kernel and user stacks an off-CPU record carries after its fixed part (bpf/sched.c trace_offcpu:
    kstack bytes, then ustack bytes), innermost first, without the zeros that end a short one."""
    tail = getattr(r, "tail", b"") or b""
    kb, ub = max(r.kstack, 0), max(r.ustack, 0)
    ips = array.array("Q", tail[:(len(tail) // 8) * 8])
    return [ip for ip in ips[:kb // 8] if ip], [ip for ip in ips[kb // 8:(kb + ub) // 8] if ip]


TRACE_OFFCPU_MIN_US = int(os.environ.get("JOBPROBE_TRACE_OFFCPU_MIN_US", "100"))


def raw_sched(host: Host) -> bool:
    """Raw tracepoint programs for the sched hooks: they need sched_switch's prev_state argument (5.18, well after
    raw tracepoints themselves, 4.17)."""
    return host.kernel_at_least(5, 18)


def btf_sched(host: Host) -> tuple[tuple[str, ...], str | None]:
    """BTF tracepoint programs with task storage for the sched hooks, where the raw ones can be used (5.18) and the
    kernel has BTF (task storage from tracing programs: 5.11; BTF task pointers to helpers: 5.11). (flags, why not)"""
    if not raw_sched(host):
        return (), "no raw sched_switch with prev_state (5.18)"
    if not host.has_btf:
        return (), "no kernel BTF (/sys/kernel/btf/vmlinux)"
    # the task_struct offsets are left for the loader to take from the kernel's BTF ("@btf:...", bpf_loader): the
    # agent never reads the ~6 MB of BTF itself (its heap kept ~8 MiB of the pass)
    try:
        ncpu = possible_cpus(host.sys)
    except OSError:          # a host root without the file (a test's): the running kernel's
        ncpu = possible_cpus()
    return ("-DBTF_SCHED", f"-DSCHED_NCPU={ncpu}", *(f"-D{define}=@btf{'' if needed else '?'}:{where}:{size}"
                             for define, where, size, needed in BTF_OFFSETS)), None


def interval(now: dict[str, Any], before: dict[str, Any], syscall_reasons: bool = True) -> dict[str, Any]:
    """This interval's fields from two readings {counter: int, "events": [int]*NTIMES, "times": [int]*NTIMES (ns
    up to the reading, see time_totals), "hist": [int]*NBUCKETS}. Times are the differences of the two: what was
    spent off CPU within the interval, whether or not the period has ended. Without the syscall hook, lock and
    sleep are unknown (None): their time is in wait."""
    d = {k: delta(now[k], before[k]) for k in COUNTERS}
    # settle() made the readings' times monotonic and held any that no interval can hold: the differences are
    # emitted as they are, nothing clamped here.
    times = {name: a - b for name, a, b in zip(TIMES, now["times"], before["times"])}
    events = {name: delta(a, b) for name, a, b in zip(TIMES, now["events"], before["events"])}
    hist = [delta(a, b) for a, b in zip(now["hist"], before["hist"])]
    out = {
        "voluntary_switches": d["voluntary"],
        "involuntary_switches": d["involuntary"],
        "offcpu_ns": sum(times[r] for r in REASONS) + times["wakeup"],
        "runq_lat_ns": times["runq"],
        "runq_events": d["runq_events"],
        "switch_ins_missed": d["switch_ins_missed"],
        "switch_in_missed_ns": d["switch_in_missed_ns"],
        "runq_lat_us_log2": hist,
        "runq_lat_p50_us": log2_percentile(hist, 0.50),
        "runq_lat_p99_us": log2_percentile(hist, 0.99),
        "offcpu_wakeup_ns": times["wakeup"],
        **{k: now.get(k, 0) - before.get(k, 0) for k in HELD},
    }
    for r in REASONS:
        known = syscall_reasons or r not in SYSCALL_REASONS
        out[f"offcpu_{r}_ns"] = times[r] if known else None
        out[f"offcpu_{r}_events"] = events[r] if known else None
    return out


def zero_reading() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, "events": [0] * NTIMES, "times": [0] * NTIMES, "hist": [0] * NBUCKETS,
            **{k: 0 for k in HELD}, "t": 0, "lag": 0, "node": None}


def syscall_cflags(machine: str) -> list[str] | None:
    """-DNR_*=n for bpf/sched.c's syscall classes on this architecture, or None when its numbers are unknown."""
    nrs = SYSCALL_NRS.get(machine)
    return None if nrs is None else ["-DSYSCALL_REASONS", *(f"-DNR_{k}={v}" for k, v in nrs.items()),
                                     f"-DSYSCALL_ARG2_OFF={SYSCALL_ARG2_OFF[machine]}"]


def syscall_from_regs(host: Host) -> bool:
    """Whether the syscall a sleeping thread is in can be read at its switch-out: bpf_task_pt_regs (5.15) on a
    task from bpf_get_current_task_btf (BTF)."""
    return host.kernel_at_least(5, 15) and host.has_btf


def why_no_syscall_reasons(host: Host, wanted: bool, machine: str, hook: bool = True) -> str | None:
    """Why lock/sleep cannot be told apart from wait here, or None when they can (`hook`: by the syscall hook)."""
    if not wanted:
        return "turned off (syscall_reasons=False)"
    if syscall_cflags(machine) is None:
        return f"syscall numbers of {machine} unknown"
    missing = [tp for tp, _ in SYSCALL_HANDLERS if hook and not host.tracepoint_exists(*tp.split(":"))]
    return f"tracepoint {missing[0]} not found in tracefs" if missing else None


_REASON_MEANING = {
    "preempt": "switched out while still runnable (preempted, or yielded): the whole period waiting for a CPU",
    "io": "in uninterruptible sleep (state D: disk I/O, reads through the page cache, fsync, kernel mutexes), "
          "to the wakeup",
    "lock": "asleep in a futex wait (locks, condition variables, semaphores, Event.wait, the Python GIL), to the "
            "wakeup; None where the syscall cannot be told (then in wait)",
    "sleep": "asleep in nanosleep / clock_nanosleep (time.sleep), to the wakeup; None where the syscall cannot be "
             "told (then in wait)",
    "wait": "in any other sleep (poll/epoll/select, pipe and socket reads, wait4), to the wakeup",
    "stopped": "stopped or traced (SIGSTOP, SIGTSTP, a debugger: state T or t), to the SIGCONT's wakeup — paused, "
               "not waiting for anything",
}


def _fields() -> dict[str, Field]:
    out = {
        "voluntary_switches": Field("int", "count", "switches out of the job's threads that went to sleep"),
        "involuntary_switches": Field("int", "count", "switches out of the job's threads that were still runnable "
                                      "(preempted, or yielded)"),
        "offcpu_ns": Field("int", "ns", "time the job's threads spent off CPU (asleep or waiting for a CPU) within "
                           "the interval, threads still off CPU at the tick included (≤ dt per thread); the sum of "
                           "offcpu_{preempt,io,lock,sleep,wait,stopped,wakeup}_ns"),
        "runq_lat_us_log2": Field("list[int]", "count", f"run-queue latency histogram of the waits that ended in the "
                                  f"interval: bucket i counts waits of [2^i, 2^(i+1)) µs (bucket 0: [0, 2)), "
                                  f"{NBUCKETS} buckets, the last open-ended"),
        "runq_lat_ns": Field("int", "ns", "time the job's threads spent runnable waiting for a CPU within the "
                             "interval, waits still going on at the tick included (offcpu_preempt_ns + "
                             "offcpu_wakeup_ns + new threads' first waits)"),
        "runq_lat_p50_us": Field("float", "us", "median run-queue latency (from the histogram; None if no events)"),
        "runq_lat_p99_us": Field("float", "us", "99th percentile run-queue latency (from the histogram; None if "
                                 "no events)"),
        "runq_events": Field("int", "count", "times a job thread went from runnable to running (waits that ended)"),
        "switch_ins_missed": Field("int", "count", "off-CPU periods whose switch-in reached no program (now and then "
                                   "the kernel delivers none for a switch away from a kernel worker), closed at the "
                                   "thread's next switch-out"),
        "switch_in_missed_ns": Field("int", "ns", "time those periods were counted off CPU (and waiting, where woken "
                                     "or preempted) after the thread was back on a CPU: from the kernel's own stamp of "
                                     "that switch-in (sched_info.last_arrival, BTF programs) to the last reading that "
                                     "counted the period open; where no stamp can be had, the whole period"),
        "offcpu_wakeup_ns": Field("int", "ns", "off-CPU time from the wakeup of a sleep (io, lock, sleep, wait) to "
                                  "running again: waiting for a CPU after sleeping (within the interval)"),
        "torn_reads": Field("int", "count", "ticks whose copy of the kernel's counters stayed torn (a CPU wrote "
                            "them while they were copied) after several tries: the interval reads 0 everywhere and "
                            "its figures land in the next interval; 0: every tick was read whole",
                            kind="counter"),
        "impossible": Field("int", "count", "ticks whose reading held a time no interval can (over dt per thread "
                            "on the node, or negative): a bug, not emitted; the interval reads 0 everywhere and the "
                            "next interval has its figures", kind="counter"),
    }
    for r, meaning in _REASON_MEANING.items():
        out[f"offcpu_{r}_ns"] = Field("int", "ns", f"off-CPU time of the job's threads within the interval (still "
                                      f"off CPU at the tick included), {meaning}")
        out[f"offcpu_{r}_events"] = Field("int", "count", f"off-CPU periods that ended, of threads {meaning}")
    return out


class SchedProbe(BpfProbe):
    name = "sched"
    default = True
    needs_root = True
    summary = ("context switches, off-CPU time by reason (preempt, I/O, lock, sleep, wait) and run-queue latency "
               "of the job's threads (eBPF, sched and raw_syscalls tracepoints)")
    fields = _fields()

    bpf_name = "sched"
    # One load for every job of the node: sample() reads its slot only; per-thread records carry their slot
    # (released with it).
    map_types = {"start": (ct.c_uint32, OffRec), "stats": (ct.c_uint32, SlotStats)}

    def __init__(self, host: Host | None = None, node: Node | None = None, syscall_reasons: bool = True,
                 machine: str | None = None, syscall_source: str | None = None, btf: bool | None = None):
        """syscall_source: "regs" (read at switch-out), "hook" (raw_syscalls:sys_enter), or None: regs where the
        kernel can, else the hook. btf: BTF tracepoint programs with records in task storage (None: where the
        kernel can; False: raw ones with a hash of records, whose entries user space can list)."""
        super().__init__(host, node)
        self._raw, self._cols = b"", {}     # the slot's last copy and its sum over CPUs (reading)
        machine = machine or platform.machine()
        self.from_regs = syscall_source == "regs" or (syscall_source is None and syscall_from_regs(self.host))
        # Why lock and sleep are not told apart from wait (None: they are); decided once, from the host.
        self.syscall_reasons_off = why_no_syscall_reasons(self.host, syscall_reasons, machine, not self.from_regs)
        self.syscall_reasons = self.syscall_reasons_off is None
        self.syscall_hook = self.syscall_reasons and not self.from_regs
        self.raw = raw_sched(self.host)
        btf_flags, self.btf_why = btf_sched(self.host) if btf is not False else ((), "not asked for")
        self.btf = bool(btf_flags)
        self.handlers = (BTF_HANDLERS if self.btf else RAW_HANDLERS if self.raw else HANDLERS) + \
            ((RAW_SYSCALL_HANDLERS if self.raw else SYSCALL_HANDLERS) if self.syscall_hook else ())
        self.cflags = tuple(syscall_cflags(machine) or ()) if self.syscall_reasons else ()
        if self.syscall_hook:
            self.cflags += ("-DSYSCALL_HOOK",)
            self.map_types = {**self.map_types, "in_call": (ct.c_uint32, ct.c_uint32)}
        elif self.syscall_reasons:
            self.cflags += ("-DSYSCALL_FROM_REGS", f"-DSYSCALL_NR_OFF={SYSCALL_NR_OFF[machine]}")
        if self.raw:   # `start` is keyed by task_struct address instead of thread id
            self.cflags += ("-DRAW_SCHED",)
            self.map_types = {**self.map_types, "start": (ct.c_uint64, OffRec)}
        if self.btf:   # `start` is task storage: not listed (a released slot's epoch moves instead)
            self.cflags += btf_flags
            self.map_types = {k: v for k, v in self.map_types.items() if k != "start"}

    # ---- deep-trace windows: each off-CPU period, with the stacks it left the CPU with ----------------------
    trace_kinds = {1: OffcpuEvent}
    trace_min_ns = TRACE_OFFCPU_MIN_US * 1000

    def trace_keep(self, rec: bytes) -> Any:
        """A record's fixed part, and its stacks as one bytes object shared by every record with the same ones
        (a window keeps up to TRACE_KEEP records; most repeat a handful of stacks). A process's maps are read at
        its first record, while it runs (a job that ends inside its window still has its user stacks named)."""
        n = ct.sizeof(OffcpuEvent)
        extra = self.shared.extra
        seen, maps = extra.setdefault("stacks_seen", {}), extra.setdefault("maps_seen", {})
        tgid = int.from_bytes(rec[12:16], "little")
        if tgid not in maps:
            maps[tgid] = read_maps(self.host.proc, tgid) or b""
        tail = rec[n:]
        return rec[:n], seen.setdefault(tail, tail)

    def trace_take(self) -> tuple[list[Any], int]:
        """The window's off-CPU periods, each with its stacks, and each process's maps read again now where it still
        runs (what it mapped since), to name its user addresses later. Once no job of the load is in a window, the
        threads' stacks held in the kernel (trace_stacks) go, and the maps kept."""
        records, dropped = super().trace_take()
        with self.shared.lock:
            early = dict(self.shared.extra.get("maps_seen", {}))
            if self.deep and not self.shared.extra.get("traced", 0):
                table = self.loaded.maps["trace_stacks"]
                for tid in table.keys():
                    table.delete(tid)
                self.shared.extra.pop("stacks_seen", None)
                self.shared.extra.pop("maps_seen", None)
        # (read outside the lock: the load's other jobs drain the ring meanwhile)
        self._taken = {tgid: read_maps(self.host.proc, tgid) or early.get(tgid, b"")
                       for tgid in {r.tgid for r in records}}
        return records, dropped

    def trace_events(self, records: list[Any], clock: Any) -> list[dict[str, Any]]:
        """One complete ("X") event per off-CPU period on its thread's kernel track: its reason, how long of it
        was spent waiting for a CPU once runnable, and its kernel and user stacks, innermost first."""
        maps = getattr(self, "_taken", {})
        ksyms = KernelSymbols(self.host.proc) if any(r.kstack > 0 for r in records) else None
        users: dict[int, UserSymbols] = {}
        out = []
        for r in records:
            reason = REASON_OF.get(r.reason, "new")
            args: dict[str, Any] = {"reason": reason}
            if r.enq_ns and r.reason != 1:
                args["runq_us"] = round(max(0, r.in_ns - r.enq_ns) / 1e3, 1)
            kernel, user = record_stacks(r)
            if ksyms is not None and kernel:
                names = [ksyms.name(ip) for ip in kernel]
                while names and names[0].startswith("bpf_"):    # this program and the tracepoint's caller
                    names.pop(0)
                args["kernel_stack"] = names
            for side, n in (("kernel", r.kstack), ("user", r.ustack)):
                if n < -1:          # bpf_get_stack could not read it (-1: no stack asked for)
                    args[f"{side}_stack_lost"] = STACK_ERRORS.get(-n, f"error {-n}")
            if user:
                if r.tgid not in users:
                    users[r.tgid] = UserSymbols(maps.get(r.tgid, b""), f"{self.host.proc}/{r.tgid}/root")
                args["user_stack"] = [users[r.tgid].name(ip) for ip in user]
            out.append({"ph": "X", "cat": "off-cpu", "name": f"off-CPU: {reason}", "pid": r.tgid,
                        "tid": clock.kernel_tid(r.tid), **clock.span(r.out_ns, r.in_ns), "args": args})
        return out

    def release(self) -> None:
        """With task storage the job's records cannot be listed: its slot's epoch moves first, so that whatever
        record of it is left counts nowhere, then the counters are zeroed."""
        if self.btf and self.loaded is not None and self.slot >= 0:
            epoch = self.loaded.maps["slot_epoch"].typed(ct.c_uint32, ct.c_uint32)
            epoch.update(self.slot, ((epoch.lookup(self.slot) or 0) + 1) & 0xFFFFFFFF)
        super().release()

    def slot_copy(self, again: bool) -> tuple[bytes, int, int]:
        """This slot's per-CPU copies as the kernel made them, with the monotonic instants just before and just
        after the copy. In an agent tick the first is the tick's one read of every slot (shared by the node's
        jobs, as slot_sums); `again`, a copy of this slot alone."""
        table = self.loaded.maps["stats"]
        if tickmemo.active() and not again:
            def whole() -> tuple[bytes, int, int]:
                t0 = time.monotonic_ns()
                raw = table.array_raw()
                t1 = time.monotonic_ns()
                self.read_at(t1)
                return raw, t0, t1
            raw, t0, t1 = tickmemo.get(("sched-slots", table), whole)
            size = WORDS * 8 * table.ncpus
            return raw[self.slot * size:(self.slot + 1) * size], t0, t1
        t0 = time.monotonic_ns()
        per_cpu = table.lookup(self.slot)
        t1 = time.monotonic_ns()
        self.read_at(t1)
        return b"".join(bytes(v) for v in per_cpu), t0, t1

    def read_at(self, t: int) -> None:
        """Tell the programs the instant this reading counted open periods up to (bpf/sched.c missed_end)."""
        table = self.loaded.maps.get("read_at")
        if table is not None:
            table.update(ct.c_uint32(0), ct.c_uint64(t))

    def reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs, from a copy in which no CPU's words were being
        written (bpf/sched.c write_begin); times up to the instant after the copy. A slot still torn after
        READ_TRIES copies is not read this tick: the last reading is kept (`torn_reads` up one), and so is one
        that settle() finds impossible."""
        ncpus = self.loaded.maps["stats"].ncpus
        # the node's threads just before the copy: every thread alive at the instant the reading stands for was
        # alive then or forked since (counted in the next reading's forks)
        node = tickmemo.get(("node-threads", self.host.proc), lambda: node_threads(self.host.proc))
        for attempt in range(READ_TRIES if self._last is not None else 10 * READ_TRIES):
            raw, t0, t1 = self.slot_copy(again=attempt > 0)
            if not torn_cpus(raw, ncpus):
                break
        else:
            if self._last is None:   # no baseline to keep: start() says so (ProbeUnavailable)
                raise ValueError(f"the sched counters of slot {self.slot} stayed torn over {10 * READ_TRIES} copies")
            return {**self._last, "torn_reads": self._last["torn_reads"] + 1}
        self.read_ns = t1
        if raw != self._raw:           # an idle job's copy is the same bytes tick after tick: summed once
            self._raw, self._cols = raw, slot_columns(raw, ncpus)
        out = {k: list(v) if isinstance(v, list) else v for k, v in self._cols.items()}
        out["times"] = time_totals(out, t1)      # open periods counted up to the instant after the copy
        out["hist"] = out.pop("runq_hist")
        out.update(t=t1, lag=t1 - t0, node=node)
        if self._last is None:
            return {**out, **{k: 0 for k in HELD}}
        return settle(out, self._last)

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return interval(now, before, self.syscall_reasons)
