# SPDX-License-Identifier: Apache-2.0
"""Values read once per agent tick: what every job of a tick would otherwise read alike — the agent's own rusage
(the `self` probe), a shared program's run counts (`bpf_missed`), a cgroup's directory walk and process list (read by
the agent's end-of-job check, the membership sync and the `cgroup` probe). The agent opens a tick with begin() and
closes it with end(); outside a tick (a probe used on its own, a test) nothing is cached. Imports nothing.

A key that names an object holds the object itself (never its `id()`): the memo keeps it alive until the tick ends,
so an object freed during a tick cannot hand its value to a new one that the allocator puts at the same address.
The memo is one per process because the tick is: one agent per process, one tick for all its jobs, and every probe
of every job reads through it without being handed anything.
"""
from __future__ import annotations

from typing import Any, Callable

_tick = 0
_values: dict[Any, Any] = {}


def begin() -> None:
    global _tick
    _tick = abs(_tick) + 1
    _values.clear()


def end() -> None:
    global _tick
    _values.clear()
    _tick = -abs(_tick)     # remembered, but not in a tick


def active() -> bool:
    """Whether a tick is open (values are shared until it ends)."""
    return _tick > 0


def get(key: Any, fn: Callable[[], Any]) -> Any:
    """fn()'s value, computed once per tick for `key` (every call outside a tick computes it)."""
    if _tick <= 0:
        return fn()
    if key not in _values:
        _values[key] = fn()
    return _values[key]
