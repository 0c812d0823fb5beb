"""--tsdb victoriametrics://HOST:PORT — the controller copies every stored sample to VictoriaMetrics.

The store stays the record (frames, events, delivery); VictoriaMetrics is where a site's dashboards and PromQL
look, and it scales out (vminsert / vmstorage / vmselect) when one machine is outgrown: point `--tsdb` at a
vminsert (`victoriametrics://vminsert:8480/insert/0/prometheus`) instead of a single node.

Each sample frame becomes Prometheus text lines with the frame's own time (`/api/v1/import/prometheus`): the same
names and labels as the agents' /metrics (exporters/prometheus.py: from the fields the hello frame declares),
plus `run`. Counters are running totals per (node, job, run) kept here: a controller restart starts them again
from 0, which PromQL's rate() and increase() read as a counter reset. The schema of a run comes from its hello
frame, or from the store when the hello came before this controller started.

Writes go through a thread with a bounded queue: a slow or absent VictoriaMetrics never holds up the store. While
it is unreachable, batches wait (up to `max_batches`; beyond, the oldest go, counted and logged).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections import deque
from typing import Any, Callable

from jobprobe.exporters.prometheus import cumulative_buckets, flatten

log = logging.getLogger("jobprobe.tsdb")


def _labels(d: dict[str, str]) -> str:
    return ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in d.items())


class VictoriaMetrics:
    def __init__(self, url: str, schema_of: Callable[[str, str, str], dict | None] | None = None,
                 max_batches: int = 1000):
        # a single node, or a cluster's vminsert (…/insert/<tenant>/prometheus): the import path follows either
        self.endpoint = url.replace("victoriametrics://", "http://", 1).rstrip("/") + "/api/v1/import/prometheus"
        self.schema_of = schema_of or (lambda node, job, run: None)
        self.schemas: dict[tuple[str, str, str], dict] = {}
        self.totals: dict[tuple, float] = {}
        self.hists: dict[tuple, list[int]] = {}
        self.last_seq: dict[tuple[str, str, str], int] = {}    # a frame delivered again is not counted again
        self.queue: deque[bytes] = deque()
        self.max_batches = max_batches
        self.counts = {"samples": 0, "lines": 0, "batches": 0, "dropped": 0, "errors": 0}
        self.cond = threading.Condition()
        self.closing = False
        self.state = "ok"
        self.thread = threading.Thread(target=self._run, name="tsdb", daemon=True)
        self.thread.start()

    # ---- the controller's side: frames just committed to the store ----------------------------------------
    def add(self, frames: list[dict[str, Any]]) -> None:
        lines: list[str] = []
        for fr in frames:
            key = (fr.get("node", ""), fr.get("job", ""), fr.get("run", ""))
            if fr.get("kind") == "hello" and isinstance(fr.get("schema"), dict):
                self.schemas[key] = fr["schema"]
                continue
            if fr.get("kind") != "sample" or not isinstance(fr.get("probes"), dict):
                continue
            seq = fr.get("seq", 0)
            if seq <= self.last_seq.get(key, -1):
                continue
            self.last_seq[key] = seq
            schema = self.schemas.get(key)
            if schema is None:
                schema = self.schemas[key] = self.schema_of(*key) or {}
            ts = int(float(fr["t"]) * 1000)
            base = {"node": key[0], "job": key[1], "run": key[2]}
            for name, kind, dev, v, factor, _ in flatten(schema, fr["probes"]):
                lab = {**base, **dict(dev)}
                sk = (key, name, dev)
                if kind == "histogram":
                    counts = self.hists.get(sk, [])
                    counts = counts + [0] * (len(v) - len(counts))
                    for i, c in enumerate(v):
                        counts[i] += c
                    self.hists[sk] = counts
                    for le, total in cumulative_buckets(counts, factor):
                        lines.append(f"{name}_bucket{{{_labels({**lab, 'le': le})}}} {total} {ts}")
                    continue
                if kind == "counter":
                    value = self.totals[sk] = self.totals.get(sk, 0.0) + v * factor
                else:
                    value = v * factor
                lines.append(f"{name}{{{_labels(lab)}}} {value!r} {ts}")
            self.counts["samples"] += 1
        if lines:
            with self.cond:
                self.queue.append(("\n".join(lines) + "\n").encode())
                self.counts["lines"] += len(lines)
                while len(self.queue) > self.max_batches:
                    self.queue.popleft()
                    self.counts["dropped"] += 1
                    if self.counts["dropped"] in (1, 10, 100) or self.counts["dropped"] % 1000 == 0:
                        log.warning("victoriametrics %s: %d batches dropped while it is away (the store has "
                                    "them)", self.endpoint, self.counts["dropped"])
                self.cond.notify()

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
        backoff, said = 0.5, None
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait(1.0)
                if self.closing and (not self.queue or self.state != "ok"):
                    return
                body = self.queue[0]
            try:
                req = urllib.request.Request(self.endpoint, data=body, method="POST",
                                             headers={"Content-Type": "text/plain"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
                with self.cond:
                    if self.queue and self.queue[0] is body:
                        self.queue.popleft()
                self.counts["batches"] += 1
                if said:
                    log.warning("victoriametrics %s: writing again", self.endpoint)
                self.state, said, backoff = "ok", None, 0.5
            except Exception as err:        # unreachable, refused: the batch waits, the store has it anyway
                self.counts["errors"] += 1
                kind = f"{type(err).__name__}: {err}"[:200]
                if kind != said:
                    log.warning("victoriametrics %s: %s; %d batches wait", self.endpoint, kind, len(self.queue))
                said, self.state = kind, f"waiting: {type(err).__name__}"
                with self.cond:
                    if not self.closing:
                        self.cond.wait(backoff)
                backoff = min(5.0, backoff * 2)


def schema_from_store(store) -> Callable[[str, str, str], dict | None]:
    """The schema of a run from its stored hello frame (a hello this controller did not see itself)."""
    def look(node: str, job: str, run: str) -> dict | None:
        _, rows = store.sql("SELECT body FROM frames WHERE node = ? AND job = ? AND run = ? AND kind = 'hello' "
                            "ORDER BY seq DESC LIMIT 1", (node, job, run))
        return json.loads(rows[0][0]).get("schema") if rows else None
    return look
