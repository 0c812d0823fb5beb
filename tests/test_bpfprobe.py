"""What every eBPF probe shares (probes/_bpfprobe.py): the job-membership maps stay exact through exec."""
import subprocess
import sys
import time

import pytest

from jobprobe.target import PidTreeTarget
from probes.sched import SchedProbe

EXEC_FROM_A_THREAD = ("import os, threading, time; time.sleep(0.5); "
                      "t = threading.Thread(target=lambda: os.execv('/bin/sleep', ['sleep', '1.5'])); "
                      "t.start(); t.join()")


@pytest.mark.kernel
def test_exec_from_a_thread_leaves_no_stale_member():
    """A non-leader thread that calls execve takes over the process's pid; its old tid never exits. Without the
    exec handler of bpf/common.h that tid would stay in job_of_tgid forever."""
    proc = subprocess.Popen([sys.executable, "-c", EXEC_FROM_A_THREAD])
    probe = SchedProbe()
    try:
        probe.start(PidTreeTarget([proc.pid]))
        for _ in range(100):                  # wait for the thread to be created and to exec
            if open(f"/proc/{proc.pid}/comm").read().strip() == "sleep":
                break
            time.sleep(0.02)
        time.sleep(0.1)
        assert probe.members() == {proc.pid}, probe.members()
        proc.wait(timeout=10)
        time.sleep(0.1)
        assert probe.members() == set()
    finally:
        probe.stop()
        proc.kill()
        proc.wait()
