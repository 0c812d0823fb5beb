"""The one reader each of /proc/PID/stat and /proc/PID/cgroup (proc(5)); every path under a root, for fixture trees.

/proc/PID/stat: the command name may hold spaces and ')', so fields are counted from the last ')'. Times are in
clock ticks (USER_HZ). Imports nothing of jobprobe.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

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
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


class Stat(NamedTuple):
    state: str          # R S D Z X T t I ...
    ppid: int
    flags: int          # PF_* (include/linux/sched.h)
    utime: int          # clock ticks, this process (all its threads)
    stime: int
    cutime: int         # of the children it has waited for
    cstime: int
    num_threads: int


def read_stat(proc: str, pid: int | str) -> Stat | None:
    """The fields of /proc/PID/stat this project uses; None if the process is gone."""
    data = read_small(f"{proc}/{pid}/stat")
    if data is None:
        return None
    # after comm: state(0) ppid(1) pgrp session tty_nr tpgid flags(6) minflt cminflt majflt cmajflt utime(11)
    # stime(12) cutime(13) cstime(14) priority nice num_threads(17)
    f = data[data.rfind(")") + 2:].split()
    if len(f) < 2:
        return None

    def num(i: int, default: int = 0) -> int:   # (a short line: a fixture tree, or a kernel that had fewer fields)
        return int(f[i]) if i < len(f) else default
    return Stat(f[0], num(1), num(6), num(11), num(12), num(13), num(14), num(17, 1))


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
