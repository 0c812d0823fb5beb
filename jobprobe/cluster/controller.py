# SPDX-License-Identifier: Apache-2.0
"""`jobprobe controller`: what is done with each frame of every node — checked, fed to each consumer, stored.

The frames come from NATS JetStream in batches (jobprobe/cluster/ingest.py: fetch → Controller.ingest → ack);
Controller.ingest is everything between. Every message is hostile until checked (jobprobe/cluster/framecheck.py:
decoding bounded in objects, every value against the declared types); a frame that is not valid is refused, counted
and logged (`rejects`), and acked: it will never become valid. Each consumer of frames (freshness, stragglers, the
cost meter, the TSDB writer, the store) has its own error boundary: one failing on a frame neither stops the loop
nor the others (docs/SECURITY.md). A store that cannot write at all raises StoreDown: nothing of the batch is acked.
A store whose fence says another controller holds the lease now raises Fenced (jobprobe/cluster/store.py): nothing
is stored or acked, and the controller stands by (ingest.py).

Freshness: per node, when its newest frame or heartbeat arrived. Every agent sends a `heartbeat` each tick on its
node's beat subject (read by every controller, used for freshness only, never stored), saying how many jobs it has
attached, and one marked `stopping` when it stops cleanly: liveness does not depend on having jobs, nor on which
partition a job's frames go to, and a stopped node is not lost. A node silent for 3 of its intervals (and not
stopped) gets a `node_lost` event for each job of this controller's partition live when it went silent — or, when
none was, one of job `node` from the controller whose partition owns the node (`owns_node`); its next frame or
heartbeat a `node_back`.

Partitions (`--partition I/N`, jobprobe/core/wire.py): the server maps each frame by its job's token to one of N
partitions; this controller takes partition I's frames, all of every job in it.

Elsewhere in jobprobe/cluster/: trace.py answers `jobprobe trace --job` across the nodes, natsserver.py runs the
controller's own nats-server when no --nats is given, metrics.py gives the controller's numbers (--metrics, `stats`).
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

from jobprobe.cluster import framecheck
from jobprobe.cluster.clocks import Clocks
from jobprobe.cluster.ingest import StoreDown, serve
from jobprobe.cluster.nodes import SUSPECT_JOBS, SUSPECT_WINDOW_S, Suspects
from jobprobe.cluster.quota import Limits, Quotas
from jobprobe.cluster.refusals import Refusals, WrongSubject, inflate
from jobprobe.cluster.store import Store
from jobprobe.cluster.stragglers import StragglerWatch
from jobprobe.cluster.summary import MIN_SAMPLES, JobEnds, job_frames, summarize
from jobprobe.core.errors import BadInput
from jobprobe.core.frame import NODE_JOB, MalformedFrame
from jobprobe.core.wire import job_token, parse_subject, partition, token

log = logging.getLogger("jobprobe.cluster.controller")

LOST_AFTER = 3          # intervals of silence before a node is lost
LIVE_JOB_INTERVALS = 3  # a lost node's jobs named in node_lost: those seen this many intervals before its silence
MAX_RUNS = 10_000       # runs whose declared schema is kept (the oldest go first)
MAX_JOBS_PER_NODE = 4096
FORGET_NODE_S = 86400.0 # a node silent this long is forgotten (its node_lost was said long before)
CONTROLLER_RUN = "controller"   # the run of the controller's own events; no node's frame may claim it
SUMMARY_MAX_SAMPLES = 50_000    # samples the controller reads for a summary event, inline (0.65 s per 10^4 here)


@dataclass
class NodeState:
    interval: float = 1.0
    last: float = 0.0                     # when its last frame arrived (controller clock, UNIX s)
    lost: float = 0.0                     # when it was lost (controller clock); 0: it is not
    stopped: bool = False                 # its agent announced a clean stop (a heartbeat `stopping`): never lost
    heartbeats: int = 0                   # heartbeats received (not stored)
    beat_jobs: int = 0                    # the jobs its agent had attached, as its last heartbeat said
    jobs: dict[str, float] = field(default_factory=dict)   # job → when last seen
    live: set[str] = field(default_factory=set)            # jobs whose frames came since its last heartbeat
    lost_jobs: list[str] = field(default_factory=list)     # the jobs its node_lost named (its node_back names them)


class Controller:
    """The controller's state and what it does with each batch of frames (the module's docstring); run() takes
    them from the stream."""

    def __init__(self, store: Store, nats_url: str, retention_s: float = 7 * 86400, creds: str | None = None,
                 ca: str | None = None, replicas: int = 1, tsdb: str | None = None, prices: str | None = None,
                 part: tuple[int, int] = (0, 1), raw_s: float = 600.0, stream_s: float = 7 * 86400.0,
                 limits: Limits | None = None, suspect_jobs: int = SUSPECT_JOBS,
                 suspect_window_s: float = SUSPECT_WINDOW_S):
        self.store, self.url, self.retention_s, self.creds, self.ca = store, nats_url, retention_s, creds, ca
        if not (isinstance(part, tuple) and len(part) == 2 and 0 <= part[0] < part[1] <= 1024):
            raise BadInput(f"partition {part!r}: expected I/N, 0 ≤ I < N ≤ 1024")
        self.part = part              # (I, N): this controller takes partition I of N (N = 1: every frame)
        self.stream_s = stream_s      # how long the stream keeps a frame the controller has not taken (max_age)
        self.raw_s = raw_s            # samples kept whole as JSON this long, then compacted (cluster/compact.py)
        self.active = False           # it holds its partition's lease (jobprobe/cluster/lease.py): it consumes
        self.replicas = replicas      # copies of the stream on a JetStream cluster (3: survives a server's loss)
        self.nodes: dict[str, NodeState] = {}
        self.quotas = Quotas(limits)
        self.refusals = Refusals()
        self.clocks = Clocks()
        self.ended_by: dict[tuple, int] = {}   # jobs summarized since the start, by (cause, failed) (/metrics)
        self.suspects = Suspects(store, suspect_jobs, suspect_window_s)   # nodes named in job after job
        self._given: dict[tuple[str, str], int] = {}   # (node, job) → the last seq an event of this batch took
        self.refused_by: dict[str, int] = {}           # reason → refusals (a handful of reasons: bounded)
        self.counts = {"stored": 0, "duplicates": 0, "rejected": 0, "consumer_errors": 0}
        self.consumer_errors: dict[str, int] = {}      # consumer (stragglers, cost, tsdb, freshness) → errors
        self.declared: dict[tuple, dict] = {}          # (node, job, run) → its hello's schema
        self.stop_event = asyncio.Event()
        self.nc: Any = None           # its NATS connection, once made (ingest.serve): /metrics' nats_up
        self.server: Any = None       # the nats-server it runs and supervises (natsserver.LocalNats; no --nats)
        self.reset()
        from jobprobe.cluster.cost import Meter
        from jobprobe.cluster.cost import load as load_prices
        self.meter = Meter(load_prices(prices) if prices else None)     # per-job energy and cost, for --metrics
        self.tsdb = None
        if tsdb:
            from jobprobe.cluster.tsdb import VictoriaMetrics, schema_from_store
            if not tsdb.startswith("victoriametrics://"):
                raise BadInput(f"--tsdb {tsdb}: expected victoriametrics://HOST:PORT[/insert/TENANT/prometheus]")
            self.tsdb = VictoriaMetrics(tsdb, schema_from_store(store))

    def reset(self) -> None:
        """What the controller knows of the nodes, forgotten: at start, and when it becomes its partition's active
        controller (what it knew while standing by is stale: its nodes would all seem silent)."""
        self.nodes.clear()
        self.declared.clear()
        self.stragglers = StragglerWatch()
        self.ends = JobEnds()                  # when each job's last node let it go: its `summary` event
        self.clocks = Clocks()

    def owns_job(self, job: str) -> bool:
        """Whether the job's frames come to this controller's partition."""
        return self.part[1] == 1 or partition(job_token(job), self.part[1]) == self.part[0]

    def owns_node(self, node: str) -> bool:
        """Whether this controller says a node with no job of its partition is lost (one controller per node)."""
        return self.part[1] == 1 or partition(token(node), self.part[1]) == self.part[0]

    # ---- one message -------------------------------------------------------------------------------------
    def check(self, subject: str, data: bytes) -> dict:
        """The frame in a message, or MalformedFrame saying why it is refused: inflated within MAX_INFLATED bytes,
        decoded within framecheck's bounds on objects, every value checked (framecheck.check, against the run's
        declared schema when its hello was seen), on its own subject (_subject_fits), not claiming the
        controller's own run."""
        return self._check(subject, inflate(data))

    def _check(self, subject: str, data: bytes) -> dict:
        """check(), of a message's msgpack (inflated)."""
        obj = framecheck.decode(data)
        key = (obj.get("node"), obj.get("job"), obj.get("run")) if isinstance(obj, dict) else None
        frame = framecheck.check(obj, self.declared.get(key) if key and all(isinstance(k, str) for k in key)
                                 else None)
        self._subject_fits(subject, frame)
        if frame.get("run") == CONTROLLER_RUN:
            raise MalformedFrame("a node's frame claims the controller's run (its events are the controller's)")
        if frame["kind"] == "hello" and isinstance(frame.get("schema"), dict):
            self.declared.pop(key, None)
            self.declared[key] = frame["schema"]
            while len(self.declared) > MAX_RUNS:        # the oldest run's declarations go first
                self.declared.pop(next(iter(self.declared)))
        return frame

    def _subject_fits(self, subject: str, frame: dict) -> None:
        """MalformedFrame unless the subject is the frame's own: its node's (a node publishes its own frames), its
        job's (the job decides the partition), in this controller's partition; a heartbeat on the beat subject and
        nothing else there."""
        try:
            part, job_tok, node_tok = parse_subject(subject)
        except ValueError as err:
            raise WrongSubject(str(err)) from None
        if _token_or_none(frame["node"]) != node_tok:
            raise WrongSubject(f"node {frame['node'][:80]!r} on subject {subject[:120]!r}: a node publishes its "
                                 "own frames")
        if (job_tok is None) != (frame["kind"] == "heartbeat"):
            raise WrongSubject(f"a {frame['kind']} on subject {subject[:120]!r}: heartbeats, and only they, go "
                                 "on the beat subject")
        if job_tok is None:
            return
        if job_token(frame["job"]) != job_tok:
            raise WrongSubject(f"job {frame['job'][:80]!r} on subject {subject[:120]!r}: a frame goes on its "
                                 "job's subject")
        if (part is not None) if self.part[1] == 1 else (part != self.part[0] or not self.owns_job(frame["job"])):
            raise WrongSubject(f"subject {subject[:120]!r} is not partition {self.part[0]}/{self.part[1]}'s, or "
                                 "not its job's partition")

    def take(self, msgs: list[Any], now: float | None = None) -> list[dict]:
        """Validate a batch; refuse what is not a frame (recorded in the store at once). Returns the frames to
        store."""
        good = [f for _, f in self._take(msgs, time.time() if now is None else now)]
        self.flush_refusals()
        return good

    def _take(self, msgs: list[Any], now: float) -> list[tuple[Any, dict]]:
        """take(), with each frame's message: (message, frame). Each message's node (its subject's) must have the
        quota for it before it is decoded (jobprobe/cluster/quota.py); what it inflates to beyond its size is
        charged to the node too."""
        good = []
        for m in msgs:
            try:
                _, job, node = parse_subject(m.subject)
            except ValueError as err:
                self.refuse(m.subject, None, str(err), len(m.data), "subject", m.data, now)
                continue
            over = self.quotas.admit(node, job, len(m.data), now)
            if over:
                self.refuse(m.subject, node, f"over the node's quota ({over[6:]})", len(m.data), over, m.data, now)
                continue
            try:
                data = inflate(m.data)
                self.quotas.charge(node, len(data) - len(m.data))
                good.append((m, self._check(m.subject, data)))
            except MalformedFrame as err:
                kind = "subject" if isinstance(err, WrongSubject) else "malformed"
                self.refuse(m.subject, node, str(err), len(m.data), kind, m.data, now)
        return good

    def refuse(self, subject: str, node: str | None, why: str, size: int, reason: str = "malformed",
               body: bytes = b"", now: float | None = None) -> None:
        """Count one refusal (reason: its kind) and keep it until the batch's end (flush_refusals)."""
        self.counts["rejected"] += 1
        self.refused_by[reason] = self.refused_by.get(reason, 0) + 1
        self.refusals.add(node or "", reason, subject, why, size, body, time.time() if now is None else now)

    def flush_refusals(self) -> None:
        """The batch's refusals into the store, one transaction (a flood of them is one write, not one each)."""
        counts, kept = self.refusals.take()
        if not counts:
            return
        try:
            self.store.reject(counts, kept)
        except Exception as err:    # the store failing here must not stop the loop: the count and the log remain
            log.warning("could not record %d refusals in the store: %s: %s", sum(c[0] for c in counts.values()),
                        type(err).__name__, err)

    def seen(self, frames: list[dict], now: float) -> list[dict]:
        """Freshness upkeep: any frame, a heartbeat included, says its node is alive; a heartbeat with no job
        attached ends what the node had live, one `stopping` says its agent stopped cleanly (the node is then never
        lost, and its next heartbeat or a new run's hello ends the stop without a node_back; a job's other frames do
        not: the last ones of a stopped agent may come after its stop, through the stream). Returns the node_back
        events the frames call for."""
        out = []
        for f in frames:
            st = self.nodes.setdefault(f["node"], NodeState())
            beat = f["kind"] == "heartbeat"
            if f["kind"] in ("hello", "heartbeat") and isinstance(f.get("interval"), (int, float)) \
                    and f["interval"] > 0:
                st.interval = float(f["interval"])
            if st.lost:
                st.lost = 0.0
                out += [self.node_event(f["node"], job, "node_back", now, silent_s=round(now - st.last, 3))
                        for job in st.lost_jobs]
                st.lost_jobs = []
                log.warning("node %s is back", f["node"])
            st.last = now
            if beat:
                st.stopped = f.get("stopping") is True
                st.heartbeats += 1
                st.beat_jobs = f.get("jobs") or 0
                if not f.get("jobs"):
                    st.live.clear()     # its agent has no job attached: what it had ended
                continue
            if f["kind"] == "hello":
                st.stopped = False      # a run begins: an agent (re)started
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
        its last frame) — or, when none was, for the node itself (job "node"), by the controller that owns it, when
        its agent had no job attached (with jobs, their partitions' controllers name it)."""
        out = []
        for node, st in self.nodes.items():
            if not st.lost and not st.stopped and st.last and now - st.last > LOST_AFTER * st.interval:
                st.lost = now
                since = st.last - LIVE_JOB_INTERVALS * st.interval
                st.lost_jobs = [j for j in st.live if st.jobs.get(j, 0.0) >= since] or \
                    ([NODE_JOB] if self.owns_node(node) and (self.part[1] == 1 or not st.beat_jobs) else [])
                out += [self.node_event(node, job, "node_lost", now, silent_s=round(now - st.last, 3))
                        for job in st.lost_jobs]
                if st.lost_jobs:
                    log.warning("node %s lost: silent for %.1f s", node, now - st.last)
        return out

    def straggler_events(self, frames: list[dict], now: float) -> list[dict]:
        out = []
        for node, job, name, body in self.stragglers.feed(frames):
            log.warning("job %s: %s %s", job, name, body.get("reason", node))
            out.append(self.node_event(node, job, name, now, body))
            suspect = self.suspects.check(node, job, now) if name == "straggler" else None
            if suspect is not None:        # named in job after job: the node's own record (cluster/nodes.py)
                log.warning("node %s: %s", node, suspect["reason"])
                out.append(self.node_event(node, job, "node_suspect", now, suspect))
        return out

    def summaries(self, frames: list[dict], now: float) -> list[dict]:
        """A `summary` event (jobprobe/cluster/summary.py) for each job whose last node let it go: every node that
        sent its samples still heard from, none sending one of it for END_AFTER of its intervals."""
        self.ends.saw(frames, now)

        def alive(node: str) -> bool:     # heard from, or lost in an earlier batch (its node_lost is stored)
            st = self.nodes.get(node)
            return st is not None and (0 < st.lost < now or not st.lost and now - st.last <= LOST_AFTER * st.interval)
        ended = self.ends.ended(now, alive, lambda n: self.nodes[n].interval)
        # a job summarized before (its summary kept) whose samples came again is summarized again, whole
        out = [ev for job in ended if self.ends.samples.get(job, 0) >= MIN_SAMPLES or job in self.ends.done
               for ev in self._summary(job, now)]
        self.end_jobs(ended)
        return out

    def _summary(self, job: str, now: float) -> list[dict]:
        """The ended job's `summary` event (none for a job with no node's samples)."""
        first = min(self.ends.seen.get(job) or [NODE_JOB])     # the event's node: the job's first by name
        n = self.store.count_samples(job)
        if n > SUMMARY_MAX_SAMPLES:     # read inline, between two batches: a bound on the pause it makes
            log.info("job %s ended: %d samples, over the %d the controller sums inline", job, n,
                     SUMMARY_MAX_SAMPLES)
            return [self.node_event(first, job, "summary", now,
                                    {"skipped": f"{n} samples: run `jobprobe summary --store`"})]
        s = summarize(job_frames(self.store, job), job)
        if not s["nodes"]:
            return []
        self.ends.keep(job, s)
        kind = (s["ended"]["cause"], str(not s["ended"]["ok"]).lower()) if s.get("ended") else ("unknown", "false")
        self.ended_by[kind] = self.ended_by.get(kind, 0) + 1
        log.info("job %s ended (%s): %.0f s, goodput %.0f%%", job, (s.get("ended") or {}).get("how", "how unknown"),
                 s["wall_s"], 100 * s["goodput"])
        return [self.node_event(first, job, "summary", now, {k: v for k, v in s.items() if k != "job"})]

    def end_jobs(self, jobs: list[str]) -> None:
        """Jobs that ended let go of what the controller held for them — their straggler tracks, their ends'
        bookkeeping, their runs' declared schemas, their place among each node's jobs, their energy once the newest
        KEEP_ENDED ended jobs' are enough — so a month of short jobs costs what the live ones do (a frame of one that
        comes later starts them again). Their summaries stay (summary.KEEP newest). One pass a batch, not a job."""
        if not jobs:
            return
        for job in jobs:
            self.stragglers.jobs.pop(job, None)
            self.ends.seen.pop(job, None)
            self.ends.samples.pop(job, None)
            self.meter.end(job)
        gone = set(jobs)
        for key in [k for k in self.declared if k[1] in gone]:
            del self.declared[key]
        for st in self.nodes.values():
            for job in gone & st.jobs.keys():
                del st.jobs[job]
            st.live -= gone

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
        self.ends.forget(live)
        for key in [k for k in self.declared if k[1] not in live]:
            del self.declared[key]
        self.clocks.forget(set(self.nodes))

    def node_event(self, node: str, job: str, name: str, now: float, body: dict | None = None, **fields: Any) -> dict:
        """An event of the controller's own about `node`: `body` and `fields` under the frame's keys, which win (a
        body may name the node again, as `imbalance`'s `node` does)."""
        # two events of one (node, job) in a batch (node_back and a summary) must not share a seq: the second would
        # be stored as the first's duplicate — the store has neither yet
        seq = max(self.store.next_controller_seq(node, job), self._given.get((node, job), -1) + 1)
        self._given[(node, job)] = seq
        return {**(body or {}), **fields, "v": 1, "kind": "event", "node": node, "job": job, "run": CONTROLLER_RUN,
                "seq": seq, "t": now, "dt": 0.0, "event": name}

    # ---- the loop ----------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Consume the stream until stop_event is set (jobprobe/cluster/ingest.py)."""
        await serve(self)

    def ingest(self, msgs: list[Any], now: float, beats: list[Any] = ()) -> list[Any]:
        """One fetched batch, and the heartbeats that came meanwhile: checked, fed to every consumer — each behind
        its own error boundary, so that one failing on a frame neither stops the loop nor the other consumers —,
        stored. Returns the messages to ack (all of `msgs`: stored, or refused for good). Raises StoreDown when the
        store cannot take anything (a full disk, a lock): then nothing is acked."""
        self._given.clear()
        taken = self._take(list(beats) + list(msgs), now)
        frames = [f for _, f in taken]
        extra = self._guard("freshness", lambda: self.seen(frames, now) + self.lost_nodes(now), [])
        extra += self._guard("clocks", lambda: [self.node_event(n, j, e, now, b)        # a clock off, or back
                                                for n, j, e, b in self.clocks.feed(taken, now)], [])
        taken = [(m, f) for m, f in taken if f["kind"] != "heartbeat"]   # liveness only: not stored, acked
        frames = [f for _, f in taken]
        extra += self._guard("stragglers", lambda: self.straggler_events(frames, now), [])
        extra += self._guard("summaries", lambda: self.summaries(frames, now), [])
        refused = self.store_frames(taken, extra, now)
        kept = [f for (m, f) in taken if id(m) not in refused]
        if self.tsdb is not None and kept:
            self._guard("tsdb", lambda: self.tsdb.add(kept), None)   # a copy for dashboards, queued
        for f in kept:
            self._guard("cost", lambda: self.meter.add(f), None, f)
        self.flush_refusals()
        return list(msgs)

    def store_frames(self, taken: list[tuple[Any, dict]], extra: list[dict], now: float) -> set[int]:
        """The batch in one transaction; when it fails on a value, one frame at a time, refusing those the store
        will never take (ValueError, OverflowError, a constraint). Returns id()s of the refused messages."""
        if self._store_one([f for _, f in taken] + extra, now, own=len(extra)) is None:
            return set()
        log.warning("the store refused a batch: storing it frame by frame")
        refused: set[int] = set()
        for m, f in taken:
            err = self._store_one([f], now)
            if err is not None:
                refused.add(id(m))
                self.refuse(m.subject, f.get("node"), f"the store: {type(err).__name__}: {err}", len(m.data),
                            "store", m.data, now)
        for ev in extra:
            err = self._store_one([ev], now, own=1)
            if err is not None:
                log.warning("controller event %s of job %s not stored: %s", ev.get("event"), ev.get("job"), err)
        return refused

    def _store_one(self, frames: list[dict], now: float, own: int = 0) -> Exception | None:
        """Store frames in one transaction: None, or the error of a value the store will not take. A database
        that cannot write at all (sqlite3.OperationalError: a full disk, a lock held too long) is not a frame's
        fault: StoreDown, and nothing is acked. `own`: how many of them are the controller's own events (always
        new: their seq is the controller's), which the counts of nodes' frames leave out."""
        try:
            stored, dups = self.store.add(frames, received=now)
            self._count((stored - own, dups))
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
            subject = f"(node {frame['node'][:80]!r}, job {frame['job'][:80]!r})" if frame else f"({consumer})"
            self.refuse(subject, frame.get("node") if frame else None, f"{consumer}: {type(err).__name__}: {err}", 0,
                        f"consumer_{consumer}")
            return default


def _token_or_none(node: str) -> str | None:
    try:
        return token(node)
    except ValueError:
        return None
