# SPDX-License-Identifier: Apache-2.0
"""pystacks: the job's Python stacks with py-spy, on real Python processes — a parent and two worker processes
(as a DataLoader's), each in a function named for the test. References: the job's own list of its processes, and
the functions it is known to be in (busy workers, a parent asleep waiting for them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobprobe.devices.pyproc import py_spy
from jobprobe.probes.pystacks import fold

REPO = Path(__file__).resolve().parents[1]

JOB = r'''
import multiprocessing as mp, os, sys, time

def worker_busy_loop(seconds):
    end = time.time() + seconds
    x = 0
    while time.time() < end:
        x += 1

def wait_for_workers(procs):
    for p in procs:
        p.join()

if __name__ == "__main__":
    mp.set_start_method("fork")
    procs = [mp.Process(target=worker_busy_loop, args=(float(sys.argv[2]),)) for _ in range(2)]
    for p in procs:
        p.start()
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(str(x) for x in [os.getpid()] + [p.pid for p in procs]))
    wait_for_workers(procs)
'''


def test_fold_reads_py_spys_json():
    threads = [{"active": True, "frames": [{"name": "leaf", "short_filename": "a.py", "line": 3},
                                           {"name": "root", "short_filename": "a.py", "line": 9}]},
               {"active": False, "frames": [{"name": "wait", "short_filename": "threading.py", "line": 320}]},
               {"active": True, "frames": []}]
    assert fold(threads) == ["root (a.py:9);leaf (a.py:3)", "wait (threading.py:320) [idle]"]


@pytest.mark.kernel
def test_stacks_of_a_parent_and_its_worker_processes(tmp_path):
    assert py_spy(), "py-spy is installed by scripts/setup.sh (make test)"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    pids_file = tmp_path / "pids"
    env = {**os.environ, "JOBPROBE_PYSTACKS_HZ": "4"}
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "pystacks", "--stdout", "json",
                        "--interval", "1", "--", sys.executable, str(script), str(pids_file), "4"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(x) for x in r.stdout.splitlines()]
    want = set(map(int, pids_file.read_text().split()))
    parent = int(pids_file.read_text().split()[0])
    stacks = [f for f in frames if f["kind"] == "stacks"]
    seen = {f["pid"] for f in stacks}
    print(f"pystacks: pids {sorted(seen)} (the job's own: {sorted(want)}); "
          f"{sum(f['samples'] for f in stacks)} stacks in {len(stacks)} frames")
    assert seen == want                                   # the parent and both workers, nothing else
    # the first worker's end wakes the parent (its join returns): from that interval on it runs, and may be sampled so
    first_end = min(max(f["t"] for f in stacks if f["pid"] == pid) for pid in want - {parent})
    for pid in want:
        mine = [f for f in stacks if f["pid"] == pid]
        for i, f in enumerate(mine):
            top = f["stacks"][0]["stack"]
            if i == len(mine) - 1 and ("_shutdown" in top or "_exitfunc" in top or "_bootstrap" in top and
                                       "worker_busy_loop" not in top):
                continue        # a process's last frame may hold only its exit (a worker's multiprocessing shutdown)
            if pid == parent:
                assert "wait_for_workers" in top, f["stacks"][:3]
                assert f["t"] >= first_end or top.endswith("[idle]"), f["stacks"][:3]   # asleep while they work
            else:
                assert "worker_busy_loop" in top and not top.endswith("[idle]"), f["stacks"][:3]
    samples = [f["probes"]["pystacks"] for f in frames if f["kind"] == "sample"]
    busy = [s for s in samples if s["processes"] == 3]
    # the whole intervals between the first (processes just found) and the last (exiting): ~4 snapshots/s × 3
    assert len(busy) >= 3 and all(s["samples"] >= 3 * 2 for s in busy[1:-1]), busy
    assert sum(s["cost_cpu_ms"] for s in samples) > 0 and all("note" not in s for s in busy)


@pytest.mark.kernel
def test_a_job_without_python_says_so():
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "pystacks", "--stdout", "json",
                        "--interval", "0.5", "--", "sleep", "2"], capture_output=True, text=True, cwd=REPO,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(x) for x in r.stdout.splitlines()]
    samples = [f["probes"]["pystacks"] for f in frames if f["kind"] == "sample"]
    assert samples and all(s["processes"] == 0 and "no Python process" in s["note"] for s in samples)
    assert not [f for f in frames if f["kind"] == "stacks"]
