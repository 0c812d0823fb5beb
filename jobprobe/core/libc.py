# SPDX-License-Identifier: Apache-2.0
"""The C library, loaded once per process through ctypes with errno kept (`LIBC`), for the calls Python's os module
does not make: syscall(2) for bpf(2) and perf_event_open(2), setns, unshare, mount, prctl, adjtimex. In core, the
room every other may import (the controller's nats-server child sets its parent-death signal through it too)."""
from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long      # a syscall's result is a long (a fd, or -1 with errno)


def errno() -> int:
    """The errno the last call through LIBC left (ctypes keeps it per thread)."""
    return ctypes.get_errno()
