# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench controller --partitions N`: controllers past one — N partitions by job, two controllers each (one
active, one standing by), simulated nodes in jobs of 8 to 512 nodes, and the active controller of one partition
SIGKILLed mid-run.

- A real nats-server with the partition mapping (jobprobe/core/wire.py), 2N real `jobprobe controller --partition`
  processes (each pair sharing its partition's store), the generator of `bench controller` publishing one frame per
  node per second, each node in one job (sizes 8, 16, …, 512 in turn).
- Measured: frames stored per second over all partitions against those published; the time from the SIGKILL to
  the standby saying it is active (failover); after the run, whether every frame published is stored, how many
  were delivered again after the kill (the store's key made them no-ops: `duplicates`), and how many keys are in
  the stores more than once (0, or the store's key is broken); the controllers' CPU.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from jobprobe.bench.controller import GENERATOR, cpu_s, stored
from jobprobe.bench.overhead import free_port, scratch
from jobprobe.core.child import stop_child

SIZES = (8, 16, 32, 64, 128, 256, 512)


def bench_failover(nodes: int = 1000, seconds: float = 40.0, partitions: int = 4, kill_after: float = 15.0,
                   progress=None) -> dict:
    with scratch(None, "jobprobe-bench-failover-") as work:
        return _bench(nodes, seconds, partitions, kill_after, progress, work)


def _bench(nodes: int, seconds: float, n: int, kill_after: float, progress, work: Path) -> dict:
    from jobprobe.cluster.natsserver import LocalNats
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    root = str(Path(__file__).resolve().parents[2])
    srv = LocalNats(work, f"127.0.0.1:{free_port()}", partitions=n)
    srv.wait()
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    logs = {(i, k): work / f"c{i}-{k}.log" for i in range(n) for k in (0, 1)}
    stores = [work / f"p{i}.db" for i in range(n)]
    gen = None
    res: dict = {"nodes": nodes, "partitions": n, "controllers": 2 * n, "seconds": seconds,
                 "jobs": _jobs(nodes)}
    try:
        for k, say_it in ((0, "active"), (1, "standing by")):
            for i in range(n):
                procs[i, k] = subprocess.Popen(
                    [sys.executable, "-m", "jobprobe.cli", "controller", "--nats", srv.url, "--creds", srv.creds,
                     "--partition", f"{i}/{n}", "--store", str(stores[i])], cwd=root, stdout=subprocess.DEVNULL,
                    stderr=open(logs[i, k], "ab"))
            _wait(lambda: all(say_it in logs[i, k].read_text() for i in range(n)), 120, f"controllers {say_it}")
        gen = subprocess.Popen([sys.executable, "-c", GENERATOR, root, srv.url, str(nodes), str(seconds), "1.0", "4",
                                "0", os.urandom(8).hex(), srv.creds, ",".join(map(str, SIZES))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        cpu0 = sum(cpu_s(p.pid) for p in procs.values())
        time.sleep(kill_after)
        victim = next(k for k in (0, 1) if "active" in logs[0, k].read_text())
        cpu_killed = cpu_s(procs[0, victim].pid)
        procs[0, victim].kill()
        killed = time.monotonic()
        standby = logs[0, 1 - victim]
        _wait(lambda: "active" in standby.read_text(), 60, "the standby to take over")
        res["failover_s"] = round(time.monotonic() - killed, 2)
        say(f"partition 0: controller killed {kill_after:.0f} s in; its standby active {res['failover_s']} s later")
        out, err = gen.communicate(timeout=seconds * 10 + 600)
        if gen.returncode != 0:
            raise RuntimeError(f"generator: {err[-2000:]}")
        t1 = time.monotonic()
        sent = int(out.strip().splitlines()[-1].split('"sent": ')[1].split(",")[0])
        at_end = sum(stored(s) for s in stores)
        _wait(lambda: sum(stored(s) for s in stores) >= sent, 180, "every frame stored", fail=False)
        cpu1 = cpu_killed + sum(cpu_s(p.pid) for key, p in procs.items() if p.poll() is None)
        res.update({"sent": sent, "published_per_s": round(sent / (t1 - t0), 1),
                    "stored_per_s": round(at_end / (t1 - t0), 1), "backlog_at_end": sent - at_end,
                    "drained_after_s": round(time.monotonic() - t1, 2),
                    "all_stored": sum(stored(s) for s in stores) == sent,
                    "duplicates": sum(_one(s, "SELECT SUM(duplicates) FROM delivery") for s in stores),
                    "stored_twice": _twice(stores), "controllers_cores": round((cpu1 - cpu0) / (t1 - t0), 3)})
        say(f"{n} partitions, {nodes} nodes: {res}")
    finally:
        if gen is not None and gen.poll() is None:
            gen.kill()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            stop_child(p, 30)
        srv.stop()
    return res


def _jobs(nodes: int) -> dict:
    """How many jobs of each size the generator's nodes make (the last one may be short)."""
    out: dict[int, int] = {}
    k = left = 0
    left = nodes
    while left > 0:
        size = SIZES[k % len(SIZES)]
        out[min(size, left)] = out.get(min(size, left), 0) + 1
        left -= size
        k += 1
    return out


def _wait(cond, timeout: float, what: str, fail: bool = True) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    if fail:
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _one(store: Path, sql: str) -> int:
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
    try:
        return db.execute(sql).fetchone()[0] or 0
    finally:
        db.close()


def _twice(stores: list[Path]) -> int:
    """Keys (node, job, run, seq) in the stores more than once, over all of them."""
    from jobprobe.cluster.store import Store
    st = Store([str(s) for s in stores], readonly=True)
    try:
        return st.sql("SELECT COUNT(*) FROM (SELECT 1 FROM frames GROUP BY node, job, run, seq HAVING COUNT(*) > 1)"
                      )[1][0][0]
    finally:
        st.close()


def markdown(res: dict) -> str:
    return "\n".join([
        "| | |", "| - | - |",
        f"| {res['nodes']} simulated nodes at 1 s, jobs of {', '.join(f'{k}×{v}' for k, v in res['jobs'].items())} "
        f"nodes | {res['partitions']} partitions, {res['controllers']} controllers: published "
        f"{res.get('published_per_s')} frames/s, stored {res.get('stored_per_s')}/s; controllers "
        f"{res.get('controllers_cores')} cores in all |",
        f"| partition 0's active controller SIGKILLed | its standby active {res.get('failover_s')} s later; every frame"
        f" stored: {res.get('all_stored')} ({res.get('sent')} sent, backlog {res.get('backlog_at_end')} at the end, "
        f"drained {res.get('drained_after_s')} s later); delivered again after the kill {res.get('duplicates')}, "
        f"stored twice {res.get('stored_twice')} |",
    ])
