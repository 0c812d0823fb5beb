# SPDX-License-Identifier: Apache-2.0
"""syscalls — where the job's threads spend their time in system calls: calls and time per class and per syscall.

Measures, per interval, for the job's threads: calls and time in syscalls by class (rw, net, futex, mem, poll,
file, ioctl, other), the five syscalls that took the most time, and a log2 µs latency histogram of the class that
took the most time. A call is counted when it returns, with its whole duration (a long poll lands in the interval
where it ends); exit/exit_group and calls of threads killed inside them are not counted.
Hooks: eBPF on tracepoints raw_syscalls:sys_enter and sys_exit, sched:sched_process_exec via common.h (a thread's execve
changes its tid), plus sched_process_fork/exit (bpf/syscalls.c, bpf/common.h); only tracepoint arguments are
read, never task_struct. Syscall numbers are named at start from the kernel's own list (the generated
unistd_64.h of the running kernel's headers, else the libc headers'), with a small built-in x86_64 table when
neither is found; classes come from the names (tracefs's syscalls/ events carry names, not numbers).
Oldest kernel: 4.18 (bpf/common.h).
Cost, measured in the 6.18 VM (2 vCPUs) with bpf_stats (Loaded.prog_stats), which adds ~35 ns a run itself:
a syscall outside the job runs on_enter + on_exit, one hash lookup each, 100-130 ns in all (a getppid loop);
a member's call 210-270 ns; 255 ns on average over a node running the reference training job. In wall time a
getppid loop (jobprobe.bench.micro syscalls, ~175 ns a call unwatched) pays +90 ns outside the job and +250 ns
inside; ~55 ns of that is the perf-event tracepoint path itself (empty programs). sample(): one per-CPU array
lookup and one batch read of by_nr, 0.3-0.5 ms of Python.
While attached, perf users on the node see raw_syscalls:sys_enter/sys_exit count 0 (docs/PROBES.md).
"""
from __future__ import annotations

import array
import ctypes as ct
import os
import platform
import re
from pathlib import Path
from typing import Any

from jobprobe.contract.bpfprobe import BpfProbe
from jobprobe.contract.probe import Field
from jobprobe.core.counters import delta, log2_percentile
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node

NBUCKETS = 27     # bpf/syscalls.c NBUCKETS
NR_MAX = 1024     # bpf/syscalls.c NR_MAX: numbers outside [0, NR_MAX) are all counted as NR_MAX
TOP = 5
# Index = the class number stored in the kernel's class_of map; 0 ("other") is what an unfilled entry reads.
CLASSES = ("other", "rw", "net", "futex", "mem", "poll", "file", "ioctl")
CLASS_MEANING = {
    "rw": "data reads and writes on fds (read, write, pread64, readv, sendfile, splice, io_uring_enter, ...)",
    "net": "sockets (socket, connect, accept, sendto, recvfrom, sendmsg, recvmsg, setsockopt, ...)",
    "futex": "futexes and locks (futex, futex_waitv, flock, sched_yield, ...)",
    "mem": "memory mappings (mmap, munmap, mprotect, madvise, brk, mremap, mbind, ...)",
    "poll": "waiting (poll, select, epoll_wait, nanosleep, clock_nanosleep, wait4, io_getevents, ...)",
    "file": "file metadata and fds (openat, close, newfstatat, statx, lseek, getdents64, fcntl, dup, fsync, ...)",
    "ioctl": "ioctl (device drivers: GPUs, NICs, terminals)",
    "other": "every other syscall (clone, execve, getpid, rt_sigaction, ...)",
}
_NAMES_OF_CLASS = {
    "rw": "read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 sendfile sendfile64 splice tee "
          "vmsplice copy_file_range io_submit io_uring_enter process_vm_readv process_vm_writev",
    "net": "socket socketpair bind listen accept accept4 connect getsockname getpeername sendto recvfrom sendmsg "
           "recvmsg sendmmsg recvmmsg shutdown setsockopt getsockopt send recv socketcall",
    "futex": "futex futex_time64 futex_waitv futex_wake futex_wait futex_requeue set_robust_list get_robust_list "
             "flock sched_yield",
    "mem": "mmap mmap2 munmap mprotect pkey_mprotect mremap madvise process_madvise brk msync mlock mlock2 munlock "
           "mlockall munlockall mincore mbind set_mempolicy get_mempolicy set_mempolicy_home_node migrate_pages "
           "move_pages remap_file_pages mseal map_shadow_stack",
    "poll": "poll ppoll ppoll_time64 select _newselect pselect6 pselect6_time64 epoll_wait epoll_pwait "
            "epoll_pwait2 nanosleep clock_nanosleep clock_nanosleep_time64 wait4 waitid waitpid pause rt_sigsuspend "
            "rt_sigtimedwait io_getevents io_pgetevents io_pgetevents_time64",
    "file": "open openat openat2 creat close close_range stat fstat lstat newfstatat fstatat64 statx access "
            "faccessat faccessat2 getdents getdents64 readlink readlinkat mkdir mkdirat rmdir unlink unlinkat rename "
            "renameat renameat2 link linkat symlink symlinkat chmod fchmod fchmodat fchmodat2 chown fchown lchown "
            "fchownat truncate ftruncate lseek _llseek fsync fdatasync sync syncfs sync_file_range fallocate statfs "
            "fstatfs utime utimes utimensat futimesat setxattr lsetxattr fsetxattr getxattr lgetxattr fgetxattr "
            "listxattr llistxattr flistxattr removexattr lremovexattr fremovexattr chdir fchdir getcwd fcntl dup "
            "dup2 dup3 pipe pipe2 mknod mknodat umask memfd_create inotify_init inotify_init1 inotify_add_watch "
            "inotify_rm_watch fanotify_init fanotify_mark name_to_handle_at open_by_handle_at fadvise64 readahead "
            "file_getattr file_setattr",
    "ioctl": "ioctl",
}
CLASS_OF_NAME = {name: cls for cls, names in _NAMES_OF_CLASS.items() for name in names.split()}

# The fallback when no header is found (x86_64 only, from arch/x86/entry/syscalls/syscall_64.tbl): the calls a
# training job makes most. Anything else is named nr_<N>.
FALLBACK_X86_64 = {
    0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 6: "lstat", 7: "poll", 8: "lseek",
    9: "mmap", 10: "mprotect", 11: "munmap", 12: "brk", 13: "rt_sigaction", 14: "rt_sigprocmask",
    15: "rt_sigreturn", 16: "ioctl", 17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev", 21: "access",
    22: "pipe", 23: "select", 24: "sched_yield", 25: "mremap", 26: "msync", 28: "madvise", 32: "dup", 33: "dup2",
    35: "nanosleep", 39: "getpid", 40: "sendfile", 41: "socket", 42: "connect", 43: "accept", 44: "sendto",
    45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 48: "shutdown", 49: "bind", 50: "listen", 54: "setsockopt",
    55: "getsockopt", 56: "clone", 57: "fork", 59: "execve", 60: "exit", 61: "wait4", 62: "kill", 72: "fcntl",
    74: "fsync", 75: "fdatasync", 77: "ftruncate", 78: "getdents", 79: "getcwd", 87: "unlink", 89: "readlink",
    96: "gettimeofday", 102: "getuid", 110: "getppid", 186: "gettid", 202: "futex", 217: "getdents64",
    228: "clock_gettime", 230: "clock_nanosleep", 231: "exit_group", 232: "epoll_wait", 233: "epoll_ctl",
    257: "openat", 262: "newfstatat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4",
    290: "eventfd2", 291: "epoll_create1", 292: "dup3", 293: "pipe2", 299: "recvmmsg", 302: "prlimit64",
    307: "sendmmsg", 318: "getrandom", 319: "memfd_create", 332: "statx", 334: "rseq", 426: "io_uring_enter",
    435: "clone3", 436: "close_range", 449: "futex_waitv",
}

# Where the running kernel's own numbers are, nearest first: the generated header of its kernel headers (what
# bcc compiles against), then the libc headers. Paths relative to the modules dir / the include dir.
HEADERS = {
    "x86_64": (("build/arch/x86/include/generated/uapi/asm/unistd_64.h",),
               ("x86_64-linux-gnu/asm/unistd_64.h", "asm/unistd_64.h")),
    "aarch64": (("build/arch/arm64/include/generated/uapi/asm/unistd_64.h",),
                ("asm-generic/unistd.h", "aarch64-linux-gnu/asm/unistd.h")),
}
_DEFINE = re.compile(r"^#define\s+__NR(?:3264)?_(\w+)\s+(\w+)", re.M)


def parse_unistd(text: str) -> dict[int, str]:
    """number -> name from a unistd header's `#define __NR_name N` lines. asm-generic writes some as aliases
    (`#define __NR_fcntl __NR3264_fcntl`), resolved through the __NR3264_ defines."""
    raw = {name: value for name, value in _DEFINE.findall(text)}
    out: dict[int, str] = {}
    for name, value in _DEFINE.findall(text):
        for _ in range(4):                       # follow an alias chain a few steps
            if value.isdigit():
                break
            value = raw.get(re.sub(r"^__NR(?:3264)?_", "", value), "")
        if value.isdigit() and name not in ("syscalls", "arch_specific_syscall") and not name.startswith("_"):
            out.setdefault(int(value), name)
    return out


def syscall_table(machine: str | None = None, release: str | None = None, modules: str = "/lib/modules",
                  include: str = "/usr/include") -> tuple[dict[int, str], str]:
    """(number -> name, where it came from) for this machine: the headers above merged nearest first, else the
    built-in x86_64 table, else nothing (every call is then named nr_<N>, class other)."""
    machine = machine or platform.machine()
    release = release or platform.release()
    kernel_side, libc_side = HEADERS.get(machine, ((), ()))
    paths = [Path(modules, release, p) for p in kernel_side] + [Path(include, p) for p in libc_side]
    table: dict[int, str] = {}
    used = []
    for path in paths:
        try:
            found = parse_unistd(path.read_text())
        except OSError:
            continue
        if found:
            used.append(str(path))
            for nr, name in found.items():
                table.setdefault(nr, name)
    if table:
        return table, " + ".join(used)
    if machine == "x86_64":
        return dict(FALLBACK_X86_64), "built-in x86_64 table"
    return {}, "none"


def name_of(nr: int, table: dict[int, str]) -> str:
    return table.get(nr) or ("nr_unknown" if nr >= NR_MAX else f"nr_{nr}")


def class_index(name: str) -> int:
    return CLASSES.index(CLASS_OF_NAME.get(name, "other"))


class SlotStats(ct.Structure):
    """bpf/syscalls.c struct slot_stats, one per job slot and CPU (the map checks the size at start)."""
    _fields_ = [("calls", ct.c_uint64 * len(CLASSES)), ("ns", ct.c_uint64 * len(CLASSES)),
                ("untracked", ct.c_uint64), ("unrecorded", ct.c_uint64),
                ("hist", (ct.c_uint64 * NBUCKETS) * len(CLASSES))]


class NrTotal(ct.Structure):
    _fields_ = [("calls", ct.c_uint64), ("ns", ct.c_uint64)]


class InflightRec(ct.Structure):
    _fields_ = [("ts", ct.c_uint64), ("slot", ct.c_uint32), ("nr", ct.c_uint32)]


def zero_reading() -> dict[str, Any]:
    n = len(CLASSES)
    return {"calls": [0] * n, "ns": [0] * n, "untracked": 0, "unrecorded": 0,
            "hist": [[0] * NBUCKETS for _ in range(n)],
            "by_nr": {}}


def interval(now: dict[str, Any], before: dict[str, Any], table: dict[int, str]) -> dict[str, Any]:
    """This interval's fields from two cumulative readings (zero_reading()'s shape; by_nr: nr -> (calls, ns))."""
    calls = [delta(a, b) for a, b in zip(now["calls"], before["calls"])]
    ns = [delta(a, b) for a, b in zip(now["ns"], before["ns"])]
    out: dict[str, Any] = {"syscalls": sum(calls), "syscall_ns": sum(ns),
                           "untracked_calls": delta(now["untracked"], before["untracked"]),
                           "unrecorded_calls": delta(now["unrecorded"], before["unrecorded"])}
    for i, cls in enumerate(CLASSES):
        out[f"{cls}_calls"], out[f"{cls}_ns"] = calls[i], ns[i]
    # The slowest class: most time, ties to the most calls; None when no call returned.
    slowest = max(range(len(CLASSES)), key=lambda i: (ns[i], calls[i]))
    if calls[slowest] == 0:
        out["slowest_class"], hist = None, [0] * NBUCKETS
    else:
        out["slowest_class"] = CLASSES[slowest]
        hist = [delta(a, b) for a, b in zip(now["hist"][slowest], before["hist"][slowest])]
    out["slowest_lat_us_log2"] = hist
    out["slowest_lat_p50_us"] = log2_percentile(hist, 0.50)
    out["slowest_lat_p99_us"] = log2_percentile(hist, 0.99)
    per_nr = []
    for nr, (c, t) in now["by_nr"].items():
        c0, t0 = before["by_nr"].get(nr, (0, 0))
        if c != c0:
            per_nr.append((delta(t, t0), delta(c, c0), nr))
    per_nr.sort(reverse=True)
    out["top"] = [{"name": name_of(nr, table), "calls": c, "ns": t} for t, c, nr in per_nr[:TOP]]
    return out


def by_name(now: dict[str, Any], before: dict[str, Any], table: dict[int, str]) -> dict[str, tuple[int, int]]:
    """name -> (calls, ns) of every syscall the interval saw (the whole list behind `top`)."""
    out = {}
    for nr, (c, t) in now["by_nr"].items():
        c0, t0 = before["by_nr"].get(nr, (0, 0))
        if c != c0:
            out[name_of(nr, table)] = (delta(c, c0), delta(t, t0))
    return out


def _class_fields() -> dict[str, Field]:
    out = {}
    for cls in CLASSES:
        out[f"{cls}_calls"] = Field("int", "count", f"syscalls of class {cls} that returned: {CLASS_MEANING[cls]}")
        out[f"{cls}_ns"] = Field("int", "ns", f"time inside syscalls of class {cls}, from entry to return")
    return out


class SyscallEvent(ct.Structure):
    """bpf/syscalls.c struct syscall_event: one syscall of a traced job's thread (deep-trace windows)."""
    _fields_ = [("kind", ct.c_uint32), ("slot", ct.c_uint32), ("tid", ct.c_uint32), ("tgid", ct.c_uint32),
                ("enter_ns", ct.c_uint64), ("exit_ns", ct.c_uint64), ("nr", ct.c_uint32), ("pad", ct.c_uint32)]


TRACE_SYSCALL_MIN_US = int(os.environ.get("JOBPROBE_TRACE_SYSCALL_MIN_US", "100"))


class SyscallsProbe(BpfProbe):
    name = "syscalls"
    default = False   # every syscall on the node passes two programs (~100-150 ns): opt in with +syscalls
    needs_root = True
    summary = "syscall calls and time by class, the top syscalls by time, latency of the slowest class (eBPF)"
    fields = {
        "syscalls": Field("int", "count", "syscalls of the job's threads that returned in the interval"),
        "syscall_ns": Field("int", "ns", "time the job's threads spent inside those syscalls (entry to return)"),
        **_class_fields(),
        "top": Field("list[map]", "ns", f"the {TOP} syscalls with the most time: [{{name, calls, ns}}], most "
                     "time first"),
        "slowest_class": Field("str", "class", "the class with the most time in the interval (None if no calls)"),
        "slowest_lat_us_log2": Field("list[int]", "count", f"latency histogram of the slowest class: bucket i "
                                     f"counts calls of [2^i, 2^(i+1)) µs (bucket 0: [0, 2)), {NBUCKETS} buckets, "
                                     "the last open-ended"),
        "slowest_lat_p50_us": Field("float", "us", "median latency of the slowest class (from the histogram)"),
        "slowest_lat_p99_us": Field("float", "us", "99th percentile latency of the slowest class (histogram)"),
        "untracked_calls": Field("int", "count", "calls counted in their class but missing from `top` (the "
                                 "per-syscall table of the node was full)"),
        "unrecorded_calls": Field("int", "count", "calls of the job entered while the node's per-thread table "
                                  "(65 536 threads) was full: in no count or time above — the shortfall counted"),
    }

    bpf_name = "syscalls"
    # One load for every job of the node: reads its slot's counters and by_nr keys (slot << 16 | nr); per-thread
    # records carry their slot.
    handlers = (("raw_syscalls:sys_enter", "on_enter"), ("raw_syscalls:sys_exit", "on_exit"))
    raw_handlers = (("raw:raw_syscalls:sys_enter", "on_enter_raw"), ("raw:raw_syscalls:sys_exit", "on_exit_raw"))
    map_types = {"inflight": (ct.c_uint32, InflightRec), "stats": (ct.c_uint32, SlotStats),
                 "by_nr": (ct.c_uint32, NrTotal), "class_of": (ct.c_uint32, ct.c_uint32)}

    def __init__(self, host: Host | None = None, node: Node | None = None):
        super().__init__(host, node)
        if self.host.has_raw_tracepoints:   # cheaper, and perf users of raw_syscalls keep their counts
            self.handlers = self.raw_handlers
            self.cflags = (*self.cflags, "-DRAW_SYSCALLS")
        self.table: dict[int, str] = {}
        self.table_source = ""
        self.last_by_name: dict[str, tuple[int, int]] = {}   # the last interval, every syscall (tests, debugging)

    def prepare(self, loaded: Any) -> None:
        """Fill the module's class table (once per load)."""
        self.table, self.table_source = syscall_table()
        classes = loaded.maps["class_of"]
        for nr, name in self.table.items():
            cls = class_index(name)
            if cls and 0 <= nr < NR_MAX:
                classes.update(nr, cls)

    # ---- deep-trace windows: each syscall of the job's threads that took TRACE_SYSCALL_MIN_US or more ----------
    trace_kinds = {2: SyscallEvent}
    trace_min_ns = TRACE_SYSCALL_MIN_US * 1000

    def trace_events(self, records: list[Any], clock: Any) -> list[dict[str, Any]]:
        """One complete ("X") event per syscall, on its thread's kernel track (its off-CPU periods nest inside)."""
        table = self.table or syscall_table()[0]
        return [{"ph": "X", "cat": "syscall", "name": table.get(r.nr, f"syscall {r.nr}"), "pid": r.tgid,
                 "tid": clock.kernel_tid(r.tid), **clock.span(r.enter_ns, r.exit_ns), "args": {"nr": r.nr}}
                for r in records]

    def reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs; by_nr: nr -> (calls, ns) of our slot."""
        per_cpu = self.loaded.maps["stats"].lookup(self.slot)
        # Summed as flat u64 columns: reading 233 ctypes attributes per CPU one by one costs ~1 ms a tick.
        tot = [sum(col) for col in zip(*(array.array("Q", bytes(s)) for s in per_cpu))]
        n = len(CLASSES)
        hist = tot[2 * n + 2:]
        out = {"calls": tot[:n], "ns": tot[n:2 * n], "untracked": tot[2 * n], "unrecorded": tot[2 * n + 1],
               "hist": [hist[i * NBUCKETS:(i + 1) * NBUCKETS] for i in range(n)], "by_nr": {}}
        for key, vals in self.loaded.maps["by_nr"].items():
            if key >> 16 == self.slot:
                out["by_nr"][key & 0xFFFF] = (sum(v.calls for v in vals), sum(v.ns for v in vals))
        return out

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        self.last_by_name = by_name(now, before, self.table)
        return interval(now, before, self.table)
