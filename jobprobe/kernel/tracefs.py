# SPDX-License-Identifier: Apache-2.0
"""The one reader of tracefs event formats: where an event lives, its format text, its field names.

tracefs is mounted at /sys/kernel/tracing (4.1+) or, on older setups, reached through /sys/kernel/debug/tracing; a
tracepoint's fields are added across kernel versions (sched_process_exit's group_dead, block_rq_complete's ...), so
probes decide hooks and C defines from these files. Every path is under a root (tests use fixture trees). Imports
nothing of jobprobe (host.py uses it).
"""
from __future__ import annotations

from pathlib import Path

BASES = ("kernel/tracing", "kernel/debug/tracing")


def event_dir(sys_root: str, category: str, event: str) -> Path | None:
    """The event's directory, or None when the kernel has no such tracepoint."""
    for base in BASES:
        d = Path(sys_root, base, "events", category, event)
        if d.is_dir():
            return d
    return None


def event_format(sys_root: str, category: str, event: str) -> str | None:
    """The text of the event's format file, or None when there is none."""
    for base in BASES:
        try:
            return Path(sys_root, base, "events", category, event, "format").read_text()
        except OSError:
            continue
    return None


def event_fields(sys_root: str, category: str, event: str) -> set[str] | None:
    """Field names from the format file ("field:unsigned int nr_sector;" → nr_sector, "char comm[16]" → comm);
    None when the tracepoint does not exist."""
    text = event_format(sys_root, category, event)
    if text is None:
        return None
    names = set()
    for line in text.splitlines():
        decl = line.strip().partition(";")[0]
        if decl.startswith("field:"):
            names.add(decl.split()[-1].partition("[")[0])
    return names
