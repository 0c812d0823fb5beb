# SPDX-License-Identifier: Apache-2.0
"""Clock skew: each node's clock against the stream's own time of its messages.

The agent stamps every message it publishes with its clock (header `Jobprobe-Sent`, jobprobe/core/wire.py); the
stream records when it stored the message (JetStream's metadata timestamp; a heartbeat, which comes by plain
subscription: when the controller took it). The difference is the node's clock offset, backlog or not: a frame sent
late from the spool is stamped when it is sent. A frame's own `t` cannot tell a clock behind from a backlog.

A node off by more than SKEW_S gets a `clock_skew` event — once, until it is back within half of that
(`clock_skew_end`) — and its offset is in `/metrics` and `controller stats`. Its frames are kept: the store's
retention and compaction count from when a frame came as well as from its own time (jobprobe/cluster/store.py).
One offset per node (the first of its messages in each batch): a map keyed by node, forgotten with the node.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable

from jobprobe.core.wire import SENT_HEADER

log = logging.getLogger("jobprobe.controller")

SKEW_S = 60.0            # a clock further off than this is named (NTP keeps nodes within milliseconds)
T_MIN, T_MAX = 946684800.0, 7258118400.0     # 2000..2200: a header outside is no clock


def sent_at(msg: Any) -> float | None:
    """The node's clock when it published `msg` (its header), or None: no header (an older agent), or not a time."""
    headers = getattr(msg, "headers", None)
    v = headers.get(SENT_HEADER) if isinstance(headers, dict) else None
    if not isinstance(v, str) or len(v) > 32:
        return None
    try:
        t = float(v)
    except ValueError:
        return None
    return t if math.isfinite(t) and T_MIN <= t <= T_MAX else None


def stored_at(msg: Any, now: float) -> float:
    """When the stream stored `msg` (JetStream's metadata), else `now` (a plain subscription's heartbeat)."""
    try:
        ts = msg.metadata.timestamp
        return ts.timestamp() if hasattr(ts, "timestamp") else float(ts)
    except Exception:        # not a JetStream message, or metadata it cannot parse
        return now


class Clocks:
    """Each node's clock offset (its clock − the stream's, seconds) and which nodes are named skewed now."""

    def __init__(self, bound: float = SKEW_S):
        self.bound = bound
        self.offset: dict[str, float] = {}
        self.skewed: set[str] = set()

    def feed(self, taken: Iterable[tuple[Any, dict]], now: float) -> list[tuple[str, str, str, dict]]:
        """The batch's (message, frame)s: (node, job, event, body) for each node that went off or came back."""
        out = []
        seen: set[str] = set()
        for msg, f in taken:
            node = f["node"]
            if node in seen:
                continue
            sent = sent_at(msg)
            if sent is None:
                continue
            seen.add(node)
            off = round(sent - stored_at(msg, now), 3)
            self.offset[node] = off
            body = {"offset_s": off, "bound_s": self.bound}
            if abs(off) > self.bound and node not in self.skewed:
                self.skewed.add(node)
                way = "behind" if off < 0 else "ahead of"
                out.append((node, f["job"], "clock_skew", {**body, "reason": (
                    f"node {node}'s clock is {abs(off):.0f} s {way} the stream's: its frames' times are off by as "
                    "much (they are kept as long as anyone's: retention counts from when they came)")}))
            elif abs(off) <= self.bound / 2 and node in self.skewed:
                self.skewed.discard(node)
                out.append((node, f["job"], "clock_skew_end", body))
        for node, _, name, body in out:
            log.warning("node %s: %s: its clock %+.1f s off the stream's", node, name, body["offset_s"])
        return out

    def forget(self, keep: set[str]) -> None:
        for node in [n for n in self.offset if n not in keep]:
            del self.offset[node]
        self.skewed &= keep
