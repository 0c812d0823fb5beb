# SPDX-License-Identifier: Apache-2.0
"""What a task carries at its exit, from the kernel's taskstats interface (generic netlink, family "TASKSTATS").

A listener registered for every CPU receives one record per exiting task (thread) of the node, sent from do_exit
with the thread's final counters: its I/O (read_bytes, write_bytes: storage bytes; rounded down to KiB by the
kernel), CPU time and ids (pid = thread id, tgid, ppid). A probe that reads /proc between ticks loses what a process
did between its last read and its exit; the exit record holds it (Documentation/accounting/taskstats.rst).
Needs CONFIG_TASKSTATS (+ CONFIG_TASK_XACCT, CONFIG_TASK_IO_ACCOUNTING for the I/O bytes) and CAP_NET_ADMIN to
register. Records the socket could not hold (ENOBUFS: a burst of exits larger than the receive buffer, 8 MiB here)
are lost; `lost` counts the overflows so that a reader can say so.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from typing import Any, NamedTuple

from jobprobe.core.errors import ProbeUnavailable

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY, CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 3, 1, 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR, NLMSG_DONE = 0x2, 0x3
NLA_F_NESTED = 1 << 15
SO_RCVBUFFORCE = 33          # asm-generic/socket.h (the socket module does not name it)
# include/uapi/linux/taskstats.h
TASKSTATS_CMD_GET, TASKSTATS_CMD_NEW = 1, 2
CMD_ATTR_REGISTER_CPUMASK, CMD_ATTR_DEREGISTER_CPUMASK = 3, 4
TYPE_PID, TYPE_STATS, TYPE_AGGR_PID = 1, 3, 4
# Offsets in struct taskstats (append-only across versions; tests/test_taskstats.py checks them against the
# installed header with the C compiler). ac_tgid came with version 12.
OFFSETS = {"version": (0, "H"), "ac_exitcode": (4, "I"), "ac_pid": (128, "I"), "ac_ppid": (132, "I"),
           "ac_utime": (152, "Q"),
           "ac_stime": (160, "Q"), "read_bytes": (248, "Q"), "write_bytes": (256, "Q"),
           "cpu_run_virtual_total": (72, "Q"), "ac_comm": (80, "32s"), "ac_tgid": (368, "I")}
TGID_VERSION = 12
RCVBUF = 8 << 20


class ExitRecord(NamedTuple):
    tid: int
    tgid: int            # 0 where the kernel's taskstats is older than version 12
    ppid: int            # the parent process of the thread group
    read_bytes: int
    write_bytes: int
    utime_us: int        # the kernel's raw user/system split: charged a whole tick at a time to whoever ran at it
    stime_us: int
    run_ns: int          # time on CPU, exact (sum_exec_runtime: cpu_run_virtual_total); 0 where the kernel has no
                         # delay accounting struct for the task (CONFIG_TASK_DELAY_ACCT off)
    status: int = 0      # how it ended, as wait(2) reports it (ac_exitcode: the task's exit_code)

    def ended(self) -> dict[str, int]:
        """{"exit_code": n} for an exit, {"signal": n} for a death by a signal (the wait status decoded)."""
        sig = self.status & 0x7f
        return {"signal": sig} if sig else {"exit_code": (self.status >> 8) & 0xff}

    def cpu_ns(self) -> tuple[int, int]:
        """(user, system) ns: the exact time on CPU split in the raw ticks' proportion — what the kernel itself does
        for /proc/PID/stat and getrusage (cputime_adjust) — so that a thread's exit counts in the same measure as its
        reads before it. The raw ticks alone drift from it on a shared CPU: a tick charges its whole length to
        whoever runs at that instant (a burner beside a CPU hog read 460 ms of ticks for 448 ms on CPU). Without
        run_ns, the raw ticks."""
        raw = self.utime_us + self.stime_us
        if self.run_ns <= 0:
            return self.utime_us * 1000, self.stime_us * 1000
        system = self.run_ns * self.stime_us // raw if raw else 0
        return self.run_ns - system, system


def attrs(data: bytes, off: int = 0, end: int | None = None) -> dict[int, bytes]:
    """Netlink attributes (nla_len, nla_type, payload padded to 4) → {type: payload} (the last of a repeated type)."""
    return dict(attr_items(data, off, end))


def attr_items(data: bytes, off: int = 0, end: int | None = None) -> list[tuple[int, bytes]]:
    """Netlink attributes in order, repeats kept (the entries of a nested table): [(type, payload)]."""
    end = len(data) if end is None else end
    out = []
    while off + 4 <= end:
        n, t = struct.unpack_from("=HH", data, off)
        if n < 4:
            break
        out.append((t & ~NLA_F_NESTED, data[off + 4:off + n]))
        off += (n + 3) & ~3
    return out


def attr(t: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, t) + payload + b"\0" * (((n + 3) & ~3) - n)


def field(raw: bytes, name: str) -> Any:
    """Field `name` of a struct taskstats (OFFSETS), or its zero where the kernel's struct is too short to hold it."""
    off, fmt = OFFSETS[name]
    end = off + struct.calcsize("=" + fmt)
    return struct.unpack_from("=" + fmt, raw if end <= len(raw) else bytes(end), off)[0]


def parse_stats(raw: bytes) -> ExitRecord:
    def get(name: str) -> int:
        return field(raw, name)
    version = get("version")
    return ExitRecord(get("ac_pid"), get("ac_tgid") if version >= TGID_VERSION else 0, get("ac_ppid"),
                      get("read_bytes"), get("write_bytes"), get("ac_utime"), get("ac_stime"),
                      get("cpu_run_virtual_total"), get("ac_exitcode"))


def parse_messages(data: bytes) -> list[ExitRecord]:
    """Exit records in one datagram (one or more netlink messages)."""
    out = []
    off = 0
    while off + 16 <= len(data):
        length, _type, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
        if length < 16:
            break
        body = data[off + 16:off + length]
        if len(body) >= 4 and body[0] == TASKSTATS_CMD_NEW:
            for t, payload in attrs(body, 4).items():
                if t == TYPE_AGGR_PID:
                    inner = attrs(payload)
                    if TYPE_STATS in inner:
                        out.append(parse_stats(inner[TYPE_STATS]))
        off += (length + 3) & ~3
    return out


class ExitListener:
    """Exit records of every task of the node, drained without blocking. close() deregisters. The socket is
    opened in __init__; ProbeUnavailable says why it cannot be (no taskstats in the kernel, not root)."""

    def __init__(self, ncpus: int | None = None):
        self.lost = 0
        self.sock: socket.socket | None = None
        self.cpumask = f"0-{(ncpus or os.cpu_count() or 1) - 1}"
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_GENERIC)
        except OSError as err:
            raise ProbeUnavailable(f"no generic netlink socket: {err.strerror}") from err
        try:
            sock.bind((0, 0))
            try:   # root may go past rmem_max; a burst of exits must fit
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            self.family = self._family(sock)
            self._request(sock, CMD_ATTR_REGISTER_CPUMASK)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise ProbeUnavailable(f"cannot listen for taskstats exit records: {err.strerror or err}") from err
        self.sock = sock

    @staticmethod
    def _send(sock: socket.socket, family: int, cmd: int, payload: bytes) -> None:
        body = struct.pack("=BBH", cmd, 1, 0) + payload
        sock.send(struct.pack("=IHHII", 16 + len(body), family, NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body)

    @staticmethod
    def _ack(sock: socket.socket) -> bytes:
        """The reply to a request: its data, or OSError with the kernel's errno."""
        while True:
            data = sock.recv(65536)
            length, typ = struct.unpack_from("=IH", data)
            if typ == NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, 16)[0]
                if code:
                    raise OSError(code, os.strerror(code))
                return b""
            if typ != NLMSG_DONE:
                return data

    def _family(self, sock: socket.socket) -> int:
        self._send(sock, GENL_ID_CTRL, CTRL_CMD_GETFAMILY, attr(CTRL_ATTR_FAMILY_NAME, b"TASKSTATS\0"))
        try:
            data = self._ack(sock)
        except OSError as err:
            if err.errno == errno.ENOENT:
                raise ProbeUnavailable("the kernel has no taskstats (CONFIG_TASKSTATS)") from err
            raise
        fam = attrs(data, 20).get(CTRL_ATTR_FAMILY_ID)
        if fam is None:
            raise ProbeUnavailable("the kernel has no taskstats (CONFIG_TASKSTATS)")
        self._ack(sock)   # the ACK that follows the reply
        return struct.unpack("=H", fam[:2])[0]

    def _request(self, sock: socket.socket, which: int) -> None:
        self._send(sock, self.family, TASKSTATS_CMD_GET, attr(which, self.cpumask.encode() + b"\0"))
        self._ack(sock)

    def drain(self) -> list[ExitRecord]:
        """Every record received since the last call."""
        out: list[ExitRecord] = []
        while self.sock is not None:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == errno.ENOBUFS:   # the kernel dropped records: count, go on
                    self.lost += 1
                    continue
                raise
            out.extend(parse_messages(data))
        return out

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is None:
            return
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            self._request(sock, CMD_ATTR_DEREGISTER_CPUMASK)
        except OSError:
            pass   # closing the socket deregisters it too (the kernel drops listeners whose socket is gone)
        finally:
            sock.close()


class ExitFeed:
    """One listener per process, shared by every reader that wants exit records (the `cgroup` probe of each job
    the agent holds): the kernel sends each record once, it is parsed once, and each subscription gets every record
    that arrived since its own last drain. The socket is opened at the first subscription and closed with the last.
    Without this, N jobs mean N sockets each receiving and parsing every exit of the node."""

    _lock = threading.Lock()
    _listener: ExitListener | None = None
    _subs: set["Subscription"] = set()

    @classmethod
    def subscribe(cls) -> "Subscription":
        """A new subscription; ProbeUnavailable (as ExitListener) when the kernel or the caller cannot listen."""
        with cls._lock:
            if cls._listener is None:
                cls._listener = ExitListener()
            sub = Subscription(cls)
            cls._subs.add(sub)
            return sub

    @classmethod
    def pump(cls) -> None:
        """Read what the socket holds and hand it to every subscription."""
        with cls._lock:
            if cls._listener is None:
                return
            records = cls._listener.drain()
            if records:
                for sub in cls._subs:
                    sub.pending.extend(records)

    @classmethod
    def lost(cls) -> int:
        return cls._listener.lost if cls._listener is not None else 0

    @classmethod
    def unsubscribe(cls, sub: "Subscription") -> None:
        with cls._lock:
            cls._subs.discard(sub)
            if not cls._subs and cls._listener is not None:
                cls._listener.close()
                cls._listener = None


class Subscription:
    """One reader's view of the shared ExitFeed: drain() as ExitListener's, close() leaves the feed."""

    def __init__(self, feed: type[ExitFeed]):
        self.feed: type[ExitFeed] | None = feed
        self.pending: list[ExitRecord] = []

    @property
    def lost(self) -> int:
        return self.feed.lost() if self.feed is not None else 0

    def drain(self) -> list[ExitRecord]:
        if self.feed is None:
            return []
        self.feed.pump()
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.unsubscribe(self)
