# SPDX-License-Identifier: Apache-2.0
"""One backoff for every loop that tries again: the agent's publisher, the controller's connect loop, the K8s watcher.

Without jitter, every agent of a cluster that lost its NATS server at the same moment asks again at the same
moments (0.5 s, 1 s, 2 s, …): a restarted server is met by all of them at once, each time. With jitter the retries
spread over the interval and the server sees a steady trickle instead.

Backoff only computes delays — `next()` returns the seconds to wait, `reset()` after a success — so the same object
serves a thread (`event.wait(b.next())`) and a coroutine (`await asyncio.sleep(b.next())`). Jitter:

- `decorrelated` (the default): each delay is drawn from [initial, previous × multiplier], capped at `maximum`
  (never shorter than `initial`: a failing peer is never hammered);
- `full`: drawn from [0, min(maximum, initial × multiplier^n)];
- `none`: exactly min(maximum, initial × multiplier^n).
"""
from __future__ import annotations

import random

JITTERS = ("decorrelated", "full", "none")


class Backoff:
    def __init__(self, initial: float = 0.5, maximum: float = 5.0, multiplier: float = 2.0,
                 jitter: str = "decorrelated", rng: random.Random | None = None):
        if not initial > 0 or not maximum >= initial or not multiplier >= 1:
            raise ValueError(f"backoff: need 0 < initial <= maximum and multiplier >= 1 "
                             f"(got {initial}, {maximum}, {multiplier})")
        if jitter not in JITTERS:
            raise ValueError(f"backoff: jitter is one of {', '.join(JITTERS)} (got {jitter!r})")
        self.initial, self.maximum, self.multiplier, self.jitter = float(initial), float(maximum), multiplier, jitter
        self.rng = rng or random.Random()
        self.reset()

    def reset(self) -> None:
        """After a success: the next delay is short again."""
        self.attempt = 0
        self.last = self.initial

    def ceiling(self) -> float:
        """The longest delay the next call may return (without jitter: the delay itself)."""
        if self.jitter == "decorrelated":
            return min(self.maximum, self.last * self.multiplier)
        return min(self.maximum, self.initial * self.multiplier ** self.attempt)

    def next(self) -> float:
        """The seconds to wait before the next try."""
        top = self.ceiling()
        if self.jitter == "decorrelated":
            delay = self.rng.uniform(self.initial, top)
        elif self.jitter == "full":
            delay = self.rng.uniform(0.0, top)
        else:
            delay = top
        delay = min(self.maximum, max(0.0, delay))
        self.last = max(self.initial, delay)
        if top < self.maximum:     # past the cap the exponent stops: no float overflow after days of failures
            self.attempt += 1
        return delay
