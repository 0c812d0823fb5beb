# SPDX-License-Identifier: Apache-2.0
"""The DDP job's own clocks (scripts/ddp_job.py's prints, `rank R step K: X steps/s, blocked in collectives B s at
T`), against which the time its ranks waited for a slow peer is checked: the progress the job lost, by its step
count, and a rank's time blocked in collectives (tests/test_stragglers.py, scripts/peers_truth.py)."""
from __future__ import annotations

from pathlib import Path


def progress(log: Path) -> list[tuple[float, float, float]]:
    """A rank's log: (T, K, B) per print — UNIX time, steps so far, seconds blocked in collectives so far."""
    out = []
    for line in log.read_text().splitlines():
        if "blocked in collectives" in line and " step " in line:
            words = line.split()
            out.append((float(words[-1]), float(words[3].rstrip(":")), float(words[-4])))
    return out


def _over(clock: list[tuple[float, float]]):
    """The clock's (time, so far) points as a function of a span: how much it moved between a and z."""
    import numpy as np  # (the controller's and the tests' dependency; reading a log needs none)
    t, v = np.array([c[0] for c in clock]), np.array([c[1] for c in clock])
    return lambda a, z: float(np.interp(z, t, v) - np.interp(a, t, v))


def lost_progress(steps: list[tuple[float, float]], limited: tuple[float, float], span: tuple[float, float]) -> float:
    """The job's progress lost over `span` by a rank's own count of its steps ((time, steps so far)): the span's
    length less the time its steps there take at the job's pace around the fault — the mean of its rates over the
    6 s before it (`limited`: from, to) and over 6 s from 2 s after it went (the pace drifts a few % a minute: a
    rate in step a minute earlier read 3-17% low)."""
    before, after = _paces(steps, limited)
    return _lost(steps, span, (before + after) / 2)


def lost_progress_band(steps: list[tuple[float, float]], limited: tuple[float, float],
                       span: tuple[float, float]) -> tuple[float, float]:
    """lost_progress's own uncertainty: the progress lost against the pace before the fault alone and after it
    alone, the smaller first (where the job's pace moved between the two, no single pace of reference is right)."""
    lost = [_lost(steps, span, pace) for pace in _paces(steps, limited)]
    return min(lost), max(lost)


def _paces(steps: list[tuple[float, float]], limited: tuple[float, float]) -> tuple[float, float]:
    done = _over(steps)
    return done(limited[0] - 6.5, limited[0] - 0.5) / 6, done(limited[1] + 2, limited[1] + 8) / 6


def _lost(steps: list[tuple[float, float]], span: tuple[float, float], pace: float) -> float:
    return span[1] - span[0] - _over(steps)(*span) / pace


def more_blocked(clock: list[tuple[float, float]], usual: tuple[float, float], span: tuple[float, float]) -> float:
    """A rank's time blocked in collectives over `span` ((time, blocked s so far)), less its rate over `usual` (the
    job in step) times the span's length."""
    over = _over(clock)
    return over(*span) - over(*usual) / (usual[1] - usual[0]) * (span[1] - span[0])
