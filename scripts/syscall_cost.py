"""Wall-clock cost a probe's syscall hook adds to every syscall of the node, with its classic and its raw tracepoint
programs, in interleaved rounds: a getppid loop run outside the job (the path every other task on the node takes).
`syscalls` (sys_enter + sys_exit) or `sched` (its sys_enter hook, which tells lock from sleep from wait).

    sudo .venv/bin/python scripts/syscall_cost.py [--probe syscalls|sched] [--rounds 6] [--n 400000]

Prints the median ns per loop iteration with nothing attached, with classic programs and with raw ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobprobe.host import Host  # noqa: E402
from jobprobe.target import PidTreeTarget  # noqa: E402
from probes.sched import SchedProbe  # noqa: E402
from probes.syscalls import SyscallsProbe  # noqa: E402

# probe → (its class, a kernel version that makes it choose its classic programs)
PROBES = {"syscalls": (SyscallsProbe, "4.16.0"), "sched": (SchedProbe, "5.17.0")}


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
    res: dict[str, list[float]] = {"off": [], "classic": [], "raw": []}
    for _ in range(args.rounds):
        for mode in res:
            probe = None
            if mode != "off":   # an older kernel version makes the probe choose its classic programs
                cls, old = PROBES[args.probe]
                probe = cls(Host(kernel=old) if mode == "classic" else Host())
                probe.start(PidTreeTarget([os.getpid()]))   # the job is this process: the loop is an outsider
            try:
                res[mode].append(loop_ns(args.n))
            finally:
                if probe:
                    probe.stop()
    off = statistics.median(res["off"])
    for mode, vals in res.items():
        med = statistics.median(vals)
        print(f"{mode:8s} median {med:.0f} ns per getppid ({med - off:+.0f}); rounds {[round(v) for v in vals]}")


if __name__ == "__main__":
    main()
