# SPDX-License-Identifier: Apache-2.0
"""What the controller refuses, and how it keeps the count: a message's msgpack inflated within bounds (inflate),
a frame on a subject not its own (WrongSubject), and the refusals of a batch (Refusals) — counted per node, reason
and minute, the first few kept whole, logged once a minute — which Controller.flush_refusals writes to the store in
one transaction (jobprobe/cluster/store.py `reject_counts`, `rejects`)."""
from __future__ import annotations

import logging
import zlib

from jobprobe.cluster.ingest import MAX_FRAME
from jobprobe.cluster.store import REJECT_BODY, REJECT_SAMPLES
from jobprobe.core.frame import MalformedFrame

log = logging.getLogger("jobprobe.cluster.controller")

MAX_INFLATED = 1 << 20         # bytes of msgpack a compressed frame may inflate to
REJECT_LOG_PER_MIN = 10        # refusals logged whole a minute; then one line per node and reason a minute
MAX_REJECT_KEYS = 10_000       # (node, reason) pairs counted in memory between two flushes, and their log lines


class WrongSubject(MalformedFrame):
    """A frame on a subject that is not its own (another node's, another job's, another partition's)."""


def inflate(data: bytes) -> bytes:
    """A message's msgpack: inflated within MAX_INFLATED bytes when zlib-compressed (the agents' default; a msgpack
    map never starts with 0x78, zlib's first byte), else as it is; MalformedFrame when it cannot be."""
    if len(data) > MAX_FRAME:
        raise MalformedFrame(f"{len(data)} bytes: larger than {MAX_FRAME}")
    if data[:1] != b"\x78":
        return data
    z = zlib.decompressobj()
    try:
        out = z.decompress(data, MAX_INFLATED + 1)
    except zlib.error as err:
        raise MalformedFrame(f"not a zlib stream: {err}") from err
    if len(out) > MAX_INFLATED or z.unconsumed_tail:
        raise MalformedFrame(f"inflates past {MAX_INFLATED} bytes")
    return out


class Refusals:
    """Refusals between two flushes: counted per (node, reason, minute), the first REJECT_SAMPLES of each node and
    reason a minute kept whole. Logged: the first REJECT_LOG_PER_MIN of a minute whole, the rest as one line per
    node and reason when the minute ends. Memory: at most MAX_REJECT_KEYS keys of each kind (~3 MiB); past that the
    counts go to node '' reason `overflow`."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], list[int]] = {}
        self.kept: list[tuple] = []
        self.minute = 0
        self.sampled: dict[tuple[str, str], int] = {}     # this minute: kept per (node, reason)
        self.quiet: dict[tuple[str, str], int] = {}       # this minute: refused, not logged
        self.logged = 0

    def add(self, node: str, reason: str, subject: str, why: str, size: int, body: bytes, now: float) -> None:
        minute = int(now // 60)
        if minute != self.minute:
            self.roll(minute)
        node = node[:200]
        key = (node, reason, minute)
        if key not in self.counts and len(self.counts) >= MAX_REJECT_KEYS:
            key = ("", "overflow", minute)
        c = self.counts.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += size
        pair = (node, reason)
        n = self.sampled.get(pair, 0)
        if n < REJECT_SAMPLES and (n or len(self.sampled) < MAX_REJECT_KEYS):
            self.sampled[pair] = n + 1
            self.kept.append((now, subject[:200], node or None, why[:500], size, bytes(body[:REJECT_BODY])))
        if self.logged < REJECT_LOG_PER_MIN:
            self.logged += 1
            log.warning("refused a frame on %s: %s", subject[:200], why)
        elif pair in self.quiet or len(self.quiet) < MAX_REJECT_KEYS:
            self.quiet[pair] = self.quiet.get(pair, 0) + 1

    def roll(self, minute: int) -> None:
        """A new minute: the last one's unlogged refusals said, a line per node and reason (the 20 largest)."""
        worst = sorted(self.quiet.items(), key=lambda kv: -kv[1])
        for (node, reason), n in worst[:20]:
            log.warning("… and %d more refused frames of node %r (%s) in that minute", n, node, reason)
        if len(worst) > 20:
            log.warning("… and %d more refused frames of %d other nodes or reasons in that minute",
                        sum(n for _, n in worst[20:]), len(worst) - 20)
        self.minute, self.sampled, self.quiet, self.logged = minute, {}, {}, 0

    def take(self) -> tuple[dict[tuple[str, str, int], list[int]], list[tuple]]:
        counts, kept, self.counts, self.kept = self.counts, self.kept, {}, []
        return counts, kept
