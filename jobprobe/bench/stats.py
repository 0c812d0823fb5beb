# SPDX-License-Identifier: Apache-2.0
"""Statistics of paired runs: relative slowdown of a job with a collector on, its 95% interval, the stop rule.

Each pair is one run without jobprobe and one with a config, back to back in random order, so slow drifts of the
machine (thermal, other tenants) hit both sides alike. The slowdown of a pair is (with - without) / without; the
estimate is the mean over pairs with a Student-t 95% interval. We keep adding pairs until the last three estimates
agree within 0.5 percentage points (the method of the reference performance page), or the budget runs out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# two-sided 95% Student-t quantiles, df = 1..30
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    if df < 1:
        return math.inf
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964  # Cornish-Fisher expansion of the t quantile around the normal one; < 1e-3 off for df > 30
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


@dataclass
class Estimate:
    n: int
    mean: float          # relative slowdown, as a fraction (0.01 = +1%)
    lo: float
    hi: float

    def pct(self) -> str:
        if self.n < 2:
            return f"{self.mean * 100:+.2f}% (n={self.n})"
        return f"{self.mean * 100:+.2f}% ({self.lo * 100:+.2f} to {self.hi * 100:+.2f})"


def estimate(slowdowns: list[float]) -> Estimate:
    n = len(slowdowns)
    if n == 0:
        return Estimate(0, math.nan, math.nan, math.nan)
    mean = sum(slowdowns) / n
    if n == 1:
        return Estimate(1, mean, -math.inf, math.inf)
    var = sum((x - mean) ** 2 for x in slowdowns) / (n - 1)
    half = t975(n - 1) * math.sqrt(var / n)
    return Estimate(n, mean, mean - half, mean + half)


@dataclass
class Series:
    """Paired runs of one config: the job's time without and with it, and the estimate after each pair."""

    config: str
    without: list[float] = field(default_factory=list)
    with_: list[float] = field(default_factory=list)
    history: list[float] = field(default_factory=list)   # the estimate's mean after each pair

    def add(self, t_without: float, t_with: float) -> Estimate:
        self.without.append(t_without)
        self.with_.append(t_with)
        est = self.estimate()
        self.history.append(est.mean)
        return est

    def slowdowns(self) -> list[float]:
        return [(w - b) / b for b, w in zip(self.without, self.with_)]

    def estimate(self) -> Estimate:
        return estimate(self.slowdowns())

    def settled(self, window: int = 3, tol: float = 0.005, min_pairs: int = 3,
                precision: float | None = None) -> bool:
        """The last `window` estimates agree within `tol` (0.005 = 0.5 percentage points) — and, if `precision`
        is given, the 95% interval's half-width is at most that: on a noisy machine the running mean can hold
        still long before the interval is narrow."""
        if len(self.history) < max(window, min_pairs):
            return False
        last = self.history[-window:]
        if max(last) - min(last) > tol:
            return False
        if precision is not None:
            est = self.estimate()
            return (est.hi - est.lo) / 2 <= precision
        return True


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    if not ys:
        return math.nan
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2
