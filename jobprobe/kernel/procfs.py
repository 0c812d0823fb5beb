# SPDX-License-Identifier: Apache-2.0
"""The one reader each of /proc/PID/stat and /proc/PID/cgroup (proc(5)); every path under a root, for fixture trees.

/proc/PID/stat: the command name may hold spaces and ')', so fields are counted from the last ')'. Times are in
clock ticks (USER_HZ). Imports nothing of jobprobe.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

CLK_TCK = os.sysconf("SC_CLK_TCK")
NS_PER_TICK = 1_000_000_000 // CLK_TCK


def read_small(path: str | Path) -> str | None:
    """A small /proc or /sys file's text in one read(2) (half what pathlib costs: the agent reads some ten of them
    per job per tick), or None if it cannot be opened or read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while True:
            b = os.read(fd, 65536)
            chunks.append(b)
            if len(b) < 65536:   # seq_file and sysfs fill a read to its size unless the file ends first
                break
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def read_kv(path: str | Path, read: Callable[[str], str | None] = read_small) -> dict[str, int] | None:
    """'key value' lines (cpu.stat, memory.stat) → dict, or None if the file does not exist."""
    text = read(str(path))
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


class OpenFiles:
    """Small /proc, /sys and cgroup files read again every tick, through an fd kept open: one pread(2) at offset 0
    (seq_file and kernfs make the text anew) instead of open + read + close — 4–6× cheaper here, and the agent reads
    some ten such files per job per tick. A read that fails on a kept fd (the process reaped: ESRCH; the group
    removed: ENODEV) opens the path once more, so a PID used again is read as the new process. Files not read since
    the previous sweep() are closed. Thread-safe: a job's probes start side by side, each reading its target's
    files (two first reads of one path opened two fds and kept one: one leaked fd per file per attach). Only the
    kernel's own files (under /proc and /sys) are kept: a regular file (a fixture tree) could be replaced or
    removed under a kept fd. Bounded: past LIMIT fds held by all instances,
    reads open and close as read_small does."""

    LIMIT = 4096
    KEEP = ("/proc/", "/sys/")
    held = 0

    def __init__(self):
        self.lock = threading.Lock()
        self.fds: dict[str, list[int]] = {}    # path → [fd, generation of its last read]
        self.absent: dict[str, float] = {}     # path → when to look again
        self.gen = 0
        self.closed = False

    def read(self, path: str | Path, recheck: float = 0.0) -> str | None:
        """The file's text; None if it cannot be read. `recheck` > 0: a file found absent is not looked for again
        for that many seconds (a controller file of a group whose controller is off: it rarely comes on)."""
        path = str(path)
        if recheck and self.absent and time.monotonic() < self.absent.get(path, 0.0):
            return None
        with self.lock:
            return self._read(path, recheck)

    def _read(self, path: str, recheck: float) -> str | None:
        entry = self.fds.get(path)
        if entry is not None:
            entry[1] = self.gen
            data = self._pread(entry[0])
            if data is not None:
                return data
            self._drop(path)
        if OpenFiles.held >= self.LIMIT or not path.startswith(self.KEEP) or self.closed:
            return read_small(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            if recheck:
                self.absent[path] = time.monotonic() + recheck
            return None
        self.fds[path] = [fd, self.gen]
        OpenFiles.held += 1
        data = self._pread(fd)
        if data is None:
            self._drop(path)
        return data

    @staticmethod
    def _pread(fd: int) -> str | None:
        try:
            chunks = [os.pread(fd, 65536, 0)]
            while len(chunks[-1]) == 65536:
                chunks.append(os.pread(fd, 65536, 65536 * len(chunks)))
        except OSError:
            return None
        return b"".join(chunks).decode(errors="replace")

    def _drop(self, path: str) -> None:
        fd, _ = self.fds.pop(path)
        OpenFiles.held -= 1
        os.close(fd)

    def sweep(self) -> None:
        """Close what was not read since the last sweep (processes gone, groups removed)."""
        with self.lock:
            for path in [p for p, (_, g) in self.fds.items() if g != self.gen]:
                self._drop(path)
            self.gen += 1

    def close(self) -> None:
        """Close every kept fd; later reads (a last look at a job let go) open and close as read_small does."""
        with self.lock:
            self.closed = True
            for path in list(self.fds):
                self._drop(path)


class Stat(NamedTuple):
    state: str          # R S D Z X T t I ...
    ppid: int
    flags: int          # PF_* (include/linux/sched.h)
    utime: int          # clock ticks, this process (all its threads)
    stime: int
    cutime: int         # of the children it has waited for
    cstime: int
    num_threads: int
    processor: int = -1  # the CPU it last ran on
    starttime: int = 0   # clock ticks after boot it started at


def read_stat(proc: str, pid: int | str, read: Callable[[str], str | None] = read_small) -> Stat | None:
    """The fields of /proc/PID/stat this project uses; None if the process is gone. `read`: OpenFiles.read for
    a reader that comes back every tick."""
    data = read(f"{proc}/{pid}/stat")
    if data is None:
        return None
    # after comm: state(0) ppid(1) pgrp session tty_nr tpgid flags(6) minflt cminflt majflt cmajflt utime(11)
    # stime(12) cutime(13) cstime(14) priority nice num_threads(17) itrealvalue starttime(19) … processor(36)
    f = data[data.rfind(")") + 2:].split()
    if len(f) < 2:
        return None

    def num(i: int, default: int = 0) -> int:   # (a short line: a fixture tree, or a kernel that had fewer fields)
        return int(f[i]) if i < len(f) else default
    return Stat(f[0], num(1), num(6), num(11), num(12), num(13), num(14), num(17, 1), num(36, -1), num(19))


def read_cmdline(proc: str, pid: int | str, limit: int = 4096) -> bytes | None:
    """The process's command line as the kernel keeps it (arguments NUL-separated; empty for a kernel thread or a
    zombie), its first `limit` bytes; None if it has gone."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def read_maps(proc: str, pid: int | str) -> bytes | None:
    """The process's /proc/PID/maps text (its mappings, one a line); None if it has gone (or is not readable)."""
    try:
        with open(f"{proc}/{pid}/maps", "rb") as f:
            return f.read()
    except OSError:
        return None


def read_ppid(proc: str, pid: int) -> int | None:
    """Parent PID, or None if the process is gone or a zombie (it has ended; only its exit status waits to be
    collected)."""
    st = read_stat(proc, pid)
    return None if st is None or st.state in ("Z", "X") else st.ppid


def list_pids(proc: str) -> list[int]:
    """Every process's PID (the numeric directories of /proc)."""
    return [int(d) for d in os.listdir(proc) if d.isdigit()]


def read_cgroup(proc: str, pid: int | str) -> list[tuple[str, list[str], str]] | None:
    """/proc/PID/cgroup as (hierarchy id, controllers, path) per line ("0", [], "/…" for cgroup2); None if gone."""
    text = read_small(f"{proc}/{pid}/cgroup")
    if text is None:
        return None
    out = []
    for line in text.splitlines():
        hid, ctrls, path = line.split(":", 2)
        out.append((hid, [c for c in ctrls.split(",") if c], path))
    return out


def cgroup2_path(proc: str, pid: int | str) -> str | None:
    """A process's cgroup2 path ("0::/…"), relative to the cgroup2 mount; None if it is gone or has none."""
    lines = read_cgroup(proc, pid)
    return next((path for hid, ctrls, path in lines if hid == "0" and not ctrls), None) if lines else None


def cgroup_v1_path(proc: str, pid: int | str, controller: str) -> str | None:
    """The path of a process in the v1 hierarchy that carries `controller`; None if none (or it is gone)."""
    for _, ctrls, path in read_cgroup(proc, pid) or ():
        if controller in ctrls:
            return path
    return None


def environ(proc: str, pid: int | str, keys: tuple[str, ...]) -> dict[str, str] | None:
    """The variables named `keys` in a process's /proc/PID/environ (its environment at exec). None when it cannot be
    told: unreadable, or empty — a process gone, a zombie, a kernel thread, or one inside exec (the new program's
    environment is placed after the exec can no longer fail, which is when its parent hears it succeeded)."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw:
        return None
    want = {k.encode() for k in keys}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k in want:
            out[k.decode()] = v.decode(errors="replace")
    return out


def tgid(proc: str, tid: int | str) -> int | None:
    """The process (thread group) of thread `tid` (/proc/TID/status reads for any thread id); None if it is gone."""
    for line in (read_small(f"{proc}/{tid}/status") or "").splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return None
