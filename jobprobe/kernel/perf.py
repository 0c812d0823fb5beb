# SPDX-License-Identifier: Apache-2.0
"""A small ctypes wrapper of perf_event_open(2): counting events only (no sampling, no mmap ring).

Two shapes, both of which this module owns end to end (open, enable, read, scale, close):

- CgroupGroup: one event group on one CPU for a cgroup2 group (PERF_FLAG_PID_CGROUP; the kernel rejects cpu=-1 for
  cgroup events, so callers open one group per online CPU). Read with PERF_FORMAT_GROUP so every member of the group
  shares one time_enabled/time_running pair, and matched by PERF_FORMAT_ID so member order never matters.
- TaskEvent: one event on one thread with inherit=1 (children and threads forked after the open are counted in
  it, and folded into it when they exit). Read one by one: kernels before 6.x reject inherit with PERF_FORMAT_GROUP.

Every source keeps its previous cumulative reading and hands out per-interval deltas, hardware counts scaled for
multiplexing (see delta()).
OSError is turned into ProbeUnavailable here, at the edge, with a reason a user can act on.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct

from jobprobe.core.counters import delta as counter_delta
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.core.libc import LIBC

# perf_event_open has no libc wrapper; its number is per architecture (asm/unistd.h).
NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1

# include/uapi/linux/perf_event.h: enum perf_hw_id / perf_sw_ids
PERF_COUNT_HW_CPU_CYCLES = 0
PERF_COUNT_HW_INSTRUCTIONS = 1
PERF_COUNT_HW_CACHE_MISSES = 3
PERF_COUNT_HW_BRANCH_MISSES = 5
PERF_COUNT_SW_TASK_CLOCK = 1
PERF_COUNT_SW_PAGE_FAULTS = 2
PERF_COUNT_SW_CONTEXT_SWITCHES = 3
PERF_COUNT_SW_CPU_MIGRATIONS = 4

PERF_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
PERF_FORMAT_TOTAL_TIME_RUNNING = 1 << 1
PERF_FORMAT_ID = 1 << 2
PERF_FORMAT_GROUP = 1 << 3

PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_FLAG_PID_CGROUP = 1 << 2

# Bits of the attr bitfield word (little-endian bit order, as GCC lays out the C bitfield on x86_64 and aarch64).
ATTR_DISABLED = 1 << 0
ATTR_INHERIT = 1 << 1

# _IO('$', n) and _IOR('$', 7, __u64) from the generic asm-generic/ioctl.h encoding (same on x86_64 and aarch64).
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_DISABLE = 0x2401
PERF_EVENT_IOC_ID = 0x80082407
PERF_IOC_FLAG_GROUP = 1

PERF_ATTR_SIZE_VER5 = 112  # Linux 4.1; newer kernels accept it, older ones accept it as long as the tail is zero

# Our names → (type, config). Software events are never multiplexed; hardware ones share a few PMU counters.
EVENTS = {
    "task_clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK),
    "context_switches": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CONTEXT_SWITCHES),
    "cpu_migrations": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_MIGRATIONS),
    "page_faults": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_PAGE_FAULTS),
    "cycles": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES),
    "instructions": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS),
    "cache_misses": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CACHE_MISSES),
    "branch_misses": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_BRANCH_MISSES),
}
# Software events are counted in groups of their own, which the kernel never multiplexes: their counts are exact and
# are never scaled. A ratio below 1 on such a group can only come from the group's clocks (a cgroup event's
# time_enabled runs on the cgroup's own clock, which starts and stops at the cgroup switch), and extrapolating a
# task-clock by it would inflate CPU time. (Measured: running == enabled to the ns on every group, issue 8.)
SOFTWARE = ("task_clock", "context_switches", "cpu_migrations", "page_faults")
HARDWARE = ("cycles", "instructions", "cache_misses", "branch_misses")


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER5 (112 bytes). The C bitfield is one u64, `flags`."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),            # VER1 ends: 72
        ("branch_sample_type", ctypes.c_uint64),  # VER2: 80
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),             # VER3: 96
        ("sample_regs_intr", ctypes.c_uint64),   # VER4: 104
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),         # VER5: 112
    ]


def make_attr(event: str, read_format: int, disabled: bool = False, inherit: bool = False) -> PerfEventAttr:
    kind, config = EVENTS[event]
    attr = PerfEventAttr()
    attr.type, attr.config, attr.size = kind, config, ctypes.sizeof(PerfEventAttr)
    attr.read_format = read_format
    attr.flags = (ATTR_DISABLED if disabled else 0) | (ATTR_INHERIT if inherit else 0)
    return attr


_libc = LIBC


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int, group_fd: int = -1, flags: int = 0) -> int:
    """The raw syscall; raises OSError (with errno) like os.* functions do."""
    nr = NR_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"perf_event_open syscall number unknown on {platform.machine()}")
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
                       ctypes.c_int(group_fd), ctypes.c_ulong(flags | PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(fd)


PERF_EVENT_IOC_SET_BPF = 0x40042408             # _IOW('$', 8, __u32)


def open_bpf_event(attr: PerfEventAttr, prog_fd: int) -> int:
    """A perf event for every process (pid -1; on CPU 0, though its BPF program runs on any CPU) that runs prog_fd
    each time it fires (a tracepoint, a uprobe), enabled; returns its fd: closing it detaches the program."""
    fd = perf_event_open(attr, -1, 0)
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


def explain(err: OSError, event: str, where: str) -> str:
    """A reason a user can act on, for a failed perf_event_open of `event` on `where`."""
    hw = EVENTS.get(event, (None,))[0] == PERF_TYPE_HARDWARE
    if hw and err.errno in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV):
        return f"no hardware PMU (the kernel has no {event} event: {err.strerror})"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"perf_event_open({event}) on {where} not permitted: needs root or CAP_PERFMON"
    if err.errno in (errno.EMFILE, errno.ENFILE):
        return f"out of file descriptors opening {event} on {where} (raise ulimit -n)"
    if err.errno == errno.ENOSYS:
        return f"perf_event_open is not available: {err.strerror}"
    if err.errno == errno.EBADF and where.startswith("cgroup"):
        return f"{where} is not a cgroup2 directory the perf_event controller knows (EBADF)"
    return f"perf_event_open({event}) on {where} failed: {err.strerror} ({errno.errorcode.get(err.errno, err.errno)})"


def scale(value: int, enabled: int, running: int) -> int:
    """A count corrected for multiplexing: the event ran `running` of `enabled` ns, so extrapolate linearly."""
    if running <= 0 or running >= enabled:
        return value  # never ran (value is 0 then) or never multiplexed
    return int(round(value * enabled / running))


def close_fds(fds: list[int]) -> None:
    """Close and forget every fd in the list (emptied in place, so a second call is a no-op)."""
    while fds:
        fd = fds.pop()
        try:
            os.close(fd)
        except OSError:
            pass


def parse_group(buf: bytes) -> tuple[int, int, dict[int, int]]:
    """A PERF_FORMAT_GROUP|TOTAL_TIME_ENABLED|TOTAL_TIME_RUNNING|ID read: (enabled, running, {id: value})."""
    nr, enabled, running = struct.unpack_from("=QQQ", buf)
    vals = struct.unpack_from(f"={2 * nr}Q", buf, 24)
    return enabled, running, {vals[i + 1]: vals[i] for i in range(0, 2 * nr, 2)}


class Source:
    """Something we read cumulative counts from; turns them into scaled per-interval deltas."""

    events: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.fds: list[int] = []
        self._prev: tuple[dict[str, int], int, int] = ({e: 0 for e in self.events}, 0, 0)

    def read(self) -> tuple[dict[str, int], int, int]:
        """Cumulative ({event: raw count}, time_enabled ns, time_running ns)."""
        raise NotImplementedError

    def delta(self) -> tuple[dict[str, int], float | None]:
        """Scaled counts since the previous call (or since open), and this interval's running/enabled ratio
        (None when the events were not enabled at all in the interval: nothing was scheduled)."""
        values, enabled, running = self.read()
        before, en0, run0 = self._prev
        self._prev = (values, enabled, running)
        de, dr = counter_delta(enabled, en0), counter_delta(running, run0)
        # Scale the interval's own delta by the interval's own ratio: a long-past multiplexing episode should not
        # distort today's figure (scaling cumulative totals would smear it over the whole run).
        out = {e: counter_delta(values[e], before.get(e, 0)) for e in self.events}
        for e in self.events:
            if e not in SOFTWARE:  # see SOFTWARE: never scaled
                out[e] = scale(out[e], de, dr)
        return out, (min(1.0, dr / de) if de > 0 else None)

    def close(self) -> None:
        close_fds(self.fds)


class CgroupGroup(Source):
    """One event group on one CPU counting a cgroup2 group (and its descendants), leader first in `events`."""

    def __init__(self, cgroup_fd: int, cpu: int, events: tuple[str, ...], where: str = "cgroup"):
        self.events = tuple(events)
        super().__init__()
        self._ids: dict[int, str] = {}
        fmt = PERF_FORMAT_GROUP | PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING | PERF_FORMAT_ID
        try:
            for ev in self.events:
                # The leader starts disabled so the whole group starts counting at one instant (the ENABLE below).
                leader = self.fds[0] if self.fds else -1
                attr = make_attr(ev, fmt, disabled=leader == -1)
                try:
                    fd = perf_event_open(attr, cgroup_fd, cpu, leader, PERF_FLAG_PID_CGROUP)
                except OSError as err:
                    raise ProbeUnavailable(explain(err, ev, f"{where} cpu {cpu}")) from err
                self.fds.append(fd)
                self._ids[struct.unpack("=Q", fcntl.ioctl(fd, PERF_EVENT_IOC_ID, bytes(8)))[0]] = ev
            fcntl.ioctl(self.fds[0], PERF_EVENT_IOC_ENABLE, PERF_IOC_FLAG_GROUP)
        except BaseException:
            self.close()  # release what this group took before the error
            raise
        self._size = 8 * (3 + 2 * len(self.events))

    def read(self) -> tuple[dict[str, int], int, int]:
        enabled, running, by_id = parse_group(os.read(self.fds[0], self._size))
        return {self._ids[i]: v for i, v in by_id.items() if i in self._ids}, enabled, running


class TaskEvent(Source):
    """One inherited event on one thread (pid=tid, any CPU). Counts of tasks it spawns are summed into it."""

    def __init__(self, tid: int, event: str):
        self.events = (event,)
        super().__init__()
        attr = make_attr(event, PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING, inherit=True)
        try:
            self.fds.append(perf_event_open(attr, tid, -1))
        except OSError as err:
            if err.errno == errno.ESRCH:
                raise ThreadGone(tid) from err
            raise ProbeUnavailable(explain(err, event, f"thread {tid}")) from err
        self.tid = tid

    def read(self) -> tuple[dict[str, int], int, int]:
        value, enabled, running = struct.unpack("=QQQ", os.read(self.fds[0], 24))
        return {self.events[0]: value}, enabled, running


class ThreadGone(Exception):
    """The thread exited before we could open an event on it; callers skip it (not a reason to give up)."""
