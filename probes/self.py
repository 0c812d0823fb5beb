"""self — what jobprobe itself costs per interval: CPU, memory, bytes written.

Hooks: getrusage(RUSAGE_SELF), /proc/self/status (VmRSS, VmHWM), /proc/self/io (wchar). Any kernel. Cost: three
small reads per tick. This is the direct, low-noise measure of what the collector takes from the node.
"""
from __future__ import annotations

import resource
import time
from pathlib import Path

from jobprobe.probe import Field, Probe


def status_kib(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class SelfProbe(Probe):
    name = "self"
    default = True
    summary = "the collector's own cost: CPU, RSS, peak RSS, bytes written"
    fields = {
        "cpu_ns": Field("int", "ns", "CPU time jobprobe used this interval (user + system)"),
        "cpu_cores": Field("float", "cores", "cpu_ns divided by the interval: the share of one core used"),
        "rss_bytes": Field("int", "bytes", "jobprobe's resident memory now"),
        "rss_peak_bytes": Field("int", "bytes", "jobprobe's highest resident memory so far (VmHWM)"),
        "written_bytes": Field("int", "bytes", "bytes jobprobe wrote this interval, to files, pipes and sockets"),
    }

    def _read(self) -> tuple[float, int, int, int]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        status = Path(self.host.proc, "self/status").read_text()
        wchar = 0
        for line in Path(self.host.proc, "self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                wchar = int(line.split()[1])
        return (ru.ru_utime + ru.ru_stime, status_kib(status, "VmRSS") * 1024, status_kib(status, "VmHWM") * 1024,
                wchar)

    def start(self, target) -> None:
        self.t = time.monotonic()
        self.prev = self._read()

    def sample(self) -> dict:
        now, cur = time.monotonic(), self._read()
        dt, self.t = now - self.t, now
        cpu_ns = int(round((cur[0] - self.prev[0]) * 1e9))
        written = cur[3] - self.prev[3]
        self.prev = cur
        return {"cpu_ns": cpu_ns, "cpu_cores": round(cpu_ns / 1e9 / dt, 5) if dt > 0 else 0.0,
                "rss_bytes": cur[1], "rss_peak_bytes": cur[2], "written_bytes": written}
