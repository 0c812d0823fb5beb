# SPDX-License-Identifier: Apache-2.0
"""self — what jobprobe itself costs per interval: CPU, memory, bytes written; and what its sinks lost.

Hooks: getrusage(RUSAGE_SELF), /proc/self/status (VmRSS, VmHWM), /proc/self/io (wchar). Any kernel. Cost: three
small reads per tick. This is the direct, low-noise measure of what the collector takes from the node.

Sinks: given `sinks`, a callable returning {sink name: counters since the sink was made} (exporters/queued.py's
`QueuedSink.stats()`: dropped, errors, depth, state), it reports per interval the frames the sinks dropped and lost
to errors, and the deepest queue now. Probes sit below sinks, so this module never imports them: the caller hands
the callable in. Without it the sink fields are absent, not 0 — nobody watched, so nothing is claimed. The first
interval counts from zero, i.e. everything since the sinks were made.
"""
from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING, Callable

from jobprobe.contract import tickmemo
from jobprobe.contract.probe import Field, Probe
from jobprobe.kernel import procfs
from jobprobe.kernel.host import Host

if TYPE_CHECKING:
    from jobprobe.kernel.membership import Node


def status_kib(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class SelfProbe(Probe):
    name = "self"
    default = True
    summary = "the collector's own cost: CPU, RSS, peak RSS, bytes written; frames its sinks dropped"
    fields = {
        "cpu_ns": Field("int", "ns", "CPU time jobprobe used this interval (user + system)"),
        "cpu_cores": Field("float", "cores", "cpu_ns divided by the interval: the share of one core used"),
        "rss_bytes": Field("int", "bytes", "jobprobe's resident memory now"),
        "rss_peak_bytes": Field("int", "bytes", "jobprobe's highest resident memory so far (VmHWM)"),
        "written_bytes": Field("int", "bytes", "bytes jobprobe wrote this interval, to files, pipes and sockets"),
        "sink_dropped": Field("int", "count", "frames the sinks dropped this interval, summed over sinks: queue full "
                              "(oldest dropped), sink dead (EPIPE...) or closing. Absent when not given the sinks"),
        "sink_dropped_total": Field("int", "count", "frames the sinks dropped since the job was attached (this run), "
                                    "summed over sinks: the whole count in every frame, so a reader that lost "
                                    "frames (the ones that carried some of the per-interval counts) still has it. "
                                    "Absent when not given the sinks", kind="gauge"),
        "sink_errors": Field("int", "count", "frames lost this interval because a sink's write raised (ENOSPC...), "
                             "summed over sinks; the sink goes on. Absent when not given the sinks"),
        "sink_queue_max": Field("int", "count", "frames waiting in the fullest sink queue now (of its maxsize, 1024 "
                                "by default). Absent when not given the sinks", kind="gauge"),
        "sinks": Field("list[map]", "—", "one record per sink (fields sinks[].*). Absent when not given the sinks"),
        "sinks[].name": Field("str", "—", "the sink (file, stdout, ...)"),
        "sinks[].dropped": Field("int", "count", "frames it dropped this interval"),
        "sinks[].dropped_total": Field("int", "count", "frames it dropped since the job was attached", kind="gauge"),
        "sinks[].errors": Field("int", "count", "frames lost this interval to its write raising"),
        "sinks[].depth": Field("int", "count", "frames waiting in its queue now", kind="gauge"),
        "sinks[].state": Field("str", "—", "ok; `stopped: WHY` (dead, e.g. a broken pipe: its frames are dropped); "
                              "closed"),
    }

    files = procfs.OpenFiles()      # the agent's own status and io, kept open: every job's self probe reads them

    def __init__(self, host: Host | None = None, sinks: Callable[[], dict[str, dict]] | None = None):
        super().__init__(host)
        self.sinks = sinks
        self._sink_prev: dict[str, dict] = {}   # counters at the last sample; a new sink counts from 0

    @classmethod
    def build(cls, host: Host, node: Node | None = None,
              sinks: Callable[[], dict[str, dict]] | None = None) -> SelfProbe:
        """One job's instance, given its sinks' counters (the agent's; None: the sink fields are absent)."""
        return cls(host, sinks=sinks)

    def _read(self) -> tuple[float, int, int, int]:
        return tickmemo.get(("self", self.host.proc), self._read_now)   # the same for every job of a tick

    def _read_now(self) -> tuple[float, int, int, int]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        status = self.files.read(f"{self.host.proc}/self/status") or ""
        wchar = 0
        for line in (self.files.read(f"{self.host.proc}/self/io") or "").splitlines():
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
        out = {"cpu_ns": cpu_ns, "cpu_cores": round(cpu_ns / 1e9 / dt, 5) if dt > 0 else 0.0,
               "rss_bytes": cur[1], "rss_peak_bytes": cur[2], "written_bytes": written}
        if self.sinks is not None:
            out.update(self._sink_fields(self.sinks()))
        return out

    def _sink_fields(self, stats: dict[str, dict]) -> dict:
        per = []
        for name, st in stats.items():
            before = self._sink_prev.get(name, {})
            per.append({"name": name, "dropped": st["dropped"] - before.get("dropped", 0),
                        "dropped_total": st["dropped"], "errors": st["errors"] - before.get("errors", 0),
                        "depth": st["depth"],
                        "state": st.get("state", "ok")})
        self._sink_prev = {name: dict(st) for name, st in stats.items()}
        return {"sink_dropped": sum(p["dropped"] for p in per), "sink_errors": sum(p["errors"] for p in per),
                "sink_dropped_total": sum(p["dropped_total"] for p in per),
                "sink_queue_max": max((p["depth"] for p in per), default=0), "sinks": per}
