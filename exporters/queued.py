# SPDX-License-Identifier: Apache-2.0
"""A sink behind a bounded queue and a thread of its own: a slow or stuck sink never delays the tick.

`QueuedSink(inner, name, maxsize)` wraps any exporter (`write(frame, data)`, `close()`). `write()` only appends to a
bounded queue and returns at once; a worker thread hands the frames to `inner.write` in order — one per sink, or one
`SinkWorker` shared by several sinks (the agent's per-job files), taking their frames in turn. Nothing
is lost silently: every frame handed to `write()` ends in exactly one of the counters (`stats()`)

    queued == written + errors + dropped + depth + in_flight

and the `self` probe reports the per-interval deltas (`self.sink_dropped`, `self.sink_errors`, `self.sink_queue_max`,
`self.sinks`), which reach every sink that is still writing. What `close()` could not flush is logged when it ends.

What is dropped
- The queue is full (the sink has fallen `maxsize` frames behind): the OLDEST queued frame goes, the new one is
  kept. A sink that catches up then delivers the newest state of the job (what a person watching, or a rule, needs),
  not a minute-old backlog followed by a second gap; either way the reader sees one gap in `seq`, counted here.
- A hello frame is never the one evicted while another frame can go instead: a file rotates with the last hello it
  saw, and a stream without one cannot be decoded on its own. (Only a queue holding nothing but hellos loses one,
  the oldest.)
- The inner sink is dead — `inner.write` raised EPIPE (a reader that went away: `jobprobe run | head`), EBADF, or
  wrote to a closed file: the worker stops, what was queued and every later frame count as dropped, and `state`
  says why. Dead means it would fail for every frame from now on; any other error (ENOSPC, a timeout) costs that
  frame only (counted in `errors`), is logged once per kind of error (type and errno), and the sink goes on.
- `close(timeout)`: what is still queued, and the frame in flight, when the timeout ends are dropped. The worker is
  then abandoned (a daemon thread: it never holds the process up); `inner.close()` is called by whichever thread
  owns the inner sink at that moment — `close()` itself once the worker has finished, else the worker when its
  stuck write returns — so an exporter is never used by two threads at once and need not be thread-safe.
Frames written after `close()` count as dropped.

The frame dict is read on the worker thread, later: the caller must not change a frame (or the probe values in it)
once it has handed it to write(); `data`, the encoded bytes, is immutable.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import deque

log = logging.getLogger("jobprobe.sink")

# errno values after which every later write would fail too: the sink is dead, not having a bad moment.
DEAD_ERRNOS = frozenset({errno.EPIPE, errno.EBADF})


def dead_reason(err: BaseException) -> str | None:
    """Why `err` means the sink can never write again (a short phrase for `state`), or None."""
    if isinstance(err, OSError) and err.errno in DEAD_ERRNOS:
        return "broken pipe" if err.errno == errno.EPIPE else "bad file descriptor"
    if isinstance(err, ValueError) and "closed file" in str(err):   # io's "I/O operation on closed file."
        return "closed file"
    return None


class SinkWorker:
    """The thread that writes for one or more QueuedSinks: a frame at a time, taken round-robin from the sinks with
    frames waiting, so a busy sink does not starve the others. Its thread runs while it has sinks and ends with
    the last (a later sink starts a new one). One worker per sink is the default; the agent shares one among the
    per-job file sinks (`--out`), so 64 idle jobs wake one thread per tick, not 64. A sink stuck in its write holds
    up the others on its worker (never the tick): they queue, and drop their oldest, as if each were stuck."""

    def __init__(self, name: str):
        self.name = name
        self.cond = threading.Condition()
        self.sinks: list[QueuedSink] = []      # registered and not finished (a finished sink is never touched again)
        self.thread: threading.Thread | None = None
        self._next = 0
        self._held = 0        # hold() depth: writes queue without waking the thread

    @contextlib.contextmanager
    def hold(self):
        """Frames written inside are taken after it, with one wake-up, not once per sink: the agent's tick writes a
        frame for each of its jobs and the thread then writes them all in one go (a wake-up, and a hand-over of
        the interpreter between the two threads, per tick rather than per job). A sink being closed inside a
        hold (a job that ended in the tick) is flushed at once all the same."""
        with self.cond:
            self._held += 1
        try:
            yield
        finally:
            with self.cond:
                self._held -= 1
                if not self._held and any(s._q for s in self.sinks):
                    self.cond.notify_all()

    def add(self, sink: "QueuedSink") -> None:
        """Register `sink` (the caller holds `cond`)."""
        self.sinks.append(sink)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"sink-{self.name}", daemon=True)
            self.thread.start()

    def retire(self, sink: "QueuedSink") -> None:
        """`sink` gets no more frames from this worker (the caller holds `cond`)."""
        if sink in self.sinks:
            self.sinks.remove(sink)
        sink._worker_done = True
        self.cond.notify_all()

    def _pick(self) -> "QueuedSink | None":
        """The next sink with a frame to write, waiting for one; None when no sink is left (holds `cond`)."""
        while True:
            for s in [s for s in self.sinks if not s._q and (s._closing or s._state != "ok")]:
                self.retire(s)              # closing and flushed, or dead: finished
            if not self.sinks:
                return None
            n = len(self.sinks)
            for i in range(n):
                s = self.sinks[(self._next + i) % n]
                if s._q and (not self._held or s._closing):    # a close() inside a hold is not held up
                    self._next = (self._next + i + 1) % n
                    return s
            self.cond.wait()

    def _run(self) -> None:
        while True:
            with self.cond:
                sink = self._pick()
                if sink is None:
                    self.thread = None
                    return
                frame, data = sink._q.popleft()
                sink._in_flight = True
            err: Exception | None = None
            try:
                sink.inner.write(frame, data)
            except Exception as e:   # a sink's failure is counted and reported, never raised into the tick
                err = e
            dead = dead_reason(err) if err is not None else None
            closer = False
            with self.cond:
                if sink._abandoned:                  # close() gave up on this frame and counted it
                    self.retire(sink)
                    closer = True
                else:
                    sink._in_flight = False
                    if err is None:
                        sink._written += 1
                    else:
                        sink._errors += 1
                        if dead:
                            sink._state = f"stopped: {dead}"
                            sink._dropped += len(sink._q)
                            sink._q.clear()
                    self.cond.notify_all()           # a close() may wait for this sink's last frame
            if err is not None:
                sink._log_error(err, dead)
            if closer:
                sink._close_inner()


class QueuedSink:
    """`inner` behind a bounded queue of `maxsize` frames, written by a SinkWorker (its own unless `worker` is given).
    Thread-safe; never blocks the caller of write(); close() waits at most `timeout` seconds."""

    def __init__(self, inner, name: str, maxsize: int = 1024, worker: SinkWorker | None = None):
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self.inner, self.name, self.maxsize = inner, name, maxsize
        self.worker = worker or SinkWorker(name)
        self._cond = self.worker.cond
        self._q: deque[tuple[dict, bytes]] = deque()
        self._queued = self._written = self._dropped = self._errors = 0
        self._in_flight = False
        self._state = "ok"             # "ok" | "stopped: <why>" (inner is dead) | "closed"
        self._closing = False          # close() called: the worker drains the queue and finishes the sink
        self._abandoned = False        # close() timed out mid-write: the worker closes inner when its write returns
        self._worker_done = False      # the worker will not touch this sink again
        self._logged: set[tuple[str, int | None]] = set()
        self._overflow_logged = False
        with self._cond:
            self.worker.add(self)

    # ---- the caller's side (the tick) --------------------------------------------------------------------
    def write(self, frame: dict, data: bytes) -> None:
        """Queue one frame; never blocks, never raises."""
        hello = frame.get("kind") == "hello"
        overflow = False
        with self._cond:
            self._queued += 1
            if self._closing or self._state != "ok":
                self._dropped += 1
                return
            if len(self._q) >= self.maxsize:
                overflow = True
                # The oldest frame that is not a hello makes room (see the header for why oldest, why not hello).
                victim = next((i for i, (f, _) in enumerate(self._q) if f.get("kind") != "hello"), None)
                if victim is not None:
                    del self._q[victim]
                elif hello:
                    self._q.popleft()           # nothing but hellos queued: the oldest of them goes
                else:
                    self._dropped += 1          # nothing but hellos queued: they stay, this frame goes
                    return
                self._dropped += 1
            self._q.append((frame, data))
            if len(self._q) == 1 and not self.worker._held:
                self._cond.notify_all()         # the worker sleeps only when every queue is empty
            log_it = overflow and not self._overflow_logged
            self._overflow_logged |= overflow
        if log_it:
            log.warning("sink %s is %d frames behind: dropping its oldest frames (counted in self.sink_dropped; "
                        "not logged again)", self.name, self.maxsize)

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued within `timeout` seconds, then close the inner sink; what could not be flushed is
        counted as dropped. Idempotent; never raises."""
        end = time.monotonic() + max(0.0, timeout)
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
            while not self._worker_done:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            unflushed = len(self._q) + (1 if self._in_flight else 0)
            self._dropped += unflushed
            self._q.clear()
            if self._state == "ok":
                self._state = "closed"
            if self._in_flight:              # the worker is stuck in our write: it closes inner when it returns
                self._in_flight = False      # counted as dropped: whatever the worker does with it now
                self._abandoned = True
                closer = False
            else:                            # finished, or its worker is busy with another sink's write
                self.worker.retire(self)
                closer = True
            stats = self._stats_locked()
        if closer:
            self._close_inner()
        if unflushed:
            log.warning("sink %s: %d frames not written within %.3g s of closing, dropped", self.name, unflushed,
                        timeout)
        if stats["dropped"] or stats["errors"]:
            log.warning("sink %s closed: %d frames written, %d dropped, %d lost to errors", self.name,
                        stats["written"], stats["dropped"], stats["errors"])

    def stats(self) -> dict:
        """Counters since the sink was made (frames): queued (handed to write), written, errors (inner.write
        raised: that frame is lost), dropped (lost without a try: overflow, a dead sink, close), and now: depth
        (queued, not yet taken), in_flight (0/1, being written), state ("ok", "stopped: <why>", "closed")."""
        with self._cond:
            return self._stats_locked()

    def _stats_locked(self) -> dict:
        return {"queued": self._queued, "written": self._written, "dropped": self._dropped,
                "errors": self._errors, "depth": len(self._q), "in_flight": int(self._in_flight),
                "state": self._state}

    def _log_error(self, err: Exception, dead: str | None) -> None:
        kind = (type(err).__name__, getattr(err, "errno", None))
        if dead:
            log.error("sink %s stopped (%s: %s): its frames are dropped from now on, counted in self.sink_dropped",
                      self.name, kind[0], err)
        elif kind not in self._logged:   # once per kind: a full disk must not write a log line per frame
            self._logged.add(kind)
            log.error("sink %s: %s: %s — that frame is lost, the sink goes on (counted in self.sink_errors; "
                      "further %s not logged)", self.name, kind[0], err, kind[0])

    def _close_inner(self) -> None:
        try:
            self.inner.close()
        except Exception:
            log.exception("sink %s failed to close", self.name)

    def __repr__(self) -> str:
        return f"QueuedSink({self.name}: {self.inner!r})"


def sink_stats(sinks) -> dict[str, dict]:
    """{name: stats()} of every QueuedSink in `sinks`: what the self probe is given (SelfProbe(sinks=...))."""
    return {s.name: s.stats() for s in sinks if isinstance(s, QueuedSink) or hasattr(s, "stats")}
