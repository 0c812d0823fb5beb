# SPDX-License-Identifier: Apache-2.0
"""The shared backoff (jobprobe/core/retry.py): every delay within its bounds, growing to the cap, spread by its jitter,
short again after reset() — for any parameters (hypothesis), and usable from asyncio (it only computes delays)."""
from __future__ import annotations

import asyncio
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobprobe.core.retry import Backoff

params = st.tuples(st.floats(0.001, 10), st.floats(1, 100), st.floats(1, 4), st.sampled_from(["decorrelated", "full",
                                                                                                 "none"]))


@settings(max_examples=200, deadline=None)
@given(params, st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_every_delay_is_within_its_bounds(p, n, seed):
    initial, span, mult, jitter = p
    b = Backoff(initial, initial * span, mult, jitter, rng=random.Random(seed))
    prev = None
    for i in range(n):
        top = b.ceiling()
        d = b.next()
        assert 0 <= d <= b.maximum and d <= top + 1e-9
        if jitter == "decorrelated":
            assert d >= initial - 1e-9                   # never shorter than the first delay
        if jitter == "none":
            assert d == pytest.approx(min(b.maximum, initial * mult ** i))
        if prev is not None and jitter != "full":
            assert top >= min(b.maximum, prev) - 1e-9   # the ceiling never falls while failures go on
        prev = d


@settings(max_examples=100, deadline=None)
@given(params, st.integers(0, 2**32 - 1))
def test_it_grows_to_the_cap_and_reset_starts_again(p, seed):
    initial, span, mult, jitter = p
    b = Backoff(initial, initial * span, mult, jitter, rng=random.Random(seed))
    for _ in range(2000):
        b.next()
    if mult > 1.01:
        assert b.ceiling() == pytest.approx(b.maximum) or jitter == "decorrelated"
    b.reset()
    first = b.next()
    assert first <= min(b.maximum, initial * mult) + 1e-9
    if jitter == "none":
        assert first == pytest.approx(initial)


def test_without_jitter_the_delays_double_up_to_the_cap():
    b = Backoff(0.5, 5.0, 2.0, jitter="none")
    assert [b.next() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    for _ in range(100_000):       # days of failures: the exponent stops at the cap, no float overflow
        b.next()
    b.reset()
    assert b.next() == 0.5


@pytest.mark.parametrize("jitter", ["decorrelated", "full"])
def test_jitter_spreads_the_retries_of_many_agents(jitter):
    """A thousand agents that lost the server at one moment: their third retry is spread over its interval, not
    one instant (no thundering herd on the server's return)."""
    thirds = []
    for seed in range(1000):
        b = Backoff(0.5, 30.0, 2.0, jitter, rng=random.Random(seed))
        thirds.append([b.next() for _ in range(3)][-1])
    lo, hi = min(thirds), max(thirds)
    assert hi - lo > 1.0 and statistics.pstdev(thirds) > 0.3
    buckets: dict[int, int] = {}                              # 50 ms slots: no slot holds a crowd
    for t in thirds:
        buckets[int(t / 0.05)] = buckets.get(int(t / 0.05), 0) + 1
    assert max(buckets.values()) < 100, max(buckets.values())
    # grows on average: the mean of the 6th retry is above that of the 2nd
    later = []
    for seed in range(1000):
        b = Backoff(0.5, 30.0, 2.0, jitter, rng=random.Random(seed))
        later.append([b.next() for _ in range(6)][-1])
    assert statistics.mean(later) > 1.2 * statistics.mean(thirds)


def test_refuses_parameters_that_make_no_sense():
    for bad in ((0, 1, 2), (1, 0.5, 2), (1, 2, 0.5)):
        with pytest.raises(ValueError, match="backoff"):
            Backoff(*bad)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter="sometimes")


def test_usable_from_a_coroutine():
    async def retry_until(ok_at: int) -> list[float]:
        b, waited = Backoff(0.001, 0.004, 2.0, jitter="full"), []
        for attempt in range(10):
            if attempt == ok_at:
                b.reset()
                return waited
            d = b.next()
            waited.append(d)
            await asyncio.sleep(d)
        return waited
    waited = asyncio.run(retry_until(4))
    assert len(waited) == 4 and all(0 <= d <= 0.004 for d in waited)
