# SPDX-License-Identifier: Apache-2.0
"""Block I/O workloads with known sizes, run as separate processes by tests/test_blockio.py.

    direct PATH OP COUNT BS OFFSET   COUNT O_DIRECT preads (OP=read) or pwrites (OP=write) of BS bytes each,
                                     back to back from byte OFFSET of PATH (a block device or a file)
    buffered PATH BYTES OFFSET       a buffered sequential read of BYTES from OFFSET (readahead: merged requests),
                                     after dropping PATH's cached pages so that they come from the device
    aio PATH OP COUNT BS OFFSET ORDER
                                     COUNT O_DIRECT operations of BS bytes, contiguous from OFFSET, handed to the
                                     kernel 16 at a time in one io_submit (so under one plug): the block layer
                                     merges them into few requests, by back merges (ORDER=asc) or front merges
                                     (ORDER=desc: each one ends where the previous began)
    fsync PATH MIB [0]               MIB MiB of buffered writes to a new file PATH, then one fsync (none with 0:
                                     the writeback kworkers will write them later)
Each prints, at its end, one JSON line: what it did ("ops", "bytes") and the kernel's own account of this
process from /proc/self/io ("proc_read_bytes", "proc_write_bytes": bytes it made the storage layer fetch /
bytes it sent or dirtied), an independent check for the probe. With --wait first, it reads one line from stdin
before starting (so that a PID-tree target can be attached first).

Loop, imported by the tests, is the device they run on: a loop device on a sparse file, made for one test.
"""
import ctypes as ct
import json
import mmap
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def proc_io() -> dict:
    io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return {"proc_read_bytes": int(io["read_bytes"]), "proc_write_bytes": int(io["write_bytes"])}


def direct(path: str, op: str, count: int, bs: int, offset: int) -> dict:
    buf = mmap.mmap(-1, bs)                        # page-aligned, as O_DIRECT wants
    buf.write(bytes(range(256)) * (bs // 256))
    fd = os.open(path, (os.O_RDONLY if op == "read" else os.O_WRONLY) | os.O_DIRECT)
    try:
        for i in range(count):
            pos = offset + i * bs
            n = os.preadv(fd, [buf], pos) if op == "read" else os.pwritev(fd, [buf], pos)
            if n != bs:
                sys.exit(f"short {op}: {n} of {bs} bytes at {pos}")
    finally:
        os.close(fd)
    return {"ops": count, "bytes": count * bs}


class Loop:
    """A loop device on a sparse file, made for one test: the job is the only source of I/O on it."""

    def __init__(self, backing: Path, size: int = 256 * MiB):
        with open(backing, "wb") as f:
            f.truncate(size)
        self.backing = backing
        self.dev = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True, capture_output=True,
                                  text=True).stdout.strip()
        self.name = Path(self.dev).name
        self.queue = Path("/sys/block", self.name, "queue")
        self.mounted: Path | None = None

    def stat(self) -> dict[str, int]:
        f = list(map(int, Path("/sys/block", self.name, "stat").read_text().split()))
        return {"reads": f[0], "read_bytes": f[2] * 512, "read_ms": f[3],
                "writes": f[4], "write_bytes": f[6] * 512, "write_ms": f[7]}

    def settle(self) -> None:
        """Wait until the last request has completed (readahead may outlive the process that started it). The
        inflight file alone is not enough: a request leaves it when its completion is raised, before the softirq
        that runs block_rq_complete and counts it in stat; so also wait for stat to stop moving."""
        last = None
        for _ in range(500):
            now = Path("/sys/block", self.name, "stat").read_text()
            if now == last and Path("/sys/block", self.name, "inflight").read_text().split() == ["0", "0"]:
                return
            last = now
            time.sleep(0.05)

    def mkfs_and_mount(self, where: Path) -> Path:
        # Inode tables and journal written now, not by a lazy-init thread in the middle of the measurement.
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.dev],
                       check=True, capture_output=True)
        where.mkdir()
        subprocess.run(["mount", self.dev, str(where)], check=True)
        self.mounted = where
        return where

    def remove(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.mounted)], check=False)
        subprocess.run(["losetup", "-d", self.dev], check=False)
        self.backing.unlink(missing_ok=True)


# Linux AIO by raw syscalls (no libaio in the stdlib): include/uapi/linux/aio_abi.h, asm/unistd.h.
AIO_NR = {"x86_64": {"setup": 206, "destroy": 207, "getevents": 208, "submit": 209},
          "aarch64": {"setup": 0, "destroy": 1, "submit": 2, "getevents": 4}}
AIO_BATCH = 16


class Iocb(ct.Structure):
    _fields_ = [("data", ct.c_uint64), ("key", ct.c_uint32), ("rw_flags", ct.c_uint32), ("opcode", ct.c_uint16),
                ("reqprio", ct.c_int16), ("fildes", ct.c_uint32), ("buf", ct.c_uint64), ("nbytes", ct.c_uint64),
                ("offset", ct.c_int64), ("reserved2", ct.c_uint64), ("flags", ct.c_uint32), ("resfd", ct.c_uint32)]


class IoEvent(ct.Structure):
    _fields_ = [("data", ct.c_uint64), ("obj", ct.c_uint64), ("res", ct.c_int64), ("res2", ct.c_int64)]


def aio(path: str, op: str, count: int, bs: int, offset: int, order: str) -> dict:
    nr = AIO_NR[platform.machine()]
    libc = ct.CDLL(None, use_errno=True)
    libc.syscall.restype = ct.c_long

    def call(name: str, *args) -> int:
        ret = libc.syscall(ct.c_long(nr[name]), *args)
        if ret < 0:
            sys.exit(f"io_{name}: {os.strerror(ct.get_errno())}")
        return ret

    ctx = ct.c_ulong(0)
    call("setup", ct.c_uint(AIO_BATCH), ct.byref(ctx))
    bufs = [mmap.mmap(-1, bs) for _ in range(AIO_BATCH)]
    fd = os.open(path, (os.O_RDONLY if op == "read" else os.O_WRONLY) | os.O_DIRECT)
    try:
        for first in range(0, count, AIO_BATCH):
            idx = list(range(first, min(first + AIO_BATCH, count)))
            if order == "desc":
                idx.reverse()
            cbs = (Iocb * len(idx))()
            for j, i in enumerate(idx):
                cbs[j] = Iocb(opcode=0 if op == "read" else 1, fildes=fd, nbytes=bs, offset=offset + i * bs,
                              buf=ct.addressof(ct.c_char.from_buffer(bufs[j])))
            ptrs = (ct.POINTER(Iocb) * len(idx))(*[ct.pointer(cb) for cb in cbs])
            if call("submit", ctx, ct.c_long(len(idx)), ptrs) != len(idx):
                sys.exit("io_submit took fewer iocbs than given")
            events = (IoEvent * len(idx))()
            got = 0
            while got < len(idx):
                got += call("getevents", ctx, ct.c_long(len(idx) - got), ct.c_long(len(idx) - got),
                            ct.byref(events, got * ct.sizeof(IoEvent)), None)
            if any(e.res != bs for e in events):
                sys.exit(f"short aio {op}: {[e.res for e in events]}")
    finally:
        os.close(fd)
        call("destroy", ctx)
    return {"ops": count, "bytes": count * bs}


def buffered(path: str, nbytes: int, offset: int) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # this device's cached pages only, not the node's
        done = 0
        while done < nbytes:
            got = len(os.pread(fd, min(1 << 20, nbytes - done), offset + done))
            if not got:
                break
            done += got
    finally:
        os.close(fd)
    return {"ops": 1, "bytes": done}


def fsync(path: str, mib: int, sync: bool = True) -> dict:
    chunk = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(mib):
            os.write(fd, chunk)
        if sync:
            os.fsync(fd)   # writeback of this file's dirty pages runs here, in the job's context
    finally:
        os.close(fd)
    return {"ops": mib, "bytes": mib << 20}


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--wait":
        args = args[1:]
        sys.stdin.readline()
    what, rest = args[0], args[1:]
    if what == "direct":
        out = direct(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
    elif what == "aio":
        out = aio(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), rest[5])
    elif what == "buffered":
        out = buffered(rest[0], int(rest[1]), int(rest[2]))
    elif what == "fsync":
        out = fsync(rest[0], int(rest[1]), rest[2:] != ["0"])
    else:
        sys.exit(f"unknown workload {what}")
    print(json.dumps({**out, **proc_io()}), flush=True)
