# SPDX-License-Identifier: Apache-2.0
"""The controller's numbers. Live, from its own state: MetricsCollector, read at each scrape of its Prometheus
endpoint (`jobprobe controller --metrics`, serve_metrics) — frames stored, duplicate, refused, consumer errors, the
data plane up (and its own nats-server's restarts), nodes by state and each one's newest frame age, open stragglers,
each job's energy and cost. From the store: stats (`jobprobe controller stats`) — freshness and delivery per node,
and each node's latest doctor verdict.
"""
from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from jobprobe.cluster.controller import CONTROLLER_RUN, Controller
from jobprobe.cluster.store import Store
from jobprobe.core.wire import host_port


class MetricsCollector:
    """The controller's view for Prometheus (--metrics): read at each scrape from the controller's own state."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        ctl, now = self.ctl, time.time()
        nodes = list(ctl.nodes.items())
        for key, doc in (("stored", "frames committed to the store"), ("duplicates", "frames received twice"),
                         ("rejected", "frames refused (malformed, or a node publishing for another)")):
            c = CounterMetricFamily(f"jobprobe_controller_frames_{key}", doc)
            c.add_metric([], ctl.counts[key])
            yield c
        c = CounterMetricFamily("jobprobe_controller_frames_refused", "messages refused, by reason (malformed, "
                                "subject: not its own, quota_*: over its node's quota, store, consumer_*)",
                                labels=["reason"])
        for reason, n in list(ctl.refused_by.items()):
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily("jobprobe_controller_consumer_errors", "frames a consumer (freshness, stragglers, "
                                "cost, tsdb) could not take; the others took them", labels=["consumer"])
        for consumer, n in list(ctl.consumer_errors.items()):
            c.add_metric([consumer], n)
        yield c
        g = GaugeMetricFamily("jobprobe_controller_active", "1 while this controller holds its partition's lease "
                              "and consumes; 0 while it stands by", labels=["partition"])
        g.add_metric([f"{ctl.part[0]}/{ctl.part[1]}"], 1 if ctl.active else 0)
        yield g
        g = GaugeMetricFamily("jobprobe_controller_nats_up", "1 while the controller is connected to NATS (its data "
                              "plane: frames come in); 0 while not — its own nats-server down and being restarted, "
                              "or the --nats servers out of reach")
        g.add_metric([], 1 if ctl.nc is not None and ctl.nc.is_connected else 0)
        yield g
        if ctl.server is not None:
            c = CounterMetricFamily("jobprobe_controller_nats_server_restarts", "times the controller's own "
                                    "nats-server exited and was started again (its log says how each exited)")
            c.add_metric([], ctl.server.restarts)
            yield c
        g = GaugeMetricFamily("jobprobe_controller_nodes", "nodes heard from, by state", labels=["state"])
        g.add_metric(["live"], sum(1 for _, st in nodes if not st.lost and not st.stopped))
        g.add_metric(["lost"], sum(1 for _, st in nodes if st.lost))
        g.add_metric(["stopped"], sum(1 for _, st in nodes if st.stopped and not st.lost))
        yield g
        age = GaugeMetricFamily("jobprobe_node_last_frame_age_seconds", "seconds since the node's newest frame "
                                "arrived", labels=["node"])
        for node, st in nodes:
            age.add_metric([node], round(now - st.last, 3))
        yield age
        clock = GaugeMetricFamily("jobprobe_node_clock_offset_seconds", "the node's clock less the stream's time of "
                                  "its newest message (a node beyond 60 s gets a clock_skew event)", labels=["node"])
        for node, off in list(ctl.clocks.offset.items()):
            clock.add_metric([node], off)
        yield clock
        s = GaugeMetricFamily("jobprobe_straggler", "1 while the node is named the straggler of the job",
                              labels=["job", "node"])
        for job, node in ctl.stragglers.open():
            s.add_metric([job, node], 1)
        yield s
        n = CounterMetricFamily("jobprobe_stragglers_named", "straggler events since the controller started")
        n.add_metric([], ctl.stragglers.named)
        yield n
        g = GaugeMetricFamily("jobprobe_node_suspect", "1 for a node named the straggler of --suspect-jobs distinct "
                              "jobs within --suspect-window (a node_suspect event; `jobprobe nodes` has its record)",
                              labels=["node"])
        for node in ctl.suspects.open(now):
            g.add_metric([node], 1)
        yield g
        e = CounterMetricFamily("jobprobe_job_energy_joules", "energy the job drew (CPU packages and DRAM by its CPU "
                                "share, GPUs by their share), from the samples stored since the controller started",
                                labels=["job"])
        for job, j in list(ctl.meter.energy.items()):
            e.add_metric([job], j)
        yield e
        done = list(ctl.ends.done.items())
        g = GaugeMetricFamily("jobprobe_job_goodput_ratio", "the share of the job's wall time it spent computing, "
                              "from its summary when its last node let it go (docs/TIMEUSE.md)", labels=["job"])
        for job, s in done:
            g.add_metric([job], s["goodput"])
        yield g
        g = GaugeMetricFamily("jobprobe_job_end", "1 for each ended job: how it ended (exit 3, SIGKILL, OOM kill, "
                              "group removed, node lost …), its cause (docs/FRAMES.md, `end`), whether that was a "
                              "failure and the node that said it, from its last frame's `end`",
                              labels=["job", "how", "cause", "failed", "node"])
        for job, s in done:
            if s.get("ended"):
                e = s["ended"]
                g.add_metric([job, e["how"], e.get("cause", ""), str(not e["ok"]).lower(), e["node"]], 1)
        yield g
        c = CounterMetricFamily("jobprobe_jobs_ended", "jobs summarized since the controller started, by the cause of "
                                "their end (exit, signal, oom_kill, group_removed, exited, no_process, node_lost, "
                                "timeout, requeued, preempted, node_fail; "
                                "unknown: no node said) and whether it was a failure", labels=["cause", "failed"])
        for (cause, bad), n in sorted(ctl.ended_by.items()):
            c.add_metric([cause, bad], n)
        yield c
        g = GaugeMetricFamily("jobprobe_job_time_seconds", "the job's wall time by bucket (startup, computing, "
                              "waiting_for_input, …), from its summary", labels=["job", "bucket"])
        for job, s in done:
            for bucket, v in s["buckets"].items():
                g.add_metric([job, bucket], v)
        yield g
        if ctl.meter.prices is not None:
            c = CounterMetricFamily("jobprobe_job_cost", "what the job cost (node-hours × the price file's per_hour, "
                                    "plus energy × electricity_per_kwh when set), since the controller started",
                                    labels=["job", "currency"])
            for job, v in list(ctl.meter.cost.items()):
                c.add_metric([job, ctl.meter.prices.currency], v)
            yield c


def serve_metrics(ctl: Controller, listen: str):
    """An HTTP /metrics for the controller in a thread of its own; returns the server (shutdown() to stop)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry
    host, port = host_port(listen, "--metrics")
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MetricsCollector(ctl))
    server, _ = start_http_server(port, host or "0.0.0.0", registry=reg)
    return server


def stats(store: Store, now: float | None = None) -> dict[str, Any]:
    """Freshness and delivery, per node, from the store: the newest sample's age now, how late samples arrived
    (received − t: median and p99 over the last 10 minutes), the longest gap between two samples of one job's run
    (from their own times, and a run's start: frames missing before its first stored one), frames missing (from seq),
    frames stored / duplicates / rejected, and frames dropped at the source (each run's self.sink_dropped_total)."""
    now = time.time() if now is None else now
    nodes: dict[str, dict[str, Any]] = {}
    _, rows = store.sql("SELECT node, frames, duplicates, rejected, newest_t, last_received FROM delivery")
    for node, frames, dups, rejected, newest, last in rows:
        nodes[node] = {"frames": frames, "duplicates": dups, "rejected": rejected,
                       "newest_sample_age_s": round(now - newest, 3) if newest else None,
                       "last_received_age_s": round(now - last, 3) if last else None}
    _, rows = store.sql("SELECT node, received - t FROM samples WHERE received > ? ORDER BY node", (now - 600,))
    lat: dict[str, list[float]] = {}
    for node, d in rows:
        lat.setdefault(node, []).append(d)
    for node, xs in lat.items():
        xs.sort()
        nodes.setdefault(node, {})["arrival_delay_s"] = {"median": round(xs[len(xs) // 2], 3),
                                                         "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3),
                                                         "n": len(xs)}
    _, rows = store.sql("SELECT node, MAX(gap) FROM (SELECT node, t - LAG(t) OVER (PARTITION BY node, job, run "
                        "ORDER BY seq) AS gap FROM samples) GROUP BY node")
    for node, gap in rows:
        nodes.setdefault(node, {})["longest_gap_s"] = round(gap, 3) if gap is not None else None
    # what is missing, from seq alone (a run's frames are numbered from 0, +1 each, the hello first): a run whose
    # first stored frame is seq k lost k frames at its start — a gap LAG cannot see — worth k of its intervals
    _, rows = store.sql("SELECT node, job, run, MIN(seq), MAX(seq), COUNT(*), "
                        "AVG(CASE WHEN kind = 'sample' AND dt > 0 THEN dt END) FROM frames WHERE run != ? "
                        "GROUP BY node, job, run", (CONTROLLER_RUN,))
    for node, _job, _run, first, last, n, dt in rows:
        v = nodes.setdefault(node, {})
        v["missing_frames"] = v.get("missing_frames", 0) + (last + 1 - n)
        if first and dt:
            v["longest_gap_s"] = max(v.get("longest_gap_s") or 0.0, round(first * dt, 3))
    # frames dropped at the source: each run's running total (self.sink_dropped_total, in every frame: the newest
    # that arrived has it all), else — frames of agents before it — the sum of the per-interval counts that arrived
    _, rows = store.sql("SELECT node, job, run, MAX(json_extract(body, '$.probes.self.sink_dropped_total')), "
                        "SUM(COALESCE(json_extract(body, '$.probes.self.sink_dropped'), 0)) FROM samples "
                        "GROUP BY node, job, run")
    for node, _job, _run, total, summed in rows:
        v = nodes.setdefault(node, {})
        v["dropped_at_source"] = v.get("dropped_at_source", 0) + int(total if total is not None else summed or 0)
    # each node's latest `jobprobe doctor --controller` verdict: a node whose worst check fails is not ready
    _, rows = store.sql("SELECT node, t, json_extract(body, '$.worst'), json_extract(body, '$.checks') FROM events "
                        "WHERE event = 'doctor' AND job = 'node' ORDER BY t")
    for node, t, worst, checks in rows:
        bad = [c["name"] for c in json.loads(checks or "[]") if c.get("status") in ("fail", "warn")]
        nodes.setdefault(node, {})["doctor"] = {"worst": worst, "t": t, "not_pass": bad}
    total = 0
    try:
        _, rows = store.sql("SELECT node, reason, SUM(n) FROM reject_counts GROUP BY node, reason")
    except sqlite3.OperationalError:     # a store written before refusals were counted (read-only: not migrated)
        _, rows = store.sql("SELECT COALESCE(node, ''), 'unclassified', COUNT(*) FROM rejects GROUP BY node")
    for node, reason, n in rows:
        total += n
        if node:
            nodes.setdefault(node, {}).setdefault("refused", {})[reason] = n
    # each node's clock offset, as its newest clock_skew or clock_skew_end said (nodes never off: none)
    _, rows = store.sql("SELECT node, event, json_extract(body, '$.offset_s') FROM events WHERE event IN "
                        "('clock_skew', 'clock_skew_end') ORDER BY t")
    for node, event, off in rows:
        nodes.setdefault(node, {})["clock"] = {"offset_s": off, "skewed": event == "clock_skew"}
    unready = sorted(n for n, v in nodes.items() if (v.get("doctor") or {}).get("worst") == "fail")
    return {"t": now, "nodes": nodes, "rejected_total": total, "unready_nodes": unready}
