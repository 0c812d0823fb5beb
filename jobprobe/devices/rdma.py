# SPDX-License-Identifier: Apache-2.0
"""RDMA devices and ports as sysfs shows them (/sys/class/infiniband): state, rate, link layer, the netdev of a RoCE
port, the IB port counters and the driver's hw_counters. Every reader takes the sysfs root, so that tests read
fixture trees (mlx5-like, irdma-like) built on a machine with no RDMA device.

What: ports(sys) lists (device, port) with their attributes; counters(sys, dev, port) reads
  ports/<n>/counters/* (IBTA PortCounters / PortCountersExtended: port_xmit_data and port_rcv_data count 4-byte
  words, per lane — ×4 for bytes) and ports/<n>/hw_counters/* (mlx5, irdma: congestion, retransmission, sequence
  errors) — and the device-level hw_counters/* some drivers keep instead.
Hooks: none; file reads. Oldest kernel: any with the IB core (counters), 4.x (hw_counters). Cost: one small read
  per counter file per tick (an mlx5 port has ~40; the agent keeps them open, jobprobe/kernel/procfs.OpenFiles).
Limits: a counter file that cannot be read (EINVAL on some drivers for counters they do not keep) is left out.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

CLASS = "class/infiniband"


@dataclass
class Port:
    device: str
    port: int
    state: str = ""                # ACTIVE, DOWN, INIT, ARMED (from "4: ACTIVE")
    phys_state: str = ""           # LinkUp, Polling, Disabled … (from "5: LinkUp")
    rate_gbps: float | None = None  # "100 Gb/sec (4X EDR)" → 100.0
    link_layer: str = ""           # InfiniBand or Ethernet (RoCE)
    netdev: str | None = None      # a RoCE port's Ethernet interface
    pci: str | None = None         # the device's PCI address (0000:3b:00.0), from its `device` link
    numa_node: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"


def _text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _after_colon(text: str | None) -> str:
    return (text or "").split(":", 1)[-1].strip()


def parse_rate(text: str | None) -> float | None:
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def devices(sys_root: str = "/sys") -> list[str]:
    try:
        return sorted(os.listdir(f"{sys_root}/{CLASS}"))
    except OSError:
        return []


def ports(sys_root: str = "/sys") -> list[Port]:
    out = []
    for dev in devices(sys_root):
        base = f"{sys_root}/{CLASS}/{dev}"
        try:
            nums = sorted(int(p) for p in os.listdir(f"{base}/ports") if p.isdigit())
        except OSError:
            continue
        pci = None
        try:
            pci = os.path.basename(os.path.realpath(f"{base}/device"))
        except OSError:
            pass
        numa = _text(f"{base}/device/numa_node")
        for n in nums:
            pb = f"{base}/ports/{n}"
            p = Port(dev, n, _after_colon(_text(f"{pb}/state")), _after_colon(_text(f"{pb}/phys_state")),
                     parse_rate(_text(f"{pb}/rate")), _text(f"{pb}/link_layer") or "",
                     pci=pci if pci and re.match(r"[0-9a-f]{4}:", pci) else None,
                     numa_node=int(numa) if numa and numa.lstrip("-").isdigit() and int(numa) >= 0 else None)
            p.netdev = netdev_of(sys_root, dev, n)
            out.append(p)
    return out


def netdev_of(sys_root: str, dev: str, port: int) -> str | None:
    """A RoCE port's Ethernet interface: gid_attrs/ndevs/0 (the default GID's netdev), else the device's only
    net/ entry."""
    name = _text(f"{sys_root}/{CLASS}/{dev}/ports/{port}/gid_attrs/ndevs/0")
    if name:
        return name
    try:
        nets = sorted(os.listdir(f"{sys_root}/{CLASS}/{dev}/device/net"))
    except OSError:
        return None
    return nets[0] if len(nets) == 1 else None


def _read_dir(path: str) -> dict[str, int]:
    out = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for n in names:
        v = _text(f"{path}/{n}")
        if v is not None and v.isdigit():
            out[n] = int(v)
    return out


def counters(sys_root: str, dev: str, port: int) -> tuple[dict[str, int], dict[str, int]]:
    """(IB port counters, hw_counters) of one port, as the files say (words are words here)."""
    base = f"{sys_root}/{CLASS}/{dev}"
    hw = _read_dir(f"{base}/ports/{port}/hw_counters") or _read_dir(f"{base}/hw_counters")
    hw.pop("lifespan", None)                   # a setting (ms the driver caches them), not a counter
    return _read_dir(f"{base}/ports/{port}/counters"), hw
