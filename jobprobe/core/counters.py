# SPDX-License-Identifier: Apache-2.0
"""Counters read from the kernel and devices: the interval's difference across a wrap, and percentiles of
log2 histograms."""
from __future__ import annotations


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
