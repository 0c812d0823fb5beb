# SPDX-License-Identifier: Apache-2.0
"""An I/O- and network-heavy reference job, to see the kernel-story probes at work:

    jobprobe run --probes all -- python scripts/io_net_job.py [--seconds S]

Each second it writes and fsyncs a file, reads it back with O_DIRECT, sends a few MiB over a TCP connection to
itself on loopback, exchanges UDP datagrams, sleeps a little and waits on a lock held by a worker thread.
"""
import argparse
import mmap
import os
import socket
import tempfile
import threading
import time

CHUNK = 1 << 20


def disk(path: str) -> None:
    buf = os.urandom(CHUNK)
    with open(path, "wb") as f:
        for _ in range(8):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        m = mmap.mmap(-1, CHUNK)           # page-aligned, as O_DIRECT needs
        while os.readv(fd, [m]) > 0:
            pass
    finally:
        os.close(fd)


def tcp(nbytes: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def sink():
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 16):
                pass

    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        data = b"x" * (1 << 16)
        for _ in range(nbytes // len(data)):
            c.sendall(data)
    t.join()
    srv.close()


def udp(n: int) -> None:
    a, b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b.bind(("127.0.0.1", 0))
    for _ in range(n):
        a.sendto(b"y" * 1000, b.getsockname())
        b.recv(2000)
    a.close()
    b.close()


def lock_wait() -> None:
    lock = threading.Lock()
    lock.acquire()
    t = threading.Thread(target=lambda: (time.sleep(0.05), lock.release()))
    t.start()
    lock.acquire()
    t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    a = ap.parse_args()
    end = time.monotonic() + a.seconds
    with tempfile.TemporaryDirectory(dir=os.environ.get("IO_JOB_DIR", "/var/tmp")) as d:
        path = os.path.join(d, "data")
        while time.monotonic() < end:
            disk(path)
            tcp(4 << 20)
            udp(200)
            lock_wait()
            time.sleep(0.1)


if __name__ == "__main__":
    main()
