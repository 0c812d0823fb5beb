# SPDX-License-Identifier: Apache-2.0
"""What this host can do, detected at run time (never assumed). Every path takes a root so tests use fixture trees."""
from __future__ import annotations

import os
import platform
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from jobprobe.kernel import tracefs


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, str, list[str]]]:
    """(fstype, mount point, root, super options) of every line of a mountinfo file; [] if unreadable."""
    try:
        text = Path(mountinfo).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        # "<id> <parent> <maj:min> <root> <mountpoint> <opts> [optional...] - <fstype> <source> <superopts>"
        left, _, right = line.partition(" - ")
        cols, fs = left.split(" "), right.split(" ")
        out.append((fs[0], cols[4].replace("\\040", " "), cols[3], fs[2].split(",") if len(fs) > 2 else []))
    return out


def find_cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The first cgroup2 mount point in mountinfo (pure cgroup v2 at /sys/fs/cgroup, hybrid at .../unified)."""
    return next((point for fstype, point, _, _ in mounts(mountinfo) if fstype == "cgroup2"), None)


def find_cgroup_v1_mount(mountinfo: str, controller: str) -> tuple[str, str] | None:
    """(mount point, root) of the cgroup v1 hierarchy that carries `controller`; None if none."""
    return next(((point, root) for fstype, point, root, opts in mounts(mountinfo)
                 if fstype == "cgroup" and controller in opts), None)


@dataclass
class Host:
    """Facts about the machine, gathered once. Probes' check() read these; nothing here has side effects."""

    proc: str = "/proc"
    sys: str = "/sys"
    mountinfo: str = "/proc/self/mountinfo"
    is_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    kernel: str = field(default_factory=platform.release)

    @property
    def cgroup2(self) -> str | None:
        return find_cgroup2_mount(self.mountinfo)

    @property
    def has_pmu(self) -> bool:
        """A core PMU is registered: 'cpu' on x86, 'cpu_core'/'cpu_atom' on hybrid Intel, 'armv8_*' on Arm."""
        devs = Path(self.sys, "bus/event_source/devices")
        try:
            names = [d.name for d in devs.iterdir()]
        except OSError:
            return False
        return any(n in ("cpu", "cpu_core", "cpu_atom") or n.startswith(("armv8", "armv7", "arm_cortex"))
                   for n in names)

    @property
    def has_btf(self) -> bool:
        return Path(self.sys, "kernel/btf/vmlinux").exists()

    def kernel_at_least(self, major: int, minor: int) -> bool:
        """Whether the running kernel's version (from its release string, '6.18.44-…') is at least major.minor."""
        m = re.match(r"(\d+)\.(\d+)", self.kernel)
        return bool(m) and (int(m[1]), int(m[2])) >= (major, minor)

    @property
    def has_raw_tracepoints(self) -> bool:
        """BPF_PROG_TYPE_RAW_TRACEPOINT and BPF_RAW_TRACEPOINT_OPEN: Linux 4.17."""
        return self.kernel_at_least(4, 17)

    def tracepoint_exists(self, category: str, event: str) -> bool:
        return tracefs.event_dir(self.sys, category, event) is not None

    def online_cpus(self) -> list[int]:
        return parse_cpu_list(Path(self.sys, "devices/system/cpu/online").read_text())


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,5,7-8' -> [0, 1, 2, 3, 5, 7, 8]"""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus
