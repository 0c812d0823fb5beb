# SPDX-License-Identifier: Apache-2.0
"""Micro-workloads for the per-event benchmark, each printing what it did as one JSON line.

    python -m jobprobe.bench.micro pingpong N     N round trips over two pipes between two processes: each trip
                                                  blocks and wakes both once (about 4 context switches)
    python -m jobprobe.bench.micro syscalls N     N getppid() calls (the cheapest real syscall)
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time


def pingpong(n: int) -> dict:
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    t0 = time.perf_counter_ns()
    pid = os.fork()
    if pid == 0:
        for _ in range(n):
            os.read(a_r, 1)
            os.write(b_w, b"x")
        os._exit(0)
    for _ in range(n):
        os.write(a_w, b"x")
        os.read(b_r, 1)
    os.waitpid(pid, 0)
    ns = time.perf_counter_ns() - t0
    me, kid = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    switches = me.ru_nvcsw + me.ru_nivcsw + kid.ru_nvcsw + kid.ru_nivcsw
    return {"ns": ns, "events": switches, "unit": "context switch"}


def syscalls(n: int) -> dict:
    getppid = os.getppid
    t0 = time.perf_counter_ns()
    for _ in range(n):
        getppid()
    return {"ns": time.perf_counter_ns() - t0, "events": n, "unit": "syscall"}


WORKLOADS = {"pingpong": pingpong, "syscalls": syscalls}

if __name__ == "__main__":
    print(json.dumps(WORKLOADS[sys.argv[1]](int(sys.argv[2]))), flush=True)
