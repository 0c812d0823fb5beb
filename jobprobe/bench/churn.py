# SPDX-License-Identifier: Apache-2.0
"""A month of job churn in a minute: `python -m jobprobe.bench.churn [--nodes 50] [--runs 2000]` (docs/PERFORMANCE.md).

A real nats-server on loopback and `jobprobe controller` as a process; `nodes` simulated nodes each run short jobs
back to back until `runs` jobs have run in all: a job is a hello, `samples` sample frames `interval` s apart (the
figures a CPU job's agent sends: enough for its summary), then the node's next job — so each ends, is summarized
and let go by the controller as an agent's would be. Measured: the controller's RSS (VmRSS, sampled every 0.25 s)
when half the runs were stored and at the end, its growth over the second half, its peak; every frame stored.
A controller that keeps what each ended job held grows linearly with the runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import zlib
from pathlib import Path

from jobprobe.bench.flood import _wait, controller_site, count, set_on_exit, status_mib
from jobprobe.bench.overhead import scratch
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.core.wire import frames_subject, msg_id


def job_frames(node: str, job: str, start: float, samples: int, interval: float) -> list[dict]:
    """A short CPU job's frames as its agent sends them: its hello, then `samples` samples (their times in the
    past: the bench sends them at once, a run after the other)."""
    b = FrameBuilder(node, job)
    out = [b.hello(interval=interval, target={"kind": "cgroup", "job": job})]
    out[0]["t"] = start
    for i in range(samples):
        out.append(b.sample(start + (i + 1) * interval, interval, {
            "cgroup": {"cpu_user_ns": int(1.6e9 * interval), "cpu_system_ns": int(1e8 * interval),
                       "mem_bytes": 1 << 30, "io_write_bytes": 4096, "cpus_online": 2},
            "sched": {"runq_lat_ns": int(2e6 * interval), "offcpu_ns": int(4e8 * interval),
                      "offcpu_sleep_ns": int(1e8 * interval), "offcpu_wait_ns": int(3e8 * interval)}},
            {"cgroup": "ok", "sched": "ok"}))
    return out


def churn(nodes: int = 50, runs: int = 2000, samples: int = 4, interval: float = 0.2, progress=None) -> dict:
    with scratch(None, "jobprobe-bench-churn-") as work:
        return _churn(Path(work), nodes, runs, samples, interval, progress)


def _churn(work: Path, nodes: int, runs: int, samples: int, interval: float, progress) -> dict:
    from jobprobe.transport.natswire import Wire
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    stop = threading.Event()
    rss: list[tuple[float, float]] = []
    with controller_site(work) as (url, db, ctl), set_on_exit(stop):
        def watch() -> None:
            while not stop.is_set():
                rss.append((time.time(), status_mib(ctl.pid, "VmRSS")))
                stop.wait(0.25)
        threading.Thread(target=watch, daemon=True).start()
        w = Wire(url, name="churn")
        w.connect()
        sent = 0
        t0 = time.time()
        per_node = -(-runs // nodes)
        t_half = t0
        for k in range(per_node):             # each node's job k, all nodes at once, a tick at a time
            if k == per_node // 2:
                t_half = time.time()
            now = time.time()
            jobs = [job_frames(f"node{n:03d}", f"job{k}-node{n:03d}", now, samples, interval) for n in range(nodes)]
            for i in range(samples + 1):
                batch = [js[i] for js in jobs]
                w.publish([(frames_subject(f["node"], f["job"]), msg_id(f), zlib.compress(encode(f)))
                           for f in batch], timeout=30)
                sent += len(batch)
                time.sleep(interval)
            if k % 10 == 9:
                say(f"{(k + 1) * nodes} runs published in {time.time() - t0:.0f} s, controller "
                    f"{rss[-1][1] if rss else 0:.1f} MiB")
        w.close()

        _wait(lambda: count(db, "SELECT COUNT(*) FROM frames WHERE run != 'controller'") >= sent, 120,
              "every frame stored")
        time.sleep(3 * interval * 3 + 1.0)      # the last jobs' ends: their summaries, their state let go
        rss.append((time.time(), status_mib(ctl.pid, "VmRSS")))
        stop.set()
        alive = ctl.poll() is None
        summaries = count(db, "SELECT COUNT(*) FROM events WHERE event = 'summary'")
        distinct = count(db, "SELECT COUNT(*) FROM frames WHERE run != 'controller'")
        half = next(v for t, v in rss if t >= t_half)      # when half the runs had been sent (and stored: it
        # keeps up — 50 nodes at 0.2 s are 250 frames/s)
        return {"alive": alive, "runs": per_node * nodes, "frames_sent": sent, "frames_stored": distinct,
                "summaries": summaries, "rss_start_mib": round(rss[0][1], 1), "rss_half_mib": round(half, 1),
                "rss_end_mib": round(rss[-1][1], 1), "rss_peak_mib": round(max(v for _, v in rss), 1),
                "second_half_growth_mib": round(rss[-1][1] - half, 2), "seconds": round(time.time() - t0, 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.2)
    a = ap.parse_args()
    print(json.dumps(churn(a.nodes, a.runs, a.samples, a.interval, progress=sys.stderr), indent=1))
