# SPDX-License-Identifier: Apache-2.0
"""Uprobes from user space: the kernel's uprobe PMU (perf_event_open with the PMU's dynamic type), one perf event per
(file, offset), running a BPF program (PERF_EVENT_IOC_SET_BPF). The agent attaches them itself, per library file, as
the job maps files — no bcc, no tracefs writes.
Oldest kernel: 4.17 (the uprobe PMU). Cost: per attach, one perf_event_open and two ioctls; per probed call, the
program (~1 µs on bare metal, more where the first instruction must be single-stepped).
"""
from __future__ import annotations

import ctypes as ct
import os
from pathlib import Path
from typing import Any

from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import perf as _perf


class UprobePmu:
    """The kernel's uprobe PMU: perf events that put a uprobe (or uretprobe) on a file offset and run a BPF program."""

    def __init__(self, sys_root: str = "/sys"):
        base = Path(sys_root, "bus/event_source/devices/uprobe")
        try:
            self.type = int((base / "type").read_text())
            fmt = (base / "format/retprobe").read_text().strip()   # "config:0"
        except (OSError, ValueError) as err:
            raise ProbeUnavailable(f"no uprobe PMU ({base}): the kernel lacks CONFIG_UPROBE_EVENTS or is older "
                                   f"than 4.17") from err
        field, _, bit = fmt.partition(":")
        if field != "config" or not bit.isdigit():
            raise ProbeUnavailable(f"unexpected uprobe retprobe format {fmt!r} in {base}")
        self.retprobe_bit = int(bit)

    def attr(self, path: bytes, offset: int, retprobe: bool) -> tuple[_perf.PerfEventAttr, Any]:
        """The perf_event_attr, and the buffer its config1 points to (keep it alive until the open)."""
        buf = ct.create_string_buffer(path)
        attr = _perf.PerfEventAttr()
        attr.type, attr.size = self.type, ct.sizeof(attr)
        attr.config = (1 << self.retprobe_bit) if retprobe else 0
        attr.config1, attr.config2 = ct.addressof(buf), offset
        attr.sample_period, attr.wakeup_events = 1, 1
        return attr, buf

    def attach(self, prog_fd: int, path: str, offset: int, retprobe: bool) -> int:
        """A uprobe on path+offset for every process (pid -1; the BPF program runs on any CPU), running prog_fd.
        Returns the perf event fd: closing it detaches."""
        attr, _buf = self.attr(os.fsencode(path), offset, retprobe)
        return _perf.open_bpf_event(attr, prog_fd)
