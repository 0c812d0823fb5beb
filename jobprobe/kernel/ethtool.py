# SPDX-License-Identifier: Apache-2.0
"""A network driver's own statistics, as `ethtool -S` prints them: SIOCETHTOOL ioctls (ETHTOOL_GSSET_INFO for the
count, ETHTOOL_GSTRINGS for the names, ETHTOOL_GSTATS for the values) on any socket of the interface's network
namespace — for the pause / PFC frame counters that rtnetlink's link statistics do not carry.

Hooks: ioctl(SIOCETHTOOL). Kernel: any (GSSET_INFO 2.6.34). Needs: CAP_NET_ADMIN for some drivers (root).
Cost: three ioctls per interface per read (names are read again only when the count changes).
"""
from __future__ import annotations

import ctypes as ct
import fcntl
import re
import socket
import struct

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS, ETHTOOL_GSTATS, ETHTOOL_GSSET_INFO = 0x1B, 0x1D, 0x37
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
PAUSE = re.compile(r"pause|pfc|xon|xoff", re.I)


def _call(sock: socket.socket, ifname: str, buf: ct.Array) -> None:
    ifr = struct.pack("16sP", ifname.encode()[:15], ct.addressof(buf)).ljust(40, b"\0")
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifr)


def count(sock: socket.socket, ifname: str) -> int:
    buf = ct.create_string_buffer(struct.pack("IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0), 24)
    _call(sock, ifname, buf)
    mask = struct.unpack_from("Q", buf, 8)[0]
    return struct.unpack_from("I", buf, 16)[0] if mask & (1 << ETH_SS_STATS) else 0


def names(sock: socket.socket, ifname: str, n: int) -> list[str]:
    buf = ct.create_string_buffer(struct.pack("III", ETHTOOL_GSTRINGS, ETH_SS_STATS, n), 12 + n * ETH_GSTRING_LEN)
    _call(sock, ifname, buf)
    raw = buf.raw[12:12 + n * ETH_GSTRING_LEN]
    return [raw[i:i + ETH_GSTRING_LEN].split(b"\0", 1)[0].decode(errors="replace") for i in range(0, len(raw),
                                                                                                   ETH_GSTRING_LEN)]


def values(sock: socket.socket, ifname: str, n: int) -> list[int]:
    buf = ct.create_string_buffer(struct.pack("II", ETHTOOL_GSTATS, n), 8 + n * 8)
    _call(sock, ifname, buf)
    return list(struct.unpack_from(f"{n}Q", buf, 8))


def stats(sock: socket.socket, ifname: str) -> dict[str, int]:
    """name → value of every driver statistic of the interface ({} when the driver has none)."""
    n = count(sock, ifname)
    return dict(zip(names(sock, ifname, n), values(sock, ifname, n))) if n else {}


def pause_totals(st: dict[str, int]) -> tuple[int, int] | None:
    """(received, sent) pause and PFC frames: the sum of the driver's counters whose names say pause / pfc / xon /
    xoff (mlx5 rx_pause_ctrl_phy, rx_prioN_pause; ice link_xon_rx, priority_xoff_rx_N; bnxt rx_pause_frames,
    rx_pfc_ena_frames_priN …), split by rx / tx in the name; None when the driver reports none. Durations
    (mlx5's *_pause_duration) and transitions are left out: frames only."""
    rx = tx = 0
    seen = False
    for k, v in st.items():
        if not PAUSE.search(k) or "duration" in k or "transition" in k:
            continue
        if re.search(r"(^|_)rx(_|$)", k):
            rx, seen = rx + v, True
        elif re.search(r"(^|_)tx(_|$)", k):
            tx, seen = tx + v, True
    return (rx, tx) if seen else None


class PauseReader:
    """Pause / PFC frame totals of interfaces, on one socket of their namespace: each interface's statistic names are
    read once (again when their count changes); an interface whose driver counts no pause frames is asked only for
    its count after that."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.layout: dict[str, tuple[int, list[int]]] = {}     # ifname → (count, indexes of pause counters)
        self.names: dict[str, list[str]] = {}

    def read(self, ifname: str) -> tuple[int, int] | None:
        try:
            n = count(self.sock, ifname)
            if self.layout.get(ifname, (-1, []))[0] != n:
                nm = names(self.sock, ifname, n) if n else []
                self.names[ifname] = nm
                self.layout[ifname] = (n, [i for i, k in enumerate(nm) if PAUSE.search(k)])
            n, idx = self.layout[ifname]
            if not idx:
                return None
            vals = values(self.sock, ifname, n)
        except OSError:               # no ethtool ops (loopback, a bridge), gone, not permitted
            return None
        return pause_totals({self.names[ifname][i]: vals[i] for i in idx})
