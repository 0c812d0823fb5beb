# SPDX-License-Identifier: Apache-2.0
"""Per-node quotas at the controller: what one node may send, judged from the message alone, before decoding.

A node over its quota has the excess refused, counted per node and reason, and acked — the other nodes' frames are
neither delayed nor dropped. The node is named by its subject (jobprobe/core/wire.py), which the NATS server
lets only that node publish on when it authenticates them. Quotas, and why each default is what it is
(docs/SECURITY.md, "A node that floods"):
- frames/s and bytes/s: token buckets holding BURST_S seconds of their rate. The agent's publisher paces a spool
  replay under half of each (exporters/nats.py PACE_*), so an honest node catching up is never refused.
- live jobs: distinct jobs with frames within LIVE_JOB_S; a frame of one job more is refused (a node attaches at most
  64 at once; the default leaves room for a job started every second).
- the largest frame, in bytes on the wire.
Memory: per node ~0.5 KiB plus ~120 B per live job; MAX_NODES nodes at most, the least recently seen forgotten
first: ≤ ~70 MiB at MAX_NODES with every node at its job cap, ~2 MiB for a thousand honest nodes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

from jobprobe.core.errors import BadInput

BURST_S = 5.0
LIVE_JOB_S = 600.0
MAX_NODES = 65536


@dataclass(frozen=True)
class Limits:
    frames_per_s: float = 1000.0       # a node of 64 jobs at 1 s sends ~70 (a sample each, events, stacks)
    bytes_per_s: float = 4 << 20       # …~0.3 MiB/s of them (docs/PERFORMANCE.md); a 1 MiB frame is the largest
    live_jobs: int = 512
    max_frame: int = 1 << 20           # the stream's max_msg_size (cluster/ingest.py MAX_FRAME)

    @classmethod
    def parse(cls, items: list[str] | None) -> "Limits":
        """Limits from NAME=VALUE strings (`jobprobe controller --quota frames_per_s=2000`); a bad one: BadInput."""
        known = {f.name: f.type for f in fields(cls)}
        given: dict[str, float] = {}
        for item in items or []:
            name, _, value = item.partition("=")
            if name not in known:
                raise BadInput(f"--quota {item}: expected NAME=VALUE, NAME one of {', '.join(known)}")
            try:
                v = float(value)
            except ValueError:
                raise BadInput(f"--quota {item}: {value!r} is not a number") from None
            if not v > 0 or v == float("inf"):
                raise BadInput(f"--quota {item}: a positive number")
            given[name] = int(v) if known[name] in ("int", int) else v
        return cls(**given)


class Bucket:
    """A token bucket: `rate` tokens a second, holding at most `burst`; starts full."""
    __slots__ = ("rate", "burst", "level", "t")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.level, self.t = rate, burst, burst, now

    def holds(self, n: float, now: float) -> bool:
        """Whether n tokens are there now (refilled to `now`); take them with charge()."""
        if now > self.t:
            self.level = min(self.burst, self.level + (now - self.t) * self.rate)
            self.t = now
        return self.level >= n

    def charge(self, n: float) -> None:
        """Take n tokens; may go below zero (a frame that inflated past its wire size), which the next frames pay
        for."""
        self.level -= n


class NodeQuota:
    __slots__ = ("frames", "bytes", "jobs")

    def __init__(self, limits: Limits, now: float):
        self.frames = Bucket(limits.frames_per_s, limits.frames_per_s * BURST_S, now)
        self.bytes = Bucket(limits.bytes_per_s, limits.bytes_per_s * BURST_S, now)
        self.jobs: OrderedDict[str, float] = OrderedDict()    # job token → last frame, oldest first


class Quotas:
    """Every node's quota. admit() is the door: the reason a message is refused, or None."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.nodes: OrderedDict[str, NodeQuota] = OrderedDict()   # least recently seen first

    def admit(self, node: str, job: str | None, size: int, now: float) -> str | None:
        """Whether a message of `size` bytes from `node` (its subject's token) for `job` (its job token; None for
        a heartbeat) may be decoded. A refusal takes nothing from the node's buckets."""
        lim = self.limits
        if size > lim.max_frame:
            return "quota_frame_size"
        q = self.nodes.get(node)
        if q is None:
            q = self.nodes[node] = NodeQuota(lim, now)
            while len(self.nodes) > MAX_NODES:
                self.nodes.popitem(last=False)
        else:
            self.nodes.move_to_end(node)
        if job is not None and job not in q.jobs:
            while q.jobs and now - next(iter(q.jobs.values())) > LIVE_JOB_S:
                q.jobs.popitem(last=False)
            if len(q.jobs) >= lim.live_jobs:
                return "quota_jobs"
        if not q.frames.holds(1, now):
            return "quota_frames"
        if not q.bytes.holds(size, now):
            return "quota_bytes"
        q.frames.charge(1)
        q.bytes.charge(size)
        if job is not None:
            q.jobs[job] = now
            q.jobs.move_to_end(job)
        return None

    def charge(self, node: str, extra: int) -> None:
        """Bytes a frame took beyond its size on the wire (inflated), charged to its node."""
        q = self.nodes.get(node)
        if q is not None and extra > 0:
            q.bytes.charge(extra)
