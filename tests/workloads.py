# SPDX-License-Identifier: Apache-2.0
"""Workloads with known behaviour, run as separate processes by the tests.

    burn SECONDS            busy loop on one core
    burncpu SECONDS         busy loop until this process has used SECONDS of CPU (time stopped or waiting does not
                            count: the length of its busy part is known however long it is frozen)
    sleepwake N USEC        N sleeps of USEC microseconds (N voluntary context switches, give or take)
    switches N USEC         sleepwake, then print this process's own "voluntary nonvoluntary" switch counts
                            from /proc/self/status (the kernel's count, an independent check for probes) and end
                            at once (no interpreter teardown after the count: beside load it was preempted dozens
                            of times, switches the probes counted and the workload did not)
    forktree DEPTH SECONDS  a chain of DEPTH processes, each forking the next after 0.2 s, each burning SECONDS of
                            CPU (not of wall time: beside other work each still burns all of it)
    exit CODE               exit with CODE
    reaped CMD…             run CMD, and once it has exited, before reaping it, print the kernel's account of its
                            whole life, to its last instruction ("reaped: run_delay_s=… ran_s=…": its main thread's
                            schedstat, readable while it is a zombie) and this process's own wait for a CPU
                            (self_run_delay_s); exit with its status
"""
import os
import sys
import time


def burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for _ in range(10000):
            x += 1


def burn_cpu(seconds: float) -> None:
    x = 0
    while time.process_time() < seconds:
        for _ in range(10000):
            x += 1


def sleepwake(n: int, usec: int) -> None:
    for _ in range(n):
        time.sleep(usec / 1e6)


def switches(n: int, usec: int) -> None:
    sleepwake(n, usec)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    print(int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]), flush=True)
    os._exit(0)


def reaped(argv: list[str]) -> None:
    import subprocess
    child = subprocess.Popen(argv)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    with open(f"/proc/{child.pid}/schedstat") as f:
        ran, delay = (int(x) / 1e9 for x in f.read().split()[:2])
    with open("/proc/thread-self/schedstat") as f:
        mine = int(f.read().split()[1]) / 1e9
    code = child.wait()
    print(f"reaped: run_delay_s={delay:.3f} ran_s={ran:.3f} self_run_delay_s={mine:.3f}", flush=True)
    os._exit(code if code >= 0 else 128 - code)


def forktree(depth: int, seconds: float) -> None:
    time.sleep(0.2)
    if depth > 1 and os.fork() == 0:
        forktree(depth - 1, seconds)
        os._exit(0)
    burn_cpu(seconds)
    try:
        while True:
            os.wait()
    except ChildProcessError:
        pass


def crowd(seconds: float, crowd_from: float, crowd_to: float) -> None:
    """A trainer and its workers on too few CPUs: 2 threads hashing (hashlib lets go of the GIL: 2 cores) for
    `seconds`, and 2 forked workers (helpers: no program of their own) that sleep, then spin from `crowd_from` s to
    `crowd_to` s — while they spin, the trainer's threads queue behind them: the job's own threads beyond its CPUs."""
    import hashlib
    import threading
    t0 = time.monotonic()
    kids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            time.sleep(max(0.0, t0 + crowd_from - time.monotonic()))
            while time.monotonic() < t0 + crowd_to:
                pass
            os._exit(0)
        kids.append(pid)
    block = b"x" * (1 << 20)

    def hash_until() -> None:
        h = hashlib.sha256()
        while time.monotonic() < t0 + seconds:
            h.update(block)
    threads = [threading.Thread(target=hash_until) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pid in kids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what in ("burn", "burncpu"):
        (burn if what == "burn" else burn_cpu)(float(args[0]))
        ru = __import__("resource").getrusage(0)   # the kernel's own account of this process, for the tests
        print(f"cpu_ns={int((ru.ru_utime + ru.ru_stime) * 1e9)}", file=sys.stderr, flush=True)
    elif what == "sleepwake":
        sleepwake(int(args[0]), int(args[1]))
    elif what == "switches":
        switches(int(args[0]), int(args[1]))
    elif what == "forktree":
        forktree(int(args[0]), float(args[1]))
    elif what == "reaped":
        reaped(args)
    elif what == "crowd":
        crowd(float(args[0]), float(args[1]), float(args[2]))
    elif what == "exit":
        sys.exit(int(args[0]))
    else:
        sys.exit(f"unknown workload {what}")
