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


M_ARENA_MAX = -8        # mallopt(3): the most malloc arenas; one per thread by default, each holding freed pages


def lean_heap() -> None:
    """A long-lived process's heap kept small: one malloc arena for all its threads (its few threads allocate
    little; each arena of its own keeps what it freed). Before the process starts threads."""
    LIBC.mallopt(M_ARENA_MAX, 1)


def trim_heap() -> None:
    """Give the C heap's free pages back to the kernel (malloc_trim(3)): what a start, an attach or a detach
    allocated for a moment and freed stays in the process's RSS otherwise."""
    LIBC.malloc_trim(0)
