# SPDX-License-Identifier: Apache-2.0
"""How long the SLURM prolog and epilog (scripts/slurm/) hold a job up: N runs of each against a real agent started
here (one probe, its own socket), and N against no agent at all. Root (the agent). Prints percentiles in ms.

    sudo .venv/bin/python scripts/prolog_time.py [N]
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = "/usr/bin/python3"


def timed(script: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([PYTHON, str(REPO / "scripts/slurm" / script)], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"{script} exited {res.returncode}: {res.stderr}")
    return dt


def summary(name: str, xs: list[float]) -> str:
    xs = sorted(x * 1000 for x in xs)
    return (f"{name:<28} n={len(xs)}  median {statistics.median(xs):6.1f} ms  "
            f"p90 {xs[int(0.9 * (len(xs) - 1))]:6.1f} ms"
            f"  max {xs[-1]:6.1f} ms")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    work = Path(tempfile.mkdtemp(prefix="jobprobe-prolog-"))
    sock = work / "agent.sock"
    agent = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "agent", "--socket", str(sock), "--state",
                              str(work / "jobs.json"), "--probes", "cgroup", "--attach-wait", "60"], cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from jobprobe.node.control import call
        end = time.monotonic() + 60
        while True:
            try:
                call(str(sock), {"cmd": "status"})
                break
            except Exception:
                if time.monotonic() > end or agent.poll() is not None:
                    sys.exit("the agent did not start")
                time.sleep(0.1)
        base = {"PATH": os.environ.get("PATH", ""), "JOBPROBE_SOCKET": str(sock), "SLURM_JOB_USER": "someone",
                "SLURM_JOB_UID": "1000", "SLURM_JOB_PARTITION": "gpu"}
        pro, epi, none = [], [], []
        for i in range(n):
            env = {**base, "SLURM_JOB_ID": str(900000 + i)}
            pro.append(timed("prolog", env))
            epi.append(timed("epilog", env))
            none.append(timed("prolog", {**env, "JOBPROBE_SOCKET": str(work / "no-agent.sock")}))
        print(summary("prolog (agent up)", pro))
        print(summary("epilog (agent up)", epi))
        print(summary("prolog (no agent)", none))
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)


if __name__ == "__main__":
    main()
