# SPDX-License-Identifier: Apache-2.0
"""rtnetlink, the little the nic probe needs: the root queueing discipline of every interface, with its statistics
(what `tc -s qdisc show` prints), read in a chosen network namespace.

A NETLINK_ROUTE socket answers for the namespace it was created in. To read a job's own namespace the socket is
made in a short-lived thread that first joins it (setns(2) changes only the calling thread's namespace); the
socket keeps answering for that namespace after the thread is gone, so the agent's threads never move.

    RTM_GETQDISC (dump) → RTM_NEWQDISC per qdisc: struct tcmsg, then TCA_KIND ("fq_codel", "tbf", "mq", …) and
    TCA_STATS2 { TCA_STATS_BASIC: gnet_stats_basic {u64 bytes; u32 packets},
                 TCA_STATS_QUEUE: gnet_stats_queue {u32 qlen, backlog, drops, requeues, overlimits} }
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading
from typing import NamedTuple

from jobprobe.core.libc import LIBC
from jobprobe.kernel.taskstats import attrs

RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWQDISC, RTM_GETQDISC = 36, 38
IFLA_IFNAME, IFLA_OPERSTATE, IFLA_STATS64 = 3, 16, 23
LINK_STATS = ("rx_packets", "tx_packets", "rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped",
              "tx_dropped")                       # the first eight u64s of struct rtnl_link_stats64
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 0x2, 0x3
TCA_KIND, TCA_STATS2 = 1, 7
TCA_STATS_BASIC, TCA_STATS_QUEUE = 1, 3
TC_H_ROOT = 0xFFFFFFFF
CLONE_NEWNET = 0x40000000


class Link(NamedTuple):
    ifindex: int
    name: str
    up: bool
    stats: dict           # LINK_STATS → count


class Qdisc(NamedTuple):
    ifindex: int
    kind: str
    bytes: int
    packets: int
    qlen: int
    backlog: int          # bytes waiting now
    drops: int
    requeues: int
    overlimits: int


def socket_in(netns_path: str | None = None, family: int = socket.AF_NETLINK, kind: int = socket.SOCK_RAW,
              proto: int = socket.NETLINK_ROUTE) -> socket.socket:
    """A socket (by default NETLINK_ROUTE) for the namespace at `netns_path` (/proc/PID/ns/net), or ours when None:
    a socket answers for the namespace it was made in, whoever uses it later."""
    if netns_path is None:
        return socket.socket(family, kind, proto)
    out: list = []

    def inside() -> None:
        try:
            fd = os.open(netns_path, os.O_RDONLY)
            try:
                if LIBC.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns_path}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out.append(socket.socket(family, kind, proto))
        except OSError as err:
            out.append(err)
    t = threading.Thread(target=inside, name="rtnl-setns")
    t.start()
    t.join()
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


def links(sock: socket.socket, seq: int = 1) -> dict[int, Link]:
    """{ifindex: name, state and counters} of every interface in the socket's namespace (what /proc/net/dev and
    `ip -s link` show)."""
    return _dump(sock, RTM_GETLINK, RTM_NEWLINK, struct.pack("=BxHiII", socket.AF_UNSPEC, 0, 0, 0, 0), _link, seq)


def root_qdiscs(sock: socket.socket, seq: int = 1) -> dict[int, Qdisc]:
    """{ifindex: its root qdisc and statistics} in the socket's namespace."""
    return _dump(sock, RTM_GETQDISC, RTM_NEWQDISC, struct.pack("=BxxxiIII", socket.AF_UNSPEC, 0, 0, 0, 0),
                 _parse, seq)


def _dump(sock: socket.socket, ask: int, answer: int, head: bytes, parse, seq: int) -> dict:
    out: dict = {}
    for typ, body in request(sock, ask, NLM_F_REQUEST | NLM_F_DUMP, head, seq, what="rtnetlink dump"):
        if typ == answer:
            q = parse(body)
            if q is not None:
                out[q[0]] = q[1]
    return out


def request(sock: socket.socket, ask: int, flags: int, body: bytes, seq: int, what: str = "netlink"):
    """Send one netlink request and yield each answer as (type, body after the 16-byte header): for a dump
    (NLM_F_DUMP) until NLMSG_DONE; else the one answer, or the acknowledgement (an NLMSG_ERROR of 0) of a request
    made with NLM_F_ACK. An error answer raises OSError with the kernel's errno."""
    sock.send(struct.pack("=IHHII", 16 + len(body), ask, flags, seq, 0) + body)
    dump = flags & NLM_F_DUMP == NLM_F_DUMP
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise OSError(errno.ECONNRESET, f"{what} {ask}: the socket closed")
        off = 0
        while off + 16 <= len(data):
            n, typ, _, _, _ = struct.unpack_from("=IHHII", data, off)
            if n < 16 or typ == NLMSG_DONE:
                return
            if typ == NLMSG_ERROR:
                err = -struct.unpack_from("=i", data, off + 16)[0]
                if err:
                    raise OSError(err, f"{what} {ask}: {os.strerror(err)}")
                return
            yield typ, data[off + 16:off + n]
            if not dump:
                return
            off += (n + 3) & ~3


def _link(msg: bytes) -> tuple[int, Link]:
    _, _, ifindex, flags, _ = struct.unpack_from("=BxHiII", msg, 0)
    a = attrs(msg, 16)
    name = a.get(IFLA_IFNAME, b"").rstrip(b"\0").decode(errors="replace")
    raw = a.get(IFLA_STATS64, b"")
    stats = dict(zip(LINK_STATS, struct.unpack_from("=8Q", raw))) if len(raw) >= 64 else {}
    up = a.get(IFLA_OPERSTATE, b"\0")[:1] in (b"\x06", b"\x00") and bool(flags & 1)   # IF_OPER_UP / unknown
    return ifindex, Link(ifindex, name, up, stats)


def _parse(msg: bytes) -> tuple[int, Qdisc] | None:
    _, ifindex, _, parent, _ = struct.unpack_from("=BxxxiIII", msg, 0)
    if parent != TC_H_ROOT:
        return None
    a = attrs(msg, 20)
    kind = a.get(TCA_KIND, b"").rstrip(b"\0").decode(errors="replace")
    st = attrs(a.get(TCA_STATS2, b""))
    nbytes, packets = struct.unpack_from("=QI", st[TCA_STATS_BASIC]) if len(st.get(TCA_STATS_BASIC, b"")) >= 12 \
        else (0, 0)
    qlen = backlog = drops = requeues = overlimits = 0
    if len(st.get(TCA_STATS_QUEUE, b"")) >= 20:
        qlen, backlog, drops, requeues, overlimits = struct.unpack_from("=5I", st[TCA_STATS_QUEUE])
    return ifindex, Qdisc(ifindex, kind, nbytes, packets, qlen, backlog, drops, requeues, overlimits)
