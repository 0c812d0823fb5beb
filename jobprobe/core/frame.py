# SPDX-License-Identifier: Apache-2.0
"""Frames: one msgpack map per job per tick (schema v1, docs/FRAMES.md). Self-delimiting in a stream.

Every frame: v, kind, node, job, run (this agent run's id), seq (per node, job and run, from 0, no gaps), t (end of
interval, UNIX s), dt (s). (node, job, run, seq) is unique across agent restarts.
"""
from __future__ import annotations

import os
import time
from typing import IO, Any, Iterator

import msgpack

from jobprobe.core.errors import JobprobeError

SCHEMA_VERSION = 1
KINDS = ("hello", "sample", "event", "stacks", "trace", "heartbeat")
REQUIRED = {"v": int, "kind": str, "node": str, "job": str, "seq": int, "t": (int, float), "dt": (int, float)}
NODE_JOB = "node"   # the job of a node's own frames (its heartbeats), not one of its jobs
# absent in files written before the run id: such frames are valid, just not keyed by run
OPTIONAL = {"run": str, "labels": dict}


class MalformedFrame(JobprobeError):
    """Bytes that are not a valid frame. `offset` is where in the stream it starts."""

    def __init__(self, msg: str, offset: int | None = None):
        super().__init__(msg if offset is None else f"{msg} (at byte {offset})")
        self.offset = offset


def new_run_id() -> str:
    """16 hex digits, random: tells one agent run from another (a restart starts seq at 0 again)."""
    return os.urandom(8).hex()


class FrameBuilder:
    """Stamps frames for one node and job with one run id and consecutive seq numbers (from 0)."""

    def __init__(self, node: str, job: str, run: str | None = None):
        self.node, self.job, self.seq = node, job, 0
        self.run = run or new_run_id()
        self.labels: dict[str, str] = {}   # the scheduler's names for the job; in every frame when there are any

    def _frame(self, kind: str, t: float, dt: float, **body: Any) -> dict:
        f = {"v": SCHEMA_VERSION, "kind": kind, "node": self.node, "job": self.job, "run": self.run,
             "seq": self.seq, "t": round(t, 6), "dt": round(dt, 6), **body}
        if self.labels:
            f["labels"] = self.labels
        self.seq += 1
        return f

    def hello(self, **body: Any) -> dict:
        return self._frame("hello", time.time(), 0.0, **body)

    def sample(self, t: float, dt: float, probes: dict, status: dict, read_dt: dict | None = None,
               end: dict | None = None) -> dict:
        """read_dt: probe → seconds its counters cover (its last read to this one), where that is known; end: how
        the job ended, in its last frame (`why`, and `exit_code` or `signal` where known)."""
        return self._frame("sample", t, dt, probes=probes, status=status, **({"read_dt": read_dt} if read_dt else {}),
                           **({"end": end} if end else {}))

    def trace(self, t: float, **body: Any) -> dict:
        return self._frame("trace", t, 0.0, **body)

    def stacks(self, t: float, dt: float, **body: Any) -> dict:
        return self._frame("stacks", t, dt, **body)

    def event(self, t: float, name: str, **body: Any) -> dict:
        return self._frame("event", t, 0.0, event=name, **body)

    def heartbeat(self, t: float, interval: float, jobs: int, stopping: bool = False) -> dict:
        """The node's own liveness (job "node"): sent while no job's frames show it alive, and once at a clean
        stop (`stopping`), so that neither an idle node nor a stopped one is taken for lost."""
        return self._frame("heartbeat", t, 0.0, interval=interval, jobs=jobs, stopping=stopping)


def encode(frame: dict) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def validate(frame: Any, offset: int | None = None) -> dict:
    if not isinstance(frame, dict):
        raise MalformedFrame(f"not a frame: a msgpack {type(frame).__name__}, expected a map", offset)
    for key, typ in REQUIRED.items():
        if key not in frame:
            raise MalformedFrame(f"frame has no {key!r} field", offset)
        if not isinstance(frame[key], typ) or isinstance(frame[key], bool):
            raise MalformedFrame(f"frame field {key!r} has type {type(frame[key]).__name__}", offset)
    for key, typ in OPTIONAL.items():
        if key in frame and not isinstance(frame[key], typ):
            raise MalformedFrame(f"frame field {key!r} has type {type(frame[key]).__name__}", offset)
    if frame["kind"] not in KINDS:
        raise MalformedFrame(f"unknown frame kind {frame['kind']!r}", offset)
    return frame


def decode(data: bytes) -> dict:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as err:   # TypeError: a map as a map's key
        raise MalformedFrame(f"not msgpack: {err}") from err
    return validate(obj)


class StreamReader:
    """Iterate the frames of a stream. A last frame cut short (a writer killed mid-write, a file still being
    written) ends the iteration; `truncated` then holds how many bytes were left over at which offset."""

    def __init__(self, fp: IO[bytes], chunk: int = 1 << 16):
        self.fp, self.chunk = fp, chunk
        self.truncated: tuple[int, int] | None = None   # (offset, bytes left)
        self.count = 0

    def __iter__(self) -> Iterator[dict]:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=64 << 20)
        fed = end = 0   # end: where the last whole frame ended (tell() moves inside a partial one)
        while True:
            data = self.fp.read(self.chunk)
            if data:
                unpacker.feed(data)
                fed += len(data)
            while True:
                offset = end
                try:
                    obj = unpacker.unpack()
                except msgpack.OutOfData:
                    break
                except (ValueError, TypeError, msgpack.UnpackException) as err:   # TypeError: a map key that is a map
                    raise MalformedFrame(f"corrupt stream: {err}", offset) from err
                end = unpacker.tell()
                frame = validate(obj, offset)
                self.count += 1
                yield frame
            if not data:
                break
        if fed > end:
            self.truncated = (end, fed - end)
