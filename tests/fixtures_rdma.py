# SPDX-License-Identifier: Apache-2.0
"""FIXTURE sysfs trees of RDMA devices (this machine has none, and cannot make one: no modules, no soft-RoCE), laid
out as the kernel's IB core and drivers lay them out: an mlx5-like InfiniBand HCA, an mlx5-like RoCE NIC (its
netdev in gid_attrs/ndevs/0, mlx5's hw_counters), an irdma-like RoCE NIC (Intel E810: its hw_counters under its own
names, the netdev under device/net/). Values are written by the tests, tick by tick."""
from __future__ import annotations

import os
from pathlib import Path

IB_COUNTERS = ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "symbol_error",
               "link_downed", "link_error_recovery", "port_rcv_errors", "port_xmit_discards", "port_xmit_wait",
               "excessive_buffer_overrun_errors", "local_link_integrity_errors", "VL15_dropped")
MLX5_HW = ("np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets", "out_of_sequence", "packet_seq_err",
           "local_ack_timeout_err", "rnr_nak_retry_err", "roce_adp_retrans", "roce_slow_restart", "out_of_buffer",
           "lifespan")
IRDMA_HW = ("cnpSent", "cnpHandled", "cnpIgnored", "RxECNMrkd", "ip4InOctets", "tcpRetransSegs")


class RdmaTree:
    def __init__(self, root: Path):
        self.sys = Path(root)
        (self.sys / "class/infiniband").mkdir(parents=True, exist_ok=True)

    def pci(self, chain: list[str], vendor: int, cls: int, numa: int = 0, host_bridge: str = "pci0000:00",
            acs: int | None = None) -> Path:
        """A PCI function at the end of `chain` (root port … function) under /sys/devices/<host_bridge>/, linked
        from /sys/bus/pci/devices; each bridge above gets class 0x060400 and, given `acs`, an ACS capability with
        that control value in its config space."""
        import struct
        path = self.sys / "devices" / host_bridge
        for i, addr in enumerate(chain):
            path = path / addr
            path.mkdir(parents=True, exist_ok=True)
            last = i == len(chain) - 1
            (path / "vendor").write_text(f"{vendor if last else 0x8086:#06x}\n")
            (path / "class").write_text(f"{cls if last else 0x060400:#08x}\n")
            (path / "numa_node").write_text(f"{numa}\n")
            if not last and acs is not None:
                cfg = bytearray(4096)
                struct.pack_into("<IHH", cfg, 0x100, 0x000D | (1 << 16), 0x7F, acs)   # ACS, version 1, last cap
                (path / "config").write_bytes(bytes(cfg))
            link = self.sys / "bus/pci/devices" / addr
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                os.symlink(os.path.relpath(path, link.parent), link)
        return path

    def device(self, name: str, pci: str, numa: int = 0, net: str | None = None,
               chain: list[str] | None = None, host_bridge: str = "pci0000:00", acs: int | None = None) -> "RdmaTree":
        """The device, its PCI function (its `device` link; by default under one root port), NUMA node, netdev."""
        fn = self.pci(chain or ["0000:00:02.0", pci], 0x15B3, 0x020700, numa, host_bridge, acs)
        (fn / "numa_node").write_text(f"{numa}\n")
        if net:
            (fn / "net" / net).mkdir(parents=True, exist_ok=True)
        d = self.sys / "class/infiniband" / name
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "device").exists():
            os.symlink(os.path.relpath(fn, d), d / "device")
        return self

    def port(self, dev: str, n: int, layer: str = "InfiniBand", rate: str = "200 Gb/sec (4X HDR)",
             state: str = "4: ACTIVE", phys: str = "5: LinkUp", ndev: str | None = None, hw: tuple = (),
             counters: tuple = IB_COUNTERS) -> "RdmaTree":
        p = self.sys / "class/infiniband" / dev / "ports" / str(n)
        for sub in ("counters", "hw_counters"):
            (p / sub).mkdir(parents=True, exist_ok=True)
        for k, v in (("link_layer", layer), ("rate", rate), ("state", state), ("phys_state", phys)):
            (p / k).write_text(v + "\n")
        if ndev:
            (p / "gid_attrs/ndevs").mkdir(parents=True, exist_ok=True)
            (p / "gid_attrs/ndevs/0").write_text(ndev + "\n")
        for k in counters:
            (p / "counters" / k).write_text("0\n")
        for k in hw:
            (p / "hw_counters" / k).write_text("1000\n" if k == "lifespan" else "0\n")
        return self

    def set(self, dev: str, n: int, **values) -> None:
        """Counters (and `state`) of one port; a counter name in hw_counters goes there."""
        p = self.sys / "class/infiniband" / dev / "ports" / str(n)
        for k, v in values.items():
            if k in ("state", "phys_state"):
                (p / k).write_text(f"{v}\n")
            elif (p / "hw_counters" / k).exists():
                (p / "hw_counters" / k).write_text(f"{v}\n")
            else:
                (p / "counters" / k).write_text(f"{v}\n")

    def add(self, dev: str, n: int, **inc) -> None:
        p = self.sys / "class/infiniband" / dev / "ports" / str(n)
        for k, v in inc.items():
            f = p / ("hw_counters" if (p / "hw_counters" / k).exists() else "counters") / k
            f.write_text(f"{int(f.read_text()) + v}\n")


def cluster_node(root: Path) -> RdmaTree:
    """One node of each kind: mlx5_0 (IB HDR), mlx5_1 (RoCE on ens1f0), irdma0 (RoCE on ens2f0)."""
    t = RdmaTree(root)
    t.device("mlx5_0", "0000:3b:00.0", numa=0).port("mlx5_0", 1, hw=MLX5_HW)
    t.device("mlx5_1", "0000:3c:00.0", numa=0).port("mlx5_1", 1, layer="Ethernet", rate="100 Gb/sec (4X EDR)",
                                                     ndev="ens1f0", hw=MLX5_HW)
    t.device("irdma0", "0000:86:00.0", numa=1, net="ens2f0").port("irdma0", 1, layer="Ethernet",
                                                                  rate="100 Gb/sec (4X EDR)", hw=IRDMA_HW,
                                                                  counters=())
    return t
