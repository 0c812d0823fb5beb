# SPDX-License-Identifier: Apache-2.0
"""The controller's JetStream side: its connection, its partition's stream and the durable pull consumer on it, the
lease that makes it its partition's active controller, and the loop that takes every frame once — fetch → check →
consume → commit → ack.

Agents publish each frame to `jobprobe.frames.<job>.<node>` (exporters/nats.py; jobprobe/core/wire.py). The stream
(JOBPROBE; JOBPROBE_P<I> for partition I, which keeps `jobprobe.part.I.frames.>`) keeps them (file storage, a 2-minute
duplicate window, frames kept until acked by the controller or a week old); the controller reads it through a
durable pull consumer in batches bounded in bytes as well as messages (Puller). Each batch goes to Controller.ingest
(jobprobe/cluster/controller.py: checked, fed to every consumer, committed to the store) and only then is acked. A
controller killed at any moment loses nothing (what was not acked is delivered again) and stores nothing twice (the
store's key is (node, job, run, seq)); a store that cannot write (StoreDown) gets nothing acked, and the batch comes
again.

Heartbeats (`jobprobe.beat.<node>`) go to the small JOBPROBE_BEATS stream (each node's newest one) so that an agent's
publish is acked (an agent drops a heartbeat no stream takes, never waits on it); every controller reads them as they
come through a plain subscription — liveness is worth something only fresh, and every partition needs every node's.

Only the holder of the partition's lease (jobprobe/cluster/lease.py) fetches; another controller of the partition
stands by, connected, and takes over from the durable consumer's position when the lease comes free. Both use the
partition's one store (the key makes a batch stored by the one and delivered again to the other a no-op). Taking
the lease, a controller writes its fencing token in the store before it fetches anything; a write of a controller
whose token is no longer the store's newest (paused past its lease, then woken) is refused (Fenced): it acks
nothing of that batch and stands by.

The same connection answers `jobprobe trace --job` requests for the jobs of its partition, while active
(jobprobe/cluster/trace.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Protocol

from jobprobe.cluster import trace
from jobprobe.cluster.lease import TRY_S, Lease
from jobprobe.cluster.store import Fenced
from jobprobe.core.errors import BadInput
from jobprobe.core.retry import Backoff
from jobprobe.core.wire import BEATS, CLUSTER_TRACE, FRAMES, PARTS, parse_subject
from jobprobe.transport.credentials import auth_options

log = logging.getLogger("jobprobe.cluster.ingest")

STREAM = "JOBPROBE"
SUBJECTS = f"{FRAMES}.>"
BEATS_STREAM = "JOBPROBE_BEATS"
DURABLE = "controller"
BATCH = 512
MAX_FRAME = 1 << 20     # bytes; the stream's max_msg_size and its nats-server's max_payload too
# A fetched frame not acked within this long is delivered again: what a killed controller had fetched reaches the
# one started after it then (a batch still being stored past it comes twice: the store's key makes that a no-op).
# 30 s held a restarted controller's store short of a killed one's last batch for that long.
ACK_WAIT_S = 10.0
FETCH_BYTES = 4 << 20   # bytes per fetch (≥ MAX_FRAME: the server never hands over a message larger than this)
MAX_BEATS_WAITING = 10_000    # nodes whose newest heartbeat is held between two batches (more: dropped, liveness only)
MAX_BEAT = 4096               # bytes: the largest heartbeat (the beats' stream's max_msg_size)


class Controller(Protocol):
    """What ingestion needs of the controller (jobprobe/cluster/controller.py's Controller is one), declared here:
    where the stream is and how to reach it, the state it shares with the loop, and what it does with a batch."""
    url: str                         # the NATS servers (comma-separated)
    creds: str | None                # its NATS credentials (nkey seed file)
    ca: str | None                   # the CA of the servers' TLS certificates
    part: tuple[int, int]            # the partition it takes (I, N)
    replicas: int                    # copies of the stream it makes
    stream_s: float                  # the stream's max_age
    raw_s: float                     # how long samples stay whole before compaction
    retention_s: float               # how long frames are kept
    stop_event: asyncio.Event        # set: the loop ends
    active: bool                     # holding the partition's lease (standing by: False)
    nc: Any                          # the NATS connection, set here
    store: Any                       # the store (cluster/store.py)
    tsdb: Any                        # the TSDB writer, or None
    nodes: dict[str, Any]            # node → its state (trace.NodeState)

    def ingest(self, msgs: list[Any], now: float, beats: list[Any] = ...) -> list[Any]: ...

    def reset(self) -> None: ...

    def refuse(self, subject: str, node: str | None, why: str, size: int, reason: str = ...,
               body: bytes = ..., now: float | None = ...) -> None: ...

    def owns_job(self, job: str) -> bool: ...

    def forget(self, now: float) -> None: ...


class StoreDown(Exception):
    """The store cannot take frames now (not the frames' fault): nothing is acked."""


def stream_of(part: tuple[int, int]) -> tuple[str, str]:
    """The stream and the subjects of partition (I, N)."""
    return (STREAM, SUBJECTS) if part[1] == 1 else (f"{STREAM}_P{part[0]}", f"{PARTS}.{part[0]}.frames.>")


async def serve(ctl: Controller) -> None:
    """Connect (waiting, with backoff, for a server still starting or a JetStream cluster still electing its leader),
    make the stream and the consumer, answer trace requests, and consume until ctl.stop_event is set."""
    try:
        import nats
    except ImportError:
        raise BadInput("the controller needs nats-py: pip install 'jobprobe[controller]'") from None

    async def said(err: Exception) -> None:
        client_error(ctl, err)
    opts: dict[str, Any] = {"servers": [u.strip() for u in ctl.url.split(",")], "connect_timeout": 2,
                            "reconnect_time_wait": 0.5, "max_reconnect_attempts": -1, "name": "jobprobe-controller",
                            "error_cb": said}
    opts.update(auth_options(ctl.creds, ctl.ca))
    nc, sub, lease = None, None, None
    stream, subjects = stream_of(ctl.part)
    backoff = Backoff(initial=0.5, maximum=5.0)
    while lease is None:   # a server still starting, a JetStream cluster still electing its leader: wait
        try:
            if nc is None:
                nc = ctl.nc = await nats.connect(**opts)
            if sub is None:
                sub = await (Puller(nc, stream, DURABLE).start() if await subscribe(
                    nc, ctl.replicas, stream, subjects, ctl.stream_s) else None)
            lease = Lease(nc.jetstream(), f"p{ctl.part[0]}", ctl.replicas)
            await lease.open()
        except Exception as err:
            lease = None
            if ctl.stop_event.is_set():
                return
            wait = backoff.next()
            log.warning("controller: %s: %s; trying again in %.1f s", type(err).__name__, err, wait)
            await asyncio.sleep(wait)

    async def on_trace(msg: Any) -> None:
        if ctl.active:
            await trace.answer(ctl.nodes, nc, msg, ctl.owns_job)
    beats: dict[str, Any] = {}

    async def on_beat(msg: Any) -> None:
        """A node's newest heartbeat is all liveness needs: kept until the next batch, one per subject. One larger
        than a heartbeat can be is refused before it is kept or decoded (a plain subscription: the beats' stream's
        max_msg_size does not bound what reaches it)."""
        if not ctl.active:
            return
        if len(msg.data) > MAX_BEAT:
            ctl.refuse(msg.subject, _node_of(msg.subject), f"a heartbeat of {len(msg.data)} bytes: larger than "
                       f"{MAX_BEAT}", len(msg.data), "quota_frame_size", msg.data[:64])
        elif msg.subject in beats or len(beats) < MAX_BEATS_WAITING:
            beats[msg.subject] = msg
    await nc.subscribe(CLUSTER_TRACE, cb=on_trace)
    await nc.subscribe(f"{BEATS}.>", cb=on_beat)
    log.warning("controller %d/%d: connected to %s (lease %s)", *ctl.part, ctl.url, lease.holder)
    try:
        await consume(ctl, nc, sub, lease, beats)
    finally:
        await lease.release()
        await nc.close()          # everything taken was acked; what was not is delivered again next time
        if ctl.tsdb is not None:
            ctl.tsdb.close()


async def subscribe(nc: Any, replicas: int, stream: str = STREAM, subjects: str = SUBJECTS,
                    max_age: float = 7 * 86400.0) -> bool:
    """The frames' stream (made, or brought to this config), the durable consumer on it (made when missing), and
    the heartbeats' stream."""
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
    from nats.js.errors import NotFoundError
    js = nc.jetstream()
    beats = StreamConfig(name=BEATS_STREAM, subjects=[f"{BEATS}.>"], duplicate_window=30.0, max_age=60.0,
                         max_msgs_per_subject=1, max_msg_size=MAX_BEAT, num_replicas=replicas)
    for config in (StreamConfig(name=stream, subjects=[subjects], duplicate_window=120.0, max_age=max_age,
                                max_msg_size=MAX_FRAME, num_replicas=replicas), beats):
        try:
            await js.stream_info(config.name)
            await js.update_stream(config)
        except NotFoundError:
            await js.add_stream(config)
    consumer = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
                              max_ack_pending=20 * BATCH, filter_subject=subjects)
    try:
        await js.consumer_info(stream, DURABLE)
    except NotFoundError:
        await js.add_consumer(stream, consumer)
    return True


async def consume(ctl: Controller, nc: Any, pull: "Puller", lease: Lease, beats: dict[str, Any]) -> None:
    """Batch after batch until ctl.stop_event, while the lease is ours: ctl.ingest, then the acks; once a minute,
    retention and forgetting. Without the lease: standing by, trying to take it every TRY_S."""
    next_sweep, next_compact, said = time.time(), time.time() + 10, False     # retention at once, then each minute
    swept = False
    while not ctl.stop_event.is_set():
        if not await lease.keep():
            if ctl.active:
                log.warning("controller %d/%d: the lease is lost: standing by", *ctl.part)
                ctl.active = False
            if not await lease.take():
                if not said:
                    log.warning("controller %d/%d: standing by (another controller holds the lease)", *ctl.part)
                    said = True
                try:
                    await asyncio.wait_for(ctl.stop_event.wait(), TRY_S)
                except asyncio.TimeoutError:
                    pass
                continue
            try:       # before anything is fetched: from now on the holder before us can write nothing
                ctl.store.take_fence(ctl.part[0], lease.token, lease.holder)
            except Exception as err:     # Fenced (a newer token there: not ours after all), a store that is down
                log.warning("controller %d/%d: the lease taken, but not the store's fence (%s: %s): standing by",
                            *ctl.part, type(err).__name__, err)
                await lease.release()
                await _stopped_or_after(ctl, TRY_S)
                continue
            ctl.reset()
            ctl.active, said = True, False
            log.warning("controller %d/%d: active: consuming %s into %s", *ctl.part, pull.subject.split(".")[-2],
                        ctl.store.path)
        try:
            msgs = await pull.fetch(BATCH, FETCH_BYTES, timeout=0.5)
        except Exception as err:       # the server restarting: the client reconnects
            log.warning("fetch: %s: %s", type(err).__name__, err)
            await asyncio.sleep(0.5)
            msgs = []
        now = time.time()
        got = list(beats.values())
        beats.clear()
        try:
            done = ctl.ingest(msgs, now, got)
        except Fenced as err:          # another controller holds the store now: nothing acked, and we stand by
            await _fenced(ctl, lease, err, msgs)
            continue
        except StoreDown as err:       # nothing acked: the server delivers them again
            log.warning("the store refused a batch (%s); %d frames will be delivered again", err, len(msgs))
            for m in msgs:
                await _quietly(m.nak(delay=1.0))
            await asyncio.sleep(1.0)
            continue
        for m in done:                 # only now: what is acked is in the store, or refused for good
            await _quietly(m.ack())
        if now > next_compact:     # samples past the raw window into blocks, a bounded step between batches
            try:
                next_compact = now + (0.0 if ctl.store.compact(now, ctl.raw_s) else 10.0)
            except Fenced as err:
                await _fenced(ctl, lease, err, [])
                continue
            except Exception as err:
                log.warning("compaction: %s: %s", type(err).__name__, err)
                next_compact = now + 60.0
        if now > next_sweep:
            try:
                gone = ctl.store.forget_before(now - ctl.retention_s)
                # said at the first sweep (at start) and whenever frames went; quiet otherwise
                (log.warning if gone or not swept else log.info)(
                    "controller %d/%d: retention swept: %d frames past %.0f s (by their time and when they came) "
                    "gone", *ctl.part, gone, ctl.retention_s)
                swept = True
            except Fenced as err:
                await _fenced(ctl, lease, err, [])
                continue
            except Exception as err:
                log.warning("retention: %s: %s", type(err).__name__, err)
            ctl.forget(now)
            next_sweep = now + 60


def client_error(ctl: Controller, err: Exception) -> None:
    """What the NATS client reports of itself (its error_cb): one line in the log, not a traceback — and a message
    it dropped, its subscription's queue full (a flood of 1 MiB heartbeats while the loop was busy), a refusal of
    the node's like any other, counted, never silent (a flood test lost 1 heartbeat of 567 so)."""
    from nats.errors import SlowConsumerError
    subject = getattr(err, "subject", None)
    if isinstance(err, SlowConsumerError) and isinstance(subject, str):
        ctl.refuse(subject, _node_of(subject), "dropped by the client: its subscription's queue was full", 0,
                   "slow_consumer")
        return
    log.warning("nats: %s: %s", type(err).__name__, err)


def _node_of(subject: str) -> str | None:
    try:
        return parse_subject(subject)[2]
    except ValueError:
        return None


async def _fenced(ctl: Controller, lease: Lease, err: Fenced, msgs: list[Any]) -> None:
    """A write refused by the store's fence: the lease is another's (we were paused past it). The batch goes back
    to the stream unacked (nak: the holder gets it at once, not after ACK_WAIT_S); we stand by."""
    log.warning("controller %d/%d: fenced: %s; %d frames left to the holder; standing by", *ctl.part, err, len(msgs))
    for m in msgs:
        await _quietly(m.nak())
    ctl.active = False
    lease.drop()


async def _stopped_or_after(ctl: Controller, seconds: float) -> None:
    try:
        await asyncio.wait_for(ctl.stop_event.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def _quietly(coro: Any) -> None:
    """An ack or nak: a connection lost meanwhile means the server delivers the message again (no loss)."""
    try:
        await coro
    except Exception as err:
        log.warning("ack: %s: %s", type(err).__name__, err)


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
