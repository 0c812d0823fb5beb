# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench peers`: jobprobe's collector cost beside a peer collector's, on the same job, same interval.

The peer is Prometheus' node_exporter (Debian's prometheus-node-exporter), started on loopback and scraped once
per interval, as a Prometheus server would. Both collectors' CPU comes from /proc/PID/stat (utime + stime over the
run), their memory from VmRSS / VmHWM. Both run at once, so both see the same job and the same machine noise.
"""
from __future__ import annotations

import http.client
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from jobprobe.bench.overhead import _wait_for_hello, collector_stats, free_port, scratch
from jobprobe.core.child import stop_child
from jobprobe.core.errors import BadInput
from jobprobe.kernel import procfs

NODE_EXPORTER = ("prometheus-node-exporter", "node_exporter")


def proc_cpu_s(pid: int) -> float:
    st = procfs.read_stat("/proc", pid)
    return 0.0 if st is None else (st.utime + st.stime) / procfs.CLK_TCK


def proc_mem(pid: int) -> tuple[int, int]:
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return rss, hwm


class Scraper(threading.Thread):
    """Scrape a /metrics endpoint once per interval until stopped; count bytes received, and the scrapes that
    failed (refused, timed out, cut short)."""

    def __init__(self, url: str, interval: float):
        super().__init__(daemon=True)
        self.url, self.interval, self.bytes, self.scrapes, self.failed = url, interval, 0, 0, 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        nxt = time.monotonic()
        while not self.stop_event.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    self.bytes += len(r.read())
                    self.scrapes += 1
            except (OSError, http.client.HTTPException):
                self.failed += 1
            nxt += self.interval
            self.stop_event.wait(max(0.0, nxt - time.monotonic()))


def run_peers(cmd: list[str], interval: float, workdir: Path | None = None,
              jobprobe: list[str] | None = None) -> dict:
    """`workdir`: where jobprobe's frames go (default: a scratch directory, removed at the end)."""
    exe = next((shutil.which(n) for n in NODE_EXPORTER if shutil.which(n)), None)
    if exe is None:
        raise BadInput("node_exporter not found: install Debian's prometheus-node-exporter (scripts/setup.sh --bench)")
    with scratch(workdir, "jobprobe-bench-peers-") as work:
        return _run_peers(cmd, interval, work, exe, jobprobe)


def _run_peers(cmd: list[str], interval: float, workdir: Path, exe: str, jobprobe: list[str] | None) -> dict:
    port = free_port()
    peer = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    out = workdir / "peers.mpk"
    out.unlink(missing_ok=True)
    agent = subprocess.Popen([*(jobprobe or [sys.executable, "-m", "jobprobe.cli"]), "run", "--interval",
                              str(interval), "--out", str(out), "--", *cmd],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    scraper = Scraper(f"http://127.0.0.1:{port}/metrics", interval)
    try:
        _wait_for_hello(out, agent)
        for _ in range(100):   # node_exporter listening?
            try:
                urllib.request.urlopen(scraper.url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.05)
        cpu0 = {p.pid: proc_cpu_s(p.pid) for p in (agent, peer)}
        t0 = time.monotonic()
        scraper.start()
        peak_rss = {agent.pid: 0, peer.pid: 0}
        agent_cpu = cpu0[agent.pid]
        while agent.poll() is None:
            for p in (agent, peer):
                try:
                    cpu_now = proc_cpu_s(p.pid)
                    hwm = proc_mem(p.pid)[1]
                except OSError:
                    continue
                peak_rss[p.pid] = max(peak_rss[p.pid], hwm)
                if p is agent:   # the agent's last reading before it exits
                    agent_cpu = cpu_now
            time.sleep(0.2)
        secs = time.monotonic() - t0
        scraper.stop_event.set()
        scraper.join(10)             # its last scrape done before the peer stops (else cut short: a failure)
        peer_cpu = proc_cpu_s(peer.pid)
        _, peer_hwm = proc_mem(peer.pid)
    finally:
        scraper.stop_event.set()
        stop_child(peer, 30)
        stop_child(agent, 60, signal.SIGINT)
    own = collector_stats(out)
    return {
        "seconds": secs, "interval": interval, "command": cmd,
        "jobprobe": {"cores": (agent_cpu - cpu0[agent.pid]) / secs, "cores_self_probe_median": own["cores"],
                     "peak_bytes": max(peak_rss[agent.pid], own["peak_bytes"]), "written_bps": own["written_bps"]},
        "node_exporter": {"cores": (peer_cpu - cpu0[peer.pid]) / secs, "peak_bytes": peer_hwm,
                          "scraped_bps": scraper.bytes / secs, "scrapes": scraper.scrapes,
                          "failed_scrapes": scraper.failed},
    }


def markdown(res: dict) -> str:
    j, n = res["jobprobe"], res["node_exporter"]
    return "\n".join([
        f"Same job (`{' '.join(res['command'])}`, {res['seconds']:.0f} s), both collectors at a "
        f"{res['interval']:g} s interval.", "",
        "| Collector | CPU | Memory, peak | Data per second |", "| - | - | - | - |",
        f"| jobprobe, standard collection | {j['cores']:.4f} cores | {j['peak_bytes'] / (1 << 20):.0f} MiB | "
        f"{j['written_bps'] / 1024:.2f} KiB/s written |",
        f"| node_exporter, scraped every {res['interval']:g} s | {n['cores']:.4f} cores | "
        f"{n['peak_bytes'] / (1 << 20):.0f} MiB | {n['scraped_bps'] / 1024:.1f} KiB/s scraped |"]
        + (["", f"{n['failed_scrapes']} of {n['scrapes'] + n['failed_scrapes']} scrapes failed (not counted)."]
           if n.get("failed_scrapes") else []))
