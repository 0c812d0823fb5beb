# SPDX-License-Identifier: Apache-2.0
"""PCI devices as sysfs shows them: each function's place in the tree (the bridges above it), vendor, class and NUMA
node, and PCIe extended capabilities read from its config space — for the doctor's GPU↔NIC checks. Every reader
takes the sysfs root (tests build fixture trees).

What: devices(sys) → {address: Function}; a Function's `chain` is the PCI addresses from its root port down to
  itself (the path under /sys/devices/pciDDDD:BB/). relation(a, b) names how two functions are connected, in
  nvidia-smi topo's words: PIX/PXB (through PCIe bridges only: a switch), PHB (through the host bridge), NODE (same
  NUMA node, different host bridges), SYS (across NUMA nodes). acs_control(sys, addr) reads the ACS capability's
  control register (extended capability 0x000D).
Hooks: none; sysfs reads. Config space beyond 64 bytes needs root. Kernel: any.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
ACS_CAP = 0x000D
ACS_RR, ACS_CR = 1 << 2, 1 << 3          # P2P Request Redirect, P2P Completion Redirect


@dataclass
class Function:
    address: str
    vendor: int = 0
    cls: int = 0                            # class code, 24 bits (0x030200: 3D controller)
    numa_node: int | None = None
    host_bridge: str = ""                   # pciDDDD:BB
    chain: list[str] = field(default_factory=list)   # root port … this function

    @property
    def is_gpu(self) -> bool:
        return self.vendor == 0x10DE and self.cls >> 16 == 0x03


def _int(path: str, base: int = 16) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), base)
    except (OSError, ValueError):
        return None


def devices(sys_root: str = "/sys") -> dict[str, Function]:
    base = f"{sys_root}/bus/pci/devices"
    out = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for name in names:
        real = os.path.realpath(f"{base}/{name}")
        parts = real.split(os.sep)
        hb = next((p for p in parts if p.startswith("pci") and ":" in p), "")
        chain = [p for p in parts[parts.index(hb) + 1:]] if hb in parts else [name]
        chain = [p for p in chain if PCI_ADDR.match(p)]
        numa = _int(f"{real}/numa_node", 10)
        out[name] = Function(name, _int(f"{real}/vendor") or 0, _int(f"{real}/class") or 0,
                             numa if numa is not None and numa >= 0 else None, hb, chain or [name])
    return out


def relation(a: Function, b: Function) -> str:
    """PIX (through one PCIe switch), PXB (through several, no host bridge), PHB (through the host bridge),
    NODE (same NUMA
    node), SYS (across NUMA nodes) — as `nvidia-smi topo -m` says it."""
    if a.host_bridge and a.host_bridge == b.host_bridge:
        common = 0
        for x, y in zip(a.chain, b.chain):
            if x != y:
                break
            common += 1
        if common:               # under one switch's ports (PIX), or through switches nested below it (PXB)
            below = max(len(a.chain) - common - 1, len(b.chain) - common - 1)
            return "PIX" if below <= 1 else "PXB"
        return "PHB"
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return "NODE"
    return "SYS"


def between(a: Function, b: Function) -> list[str]:
    """The bridges below a's and b's common ancestor that a transfer between them crosses (the switch ports where
    ACS would redirect it), or [] if they are not under one switch."""
    if a.host_bridge != b.host_bridge:
        return []
    common = 0
    for x, y in zip(a.chain, b.chain):
        if x != y:
            break
        common += 1
    if not common:
        return []
    return a.chain[common:-1] + b.chain[common:-1]


def acs_control(sys_root: str, address: str) -> int | None:
    """The ACS control register of a function (None: no ACS capability, or config space not readable)."""
    try:
        with open(f"{sys_root}/bus/pci/devices/{address}/config", "rb") as f:
            cfg = f.read(4096)
    except OSError:
        return None
    off, seen = 0x100, 0
    while 0x100 <= off <= len(cfg) - 8 and seen < 64:
        (head,) = struct.unpack_from("<I", cfg, off)
        if head in (0, 0xFFFFFFFF):
            return None
        if head & 0xFFFF == ACS_CAP:
            return struct.unpack_from("<H", cfg, off + 6)[0]
        off, seen = (head >> 20) & 0xFFC, seen + 1
    return None
