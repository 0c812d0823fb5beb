# SPDX-License-Identifier: Apache-2.0
"""Workloads for the sched probe's off-CPU reasons, run as separate processes by tests/test_sched.py.

Each prints one JSON line with its own account of the calls it makes to wait (or of whole thread bodies), from
clocks the kernel keeps independently of any tracepoint: wall time (CLOCK_MONOTONIC, the clock of
bpf_ktime_get_ns), this thread's CPU time (CLOCK_THREAD_CPUTIME_ID) and its run-queue wait (run_delay, the second
field of /proc/thread-self/schedstat, which the scheduler adds up from enqueue to running):
    runq_ns    the sum of run_delay: waiting for a CPU (preempted, or woken and not yet running)
    asleep_ns  the sum of wall - CPU - run_delay: neither running nor runnable, i.e. blocked. Steal time while the
               thread ran (a VM's vCPU taken away) lands here too: small for threads that mostly sleep.

    sleep N MS        N time.sleep(MS ms): clock_nanosleep, reason sleep
    lock N MS         after a line on stdin: a holder thread holds a threading.Lock N times for MS ms (busy),
                      the main thread waits for it each time: futex waits, reason lock; also prints hold_ns
                      and main_asleep_ns (the main thread's blocked time alone)
    io PATH N         write and fsync a file of N 64 KiB blocks at PATH, then N O_DIRECT reads of it: reason io
    pipe N            print "ready", then read N lines from stdin (a pipe the test writes slowly): reason wait
    preempt SECONDS   pin to one CPU, fork; parent and child burn SECONDS each there: reason preempt
    sleepers S1 S2 …  print "ready" and wait for a line on stdin; then one thread per S sleeps S seconds in one
                      time.sleep call (clock_nanosleep), all started together; prints each sleep's own [start, end]
                      (CLOCK_MONOTONIC ns) as "sleeps"
"""
import json
import mmap
import os
import random
import sys
import threading
import time


class Account:
    """asleep_ns and runq_ns of this thread between mark() and add() (see above), summed over windows."""

    def __init__(self):
        self.asleep_ns = self.runq_ns = 0
        self._mark = (0, 0, 0)

    @staticmethod
    def now() -> tuple[int, int, int]:
        with open("/proc/thread-self/schedstat") as f:
            run_delay = int(f.read().split()[1])
        return time.monotonic_ns(), time.thread_time_ns(), run_delay

    def mark(self) -> None:
        self._mark = self.now()

    def add(self) -> None:
        (w0, c0, d0), (w1, c1, d1) = self._mark, self.now()
        self.runq_ns += d1 - d0
        self.asleep_ns += (w1 - w0) - (c1 - c0) - (d1 - d0)

    def merge(self, other: "Account") -> "Account":
        self.asleep_ns += other.asleep_ns
        self.runq_ns += other.runq_ns
        return self

    def out(self, **extra) -> dict:
        return {"asleep_ns": self.asleep_ns, "runq_ns": self.runq_ns, **extra}


def burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(1000):
            pass


def sleep(n: int, ms: float) -> dict:
    acct = Account()
    for _ in range(n):
        acct.mark()
        time.sleep(ms / 1000)
        acct.add()
    return acct.out()


def lock(n: int, ms: float) -> dict:
    sys.stdin.readline()
    lk, turn, back = threading.Lock(), threading.Semaphore(0), threading.Semaphore(0)
    mine, theirs, held = Account(), Account(), [0]

    def holder() -> None:
        theirs.mark()
        for _ in range(n):
            with lk:
                t0 = time.monotonic_ns()
                turn.release()                  # the main thread may now try the lock: it waits the whole hold
                burn(ms / 1000)
                held[0] += time.monotonic_ns() - t0
            back.acquire()
        theirs.add()

    mine.mark()                                 # everything of both threads is futex waits or CPU
    t = threading.Thread(target=holder)
    t.start()
    for _ in range(n):
        turn.acquire()
        with lk:
            pass
        back.release()
    t.join()
    mine.add()
    # The holder's own account also holds steal time of its busy holds (see above): the main thread's alone is
    # the steady part.
    return Account().merge(mine).merge(theirs).out(hold_ns=held[0], main_asleep_ns=mine.asleep_ns)


def io(path: str, n: int) -> dict:
    blk = 64 << 10
    acct = Account()
    acct.mark()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        for _ in range(n):
            os.write(fd, b"\x5a" * blk)
        os.fsync(fd)
    finally:
        os.close(fd)
    buf = mmap.mmap(-1, blk)                    # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for i in random.Random(1).sample(range(n), n):
            assert os.preadv(fd, [buf], i * blk) == blk
    finally:
        os.close(fd)
    acct.add()
    return acct.out()


def pipe(n: int) -> dict:
    print("ready", flush=True)
    acct, lines = Account(), 0
    while lines < n:
        acct.mark()
        data = os.read(0, 4096)
        acct.add()
        if not data:
            break
        lines += data.count(b"\n")
    return acct.out(lines=lines)


def preempt(seconds: float) -> dict:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    r, w = os.pipe()
    pid = os.fork()
    acct = Account()
    acct.mark()
    burn(seconds)
    acct.add()
    if pid == 0:
        os.write(w, json.dumps(acct.out()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    child = json.loads(os.read(r, 4096))
    return {k: v + child[k] for k, v in acct.out().items()}


def sleepers(seconds: list[float]) -> dict:
    print("ready", flush=True)
    sys.stdin.readline()
    spans = [None] * len(seconds)
    go = threading.Barrier(len(seconds))

    def one(i: int) -> None:
        go.wait()
        t0 = time.monotonic_ns()
        time.sleep(seconds[i])
        spans[i] = (t0, time.monotonic_ns())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(seconds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"sleeps": spans}


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "sleep":
        res = sleep(int(args[0]), float(args[1]))
    elif what == "lock":
        res = lock(int(args[0]), float(args[1]))
    elif what == "io":
        res = io(args[0], int(args[1]))
    elif what == "pipe":
        res = pipe(int(args[0]))
    elif what == "preempt":
        res = preempt(float(args[0]))
    elif what == "sleepers":
        res = sleepers([float(a) for a in args])
    else:
        sys.exit(f"unknown workload {what}")
    print(json.dumps(res), flush=True)
