"""`jobprobe controller`: the frames of every node, from NATS JetStream into the store, none lost, none twice.

Agents publish each frame to `jobprobe.frames.<node>` (exporters/nats.py). The controller keeps a stream on those
subjects (JOBPROBE: file storage, a 2-minute duplicate window, frames kept until acked by the controller or a week
old) and reads it through a durable pull consumer, in batches: each frame is decoded and validated (the schema, and
its `node` against the subject it came on), the batch is committed to the store, and only then acked. A controller
killed at any moment loses nothing (what was not acked is delivered again) and stores nothing twice (the store's
key is (node, job, run, seq)). Every message is hostile until checked (jobprobe/cluster/framecheck.py: decoding bounded in
objects, every value against the declared types); a frame that is not valid is refused, counted and logged
(`rejects`), and acked: it will never become valid. Each consumer of frames (freshness, stragglers, the cost meter,
the TSDB writer, the store) has its own error boundary: one failing on a frame neither stops the loop nor the
others (docs/SECURITY.md).

Freshness: per node, when its newest frame arrived. An agent with no job attached sends a `heartbeat` each tick
(used for freshness only, never stored), and one marked `stopping` when it stops cleanly: liveness does not depend on
having jobs, and a stopped node is not lost. A node silent for 3 of its intervals (and not stopped) gets a `node_lost`
event for each job live when it went silent — or one of job `node` when none was; its next frame a `node_back`.

Cluster-wide deep traces: `jobprobe trace --job ID --nats URL [--at T]` asks the controller (core NATS request on
jobprobe.ctl.trace); it asks every node that sent frames of the job in the last 30 s (jobprobe.ctl.node.<node>,
answered by that node's agent) to open a window at one common time — T, or 3 s from now — and answers with each
node's reply. Each node writes its own file and announces it in a `trace` frame, which reaches the store.

With no --nats the controller starts a `nats-server` with JetStream in its data directory, listening on --listen:
one command for a small cluster — authenticated (jobprobe/transport/natsauth.py: the controller's nkey and one per node
enrolled with `jobprobe controller enroll NODE`), TLS or loopback unless told otherwise, and gone with the
controller.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobprobe.core.errors import BadInput
from jobprobe.transport.credentials import auth_options, is_loopback
from jobprobe.core.wire import CLUSTER_TRACE, FRAMES, control_subject, host_port, token
from jobprobe.cluster import framecheck
from jobprobe.core.frame import NODE_JOB, MalformedFrame
from jobprobe.core.retry import Backoff
from jobprobe.cluster.store import Store
from jobprobe.cluster.stragglers import StragglerWatch

log = logging.getLogger("jobprobe.cluster.controller")

STREAM = "JOBPROBE"
SUBJECTS = "jobprobe.frames.>"
DURABLE = "controller"
BATCH = 512
LOST_AFTER = 3          # intervals of silence before a node is lost
LIVE_JOB_INTERVALS = 3  # a lost node's jobs named in node_lost: those seen this many intervals before its silence
MAX_FRAME = 1 << 20     # bytes; the server's max_payload too
MAX_INFLATED = 1 << 20  # bytes of msgpack a compressed frame may inflate to
FETCH_BYTES = 4 << 20   # bytes per fetch (≥ MAX_FRAME: the server never hands over a message larger than this)
MAX_RUNS = 10_000       # runs whose declared schema is kept (the oldest go first)
MAX_JOBS_PER_NODE = 4096
FORGET_NODE_S = 86400.0 # a node silent this long is forgotten (its node_lost was said long before)
CONTROLLER_RUN = "controller"   # the run of the controller's own events; no node's frame may claim it
REJECT_LOG_PER_MIN = 10
TRACE_LEAD_S = 3.0      # a cluster-wide trace starts this far ahead: every node has its request by then
TRACE_ASK_S = 5.0       # how long a node has to answer


@dataclass
class NodeState:
    interval: float = 1.0
    last: float = 0.0                     # when its last frame arrived (controller clock, UNIX s)
    lost: bool = False
    stopped: bool = False                 # its agent announced a clean stop (a heartbeat `stopping`): never lost
    heartbeats: int = 0                   # heartbeats received (not stored)
    jobs: dict[str, float] = field(default_factory=dict)   # job → when last seen
    live: set[str] = field(default_factory=set)            # jobs whose frames came since its last heartbeat
    lost_jobs: list[str] = field(default_factory=list)     # the jobs its node_lost named (its node_back names them)


class Controller:
    def __init__(self, store: Store, nats_url: str, retention_s: float = 7 * 86400, creds: str | None = None,
                 ca: str | None = None, replicas: int = 1, tsdb: str | None = None, prices: str | None = None):
        self.store, self.url, self.retention_s, self.creds, self.ca = store, nats_url, retention_s, creds, ca
        self.replicas = replicas      # copies of the stream on a JetStream cluster (3: survives a server's loss)
        self.nodes: dict[str, NodeState] = {}
        self._reject_window = [0.0, 0]          # (start, refused in it): what was logged this minute
        self.counts = {"stored": 0, "duplicates": 0, "rejected": 0, "consumer_errors": 0}
        self.consumer_errors: dict[str, int] = {}      # consumer (stragglers, cost, tsdb, freshness) → errors
        self.declared: dict[tuple, dict] = {}          # (node, job, run) → its hello's schema
        self.stop_event = asyncio.Event()
        self.stragglers = StragglerWatch()
        from jobprobe.cluster.cost import Meter, load as load_prices
        self.meter = Meter(load_prices(prices) if prices else None)     # per-job energy and cost, for --metrics
        self.tsdb = None
        if tsdb:
            from jobprobe.cluster.tsdb import VictoriaMetrics, schema_from_store
            if not tsdb.startswith("victoriametrics://"):
                raise BadInput(f"--tsdb {tsdb}: expected victoriametrics://HOST:PORT[/insert/TENANT/prometheus]")
            self.tsdb = VictoriaMetrics(tsdb, schema_from_store(store))

    # ---- one message -------------------------------------------------------------------------------------
    def check(self, subject: str, data: bytes) -> dict:
        """The frame in a message, or MalformedFrame saying why it is refused: inflated within MAX_INFLATED bytes,
        decoded within framecheck's bounds on objects, every value checked (framecheck.check, against the run's
        declared schema when its hello was seen), from the node its subject names, not claiming the controller's
        own run."""
        if len(data) > MAX_FRAME:
            raise MalformedFrame(f"{len(data)} bytes: larger than {MAX_FRAME}")
        if data[:1] == b"\x78":          # zlib (the agents' default); a msgpack map never starts with 0x78
            z = zlib.decompressobj()
            try:
                data = z.decompress(data, MAX_INFLATED + 1)
            except zlib.error as err:
                raise MalformedFrame(f"not a zlib stream: {err}") from err
            if len(data) > MAX_INFLATED or z.unconsumed_tail:
                raise MalformedFrame(f"inflates past {MAX_INFLATED} bytes")
        obj = framecheck.decode(data)
        key = (obj.get("node"), obj.get("job"), obj.get("run")) if isinstance(obj, dict) else None
        frame = framecheck.check(obj, self.declared.get(key) if key and all(isinstance(k, str) for k in key)
                                 else None)
        if not subject.startswith(FRAMES + ".") or _token_or_none(frame["node"]) != subject[len(FRAMES) + 1:]:
            raise MalformedFrame(f"node {frame['node'][:80]!r} on subject {subject[:120]!r}: a node publishes its "
                                 "own frames")
        if frame.get("run") == CONTROLLER_RUN:
            raise MalformedFrame("a node's frame claims the controller's run (its events are the controller's)")
        if frame["kind"] == "hello" and isinstance(frame.get("schema"), dict):
            self.declared.pop(key, None)
            self.declared[key] = frame["schema"]
            while len(self.declared) > MAX_RUNS:        # the oldest run's declarations go first
                self.declared.pop(next(iter(self.declared)))
        return frame

    def take(self, msgs: list[Any]) -> list[dict]:
        """Validate a batch; refuse what is not a frame. Returns the frames to store."""
        return [f for _, f in self._take(msgs)]

    def _take(self, msgs: list[Any]) -> list[tuple[Any, dict]]:
        """take(), with each frame's message: (message, frame)."""
        good = []
        for m in msgs:
            try:
                good.append((m, self.check(m.subject, m.data)))
            except MalformedFrame as err:
                node = m.subject[len(FRAMES) + 1:] if m.subject.startswith(FRAMES + ".") else None
                self.refuse(m.subject, node, str(err), len(m.data))
        return good

    def refuse(self, subject: str, node: str | None, why: str, size: int) -> None:
        """Count and record one refusal; the log says the first REJECT_LOG_PER_MIN of each minute."""
        self.counts["rejected"] += 1
        try:
            self.store.reject(subject[:200], node[:200] if node else None, why, size)
        except Exception as err:    # the store failing here must not stop the loop: the count and the log remain
            log.warning("could not record a refusal in the store: %s: %s", type(err).__name__, err)
        now = time.monotonic()
        if now - self._reject_window[0] > 60:
            if self._reject_window[1] > REJECT_LOG_PER_MIN:
                log.warning("… and %d more refused frames in that minute (all in rejects)",
                            self._reject_window[1] - REJECT_LOG_PER_MIN)
            self._reject_window = [now, 0]
        self._reject_window[1] += 1
        if self._reject_window[1] <= REJECT_LOG_PER_MIN:   # a flood of bad frames must not flood the log
            log.warning("refused a frame on %s: %s", subject[:200], why)

    def seen(self, frames: list[dict], now: float) -> list[dict]:
        """Freshness upkeep: any frame, a heartbeat included, says its node is alive; a heartbeat says that no job
        of it is attached (or, `stopping`, that its agent stopped cleanly: the node is then never lost, and its next
        frame ends the stop without a node_back). Returns the node_back events the frames call for."""
        out = []
        for f in frames:
            st = self.nodes.setdefault(f["node"], NodeState())
            beat = f["kind"] == "heartbeat"
            if f["kind"] in ("hello", "heartbeat") and isinstance(f.get("interval"), (int, float)) \
                    and f["interval"] > 0:
                st.interval = float(f["interval"])
            if st.lost:
                st.lost = False
                out += [self.node_event(f["node"], job, "node_back", now, silent_s=round(now - st.last, 3))
                        for job in st.lost_jobs]
                st.lost_jobs = []
                log.warning("node %s is back", f["node"])
            st.last = now
            st.stopped = beat and f.get("stopping") is True
            if beat:
                st.heartbeats += 1
                st.live.clear()         # its agent has no job attached: what it had ended
                continue
            st.jobs.pop(f["job"], None)
            st.jobs[f["job"]] = now
            st.live.add(f["job"])
            while len(st.jobs) > MAX_JOBS_PER_NODE:     # the least recently seen job goes first
                st.jobs.pop(next(iter(st.jobs)))
            if len(st.live) > len(st.jobs):             # jobs forgotten (forget(), the bound): not live either
                st.live &= st.jobs.keys()
        return out

    def lost_nodes(self, now: float) -> list[dict]:
        """node_lost for each node silent LOST_AFTER of its intervals (not one that announced its stop), once,
        per job live when it went silent (its frames came since its last heartbeat, within LIVE_JOB_INTERVALS of
        its last frame) — or, when none was, for the node itself (job "node")."""
        out = []
        for node, st in self.nodes.items():
            if not st.lost and not st.stopped and st.last and now - st.last > LOST_AFTER * st.interval:
                st.lost = True
                since = st.last - LIVE_JOB_INTERVALS * st.interval
                st.lost_jobs = [j for j in st.live if st.jobs.get(j, 0.0) >= since] or [NODE_JOB]
                out += [self.node_event(node, job, "node_lost", now, silent_s=round(now - st.last, 3))
                        for job in st.lost_jobs]
                log.warning("node %s lost: silent for %.1f s", node, now - st.last)
        return out

    def straggler_events(self, frames: list[dict], now: float) -> list[dict]:
        out = []
        for node, job, name, body in self.stragglers.feed(frames):
            log.warning("job %s: %s %s", job, name, body.get("reason", node))
            out.append(self.node_event(node, job, name, now, **body))
        return out

    def forget(self, now: float) -> None:
        """Bounded state: nodes silent for FORGET_NODE_S go, each node's jobs unseen for an hour, and the straggler
        tracks and declared schemas of jobs no node reports any more."""
        for node in [n for n, st in self.nodes.items() if now - st.last > FORGET_NODE_S]:
            del self.nodes[node]
        live = set()
        for st in self.nodes.values():
            st.jobs = {j: t for j, t in st.jobs.items() if now - t < 3600}
            live.update(st.jobs)
        self.stragglers.keep_only(live)
        for key in [k for k in self.declared if k[1] not in live]:
            del self.declared[key]

    def node_event(self, node: str, job: str, name: str, now: float, **body: Any) -> dict:
        return {"v": 1, "kind": "event", "node": node, "job": job, "run": CONTROLLER_RUN,
                "seq": self.store.next_controller_seq(node, job), "t": now, "dt": 0.0, "event": name, **body}

    # ---- the loop ----------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            import nats
        except ImportError:
            raise BadInput("the controller needs nats-py: pip install 'jobprobe[controller]'") from None

        async def said(err: Exception) -> None:   # the client's own reports: one line, not a traceback
            log.warning("nats: %s: %s", type(err).__name__, err)
        opts: dict[str, Any] = {"servers": [u.strip() for u in self.url.split(",")], "connect_timeout": 2,
                                "reconnect_time_wait": 0.5, "max_reconnect_attempts": -1, "name": "jobprobe-controller",
                                "error_cb": said}
        opts.update(auth_options(self.creds, self.ca))
        nc, sub = None, None
        backoff = Backoff(initial=0.5, maximum=5.0)
        while sub is None:   # a server still starting, a JetStream cluster still electing its leader: wait
            try:
                if nc is None:
                    nc = await nats.connect(**opts)
                sub = await (Puller(nc, STREAM, DURABLE).start() if await self._subscribe(nc) else None)
            except Exception as err:
                if self.stop_event.is_set():
                    return
                wait = backoff.next()
                log.warning("controller: %s: %s; trying again in %.1f s", type(err).__name__, err, wait)
                await asyncio.sleep(wait)
        async def on_trace(msg: Any) -> None:
            await self._on_trace(nc, msg)
        await nc.subscribe(CLUSTER_TRACE, cb=on_trace)
        log.warning("controller: consuming %s from %s into %s", SUBJECTS, self.url, self.store.path)
        await self._consume(nc, sub)

    # ---- a trace window on every node of a job -------------------------------------------------------------
    def nodes_of(self, job: str, now: float) -> list[str]:
        """The nodes that sent frames of `job` lately (within 30 s) and are not lost."""
        return sorted(n for n, st in self.nodes.items() if not st.lost and now - st.jobs.get(job, -1e18) < 30)

    async def cluster_trace(self, nc: Any, req: dict) -> dict:
        """Ask every node of the job to open a window at one common time `at` (default now + TRACE_LEAD_S, so
        that every request is there before it); each node's answer, or why it did not answer."""
        now = time.time()
        job, duration = req.get("job"), req.get("duration", 25.0)
        if not isinstance(job, str) or not job:
            return {"ok": False, "error": "give the job's name"}
        nodes = self.nodes_of(job, now)
        if not nodes:
            return {"ok": False, "error": f"no node has sent frames of job {job!r} in the last 30 s"}
        at = req.get("at")
        at = now + TRACE_LEAD_S if at is None else at
        if not isinstance(at, (int, float)) or at < now:
            return {"ok": False, "error": f"at {at!r} is past (now {now:.1f}): give a time ahead, or none"}
        ask = json.dumps({"cmd": "trace", "job": job, "duration": duration, "at": at}).encode()

        async def one(node: str) -> dict:
            try:
                msg = await nc.request(control_subject(node), ask, timeout=TRACE_ASK_S)
                return json.loads(msg.data)
            except Exception as err:          # no agent listening, a timeout: said per node
                return {"ok": False, "error": f"{type(err).__name__}: {err}"[:200]}
        answers = await asyncio.gather(*(one(n) for n in nodes))
        log.warning("job %s: trace at %.3f on %d nodes: %s", job, at, len(nodes),
                    {n: a.get("state") or a.get("error") for n, a in zip(nodes, answers)})
        return {"ok": any(a.get("ok") and a.get("state") in ("scheduled", "tracing") for a in answers),
                "job": job, "at": at, "duration_s": duration, "nodes": dict(zip(nodes, answers))}

    async def _on_trace(self, nc: Any, msg: Any) -> None:
        try:
            req = json.loads(msg.data)
            out = await self.cluster_trace(nc, req if isinstance(req, dict) else {})
        except ValueError as err:
            out = {"ok": False, "error": f"not JSON: {err}"}
        if msg.reply:
            await msg.respond(json.dumps(out).encode())

    async def _subscribe(self, nc: Any) -> bool:
        """The stream (made, or brought to this config) and the durable consumer on it (made when missing)."""
        from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
        from nats.js.errors import NotFoundError
        js = nc.jetstream()
        config = StreamConfig(name=STREAM, subjects=[SUBJECTS], duplicate_window=120.0, max_age=7 * 86400.0,
                              max_msg_size=MAX_FRAME, num_replicas=self.replicas)
        try:
            await js.stream_info(STREAM)
            await js.update_stream(config)
        except NotFoundError:
            await js.add_stream(config)
        consumer = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
                                  max_ack_pending=20 * BATCH, filter_subject=SUBJECTS)
        try:
            await js.consumer_info(STREAM, DURABLE)
        except NotFoundError:
            await js.add_consumer(STREAM, consumer)
        return True

    async def _consume(self, nc: Any, pull: "Puller") -> None:
        next_sweep = time.time() + 60
        while not self.stop_event.is_set():
            try:
                msgs = await pull.fetch(BATCH, FETCH_BYTES, timeout=0.5)
            except Exception as err:       # the server restarting: the client reconnects
                log.warning("fetch: %s: %s", type(err).__name__, err)
                await asyncio.sleep(0.5)
                msgs = []
            now = time.time()
            try:
                done = self.ingest(msgs, now)
            except StoreDown as err:       # nothing acked: the server delivers them again
                log.warning("the store refused a batch (%s); %d frames will be delivered again", err, len(msgs))
                for m in msgs:
                    await _quietly(m.nak(delay=1.0))
                await asyncio.sleep(1.0)
                continue
            for m in done:                 # only now: what is acked is in the store, or refused for good
                await _quietly(m.ack())
            if now > next_sweep:
                try:
                    self.store.forget_before(now - self.retention_s)
                except Exception as err:
                    log.warning("retention: %s: %s", type(err).__name__, err)
                self.forget(now)
                next_sweep = now + 60
        await nc.close()          # everything taken was acked; what was not is delivered again next time
        if self.tsdb is not None:
            self.tsdb.close()

    def ingest(self, msgs: list[Any], now: float) -> list[Any]:
        """One fetched batch: checked, fed to every consumer — each behind its own error boundary, so that one
        failing on a frame neither stops the loop nor the other consumers —, stored. Returns the messages to ack
        (all of them: stored, or refused for good). Raises StoreDown when the store cannot take anything (a full
        disk, a lock): then nothing is acked."""
        taken = self._take(msgs)
        frames = [f for _, f in taken]
        extra = self._guard("freshness", lambda: self.seen(frames, now) + self.lost_nodes(now), [])
        taken = [(m, f) for m, f in taken if f["kind"] != "heartbeat"]   # liveness only: not stored, acked
        frames = [f for _, f in taken]
        extra += self._guard("stragglers", lambda: self.straggler_events(frames, now), [])
        refused = self.store_frames(taken, extra, now)
        kept = [f for (m, f) in taken if id(m) not in refused]
        if self.tsdb is not None and kept:
            self._guard("tsdb", lambda: self.tsdb.add(kept), None)   # a copy for dashboards, queued
        for f in kept:
            self._guard("cost", lambda: self.meter.add(f), None, f)
        return list(msgs)

    def store_frames(self, taken: list[tuple[Any, dict]], extra: list[dict], now: float) -> set[int]:
        """The batch in one transaction; when it fails on a value, one frame at a time, refusing those the store
        will never take (ValueError, OverflowError, a constraint). Returns id()s of the refused messages."""
        if self._store_one([f for _, f in taken] + extra, now) is None:
            return set()
        log.warning("the store refused a batch: storing it frame by frame")
        refused: set[int] = set()
        for m, f in taken:
            err = self._store_one([f], now)
            if err is not None:
                refused.add(id(m))
                self.refuse(m.subject, f.get("node"), f"the store: {type(err).__name__}: {err}", len(m.data))
        for ev in extra:
            err = self._store_one([ev], now)
            if err is not None:
                log.warning("controller event %s of job %s not stored: %s", ev.get("event"), ev.get("job"), err)
        return refused

    def _store_one(self, frames: list[dict], now: float) -> Exception | None:
        """Store frames in one transaction: None, or the error of a value the store will not take. A database
        that cannot write at all (sqlite3.OperationalError: a full disk, a lock held too long) is not a frame's
        fault: StoreDown, and nothing is acked."""
        try:
            self._count(self.store.add(frames, received=now))
            return None
        except sqlite3.OperationalError as err:
            raise StoreDown(str(err)) from err
        except (ValueError, TypeError, OverflowError, sqlite3.Error) as err:
            return err

    def _count(self, result: tuple[int, int]) -> None:
        self.counts["stored"] += result[0]
        self.counts["duplicates"] += result[1]

    def _guard(self, consumer: str, fn: Any, default: Any, frame: dict | None = None) -> Any:
        """fn() behind consumer's own error boundary: an exception is counted (consumer_errors), logged like a
        refusal, and `default` returned; the other consumers and the loop go on."""
        try:
            return fn()
        except Exception as err:
            self.counts["consumer_errors"] += 1
            self.consumer_errors[consumer] = self.consumer_errors.get(consumer, 0) + 1
            subject = f"{FRAMES}.{_token_or_none(frame['node']) or '_'}" if frame else f"({consumer})"
            self.refuse(subject, frame.get("node") if frame else None, f"{consumer}: {type(err).__name__}: {err}", 0)
            return default


class StoreDown(Exception):
    """The store cannot take frames now (not the frames' fault): nothing is acked."""


async def _quietly(coro: Any) -> None:
    """An ack or nak: a connection lost meanwhile means the server delivers the message again (no loss)."""
    try:
        await coro
    except Exception as err:
        log.warning("ack: %s: %s", type(err).__name__, err)


def _token_or_none(node: str) -> str | None:
    try:
        return token(node)
    except ValueError:
        return None


class Puller:
    """Fetches from the durable pull consumer bounded in bytes as well as messages: a JetStream pull request
    ({"batch", "max_bytes", "expires"} on $JS.API.CONSUMER.MSG.NEXT) to an inbox of our own. nats-py's fetch asks
    for a count only, so a batch of 512 messages near max_payload would hold half a GiB."""

    def __init__(self, nc: Any, stream: str, durable: str):
        self.nc, self.subject = nc, f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = nc.new_inbox()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sub = None
        self.n = 0

    async def start(self) -> "Puller":
        async def got(msg: Any) -> None:
            self.queue.put_nowait(msg)
        self.sub = await self.nc.subscribe(f"{self.inbox}.*", cb=got)
        return self

    async def fetch(self, batch: int, max_bytes: int, timeout: float) -> list[Any]:
        """Up to `batch` messages and about `max_bytes` (the server stops before passing it), waiting at most
        `timeout` s. A message of an earlier request that came late is taken too (it is the consumer's next one)."""
        self.n += 1
        reply = f"{self.inbox}.{self.n}"
        req = {"batch": batch, "max_bytes": max_bytes, "expires": int(timeout * 1e9)}
        await self.nc.publish(self.subject, json.dumps(req).encode(), reply=reply)
        out: list[Any] = []
        end = time.monotonic() + timeout + 0.5
        while len(out) < batch:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                msg = await asyncio.wait_for(self.queue.get(), left)
            except asyncio.TimeoutError:
                break
            status = (msg.headers or {}).get("Status") if not msg.data else None
            if status:
                if msg.subject == reply and status != "100":   # 404 none, 408 expired, 409 limit reached: done
                    break
                continue
            out.append(msg)
        return out


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
        c = CounterMetricFamily("jobprobe_controller_consumer_errors", "frames a consumer (freshness, stragglers, "
                                "cost, tsdb) could not take; the others took them", labels=["consumer"])
        for consumer, n in list(ctl.consumer_errors.items()):
            c.add_metric([consumer], n)
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
        s = GaugeMetricFamily("jobprobe_straggler", "1 while the node is named the straggler of the job",
                              labels=["job", "node"])
        for job, node in ctl.stragglers.open():
            s.add_metric([job, node], 1)
        yield s
        n = CounterMetricFamily("jobprobe_stragglers_named", "straggler events since the controller started")
        n.add_metric([], ctl.stragglers.named)
        yield n
        e = CounterMetricFamily("jobprobe_job_energy_joules", "energy the job drew (CPU packages and DRAM by its CPU "
                                "share, GPUs by their share), from the samples stored since the controller started",
                                labels=["job"])
        for job, j in list(ctl.meter.energy.items()):
            e.add_metric([job], j)
        yield e
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


class LocalNats:
    """A nats-server with JetStream, our child, its data under `data_dir` (the controller's one-command mode).

    Authenticated always (natsauth: the controller's nkey and every enrolled node's, with their permissions); TLS
    with `tls_cert`/`tls_key`; on an address that is not loopback, refused without TLS unless `insecure_plaintext`.
    It dies with the controller (PR_SET_PDEATHSIG: a SIGKILLed controller leaves no server behind); a server of an
    earlier controller of this data directory (its pid file) is stopped first, and anything else listening on the
    port is refused, never used."""

    def __init__(self, data_dir: str | Path, listen: str = "127.0.0.1:4222", tls_cert: str | None = None,
                 tls_key: str | None = None, insecure_plaintext: bool = False):
        from jobprobe.transport.natsauth import Auth
        exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not os.path.exists(exe):
            raise BadInput("nats-server is not installed (Debian package nats-server; scripts/setup.sh installs it)")
        host, port = host_port(listen, "--listen")
        if bool(tls_cert) != bool(tls_key):
            raise BadInput("--tls-cert and --tls-key go together")
        if not tls_cert and not insecure_plaintext and not is_loopback(host):
            raise BadInput(f"--listen {listen}: not loopback, and no TLS: give --tls-cert/--tls-key (agents then "
                           "take --nats-ca), or --insecure-plaintext on a network you trust")
        for f in (tls_cert, tls_key):
            if f and not os.path.exists(f):
                raise BadInput(f"{f}: no such file")
        self.url = f"{'tls' if tls_cert else 'nats'}://{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{port}"
        self.data = Path(data_dir)
        self.data.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.data, 0o700)
        self.auth = Auth(self.data)
        self.creds = str(self.auth.controller_seed())
        self._stop_our_orphan()
        if _listening(host or "127.0.0.1", port):
            raise BadInput(f"--listen {listen}: something else listens there already; it is not this data "
                           "directory's nats-server (stop it, or give another --listen / --nats URL)")
        d = self.data / "nats"
        d.mkdir(exist_ok=True, mode=0o700)
        self.conf = self.data / "nats-server.conf"
        tls = (f'tls {{\n  cert_file: "{os.path.abspath(tls_cert)}"\n  key_file: "{os.path.abspath(tls_key)}"\n}}\n'
               if tls_cert else "")
        listen_at = f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"
        self.conf.write_text(f'listen: "{listen_at}"\nmax_payload: {MAX_FRAME}\n'
                             f'pid_file: "{self.data / "nats-server.pid"}"\n'
                             f'jetstream {{\n  store_dir: "{d}"\n}}\n{tls}include "auth.conf"\n')
        write_auth(self.data)
        os.chmod(self.conf, 0o600)
        self.log = open(os.open(self.data / "nats-server.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                0o600), "ab")
        self.proc = subprocess.Popen([exe, "-c", str(self.conf)], stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        self.host, self.port = host or "127.0.0.1", port

    def _stop_our_orphan(self) -> None:
        """A nats-server left by an earlier controller of this data directory (its pid file, its config) goes."""
        from jobprobe.transport.natsauth import server_pid
        pid = server_pid(self.data, self.data / "nats-server.conf")
        if pid is not None:
            log.warning("stopping the nats-server (pid %d) an earlier controller of %s left running", pid, self.data)
            os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
                time.sleep(0.05)

    def wait(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise BadInput(f"nats-server exited with code {self.proc.returncode} (see "
                               f"{self.data / 'nats-server.log'})")
            if _listening(self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1", self.port):
                return
            time.sleep(0.05)
        raise BadInput(f"nats-server did not listen on {self.url} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def write_auth(data_dir: str | Path) -> Path:
    """auth.conf from the enrolled nodes (included by the server's config; enroll rewrites it and reloads)."""
    from jobprobe.transport.natsauth import Auth, _write_secret
    path = Path(data_dir, "auth.conf")
    _write_secret(path, Auth(data_dir).server_config())
    return path


def _listening(host: str, port: int) -> bool:
    import socket
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the controller dies, however it dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


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
    _, rows = store.sql("SELECT COUNT(*) FROM rejects")
    unready = sorted(n for n, v in nodes.items() if (v.get("doctor") or {}).get("worst") == "fail")
    return {"t": now, "nodes": nodes, "rejected_total": rows[0][0], "unready_nodes": unready}
