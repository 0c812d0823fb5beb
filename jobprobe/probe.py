"""The probe contract (DESIGN.md). Each probe is one module in probes/, found by the registry by its `name`."""
from __future__ import annotations

from typing import Any, NamedTuple

from jobprobe.host import Host
from jobprobe.target import Target


# sample() may return, under this key, a list of one-off events: {"event": name, "t": UNIX time (optional), ...}.
# The sampler sends each as an `event` frame right after the tick's sample frame (docs/FRAMES.md).
EVENTS_KEY = "_events"


class Field(NamedTuple):
    """One field a probe emits: msgpack type, unit, meaning. docs/FRAMES.md lists every one of them."""

    type: str     # int | float | bool | str | list[int] | list[str] | list[map] | map
    unit: str     # ns, bytes, count, ratio, us, ...
    meaning: str


class Probe:
    name = ""                     # --probes NAME, and the key in frame["probes"]
    default = True                # part of standard collection?
    needs_root = False            # does start() need root (BPF, cgroup perf counters)?
    summary = ""                  # one line for `jobprobe probes`
    fields: dict[str, Field] = {}

    def __init__(self, host: Host | None = None):
        self.host = host or Host()

    def check(self, host: Host) -> str | None:
        """Why this probe cannot run on this host, or None. No side effects."""
        if self.needs_root and not host.is_root:
            return "needs root"
        return None

    def start(self, target: Target) -> None:
        """Acquire everything; on failure release what was acquired and raise ProbeUnavailable."""

    def sample(self) -> dict[str, Any]:
        """This interval's values only: deltas since the previous sample (or since start). One-off events go in
        a list under EVENTS_KEY."""
        return {}

    def stop(self) -> None:
        """Release everything. Idempotent."""

    def note(self) -> str | None:
        """A running probe's word on what it is waiting for, when it is running but has nothing to count yet
        (status "ok: <note>"); None when it is counting (status "ok"). Asked after start and after each sample."""
        return None


def delta(now: int, before: int, width: int = 64) -> int:
    """Counter difference corrected for one wrap-around of a `width`-bit counter; a reset (now < before on a
    counter too young to have wrapped) counts from zero."""
    if now >= before:
        return now - before
    wrapped = now + (1 << width) - before
    return wrapped if wrapped < (1 << (width - 1)) else now


def log2_percentile(hist: list[int], q: float) -> float | None:
    """Percentile q (0..1) of a log2 histogram whose bucket i holds values in [2^i, 2^(i+1)) (bucket 0: [0, 2)).
    Interpolates linearly inside the bucket; None for an empty histogram."""
    total = sum(hist)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(hist):
        if n and seen + n >= rank:
            lo = 0 if i == 0 else 1 << i
            hi = 2 if i == 0 else 1 << (i + 1)
            return lo + (hi - lo) * max(0.0, rank - seen) / n
        seen += n
    return float(1 << len(hist))
