# SPDX-License-Identifier: Apache-2.0
"""Wall-clock cost a probe adds to every syscall of the node, in interleaved rounds: a getppid loop run outside the
job (the path every other task on the node takes).
`syscalls` (sys_enter + sys_exit): classic vs raw tracepoint programs. `sched`: its classic syscall hook (kernels
before 5.15), its raw one, and none (5.15+ with BTF: the syscall is read from a sleeping thread's registers).

    sudo .venv/bin/python scripts/syscall_cost.py [--probe syscalls|sched] [--rounds 6] [--n 400000]

Prints the median ns per loop iteration in each mode.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.kernel.host import Host  # noqa: E402
from jobprobe.node.targets.pidtree import PidTreeTarget  # noqa: E402
from jobprobe.probes.sched import SchedProbe  # noqa: E402
from jobprobe.probes.syscalls import SyscallsProbe  # noqa: E402

# probe → mode → how to make it (None: nothing attached). An older kernel version makes a probe choose its classic
# programs.
PROBES = {
    "syscalls": {"off": None, "classic": lambda: SyscallsProbe(Host(kernel="4.16.0")), "raw": lambda: SyscallsProbe()},
    "sched": {"off": None, "classic hook": lambda: SchedProbe(Host(kernel="5.14.0")),
              "raw hook": lambda: SchedProbe(syscall_source="hook"),
              "no hook": lambda: SchedProbe(syscall_source="regs")},
}


def loop_ns(n: int) -> float:
    code = (f"import os, time\nf = os.getppid\nt = time.perf_counter_ns()\nfor _ in range({n}): f()\n"
            f"print((time.perf_counter_ns() - t) / {n})")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", choices=list(PROBES), default="syscalls")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=400_000)
    args = ap.parse_args()
    modes = PROBES[args.probe]
    res: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, make in modes.items():
            probe = None
            if make is not None:
                probe = make()
                probe.start(PidTreeTarget([os.getpid()]))   # the job is this process: the loop is an outsider
            try:
                res[mode].append(loop_ns(args.n))
            finally:
                if probe:
                    probe.stop()
    off = statistics.median(res["off"])
    for mode, vals in res.items():
        med = statistics.median(vals)
        print(f"{mode:12s} median {med:.0f} ns per getppid ({med - off:+.0f}); rounds {[round(v) for v in vals]}")


if __name__ == "__main__":
    main()
