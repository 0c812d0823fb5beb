# SPDX-License-Identifier: Apache-2.0
"""RDMA netlink (NETLINK_RDMA, the `rdma` tool's interface): the per-process queue-pair counters of a port.

The IB core can bind each queue pair (QP) to a counter of its own kind: in *auto* mode with the PID mask
(`rdma statistic qp set link DEV/PORT auto pid on`) every process gets a counter on the port, to which each QP it
creates from then on is bound, and the counter holds the driver's QP statistics (mlx5's "q counters":
out_of_sequence, packet_seq_err, local_ack_timeout_err, rnr_nak_retry_err, duplicate_request, out_of_buffer,
rx_read/write/atomic_requests, …; with the driver's optional counters on, also rdma_tx/rx_bytes and packets).
What belongs to one job is then the sum of the counters of its processes.

    RDMA_NLDEV_CMD_GET (dump)                     → per device: DEV_INDEX, DEV_NAME
    RDMA_NLDEV_CMD_STAT_GET {DEV_INDEX, PORT_INDEX, STAT_RES=RES_QP}
                                                  → the port's QP counter mode: STAT_MODE, STAT_AUTO_MODE_MASK
    RDMA_NLDEV_CMD_STAT_SET {…, STAT_MODE=AUTO, STAT_AUTO_MODE_MASK=PID}   (root: CAP_NET_ADMIN)
    RDMA_NLDEV_CMD_STAT_GET (dump) {DEV_INDEX, [PORT_INDEX], STAT_RES=RES_QP}
                                                  → per message: DEV_INDEX, DEV_NAME, STAT_COUNTER { STAT_COUNTER_ENTRY
                                                    { PORT_INDEX, STAT_COUNTER_ID, STAT_MODE, [RES_PID], RES_QP {
                                                    RES_QP_ENTRY { RES_LQPN } … }, STAT_HWCOUNTERS { HWCOUNTER_ENTRY
                                                    { NAME, VALUE u64 } … } } … }; a long table continues in the next
                                                    message of the dump

Values from include/uapi/rdma/rdma_netlink.h (stable uapi). Oldest kernel: 5.3 (QP counters, auto mode). Drivers:
those with counter binding (mlx5); others answer EOPNOTSUPP to the mode change, and a port whose mode an operator
set otherwise (manual, or auto without the PID mask) is left as it is. Only QPs created after the mode is on are
bound: a job that made its QPs before gets per-job counts for its later ones only (`qps` says how many are bound).
A counter is freed with its last QP: what it counted since the last read is lost with it.
"""
from __future__ import annotations

import socket
import struct
from typing import NamedTuple

from jobprobe.kernel.rtnl import NLM_F_DUMP, NLM_F_REQUEST, request
from jobprobe.kernel.taskstats import attr, attr_items, attrs

NETLINK_RDMA = 20
NLDEV = 5                                  # RDMA_NL_NLDEV
CMD_GET, CMD_STAT_SET, CMD_STAT_GET = 1, 16, 17
A_DEV_INDEX, A_DEV_NAME, A_PORT_INDEX = 1, 2, 3
A_RES_QP, A_RES_QP_ENTRY, A_RES_LQPN, A_RES_PID = 19, 20, 21, 28
A_STAT_MODE, A_STAT_RES, A_STAT_AUTO_MODE_MASK = 74, 75, 76
A_STAT_COUNTER, A_STAT_COUNTER_ENTRY, A_STAT_COUNTER_ID = 77, 78, 79
A_STAT_HWCOUNTERS, A_STAT_HWCOUNTER_ENTRY, A_HWCOUNTER_NAME, A_HWCOUNTER_VALUE = 80, 81, 82, 83
MODE_NONE, MODE_AUTO, MODE_MANUAL = 0, 1, 2
MASK_QP_TYPE, MASK_PID = 1, 2
TIMEOUT_S = 2.0


def msg_type(cmd: int) -> int:
    return (NLDEV << 10) + cmd             # RDMA_NL_GET_TYPE(client, op)


def u32(t: int, v: int) -> bytes:
    return attr(t, struct.pack("=I", v))


class QpCounter(NamedTuple):
    device: str
    port: int
    id: int                                # the counter's id on its device
    pid: int | None                        # the process it counts for (auto mode with the PID mask), else None
    qps: tuple[int, ...]                   # the local QP numbers bound to it now
    values: dict                           # hw counter name → value since the counter was made


def _int(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    return struct.unpack_from("=Q" if len(raw) >= 8 else "=I" if len(raw) >= 4 else "=B", raw)[0]


def _text(raw: bytes | None) -> str:
    return (raw or b"").split(b"\0", 1)[0].decode(errors="replace")


def parse_counter(device: str, raw: bytes) -> QpCounter:
    a = attrs(raw)
    qps = tuple(_int(attrs(e).get(A_RES_LQPN)) or 0
                for t, e in attr_items(a.get(A_RES_QP, b"")) if t == A_RES_QP_ENTRY)
    values = {}
    for t, e in attr_items(a.get(A_STAT_HWCOUNTERS, b"")):
        if t == A_STAT_HWCOUNTER_ENTRY:
            h = attrs(e)
            if A_HWCOUNTER_NAME in h and A_HWCOUNTER_VALUE in h:
                values[_text(h[A_HWCOUNTER_NAME])] = _int(h[A_HWCOUNTER_VALUE])
    return QpCounter(device, _int(a.get(A_PORT_INDEX)) or 0, _int(a.get(A_STAT_COUNTER_ID)) or 0,
                     _int(a.get(A_RES_PID)), qps, values)


class RdmaNetlink:
    """One NETLINK_RDMA socket (or, in tests, any socket that speaks the protocol)."""

    def __init__(self, sock: socket.socket | None = None):
        self.sock = sock or socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_RDMA)
        self.sock.settimeout(TIMEOUT_S)
        self.seq = 0

    def _ask(self, cmd: int, flags: int, body: bytes = b"") -> list[tuple[int, bytes]]:
        self.seq += 1
        return list(request(self.sock, msg_type(cmd), flags, body, self.seq, what="rdma netlink"))

    def devices(self) -> dict[str, int]:
        """{device name: its index}."""
        out = {}
        for _, body in self._ask(CMD_GET, NLM_F_REQUEST | NLM_F_DUMP):
            a = attrs(body)
            if A_DEV_INDEX in a:
                out[_text(a.get(A_DEV_NAME))] = _int(a[A_DEV_INDEX])
        return out

    def qp_mode(self, index: int, port: int) -> tuple[int, int]:
        """The port's QP counter mode and auto-mode mask (MODE_*, MASK_* bits)."""
        got = self._ask(CMD_STAT_GET, NLM_F_REQUEST,
                        u32(A_DEV_INDEX, index) + u32(A_PORT_INDEX, port) + u32(A_STAT_RES, A_RES_QP))
        a = attrs(got[0][1]) if got else {}
        return _int(a.get(A_STAT_MODE)) or MODE_NONE, _int(a.get(A_STAT_AUTO_MODE_MASK)) or 0

    def set_auto_pid(self, index: int, port: int) -> None:
        """Auto mode with the PID mask: every process gets a counter for the QPs it makes from now on."""
        self._ask(CMD_STAT_SET, NLM_F_REQUEST,
                  u32(A_DEV_INDEX, index) + u32(A_PORT_INDEX, port) + u32(A_STAT_RES, A_RES_QP)
                  + u32(A_STAT_MODE, MODE_AUTO) + u32(A_STAT_AUTO_MODE_MASK, MASK_PID))

    def qp_counters(self, index: int, port: int | None = None) -> list[QpCounter]:
        """The device's QP counters (of one port, or all), each with its pid, its QPs and its values."""
        body = u32(A_DEV_INDEX, index) + (u32(A_PORT_INDEX, port) if port else b"") + u32(A_STAT_RES, A_RES_QP)
        out = []
        for _, msg in self._ask(CMD_STAT_GET, NLM_F_REQUEST | NLM_F_DUMP, body):
            a = attrs(msg)
            device = _text(a.get(A_DEV_NAME))
            out += [parse_counter(device, e) for t, e in attr_items(a.get(A_STAT_COUNTER, b""))
                    if t == A_STAT_COUNTER_ENTRY]
        return out

    def close(self) -> None:
        self.sock.close()
