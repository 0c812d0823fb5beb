"""The NATS sink's on-disk spool: frames waiting for the server's ack, in segment files, with a cursor.

Records (msg id, subject, job, data, keep) are appended to segment files seg-<n> under the spool's directory, each
with one write(2); `cursor` holds the first record not yet acked. The bound (`max_bytes`) drops the oldest segment
not in flight, its frames counted lost per job. How the sink uses it: exporters/nats.py.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from pathlib import Path

import msgpack

from jobprobe.core.wire import FRAMES, job_token

log = logging.getLogger("jobprobe.nats")

SEGMENT_BYTES = 4 << 20


class Spool:
    """Records (msg id, subject, job, data, keep) appended to segment files seg-<n>; `cursor` holds the first record
    not yet acked (segment, offset). Thread-safe. A record marked `keep` (a run's hello: its schema and interval,
    without which the store cannot read the run) survives the bound: when its segment goes it is written again at
    the end, never counted lost."""

    def __init__(self, path: str | Path, max_bytes: int = 256 << 20, segment_bytes: int = SEGMENT_BYTES):
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes, self.segment_bytes = max_bytes, min(segment_bytes, max(4096, max_bytes // 4))
        self.lock = threading.Lock()
        self.pending: deque[tuple] = deque()   # (seg, start, end, msg id, subject, job, data, keep), in order
        self.lost: dict[str, int] = {}
        self.inflight = 0         # the first `inflight` pending records were handed to the server, not yet acked
        self.written = self.settled = 0   # records appended and taken off `pending` (acked, lost, dropped): so far
        self.segments: list[int] = sorted(int(p.name[4:]) for p in self.dir.glob("seg-*") if p.name[4:].isdigit())
        self._load()
        self.seg = self.segments[-1] if self.segments else 0
        if not self.segments:
            self.segments = [0]
        self.fd = os.open(self.dir / f"seg-{self.seg}", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size

    def _load(self) -> None:
        """What a previous agent left unacked: every record from the cursor on (a record cut short by a crash, at
        a segment's end, is skipped)."""
        try:
            seg0, off0 = (int(x) for x in (self.dir / "cursor").read_text().split())
        except (OSError, ValueError):
            seg0, off0 = (self.segments[0] if self.segments else 0), 0
        for seg in [s for s in self.segments if s >= seg0]:
            data = (self.dir / f"seg-{seg}").read_bytes()
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
            except (ValueError, msgpack.UnpackException):
                log.warning("spool %s: segment %d damaged after byte %d; the rest of it is skipped", self.dir, seg,
                            pos)
        for seg in [s for s in self.segments if s < seg0]:
            (self.dir / f"seg-{seg}").unlink(missing_ok=True)
        self.segments = [s for s in self.segments if s >= seg0]

    def append(self, mid: str, subject: str, job: str, data: bytes, keep: bool = False) -> int:
        """The record appended; its number (`written` after it: pending until `settled` reaches it)."""
        with self.lock:
            self._write(mid, subject, job, data, keep)
            n = self.written
            while len(self.segments) > 1 and self._bytes() > self.max_bytes and self._drop_oldest():
                pass
            return n

    def _write(self, mid: str, subject: str, job: str, data: bytes, keep: bool) -> None:
        """One record at the end of the current segment (a new one past segment_bytes). Under the lock."""
        rec = msgpack.packb([mid, subject, job, data, keep], use_bin_type=True)
        if self.size and self.size + len(rec) > self.segment_bytes:
            os.close(self.fd)
            self.seg += 1
            self.segments.append(self.seg)
            self.fd = os.open(self.dir / f"seg-{self.seg}", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                              0o600)
            self.size = 0
        os.write(self.fd, rec)
        self.written += 1
        self.pending.append((self.seg, self.size, self.size + len(rec), mid, subject, job, data, keep))
        self.size += len(rec)

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
        (self.dir / f"seg-{seg}").unlink(missing_ok=True)
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
            tmp = self.dir / "cursor.tmp"
            tmp.write_text(f"{seg} {off}\n")
            os.replace(tmp, self.dir / "cursor")
            while len(self.segments) > 1 and self.segments[0] < seg:
                (self.dir / f"seg-{self.segments.pop(0)}").unlink(missing_ok=True)

    def depth(self) -> int:
        return len(self.pending)

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def _upgraded(subject: str, job: str) -> str:
    """A record spooled by an agent of before frames carried their job in the subject (`jobprobe.frames.<node>`):
    its subject now (`jobprobe.frames.<job>.<node>`), so that a stream takes it."""
    parts = subject.split(".") if isinstance(subject, str) else []
    if len(parts) == 3 and subject.startswith(FRAMES + ".") and isinstance(job, str) and job:
        return f"{FRAMES}.{job_token(job)}.{parts[2]}"
    return subject
