# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench idle`: the agent's own cost as jobs are added, beside node_exporter's in the same windows.

A real `jobprobe agent` (standard collection, 1 s, frames to files) and Debian's prometheus-node-exporter, scraped
once a second by this process as Prometheus would. Per window, both processes' CPU (their threads' run time over the
same seconds, in cores) and RSS. The agent holds N idle jobs (a cgroup each with one sleeping process) for each N of
`counts`, then `busy` jobs that each read and sleep 20 times a second (started for their window only). Every run
starts a fresh agent and goes through the counts in an order that alternates between runs (up, then down), so that
the machine's drift falls on every count alike. The agent's cost per added idle job is the least-squares slope of
its cores over N.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from jobprobe.bench.agent import AgentUnderTest, JobGroups, rss
from jobprobe.bench.overhead import free_port, scratch
from jobprobe.core.child import stop_child
from jobprobe.core.errors import BadInput
from jobprobe.kernel.host import find_cgroup2_mount

NODE_EXPORTER = ("prometheus-node-exporter", "node_exporter")
# a busy job: reads 64 KiB and sleeps 50 ms, again (CPU, syscalls, context switches every tick)
BUSY = "import time\nwhile True:\n    open('/dev/zero','rb').read(65536)\n    time.sleep(0.05)\n"


class NodeExporter:
    """node_exporter on a loopback port, scraped every second by a thread of this process."""

    def __init__(self):
        exe = next((shutil.which(n) for n in NODE_EXPORTER if shutil.which(n)), None)
        if exe is None:
            raise BadInput("no node_exporter here (Debian: apt-get install prometheus-node-exporter)")
        self.url = f"http://127.0.0.1:{free_port()}/metrics"
        self.proc = subprocess.Popen([exe, f"--web.listen-address={self.url.split('/')[2]}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.stop = threading.Event()
        end = time.monotonic() + 30
        while not self._scrape():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise BadInput("node_exporter did not answer")
            time.sleep(0.1)
        self.scrapes = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _scrape(self) -> bool:
        try:
            urllib.request.urlopen(self.url, timeout=5).read()
            return True
        except OSError:
            return False

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            self.scrapes += self._scrape()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        stop_child(self.proc, 10)


def run_s(pid: int) -> float:
    """The process's CPU time in s, to the ns: its live threads' run time (/proc/PID/task/*/schedstat; /proc/PID/stat
    counts 10 ms ticks, too coarse for a window of an idle agent). A window starts and ends no thread of either
    process (no attach in it), so the live threads are all of it."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def window(pids: dict[str, int], seconds: float) -> dict[str, dict]:
    """Each process's cores over the same `seconds`, and its RSS at the end."""
    c0, t0 = {k: run_s(p) for k, p in pids.items()}, time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {k: {"cores": (run_s(p) - c0[k]) / wall, "rss_bytes": rss(p)} for k, p in pids.items()}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def bench_idle(counts: tuple[int, ...] = (1, 16, 64, 256), busy: int = 64, runs: int = 5, seconds: float = 20.0,
               settle: float = 5.0, probes: str = "std", progress=None) -> dict:
    mount = find_cgroup2_mount()
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted")
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    jobs = JobGroups(Path(mount, "jobprobe-bench", f"idle-{os.getpid()}"))
    res: dict = {"probes": probes, "seconds": seconds, "runs": [], "counts": list(counts), "busy": busy}
    ne = None
    try:
        idle = [jobs.add(f"job-{i}", ["sleep", "1000000"]) for i in range(max(counts))]
        ne = NodeExporter()
        for r in range(runs):
            order = list(counts) if r % 2 == 0 else list(reversed(counts))
            with scratch(None, "jobprobe-bench-idle-") as work:
                agent = AgentUnderTest(Path(work), probes, 1.0)
                try:
                    run = {}
                    attached: set[int] = set()
                    for n in order:
                        for i in sorted(attached - set(range(n))):
                            agent.ctl(cmd="detach", job=f"idle-{i}")
                        for i in range(n):
                            if i not in attached:
                                agent.ctl(cmd="attach", cgroup=str(idle[i]), job=f"idle-{i}")
                        attached = set(range(n))
                        time.sleep(settle)
                        run[f"idle {n}"] = window({"agent": agent.proc.pid, "node_exporter": ne.proc.pid}, seconds)
                        say(f"run {r + 1}: {n} idle: " + line(run[f"idle {n}"]))
                    if busy:
                        for i in sorted(attached):
                            agent.ctl(cmd="detach", job=f"idle-{i}")
                        # the busy jobs run only in their own windows: they would load the idle ones' machine
                        hot = [jobs.add(f"busy-{r}-{i}", [sys.executable, "-c", BUSY]) for i in range(busy)]
                        for i, g in enumerate(hot):
                            agent.ctl(cmd="attach", cgroup=str(g), job=f"busy-{i}")
                        time.sleep(settle)
                        run[f"busy {busy}"] = window({"agent": agent.proc.pid, "node_exporter": ne.proc.pid},
                                                     seconds)
                        say(f"run {r + 1}: {busy} busy: " + line(run[f"busy {busy}"]))
                        for i in range(len(hot)):
                            agent.ctl(cmd="detach", job=f"busy-{i}")
                        jobs.remove(hot)
                finally:
                    agent.close()
            res["runs"].append(run)
    finally:
        if ne is not None:
            ne.close()
        jobs.close()
    res["table"] = table(res)
    return res


def line(w: dict) -> str:
    a, n = w["agent"], w["node_exporter"]
    return (f"agent {a['cores']:.4f} cores {a['rss_bytes'] / 2**20:.1f} MiB, node_exporter {n['cores']:.4f} cores "
            f"{n['rss_bytes'] / 2**20:.1f} MiB")


def table(res: dict) -> dict:
    """Per case over the runs: each process's median and range of cores, RSS; the agent's cores over
    node_exporter's in the same window; and the agent's cores per added idle job."""
    out: dict = {}
    cases = [k for k in res["runs"][0]] if res["runs"] else []
    for case in cases:
        ws = [run[case] for run in res["runs"] if case in run]
        row = {}
        for who in ("agent", "node_exporter"):
            cores = [w[who]["cores"] for w in ws]
            row[who] = {"cores": round(statistics.median(cores), 5), "cores_range": [round(min(cores), 5),
                                                                                     round(max(cores), 5)],
                        "rss_mib": round(statistics.median(w[who]["rss_bytes"] for w in ws) / 2**20, 1)}
        ratios = [w["agent"]["cores"] / max(1e-6, w["node_exporter"]["cores"]) for w in ws]
        row["agent_over_node_exporter"] = {"median": round(statistics.median(ratios), 2),
                                           "range": [round(min(ratios), 2), round(max(ratios), 2)]}
        out[case] = row
    per_job = [slope([(n, run[f"idle {n}"]["agent"]["cores"]) for n in res["counts"]]) for run in res["runs"]]
    if len(res["counts"]) > 1 and per_job:
        out["agent_cores_per_idle_job"] = {"median": round(statistics.median(per_job), 6),
                                           "range": [round(min(per_job), 6), round(max(per_job), 6)]}
    return out


def markdown(res: dict) -> str:
    t = res["table"]
    rows = ["| jobs | agent cores (median, range) | agent RSS | node_exporter cores | node_exporter RSS | agent / "
            "node_exporter |", "|---|---|---|---|---|---|"]
    for case, row in t.items():
        if case == "agent_cores_per_idle_job":
            continue
        a, n, q = row["agent"], row["node_exporter"], row["agent_over_node_exporter"]
        rows.append(f"| {case} | {a['cores']:.4f} ({a['cores_range'][0]:.4f}–{a['cores_range'][1]:.4f}) | "
                    f"{a['rss_mib']} MiB | {n['cores']:.4f} | {n['rss_mib']} MiB | {q['median']}× "
                    f"({q['range'][0]}–{q['range'][1]}) |")
    if "agent_cores_per_idle_job" in t:
        s = t["agent_cores_per_idle_job"]
        rows.append(f"\nThe agent's cost per added idle job: {s['median'] * 1000:.3f} millicores "
                    f"({s['range'][0] * 1000:.3f}–{s['range'][1] * 1000:.3f}) over {len(res['runs'])} runs.")
    return "\n".join(rows)
