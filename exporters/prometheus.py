# SPDX-License-Identifier: Apache-2.0
"""--prometheus HOST:PORT — the agent's /metrics: every attached job's frames as Prometheus metrics.

One PromSink per agent, shared by its jobs (each writes through its own `for_job()` handle, like the NATS sink);
a prometheus-client collector turns the newest state into metric families at each scrape. The metrics are built
from the fields the probes declare (the hello frame's schema: type, unit, kind), not from a list of our own:

- `counter` fields (per-interval deltas in frames) are summed since the job was attached and exposed as
  `jobprobe_<probe>_<field>_total`; `gauge` fields as their newest value; `histogram` fields (log2 bucket lists)
  as Prometheus histograms with cumulative `le` buckets (no `_sum`: the buckets do not give it exactly).
- Units become Prometheus base units: `_ns`/`_us` fields are exposed in seconds (`…_seconds[_total]`), `_mj` in
  joules, `_mw` in watts.
- Labels: `node`, `job`, the job's owner — its frames' `labels` (the scheduler's user, account, partition…, or
  attach's `--label`) whose names are allow-listed (`prometheus_labels`: OWNER by default; a value cut at
  MAX_VALUE characters, escaped by the client), on every series of the job, empty for a job that has not that one —
  and per device where the field is one: `gpu` (its index) for `gpu.gpus[].*`, `nic` for `nic.nics[].*`. Strings,
  top-N lists (`net.top_peers`, `syscalls.top`) and other maps are never labels:
  cardinality stays bounded by jobs × devices. At most `max_jobs` jobs are exposed; the others are counted in
  `jobprobe_exporter_jobs_over_cap`. A detached job's series stay 60 s (its last frame is scraped), then go.

Scrape with `honor_labels: true` (docs/DEPLOY.md): the `job` label is the training job's, not the scrape job's.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from jobprobe.core import ends
from jobprobe.core.metrics import cumulative_buckets, flatten
from jobprobe.core.wire import host_port

KEEP_ENDED_S = 60.0      # a detached job's series stay this long, so that scrapes see its last frame
OWNER = ("user", "account", "partition", "qos", "namespace")   # the owner labels exposed unless configured
MAX_VALUE = 128          # characters of an owner label's value
RESERVED = {"node", "job", "gpu", "nic", "le", "quantile"}


def owner_names(text: str) -> tuple[str, ...]:
    """`prometheus_labels` ("user,account"): each a Prometheus label name that no series of ours uses already."""
    import re
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", n) or n.startswith("__") or n in RESERVED:
            from jobprobe.core.errors import BadInput
            raise BadInput(f"prometheus_labels: {n[:40]!r} is not a label name of its own (a-z, 0-9, _; not "
                           f"{', '.join(sorted(RESERVED))})")
    return tuple(dict.fromkeys(names))

class JobState:
    def __init__(self) -> None:
        self.schema: dict[str, dict[str, dict[str, str]]] = {}
        self.values: dict[tuple[str, tuple], float] = {}      # (metric, extra labels) → value
        self.hist: dict[tuple[str, tuple], tuple[list[int], float]] = {}   # → (bucket counts, bucket factor)
        self.node = ""
        self.owner: dict[str, str] = {}       # its allow-listed labels, from its newest frame that had any
        self.ended: float | None = None
        self.end: dict | None = None          # its last frame's `end`: how it ended


class PromSink:
    def __init__(self, listen: str, max_jobs: int = 256, owner: tuple[str, ...] = OWNER,
                 declared: dict[str, dict[str, dict[str, str]]] | None = None):
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry
        host, port = host_port(listen, "--prometheus")
        self.name, self.max_jobs, self.owner = f"prometheus:{listen}", max_jobs, owner
        self.jobs: dict[str, JobState] = {}
        self.over_cap: set[str] = set()
        self.lock = threading.Lock()
        self.help: dict[str, tuple[str, str]] = {}          # metric → (kind, help)
        # every probe's fields as the agent declares them (meanings too): HELP, and a probe switched on at run time
        self.declared = declared or {}
        self.ended: dict[tuple[str, str], int] = {}          # (cause, failed) → jobs whose last frame said so
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.server, self.thread = start_http_server(port, host or "0.0.0.0", registry=self.registry)

    # ---- the agent's side --------------------------------------------------------------------------------
    def for_job(self, job: str) -> "PromHandle":
        return PromHandle(self, job)

    def write(self, frame: dict, data: bytes) -> None:
        job = frame["job"]
        with self.lock:
            st = self.jobs.get(job)
            if st is not None and st.ended is not None:     # attached again: a new run, counted from zero
                st = self.jobs[job] = JobState()
            if st is None:
                if len(self.jobs) >= self.max_jobs:
                    self.over_cap.add(job)
                    return
                st = self.jobs[job] = JobState()
            st.node = frame["node"]
            labels = frame.get("labels")
            if isinstance(labels, dict) and labels:
                st.owner = {n: str(labels[n])[:MAX_VALUE] for n in self.owner if isinstance(labels.get(n), str)}
            if frame["kind"] == "hello" and isinstance(frame.get("schema"), dict):
                st.schema = frame["schema"]
            elif frame["kind"] == "sample" and isinstance(frame.get("probes"), dict):
                self._take(st, frame["probes"])
                if isinstance(frame.get("end"), dict):
                    st.end = frame["end"]
                    key = (ends.cause_of(st.end), str(ends.failed(st.end)).lower())
                    self.ended[key] = self.ended.get(key, 0) + 1

    def forget(self, job: str) -> None:
        """The job was detached: its series stay KEEP_ENDED_S more (its last frame scraped), then go."""
        with self.lock:
            if job in self.jobs:
                self.jobs[job].ended = time.monotonic()
            self.over_cap.discard(job)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _take(self, st: JobState, probes: dict[str, Any]) -> None:
        schema = {p: self.declared.get(p) or st.schema.get(p) or {} for p in probes}
        for name, kind, labels, v, factor, doc in flatten(schema, probes):
            if self.help.get(name, ("", ""))[1] != doc:
                self.help[name] = (kind, doc)
            key = (name, labels)
            if kind == "histogram":
                counts, _ = st.hist.get(key, ([], factor))
                if len(counts) < len(v):
                    counts = counts + [0] * (len(v) - len(counts))
                st.hist[key] = ([c + (v[i] if i < len(v) else 0) for i, c in enumerate(counts)], factor)
            elif kind == "counter":
                st.values[key] = st.values.get(key, 0.0) + v * factor
            else:
                st.values[key] = v * factor

    # ---- the collector (prometheus-client calls this at each scrape) --------------------------------------
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        fams: dict[str, Any] = {}

        def fam(name: str, extra: tuple):
            kind, doc = self.help[name]
            labels = ["node", "job", *owner, *[lk for lk, _ in extra]]
            if name not in fams:
                if kind == "counter":
                    fams[name] = CounterMetricFamily(name[: -len("_total")], doc, labels=labels)
                elif kind == "gauge":
                    fams[name] = GaugeMetricFamily(name, doc, labels=labels)
                else:
                    fams[name] = HistogramMetricFamily(name, doc, labels=labels)
            return fams[name]
        with self.lock:
            now = time.monotonic()
            for job in [j for j, st in self.jobs.items() if st.ended and now - st.ended > KEEP_ENDED_S]:
                del self.jobs[job]
            # the owner labels any exposed job has: a family's label names are one set (a job without one: "")
            owner = [n for n in self.owner if any(n in st.owner for st in self.jobs.values())]
            for job, st in self.jobs.items():
                who = [st.owner.get(n, "") for n in owner]
                for (name, extra), value in st.values.items():
                    fam(name, extra).add_metric([st.node, job, *who, *[lv for _, lv in extra]], value)
                for (name, extra), (counts, factor) in st.hist.items():
                    buckets = cumulative_buckets(counts, factor)
                    fam(name, extra).add_metric([st.node, job, *who, *[lv for _, lv in extra]], buckets, None)
            over = len(self.over_cap)
            end = GaugeMetricFamily("jobprobe_job_end", "1 for a job that ended (its series stay 60 s): how (exit 3, "
                                    "SIGKILL, OOM kill, group removed …), its cause and whether it failed, from its "
                                    "last frame's `end` (docs/FRAMES.md)",
                                    labels=["node", "job", *owner, "how", "cause", "failed"])
            for job, st in self.jobs.items():
                if st.end is not None:
                    end.add_metric([st.node, job, *[st.owner.get(n, "") for n in owner], ends.how(st.end),
                                    ends.cause_of(st.end), str(ends.failed(st.end)).lower()], 1)
            ended = CounterMetricFamily("jobprobe_jobs_ended", "jobs of this node that ended since the agent started, "
                                        "by cause (exit, signal, oom_kill, group_removed, exited, no_process, "
                                        "timeout, requeued, preempted, node_fail) and whether it was a failure",
                                        labels=["cause", "failed"])
            for (cause, bad), n in sorted(self.ended.items()):
                ended.add_metric([cause, bad], n)
        yield from fams.values()
        yield end
        yield ended
        g = GaugeMetricFamily("jobprobe_exporter_jobs_over_cap", "jobs attached but not exposed (over max_jobs)")
        g.add_metric([], over)
        yield g


class PromHandle:
    """One job's view of the shared PromSink; close() drops the job's series (the job was detached)."""

    def __init__(self, sink: PromSink, job: str):
        self.sink, self.job = sink, job
        self.name = sink.name

    def write(self, frame: dict, data: bytes) -> None:
        self.sink.write(frame, data)

    def stats(self) -> dict:
        return {"queued": 0, "written": 0, "errors": 0, "dropped": 0, "depth": 0, "in_flight": 0,
                "state": "over cap" if self.job in self.sink.over_cap else "ok"}

    def close(self) -> None:
        self.sink.forget(self.job)

    def __repr__(self) -> str:
        return f"PromHandle({self.sink.name}, {self.job})"
