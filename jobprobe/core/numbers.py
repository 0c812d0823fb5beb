# SPDX-License-Identifier: Apache-2.0
"""numbers — what counts as a number in a value that came from outside (a frame, a file, a request).

A bool is an int in Python, so `isinstance(v, (int, float))` takes `true` for 1: every boundary that wants a number
asks here instead."""
from __future__ import annotations

import math
from typing import Any


def is_number(v: Any) -> bool:
    """An int or a float (NaN and infinities included), not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite(v: Any) -> bool:
    """A number that is neither NaN nor infinite."""
    return is_number(v) and math.isfinite(v)


def is_amount(v: Any, most: float | None = None) -> bool:
    """A finite number from 0 (to `most`): seconds, prices, counts from a file."""
    return is_finite(v) and v >= 0 and (most is None or v <= most)
