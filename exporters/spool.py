# SPDX-License-Identifier: Apache-2.0
"""The NATS sink's on-disk spool: frames waiting for the server's ack, in segment files, with a cursor.

Records (msg id, subject, job, data, keep) are appended to segment files seg-<n> under the spool's directory, each
with one write(2); `cursor` holds the first record not yet acked. The bound (`max_bytes`) drops the oldest segment
not in flight, its frames counted lost per job. So does a write the disk refuses (ENOSPC): counted lost, said once a
minute at most, a short write taken back so that the segment holds whole records. The directory is the agent's
alone and every file in it is opened through jobprobe/core/safefile.py. How the sink uses it: exporters/nats.py.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

import msgpack

from jobprobe.core.safefile import Dir
from jobprobe.core.wire import FRAMES, job_token

log = logging.getLogger("jobprobe.nats")

SEGMENT_BYTES = 4 << 20
SAY_EVERY_S = 60.0                   # a disk that refuses writes: said at most this often, not once per frame


class Spool:
    """Records (msg id, subject, job, data, keep) appended to segment files seg-<n>; `cursor` holds the first record
    not yet acked (segment, offset). Thread-safe. A record marked `keep` (a run's hello: its schema and interval,
    without which the store cannot read the run) survives the bound: when its segment goes it is written again at
    the end, never counted lost."""

    def __init__(self, path: str | Path, max_bytes: int = 256 << 20, segment_bytes: int = SEGMENT_BYTES):
        self.dir = Path(path)
        self.d = Dir(str(path))              # ours alone, else UnsafeFile (the agent's start says it: exit 2)
        self.max_bytes, self.segment_bytes = max_bytes, min(segment_bytes, max(4096, max_bytes // 4))
        self.lock = threading.Lock()
        self.pending: deque[tuple] = deque()   # (seg, start, end, msg id, subject, job, data, keep), in order
        self.lost: dict[str, int] = {}
        self.inflight = 0         # the first `inflight` pending records were handed to the server, not yet acked
        self.written = self.settled = 0   # records appended and taken off `pending` (acked, lost, dropped): so far
        self.cut = 0              # records found cut short at a segment's end when loading (a crash, a full disk)
        self.cursor_errors = 0    # cursor writes the disk refused: nothing lost, those frames are sent again
        self.unsaid, self.said_at = 0, -SAY_EVERY_S   # frames the disk refused since the last line that said so
        self.segments: list[int] = sorted(int(n[4:]) for n in self.d.names() if n[:4] == "seg-" and n[4:].isdigit())
        try:
            self._load()
            self.seg = self.segments[-1] if self.segments else 0
            if not self.segments:
                self.segments = [0]
            self.fd = self.d.open(f"seg-{self.seg}", os.O_WRONLY | os.O_APPEND)
        except BaseException:
            self.d.close()
            raise
        self.size = os.fstat(self.fd).st_size

    def _load(self) -> None:
        """What a previous agent left unacked: every record from the cursor on (a record cut short by a crash, at
        a segment's end, is skipped)."""
        try:
            seg0, off0 = (int(x) for x in (self.d.read("cursor") or b"").split())
        except (OSError, ValueError):
            seg0, off0 = (self.segments[0] if self.segments else 0), 0
        for seg in [s for s in self.segments if s >= seg0]:
            data = self.d.read(f"seg-{seg}") or b""
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(data)
            pos = 0
            try:
                for rec in unpacker:
                    end = unpacker.tell()
                    if (seg, pos) >= (seg0, off0) and isinstance(rec, list) and len(rec) in (4, 5):
                        rec[1] = _upgraded(rec[1], rec[2])
                        self.pending.append((seg, pos, end, *rec[:4], bool(rec[4]) if len(rec) == 5 else False))
                    pos = end
                if pos < len(data) and (seg, pos) >= (seg0, off0):
                    self._cut_at(seg, pos, data[pos:])
            except (ValueError, msgpack.UnpackException):
                log.warning("spool %s: segment %d damaged after byte %d; the rest of it is skipped", self.dir, seg,
                            pos)
        for seg in [s for s in self.segments if s < seg0]:
            self.d.unlink(f"seg-{seg}")
        self.segments = [s for s in self.segments if s >= seg0]

    def _cut_at(self, seg: int, pos: int, tail: bytes) -> None:
        """A record cut short at the end of segment `seg` (a crash mid-write, a short write not taken back): skipped,
        counted (`cut`, and lost for its job where what is left names it); cut off the last segment, which the
        next records are appended to — after the cut part they would be read as its rest."""
        self.cut += 1
        job = _job_of(tail)
        if job is not None:
            self.lost[job] = self.lost.get(job, 0) + 1
        if seg == self.segments[-1]:
            fd = self.d.open(f"seg-{seg}", os.O_WRONLY, create=False)
            try:
                os.ftruncate(fd, pos)
            finally:
                os.close(fd)
        log.warning("spool %s: segment %d ends in a record cut short at byte %d (a crash or a full disk): skipped, "
                    "counted lost (the job's self.sink_dropped)", self.dir, seg, pos)

    def append(self, mid: str, subject: str, job: str, data: bytes, keep: bool = False) -> int:
        """The record appended; its number (`written` after it: pending until `settled` reaches it)."""
        with self.lock:
            self._write(mid, subject, job, data, keep)
            n = self.written
            while len(self.segments) > 1 and self._bytes() > self.max_bytes and self._drop_oldest():
                pass
            return n

    def _write(self, mid: str, subject: str, job: str, data: bytes, keep: bool) -> bool:
        """One record at the end of the current segment (a new one past segment_bytes); False if the disk did not
        take it whole (ENOSPC, EIO, a short write): counted lost for its job. Under the lock."""
        rec = msgpack.packb([mid, subject, job, data, keep], use_bin_type=True)
        try:
            if self.fd < 0 or self.size and self.size + len(rec) > self.segment_bytes:
                self._next_segment()
            n = os.write(self.fd, rec)
        except OSError as err:
            return self._refused(job, err.strerror or str(err))
        if n != len(rec):
            try:      # taken back: the segment ends with a whole record again, and the next one lands after it
                os.ftruncate(self.fd, self.size)
            except OSError:   # cannot: the next record starts a new segment; the reader skips this cut one
                os.close(self.fd)
                self.fd = -1
            return self._refused(job, f"a short write, {n} of {len(rec)} bytes")
        self.written += 1
        self.pending.append((self.seg, self.size, self.size + len(rec), mid, subject, job, data, keep))
        self.size += len(rec)
        return True

    def _next_segment(self) -> None:
        """The current segment closed and the next one made; if that fails, fd stays -1 and the next write tries
        again."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        fd = self.d.open(f"seg-{self.seg + 1}", os.O_WRONLY | os.O_APPEND)
        self.seg += 1
        self.segments.append(self.seg)
        self.fd, self.size = fd, os.fstat(fd).st_size

    def _refused(self, job: str, why: str) -> bool:
        """A record the disk did not take: lost, counted for its job (self.sink_dropped); said at the first and
        then at most once every SAY_EVERY_S, with how many went since — a full disk is not a line per frame."""
        self.lost[job] = self.lost.get(job, 0) + 1
        self.unsaid += 1
        now = time.monotonic()
        if now - self.said_at >= SAY_EVERY_S:
            log.error("spool %s: cannot write (%s): %d frame(s) dropped since this was last said, counted in the "
                      "jobs' self.sink_dropped (said at most once a minute)", self.dir, why, self.unsaid)
            self.unsaid, self.said_at = 0, now
        return False

    def _bytes(self) -> int:
        return (len(self.segments) - 1) * self.segment_bytes + self.size

    def _drop_oldest(self) -> bool:
        """Make room: the oldest segment that holds no frame already handed to the server goes (a frame in flight
        may be in the stream already: dropping it could count as lost a frame that arrives). Its frames are
        counted lost, per job. False if there is none to drop (the bound is then passed by what is in flight)."""
        busy = {rec[0] for rec in itertools.islice(self.pending, self.inflight)}
        seg = next((s for s in self.segments if s not in busy and s != self.seg), None)
        if seg is None:
            return False
        self.segments.remove(seg)
        rest, again, n = deque(), [], 0
        for rec in self.pending:
            if rec[0] != seg:
                rest.append(rec)
                continue
            self.settled += 1
            if rec[7]:
                again.append(rec)               # a hello: written again at the end, not lost
            else:
                self.lost[rec[5]] = self.lost.get(rec[5], 0) + 1
                n += 1
        self.pending = rest
        self.d.unlink(f"seg-{seg}")
        for rec in again:
            self._write(*rec[3:8])
        if n:
            log.warning("spool %s is full (%d KiB): %d frames never sent were dropped, the oldest (counted in the "
                        "jobs' self.sink_dropped)", self.dir, self.max_bytes >> 10, n)
        return True

    def take(self, n: int) -> list[tuple]:
        """The first n records, to send: now marked in flight (until acked; after a failure they stay so, since
        the server may hold them)."""
        with self.lock:
            out = list(itertools.islice(self.pending, n))
            self.inflight = max(self.inflight, len(out))
            return out

    def peek(self, n: int) -> list[tuple]:
        with self.lock:
            return list(itertools.islice(self.pending, n))

    def acked(self, recs: list[tuple], lost: list[tuple] = ()) -> None:
        """These records (the first ones pending, in order) are settled — in the stream, or, those in `lost`, never
        to be (the server cannot take them: counted lost, per job): move the cursor past them."""
        lost_ids = {id(rec) for rec in lost}
        with self.lock:
            for rec in recs:
                if self.pending and self.pending[0] is rec:
                    self.pending.popleft()
                    self.settled += 1
                    self.inflight = max(0, self.inflight - 1)
                    if id(rec) in lost_ids:
                        self.lost[rec[5]] = self.lost.get(rec[5], 0) + 1
            seg, off = self.pending[0][:2] if self.pending else (self.seg, self.size)
            try:
                self.d.write_atomic("cursor", f"{seg} {off}\n".encode())      # 0600, like every file here
            except OSError as err:
                # a full disk: the cursor stays behind, so after a restart these frames go again — the stream and
                # the store keep each once (its message id, its key): counted, nothing lost; the segments before it
                # stay until a cursor write succeeds
                self.cursor_errors += 1
                if self.cursor_errors == 1 or self.cursor_errors % 1000 == 0:
                    log.warning("spool %s: the cursor could not be written (%s): %d times; its frames would be sent "
                                "again after a restart", self.dir, err.strerror, self.cursor_errors)
                return
            while len(self.segments) > 1 and self.segments[0] < seg:
                self.d.unlink(f"seg-{self.segments.pop(0)}")

    def depth(self) -> int:
        return len(self.pending)

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.d.close()


def _upgraded(subject: str, job: str) -> str:
    """A record spooled by an agent of before frames carried their job in the subject (`jobprobe.frames.<node>`):
    its subject now (`jobprobe.frames.<job>.<node>`), so that a stream takes it."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) == 3 and subject.startswith(FRAMES + ".") and isinstance(job, str) and job:
        return f"{FRAMES}.{job_token(job)}.{parts[2]}"
    return subject


def _job_of(tail: bytes) -> str | None:
    """The job of a record cut short, where its first three fields (msg id, subject, job) are whole."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(tail)
    try:
        if unpacker.read_array_header() not in (4, 5):
            return None
        job = [unpacker.unpack() for _ in range(3)][2]
    except (ValueError, msgpack.UnpackException):
        return None
    return job if isinstance(job, str) else None
