# SPDX-License-Identifier: Apache-2.0
"""A FAKE of the kernel's RDMA netlink (NETLINK_RDMA), for a machine with no RDMA device and no IB core (this one:
socket(AF_NETLINK, SOCK_RAW, NETLINK_RDMA) fails with EPROTONOSUPPORT). It answers on one end of a SOCK_SEQPACKET
pair as drivers/infiniband/core/nldev.c answers: the device dump, a port's QP counter mode (get and set: auto mode
binds per process; a device without counter binding refuses with EOPNOTSUPP), and the QP counter dump (a table
nested per device, split over several messages of one dump, 64-bit values after a PAD attribute).

Its numbers are taken from the system's own uapi header (include/rdma/rdma_netlink.h, compiled and printed here by
gcc), not from jobprobe, so a wrong constant in jobprobe/kernel/rdmanl.py fails the tests that use it."""
from __future__ import annotations

import errno
import socket
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

NAMES = ("RDMA_NL_NLDEV", "RDMA_NLDEV_CMD_GET", "RDMA_NLDEV_CMD_STAT_SET", "RDMA_NLDEV_CMD_STAT_GET",
         "RDMA_NLDEV_ATTR_PAD", "RDMA_NLDEV_ATTR_DEV_INDEX", "RDMA_NLDEV_ATTR_DEV_NAME", "RDMA_NLDEV_ATTR_PORT_INDEX",
         "RDMA_NLDEV_ATTR_RES_QP", "RDMA_NLDEV_ATTR_RES_QP_ENTRY", "RDMA_NLDEV_ATTR_RES_LQPN",
         "RDMA_NLDEV_ATTR_RES_PID", "RDMA_NLDEV_ATTR_RES_KERN_NAME", "RDMA_NLDEV_ATTR_STAT_MODE",
         "RDMA_NLDEV_ATTR_STAT_RES", "RDMA_NLDEV_ATTR_STAT_AUTO_MODE_MASK", "RDMA_NLDEV_ATTR_STAT_COUNTER",
         "RDMA_NLDEV_ATTR_STAT_COUNTER_ENTRY", "RDMA_NLDEV_ATTR_STAT_COUNTER_ID", "RDMA_NLDEV_ATTR_STAT_HWCOUNTERS",
         "RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY", "RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY_NAME",
         "RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY_VALUE", "RDMA_COUNTER_MODE_NONE", "RDMA_COUNTER_MODE_AUTO",
         "RDMA_COUNTER_MODE_MANUAL", "RDMA_COUNTER_MASK_PID")
_uapi: dict[str, int] = {}


def uapi(build: Path) -> dict[str, int]:
    """The enum values of rdma_netlink.h, as the C compiler sees them."""
    if not _uapi:
        src = build / "rdma_uapi.c"
        src.write_text("#include <stdio.h>\n#include <rdma/rdma_netlink.h>\nint main(void) {\n" +
                       "".join(f'    printf("{n} %d\\n", (int){n});\n' for n in NAMES) + "    return 0;\n}\n")
        subprocess.run(["gcc", "-o", str(build / "rdma_uapi"), str(src)], check=True)
        out = subprocess.run([str(build / "rdma_uapi")], check=True, capture_output=True, text=True).stdout
        _uapi.update({k: int(v) for k, v in (ln.split() for ln in out.splitlines())})
    return _uapi


@dataclass
class Counter:
    port: int
    id: int
    pid: int | None                     # None: a kernel consumer's counter (named, no pid)
    qps: list[int]
    values: dict[str, int]


@dataclass
class Device:
    name: str
    index: int
    binding: bool = True                # the driver can bind QPs to counters (mlx5: yes; irdma: no)
    modes: dict[int, tuple[int, int]] = field(default_factory=dict)   # port → (mode, mask)
    counters: list[Counter] = field(default_factory=list)


class FakeRdmaNetlink:
    """The kernel's side. `client()` gives the socket jobprobe's RdmaNetlink is handed; `devices` and their counters
    are changed by the test between reads (under `lock`). `sets` records every mode change asked for."""

    def __init__(self, build: Path, devices: list[Device], per_message: int = 2):
        self.u = uapi(build)
        self.devices = {d.index: d for d in devices}
        self.per_message = per_message
        self.lock = threading.Lock()
        self.sets: list[tuple[str, int, int, int]] = []
        self.requests = 0
        self._socks: list[socket.socket] = []

    def client(self) -> socket.socket:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socks += [mine, theirs]
        threading.Thread(target=self._serve, args=(mine,), daemon=True).start()
        return theirs

    def close(self) -> None:
        for s in self._socks:
            s.close()

    # ---- netlink encoding (written here, apart from jobprobe's) -------------------------------------------
    @staticmethod
    def _attr(t: int, payload: bytes) -> bytes:
        n = 4 + len(payload)
        return struct.pack("=HH", n, t) + payload + b"\0" * ((4 - n % 4) % 4)

    def _u32(self, name: str, v: int) -> bytes:
        return self._attr(self.u[name], struct.pack("=I", v))

    def _msg(self, typ: int, flags: int, seq: int, body: bytes) -> bytes:
        return struct.pack("=IHHII", 16 + len(body), typ, flags, seq, 0) + body

    def _error(self, seq: int, err: int, request: bytes) -> bytes:
        return self._msg(2, 0, seq, struct.pack("=i", -err) + request[:16])

    @staticmethod
    def _parse(body: bytes) -> dict[int, int]:
        out, off = {}, 0
        while off + 4 <= len(body):
            n, t = struct.unpack_from("=HH", body, off)
            if n >= 8:
                out[t] = struct.unpack_from("=I", body, off + 4)[0]
            off += (n + 3) & ~3
        return out

    def _handle(self, data: bytes) -> list[bytes]:
        u = self.u
        _, typ, flags, seq, _ = struct.unpack_from("=IHHII", data)
        client, op = typ >> 10, typ & 0x3FF
        a = self._parse(data[16:])
        if client != u["RDMA_NL_NLDEV"] or not flags & 1:
            return [self._error(seq, errno.EINVAL, data)]
        dump = flags & 0x300 == 0x300
        multi = 2 if dump else 0                                   # NLM_F_MULTI
        done = self._msg(3, multi, seq, struct.pack("=i", 0))
        if op == u["RDMA_NLDEV_CMD_GET"] and dump:       # several messages in one datagram, as netlink packs them
            return [b"".join(self._msg(typ, multi, seq, self._u32("RDMA_NLDEV_ATTR_DEV_INDEX", d.index) +
                                       self._attr(u["RDMA_NLDEV_ATTR_DEV_NAME"], d.name.encode() + b"\0"))
                             for d in self.devices.values()) + done]
        dev = self.devices.get(a.get(u["RDMA_NLDEV_ATTR_DEV_INDEX"], -1))
        if dev is None or a.get(u["RDMA_NLDEV_ATTR_STAT_RES"]) != u["RDMA_NLDEV_ATTR_RES_QP"]:
            return [self._error(seq, errno.EINVAL, data)]
        head = self._u32("RDMA_NLDEV_ATTR_DEV_INDEX", dev.index) + \
            self._attr(u["RDMA_NLDEV_ATTR_DEV_NAME"], dev.name.encode() + b"\0")
        port = a.get(u["RDMA_NLDEV_ATTR_PORT_INDEX"])
        if op == u["RDMA_NLDEV_CMD_STAT_SET"]:
            if not dev.binding:
                return [self._error(seq, errno.EOPNOTSUPP, data)]
            mode, mask = a[u["RDMA_NLDEV_ATTR_STAT_MODE"]], a.get(u["RDMA_NLDEV_ATTR_STAT_AUTO_MODE_MASK"], 0)
            dev.modes[port] = (mode, mask)
            self.sets.append((dev.name, port, mode, mask))
            return [self._msg(typ, 0, seq, head + self._u32("RDMA_NLDEV_ATTR_PORT_INDEX", port))]
        if op == u["RDMA_NLDEV_CMD_STAT_GET"] and not dump:
            mode, mask = dev.modes.get(port, (u["RDMA_COUNTER_MODE_NONE"], 0))
            body = head + self._u32("RDMA_NLDEV_ATTR_PORT_INDEX", port) + self._u32("RDMA_NLDEV_ATTR_STAT_MODE", mode)
            if mode == u["RDMA_COUNTER_MODE_AUTO"]:
                body += self._u32("RDMA_NLDEV_ATTR_STAT_AUTO_MODE_MASK", mask)
            return [self._msg(typ, 0, seq, body)]
        if op == u["RDMA_NLDEV_CMD_STAT_GET"]:
            entries = [self._entry(c) for c in dev.counters if port is None or c.port == port]
            out = [self._msg(typ, multi, seq, head + self._attr(u["RDMA_NLDEV_ATTR_STAT_COUNTER"],
                                                               b"".join(entries[i:i + self.per_message])))
                   for i in range(0, len(entries), self.per_message)]
            return out + [done]
        return [self._error(seq, errno.EOPNOTSUPP, data)]

    def _entry(self, c: Counter) -> bytes:
        u = self.u
        body = self._u32("RDMA_NLDEV_ATTR_PORT_INDEX", c.port) + self._u32("RDMA_NLDEV_ATTR_STAT_COUNTER_ID", c.id)
        body += self._u32("RDMA_NLDEV_ATTR_STAT_MODE", u["RDMA_COUNTER_MODE_AUTO"])
        if c.pid is None:
            body += self._attr(u["RDMA_NLDEV_ATTR_RES_KERN_NAME"], b"ib_ipoib\0")
        else:
            body += self._u32("RDMA_NLDEV_ATTR_RES_PID", c.pid)
        body += self._attr(u["RDMA_NLDEV_ATTR_RES_QP"], b"".join(
            self._attr(u["RDMA_NLDEV_ATTR_RES_QP_ENTRY"], self._u32("RDMA_NLDEV_ATTR_RES_LQPN", q)) for q in c.qps))
        hw = b""
        for name, v in c.values.items():
            hw += self._attr(u["RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY"],
                             self._attr(u["RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY_NAME"], name.encode() + b"\0") +
                             self._attr(u["RDMA_NLDEV_ATTR_PAD"], b"") +
                             self._attr(u["RDMA_NLDEV_ATTR_STAT_HWCOUNTER_ENTRY_VALUE"], struct.pack("=Q", v)))
        body += self._attr(u["RDMA_NLDEV_ATTR_STAT_HWCOUNTERS"], hw)
        return self._attr(u["RDMA_NLDEV_ATTR_STAT_COUNTER_ENTRY"], body)

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.requests += 1
                replies = self._handle(data)
            for r in replies:
                try:
                    sock.send(r)
                except OSError:
                    return
