"""A sink behind a bounded queue and a thread of its own: a slow or stuck sink never delays the tick.

`QueuedSink(inner, name, maxsize)` wraps any exporter (`write(frame, data)`, `close()`). `write()` only appends to a
bounded queue and returns at once; one worker thread per sink hands the frames to `inner.write` in order. Nothing
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

import errno
import logging
import threading
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


class QueuedSink:
    """`inner` behind a bounded queue of `maxsize` frames and one worker thread. Thread-safe; never blocks the
    caller of write(); close() waits at most `timeout` seconds."""

    def __init__(self, inner, name: str, maxsize: int = 1024):
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self.inner, self.name, self.maxsize = inner, name, maxsize
        self._cond = threading.Condition()
        self._q: deque[tuple[dict, bytes]] = deque()
        self._queued = self._written = self._dropped = self._errors = 0
        self._in_flight = False
        self._state = "ok"             # "ok" | "stopped: <why>" (inner is dead) | "closed"
        self._closing = False          # close() called: the worker drains the queue and ends
        self._abandoned = False        # close() timed out: the worker closes inner when its write returns
        self._worker_done = False
        self._logged: set[tuple[str, int | None]] = set()
        self._overflow_logged = False
        self._thread = threading.Thread(target=self._run, name=f"sink-{name}", daemon=True)
        self._thread.start()

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
            self._cond.notify()
            log_it = overflow and not self._overflow_logged
            self._overflow_logged |= overflow
        if log_it:
            log.warning("sink %s is %d frames behind: dropping its oldest frames (counted in self.sink_dropped; "
                        "not logged again)", self.name, self.maxsize)

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued within `timeout` seconds, then close the inner sink; what could not be flushed is
        counted as dropped. Idempotent; never raises."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout))
        with self._cond:
            unflushed = len(self._q) + (1 if self._in_flight else 0)
            self._dropped += unflushed
            self._q.clear()
            self._in_flight = False          # counted as dropped: whatever the worker does with it now
            if self._state == "ok":
                self._state = "closed"
            closer = self._worker_done       # else the worker closes inner when its stuck write returns
            self._abandoned = not closer
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

    # ---- the worker's side -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._closing:
                    self._cond.wait()
                if not self._q or self._abandoned:
                    break
                frame, data = self._q.popleft()
                self._in_flight = True
            err: Exception | None = None
            try:
                self.inner.write(frame, data)
            except Exception as e:   # a sink's failure is counted and reported, never raised into the tick
                err = e
            dead = dead_reason(err) if err is not None else None
            with self._cond:
                if self._abandoned:                  # close() gave up on this frame and counted it
                    break
                self._in_flight = False
                if err is None:
                    self._written += 1
                else:
                    self._errors += 1
                    if dead:
                        self._state = f"stopped: {dead}"
                        self._dropped += len(self._q)
                        self._q.clear()
            if err is not None:
                self._log_error(err, dead)
            if dead:
                break
        with self._cond:
            self._worker_done = True
            closer = self._abandoned
        if closer:
            self._close_inner()

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
