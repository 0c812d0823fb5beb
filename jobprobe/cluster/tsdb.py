# SPDX-License-Identifier: Apache-2.0
"""--tsdb victoriametrics://HOST:PORT — the controller copies every stored sample to VictoriaMetrics.

The store stays the record (frames, events, delivery); VictoriaMetrics is where a site's dashboards and PromQL
look, and it scales out (vminsert / vmstorage / vmselect) when one machine is outgrown: point `--tsdb` at a
vminsert (`victoriametrics://vminsert:8480/insert/0/prometheus`) instead of a single node.

Each sample frame becomes series in VictoriaMetrics' JSON-line import (`/api/v1/import`: one object per series and
batch, `{"metric": {"__name__": …, labels…}, "values": […], "timestamps": […]}`) with the frame's own time: the
same names and labels as the agents' /metrics (exporters/prometheus.py: from the fields the hello frame declares),
plus `run`. Frames come from nodes, and a node may be hostile, so nothing of a frame is ever text in a protocol:
label values (job, node, a device's name) travel as JSON strings — a newline or a brace in them is a character of
the value, never a new series —, and a metric name is made only from the declared schema and must match
Prometheus' `[a-zA-Z_:][a-zA-Z0-9_:]*`; a field whose name does not is skipped and counted (`skipped_names`), as is
a value that is not a finite number (`skipped_values`).

Counters are running totals per (node, job, run) kept here: a controller restart starts them again from 0, which
PromQL's rate() and increase() read as a counter reset. The schema of a run comes from its hello frame, or from the
store when the hello came before this controller started.

Writes go through a thread with a bounded queue: a slow or absent VictoriaMetrics never holds up the store. While
it is unreachable, batches wait (up to `max_batches`; beyond, the oldest go, counted and logged), retried after a
jittered backoff (jobprobe/core/retry.py).
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Any, Callable

from jobprobe.core.metrics import cumulative_buckets, flatten
from jobprobe.core.retry import Backoff

log = logging.getLogger("jobprobe.cluster.tsdb")

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
MAX_BUCKETS = 64
REFUSED_FOR_GOOD = (400, 422)     # the batch itself is bad: no retry makes it good


def _finite(v: Any) -> float | None:
    """v as a float, or None when it is no finite number (JSON has no NaN, and an inf is no measurement)."""
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


class VictoriaMetrics:
    def __init__(self, url: str, schema_of: Callable[[str, str, str], dict | None] | None = None,
                 max_batches: int = 1000):
        # a single node, or a cluster's vminsert (…/insert/<tenant>/prometheus): the import path follows either
        self.endpoint = url.replace("victoriametrics://", "http://", 1).rstrip("/") + "/api/v1/import"
        self.schema_of = schema_of or (lambda node, job, run: None)
        self.schemas: dict[tuple[str, str, str], dict] = {}
        self.totals: dict[tuple, float] = {}
        self.hists: dict[tuple, list[int]] = {}
        self.last_seq: dict[tuple[str, str, str], int] = {}    # a frame delivered again is not counted again
        self.queue: deque[bytes] = deque()
        self.max_batches = max_batches
        self.counts = {"samples": 0, "lines": 0, "batches": 0, "dropped": 0, "errors": 0, "skipped_names": 0,
                       "skipped_values": 0, "refused": 0}
        self.bad_names: set[str] = set()        # logged once each (bounded: a hostile schema may hold thousands)
        self.cond = threading.Condition()
        self.closing = False
        self.state = "ok"
        self.thread = threading.Thread(target=self._run, name="tsdb", daemon=True)
        self.thread.start()

    # ---- the controller's side: frames just committed to the store ----------------------------------------
    def add(self, frames: list[dict[str, Any]]) -> None:
        series: dict[tuple, dict] = {}      # (name, labels) → its JSON object, the points of this batch in it
        for fr in frames:
            key = (str(fr.get("node", "")), str(fr.get("job", "")), str(fr.get("run", "")))
            if fr.get("kind") == "hello" and isinstance(fr.get("schema"), dict):
                self.schemas[key] = fr["schema"]
                continue
            if fr.get("kind") != "sample" or not isinstance(fr.get("probes"), dict):
                continue
            seq, t = fr.get("seq", 0), _finite(fr.get("t"))
            if not isinstance(seq, int) or t is None or seq <= self.last_seq.get(key, -1):
                continue
            self.last_seq[key] = seq
            schema = self.schemas.get(key)
            if schema is None:
                schema = self.schemas[key] = self.schema_of(*key) or {}
            ts = int(t * 1000)
            base = {"node": key[0], "job": key[1], "run": key[2]}
            for name, kind, dev, v, factor, _ in flatten(schema, fr["probes"]):
                if not self._valid_name(name):
                    continue
                lab = {**base, **{k: str(x) for k, x in dev}}
                sk = (key, name, dev)
                if kind == "histogram":
                    if len(v) > MAX_BUCKETS:          # log2 buckets of a 64-bit quantity: more is no histogram
                        self.counts["skipped_values"] += 1
                        continue
                    counts = self.hists.get(sk, [])
                    counts = counts + [0] * (len(v) - len(counts))
                    for i, c in enumerate(v):
                        counts[i] += c
                    self.hists[sk] = counts
                    for le, total in cumulative_buckets(counts, factor):
                        self._point(series, f"{name}_bucket", {**lab, "le": le}, total, ts)
                    continue
                value = _finite(v)                    # first: a huge int times a float would raise
                value = None if value is None else _finite(value * factor)
                if value is not None and kind == "counter":
                    value = _finite(self.totals.get(sk, 0.0) + value)
                    if value is not None:
                        self.totals[sk] = value
                self._point(series, name, lab, value, ts)
            self.counts["samples"] += 1
        if series:
            body = "".join(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n"
                           for obj in series.values()).encode()
            with self.cond:
                self.queue.append(body)
                self.counts["lines"] += len(series)
                while len(self.queue) > self.max_batches:
                    self.queue.popleft()
                    self.counts["dropped"] += 1
                    if self.counts["dropped"] in (1, 10, 100) or self.counts["dropped"] % 1000 == 0:
                        log.warning("victoriametrics %s: %d batches dropped while it is away (the store has "
                                    "them)", self.endpoint, self.counts["dropped"])
                self.cond.notify()

    def _valid_name(self, name: str) -> bool:
        if METRIC_NAME.fullmatch(name):
            return True
        self.counts["skipped_names"] += 1
        if len(self.bad_names) < 100 and name not in self.bad_names:
            self.bad_names.add(name)
            log.warning("victoriametrics: a declared field makes no metric name (%r): skipped", name[:120])
        return False

    def _point(self, series: dict[tuple, dict], name: str, labels: dict[str, str], value: float | None,
               ts: int) -> None:
        if value is None:
            self.counts["skipped_values"] += 1
            return
        sk = (name, tuple(labels.items()))
        obj = series.get(sk)
        if obj is None:
            obj = series[sk] = {"metric": {"__name__": name, **labels}, "values": [], "timestamps": []}
        obj["values"].append(value)
        obj["timestamps"].append(ts)

    def close(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while self.queue and time.monotonic() < end and self.state == "ok":
            time.sleep(0.05)
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join(timeout=max(0.5, end - time.monotonic()))

    # ---- the writer thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff, said = Backoff(0.5, 5.0), None
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait(1.0)
                if self.closing and (not self.queue or self.state != "ok"):
                    return
                body = self.queue[0]
            try:
                req = urllib.request.Request(self.endpoint, data=body, method="POST",
                                             headers={"Content-Type": "application/x-ndjson"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
                with self.cond:
                    if self.queue and self.queue[0] is body:
                        self.queue.popleft()
                self.counts["batches"] += 1
                if said:
                    log.warning("victoriametrics %s: writing again", self.endpoint)
                self.state, said = "ok", None
                backoff.reset()
            except Exception as err:        # unreachable, refused: the batch waits, the store has it anyway
                self.counts["errors"] += 1
                if isinstance(err, urllib.error.HTTPError) and err.code in REFUSED_FOR_GOOD:
                    # VictoriaMetrics cannot parse this batch: sent again it would hold up every batch behind it
                    with self.cond:
                        if self.queue and self.queue[0] is body:
                            self.queue.popleft()
                    self.counts["refused"] += 1
                    log.warning("victoriametrics %s: a batch refused (%s: %s); skipped, the store has it",
                                self.endpoint, err.code, err.reason)
                    continue
                kind = f"{type(err).__name__}: {err}"[:200]
                if kind != said:
                    log.warning("victoriametrics %s: %s; %d batches wait", self.endpoint, kind, len(self.queue))
                said, self.state = kind, f"waiting: {type(err).__name__}"
                with self.cond:
                    if not self.closing:
                        self.cond.wait(backoff.next())


def schema_from_store(store) -> Callable[[str, str, str], dict | None]:
    """The schema of a run from its stored hello frame (a hello this controller did not see itself)."""
    def look(node: str, job: str, run: str) -> dict | None:
        _, rows = store.sql("SELECT body FROM frames WHERE node = ? AND job = ? AND run = ? AND kind = 'hello' "
                            "ORDER BY seq DESC LIMIT 1", (node, job, run))
        return json.loads(rows[0][0]).get("schema") if rows else None
    return look
