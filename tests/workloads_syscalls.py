# SPDX-License-Identifier: Apache-2.0
"""Workloads that make a known number of syscalls, run as separate processes by tests/test_syscalls.py.

    exact N FUTEX_NR [wait]   N getppid(), N read(2) of one byte from /dev/zero, N futex(FUTEX_WAKE_PRIVATE) on a
                              word nobody waits on (FUTEX_NR: the futex syscall's number, from the caller's table);
                              with `wait`, first reads one line from stdin (so a probe can attach to this PID)
    sleeps N USEC             N sleeps of USEC µs (clock_nanosleep)
    blocked K                 waits for a line on stdin, starts K threads that block in read(2) on a pipe, prints
                              "ready", waits for another line, then exit_group()s with the threads still inside
                              read (they never reach sys_exit)
    threadexec                waits for a line, then a second thread execve()s `python -c pass` (it takes the
                              leader's pid)
    storm FORKS THREADS       waits for a line, forks and reaps FORKS children, starts and joins THREADS threads,
                              prints "done", waits for a line
"""
import ctypes
import os
import sys
import threading
import time


def exact(n: int, futex_nr: int, wait: bool) -> None:
    if wait:
        sys.stdin.readline()
    getppid = os.getppid
    for _ in range(n):
        getppid()
    fd = os.open("/dev/zero", os.O_RDONLY)
    read = os.read
    for _ in range(n):
        read(fd, 1)
    libc = ctypes.CDLL(None, use_errno=True)
    word = ctypes.c_int(0)
    addr, syscall = ctypes.addressof(word), libc.syscall
    for _ in range(n):
        syscall(futex_nr, ctypes.c_void_p(addr), 129, 1, None, None, 0)   # FUTEX_WAKE | FUTEX_PRIVATE_FLAG
    os.close(fd)


def blocked(k: int) -> None:
    sys.stdin.readline()
    r, _w = os.pipe()
    threads = [threading.Thread(target=os.read, args=(r, 1), daemon=True) for _ in range(k)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    os._exit(0)


def storm(forks: int, threads: int) -> None:
    sys.stdin.readline()
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    for _ in range(threads):
        t = threading.Thread(target=os.getppid)
        t.start()
        t.join()
    print("done", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "exact":
        exact(int(args[0]), int(args[1]), args[2:] == ["wait"])
    elif what == "sleeps":
        for _ in range(int(args[0])):
            time.sleep(int(args[1]) / 1e6)
    elif what == "blocked":
        blocked(int(args[0]))
    elif what == "threadexec":
        sys.stdin.readline()
        t = threading.Thread(target=os.execv, args=(sys.executable, [sys.executable, "-c", "pass"]))
        t.start()
        t.join()
    elif what == "storm":
        storm(int(args[0]), int(args[1]))
    else:
        sys.exit(f"unknown workload {what}")
