# SPDX-License-Identifier: Apache-2.0
"""Test doubles around the real things: a counting wrapper of the pynvml module, and a sink that keeps frames."""
from jobprobe.core.frame import decode


class Spy:
    """pynvml as it is, counting calls of the nvml* functions (also those the fake lacks)."""

    def __init__(self, nv):
        self._nv, self.counts = nv, {}

    def __getattr__(self, name):
        attr = getattr(self._nv, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def counted(*args, **kw):
            self.counts[name] = self.counts.get(name, 0) + 1
            return attr(*args, **kw)
        return counted


class Frames(list):
    """A sink that keeps what it is given, decoded from the bytes as a reader would."""
    def write(self, frame, data):
        self.append(decode(data))

    def close(self):
        pass
