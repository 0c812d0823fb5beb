# SPDX-License-Identifier: Apache-2.0
"""nats://HOST:PORT — frames to a NATS JetStream stream, through a bounded on-disk spool.

One NatsSink per agent, shared by its jobs (each job writes through its own `for_job()` handle, which keeps that
job's counters). A frame goes to subject `jobprobe.frames.<job token>.<node token>` (jobprobe/core/wire.py), the
node's heartbeat to `jobprobe.beat.<node token>`, each with header `Nats-Msg-Id: <node>/<job>/<run>/<seq>`,
its unique key: the server drops a resend inside its duplicate window, so publishing again after a lost ack stores
nothing twice.

A frame travels zlib-compressed (about half its msgpack size); the controller tells a compressed payload by its
first byte (0x78, zlib's header; a frame's msgpack map never starts so) and inflates it, bounded.

write() never touches the network: it appends the frame to the spool (exporters/spool.py: segment files under
`spool_dir`, a few MiB each, appended with one write(2)) and returns. A publisher thread sends what the spool
holds, in order, a window of
frames in flight at a time, and moves the spool's cursor past each frame only once the server has acked it (its
PubAck: the frame is in the stream). While the server cannot be reached, frames wait in the spool and go out in
order when it is back — also after the agent restarts (the spool and its cursor are on disk). When the spool passes
`max_bytes` its oldest segment goes: the frames in it that were never acked are lost, counted per job (`dropped`
in the self probe's sinks, and `jobprobe status`) and logged — never silent.

A frame the server can never take — larger than its `max_payload`, or refused by JetStream for good (larger than
the stream's maximum message size) — is counted lost the same way and skipped: it never holds up the frames behind
it. After a failure the publisher waits a jittered backoff (jobprobe/core/retry.py: a cluster's agents do not all come
back at one instant); when the server announces lame-duck mode it moves to the next server of its list at once.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

from jobprobe.core.frame import encode
from jobprobe.core.retry import Backoff
from jobprobe.core.wire import BEATS, beat_subject, frames_subject, inbox_prefix, msg_id
from jobprobe.exporters.spool import Spool
from jobprobe.transport.natswire import Wire

log = logging.getLogger("jobprobe.nats")

WINDOW = 256                         # frames published before their acks are awaited
COALESCE_S = 0.05                    # after a wake-up, the rest of the tick's frames are awaited this long
# A spool's backlog goes out at most this fast: half the controller's default per-node quota (cluster/quota.py),
# so that catching up after an outage is never refused there.
PACE_FRAMES_PER_S = 500.0
PACE_BYTES_PER_S = float(1 << 20)    # on the wire (zlib: ~2-3x less than the quota's inflated bytes)
PACE_BURST_S = 2.0


class NatsSink:
    def __init__(self, url: str, spool_dir: str | Path, max_bytes: int = 256 << 20, creds: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 name: str | None = None, compress: bool = True, allow_plaintext_password: bool = False,
                 node: str | None = None):
        self.url, self.name, self.compress = url, name or f"nats:{url}", compress
        # the credentials read (and refused, when malformed or sent in clear) now, on the agent's command line, not
        # in the thread
        self.wire = Wire(url, creds, tls_ca, tls_cert, tls_key, name=f"jobprobe-agent {node or os.uname().nodename}",
                         allow_plaintext_password=allow_plaintext_password,
                         inbox=inbox_prefix(node) if node else "_INBOX")
        self.backoff = Backoff(0.5, 5.0)
        self.paced_at = self.pace_frames = self.pace_bytes = 0.0     # _pace: a token bucket on the backlog
        self.ldm_said: str | None = None  # the lame-duck server already logged (one server: nowhere to move)
        self.spool = Spool(spool_dir, max_bytes)
        self.counts: dict[str, dict[str, int]] = {}      # job → queued, written (acked), errors
        self.state = "connecting"
        self.woken = False
        self.closing = threading.Event()
        self.wake = threading.Event()
        self.hurry = threading.Event()   # closing: the publisher tries now rather than after its backoff
        self.last_try_failed = False
        self.handler: Callable[[bytes], bytes] | None = None
        self.heartbeats_skipped = 0      # heartbeats not spooled: the last one was still waiting (heartbeat())
        self.beat_at = 0                 # the spool's `written` count with the last heartbeat spooled
        self.to_serve: list[str] = []    # subjects serve() was given: subscribed by the publisher's own thread
        self.thread = threading.Thread(target=self._run, name="nats", daemon=True)
        self.thread.start()

    def serve(self, subject: str, handler: Callable[[bytes], bytes]) -> None:
        """Answer requests on `subject` (the controller's, to this node) with handler(payload) → reply, in the
        publisher's thread: a handler must answer at once (it schedules; it does not wait). The subscription is made
        by that thread, which alone uses the connection (made here, it raced the thread's own connect: a refused
        login closed the socket under the SUB, and the agent died at start with EBADF)."""
        self.handler = handler
        self.to_serve.append(subject)
        self.wake.set()

    # ---- the agent's side --------------------------------------------------------------------------------
    def for_job(self, job: str) -> "JobHandle":
        return JobHandle(self, job)

    def write(self, frame: dict, data: bytes) -> None:
        job = frame["job"]
        c = self.counts.setdefault(job, {"queued": 0, "written": 0, "errors": 0})
        c["queued"] += 1
        if self.compress:    # ~2.1 KB of msgpack → ~1.1 KB: under 2 KiB/s per node at 1 s (docs/PERFORMANCE.md)
            data = zlib.compress(data, 6)
        self.spool.append(msg_id(frame), frames_subject(frame["node"], job), job, data,
                          keep=frame.get("kind") == "hello")
        if not self.woken:   # once per burst: the publisher takes what came meanwhile
            self.woken = True
            self.wake.set()

    def heartbeat(self, frame: dict) -> bool:
        """The node's heartbeat (kind `heartbeat`, subject `jobprobe.beat.<token>`), each tick: worth something only
        fresh, so while the last one still waits in the spool (an outage, a backlog) a new one is skipped, not
        spooled — a pile of stale heartbeats would only delay the frames: at most one waits. A `stopping` heartbeat
        is always spooled, after the jobs' last frames. Not in any job's counters. Returns whether it was spooled."""
        if not frame.get("stopping") and self.spool.settled < self.beat_at:
            self.heartbeats_skipped += 1
            return False
        data = encode(frame)
        if self.compress:
            data = zlib.compress(data, 6)
        self.beat_at = self.spool.append(msg_id(frame), beat_subject(frame["node"]), frame["job"], data)
        if not self.woken:
            self.woken = True
            self.wake.set()
        return True

    def job_stats(self, job: str) -> dict:
        c = self.counts.get(job, {"queued": 0, "written": 0, "errors": 0})
        with self.spool.lock:
            depth = sum(1 for r in self.spool.pending if r[5] == job)
            lost = self.spool.lost.get(job, 0)
        return {**c, "dropped": lost, "depth": depth, "in_flight": 0, "state": self.state}

    def close(self, timeout: float = 5.0) -> None:
        """Publish what the spool holds for up to `timeout` s, then stop; what is left stays in the spool for the
        next agent."""
        end = time.monotonic() + timeout
        if self.spool.depth() and self.state != "ok":
            self.last_try_failed = False
            self.hurry.set()             # one more try now (the server may be back), not after the backoff
            while not self.last_try_failed and self.state != "ok" and time.monotonic() < end:
                time.sleep(0.05)
        while self.spool.depth() and time.monotonic() < end and self.state == "ok":
            time.sleep(0.05)
        self.closing.set()
        self.wake.set()
        self.hurry.set()
        self.thread.join(timeout=max(1.0, end - time.monotonic()))
        self.spool.close()

    # ---- the publisher -----------------------------------------------------------------------------------
    def _run(self) -> None:
        """Connect (no reconnecting buffer of a client's own: the spool is the only buffer), send what the spool
        holds a window at a time, move its cursor past what the server acked (or can never take); on any failure
        close, wait (a jittered backoff), connect again, and send from the spool's cursor."""
        wire, connected, said = self.wire, False, None
        while not self.closing.is_set():
            try:
                if not connected:
                    wire.connect()
                    connected = True
                while self.to_serve:     # sent now, and at every connect from now on (Wire.subs)
                    wire.subscribe(self.to_serve.pop(0))
                self.wake.clear()
                self.woken = False       # before the take: a frame written after it wakes the wait below
                batch = self.spool.take(WINDOW)
                if not batch:
                    self.state = "ok"
                    if self.wake.wait(1.0):
                        # a tick writes one frame per job in a burst: gather it into one batch (one ack round,
                        # one cursor write) rather than waking per frame
                        time.sleep(COALESCE_S)
                    else:
                        wire.service()   # idle: the server's PINGs answered, a closed connection noticed
                    self._answer()
                    connected = self._stay(connected)
                    continue
                self._pace(batch)
                self._publish(batch)
                if wire.subs:
                    wire.service()       # a request that came with the acks, read now rather than next tick
                    self._answer()
                if said:
                    log.warning("nats %s: publishing again (%d frames waiting)", self.url, self.spool.depth())
                self.state, said = "ok", None
                self.backoff.reset()
                connected = self._stay(connected)
            except Exception as err:   # unreachable, no stream yet, a timeout: the frames wait in the spool
                kind = f"{type(err).__name__}: {err}"[:300]
                if wire.server_said and wire.server_said not in kind:
                    kind = f"{kind} (the server said {wire.server_said})"
                wire.server_said = None
                if kind != said:
                    log.warning("nats %s: %s; frames wait in the spool (%d now)", self.url, kind, self.spool.depth())
                said, self.state = kind, f"waiting: {type(err).__name__}"
                wire.close()
                connected = False
                self.last_try_failed = True
                self.hurry.wait(self.backoff.next())
        wire.close()

    def _pace(self, batch: list[tuple]) -> None:
        """Wait until the window may go at PACE_*: a backlog drains at the pace, a tick's frames go at once."""
        now = time.monotonic()
        fill = min(PACE_BURST_S, now - self.paced_at) if self.paced_at else PACE_BURST_S
        self.paced_at = now
        self.pace_frames = min(PACE_FRAMES_PER_S * PACE_BURST_S, self.pace_frames + fill * PACE_FRAMES_PER_S)
        self.pace_bytes = min(PACE_BYTES_PER_S * PACE_BURST_S, self.pace_bytes + fill * PACE_BYTES_PER_S)
        self.pace_frames -= len(batch)
        self.pace_bytes -= sum(len(rec[6]) for rec in batch)
        short = max(-self.pace_frames / PACE_FRAMES_PER_S, -self.pace_bytes / PACE_BYTES_PER_S, 0.0)
        if short:
            self.closing.wait(short)

    def _publish(self, batch: list[tuple]) -> None:
        """One window: the frames the server can take published and acked; those it never will (past its
        max_payload, or refused by JetStream for good) settled as lost, so that they hold up nothing behind them."""
        wire = self.wire
        fits = [rec for rec in batch if wire.fits(rec[3], rec[6])]
        acks = wire.publish([(subj, mid, data) for _, _, _, mid, subj, _, data, _ in fits], timeout=5,
                            optional=_is_beat) if fits else []
        refused = [(rec, ack["error"]) for rec, ack in zip(fits, acks) if "error" in ack]
        settled = {id(rec) for rec in fits} - {id(rec) for rec, _ in refused}
        lost = [rec for rec in batch if id(rec) not in settled]
        for rec in batch:
            c = self.counts.get(rec[5])
            if c is not None and id(rec) in settled:
                c["written"] += 1
        self.spool.acked(batch, lost)
        if lost:
            why = []
            if len(lost) > len(refused):
                why.append(f"{len(lost) - len(refused)} larger than the server's max_payload ({wire.max_payload} B)")
            if refused:
                e = refused[0][1]
                why.append(f"{len(refused)} refused by JetStream for good: "
                           f"{e.get('description', e) if isinstance(e, dict) else e}")
            log.warning("nats %s: %d frames the server cannot take were skipped (%s), %s first; counted lost "
                        "(the jobs' self.sink_dropped)", self.url, len(lost), "; ".join(why), lost[0][3])

    def _stay(self, connected: bool) -> bool:
        """Whether to keep this connection: not when its server announced lame-duck mode and another server is
        in the list — the publisher moves there now rather than when this one closes the connection. (With one
        server there is nowhere to go: the frames go on to it until it closes.)"""
        wire = self.wire
        if not (connected and wire.lame_duck):
            return connected
        if len(wire.servers) < 2:
            if wire.server_url != self.ldm_said:
                log.warning("nats %s: the server is going away (lame-duck mode); no other server to move to",
                            self.url)
                self.ldm_said = wire.server_url
            return connected
        log.warning("nats %s: %s is going away (lame-duck mode): moving to the next server", self.url,
                    wire.server_url)
        wire.leave()
        return False

    def _answer(self) -> None:
        reqs, self.wire.requests = self.wire.requests, []
        for subject, reply, data in reqs:
            try:
                out = self.handler(data) if self.handler else b'{"ok": false, "error": "no handler"}'
            except Exception as err:       # a bad request is answered, never fatal to the publisher
                log.warning("nats request on %s: %s", subject, err)
                out = json.dumps({"ok": False, "error": str(err)[:300]}).encode()
            if reply:
                self.wire.reply(reply, out)


class JobHandle:
    """One job's view of the shared NatsSink: write() through it, its own counters for the self probe; close() is
    a no-op (the agent closes the sink when it stops)."""

    def __init__(self, sink: NatsSink, job: str):
        self.sink, self.job = sink, job
        self.name = f"{sink.name}"

    def write(self, frame: dict, data: bytes) -> None:
        self.sink.write(frame, data)

    def stats(self) -> dict:
        return self.sink.job_stats(self.job)

    def close(self) -> None:
        self.sink.counts.pop(self.job, None)   # the job is gone; the spool still holds its frames until acked

    def __repr__(self) -> str:
        return f"JobHandle({self.sink.name}, {self.job})"


def _is_beat(subject: str) -> bool:
    """A heartbeat's subject: one no stream takes yet (no controller has made it) is dropped, never waited for."""
    return subject.startswith(BEATS + ".")
