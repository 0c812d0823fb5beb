# SPDX-License-Identifier: Apache-2.0
"""Reading the sched probe's per-CPU counters of one job slot (bpf/sched.c struct slot_stats) whole and sane: the
struct's layout (SlotStats), the per-CPU seqcount check of a copy (torn_cpus: a CPU whose words were being written
while they were copied; the caller copies again, up to READ_TRIES), the sum over CPUs (slot_columns) and the times
up to an instant with the periods still open counted in (time_totals), and the bound a reading's times must keep
(settle, with node_threads: at most dt per thread the node had, within the copy's own skew), which holds back a
reading no interval can hold. A reading is {counter: int, "events"/"times": [int]*NTIMES, "hist": [int]*NBUCKETS,
"torn_reads", "impossible", "t", "lag", "node"}.
"""
from __future__ import annotations

import ctypes as ct
from typing import Any

NBUCKETS = 27   # bpf/sched.c NBUCKETS
NTIMES = 8      # bpf/sched.c NTIMES: time categories: T_RUNQ 0, R_* 1..5 and 7 (off-CPU reasons), T_WAKEUP 6
# bpf/sched.c struct slot_stats' scalars, in order
COUNTERS = ("voluntary", "involuntary", "runq_events", "switch_ins_missed", "switch_in_missed_ns")
ARRAYS = ("events", "done_ns", "open_n", "open_ns")      # then its arrays of NTIMES (then runq_hist)
MASK = (1 << 64) - 1


class SlotStats(ct.Structure):
    """bpf/sched.c struct slot_stats, one per job slot and CPU (the map checks the size at start): its seqcount's
    two halves first and last (the order the kernel copies the words in matters, see bpf/sched.c write_begin)."""
    _fields_ = [("seq_done", ct.c_uint64)] + [(name, ct.c_uint64) for name in COUNTERS] + \
        [(name, ct.c_uint64 * NTIMES) for name in ARRAYS] + [("runq_hist", ct.c_uint64 * NBUCKETS)] + \
        [("seq_begun", ct.c_uint64)]


WORDS = ct.sizeof(SlotStats) // 8
READ_TRIES = 4           # copies of a slot taken before a torn one is given up on for the tick
# How far one period's stamps may sit from user space's clock: the run queue's clock turned into CLOCK_MONOTONIC
# by an offset learnt from its recent switch-ins, which the two clocks' drift moves by µs (bpf/sched.c stamp_ns).
STAMP_SKEW_NS = 100_000
HELD = ("torn_reads", "impossible")   # readings not emitted, counted (cumulative in a reading, like COUNTERS)


def signed64(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def torn_cpus(raw: bytes, ncpus: int) -> list[int]:
    """The CPUs whose copy in `raw` (one slot's per-CPU values, as the kernel copied them) a write overlapped:
    seq_done (its first word, copied first) below seq_begun (its last, copied last)."""
    words = memoryview(raw).cast("Q")
    per = len(words) // ncpus
    return [c for c in range(ncpus) if words[c * per] != words[c * per + WORDS - 1]]


def slot_columns(raw: bytes, ncpus: int) -> dict[str, Any]:
    """One slot's per-CPU copies summed over CPUs, by struct member ({name: int or list}); the seqcount left out."""
    words = memoryview(raw).cast("Q")
    per = len(words) // ncpus
    cols = [sum(words[i::per]) for i in range(1, WORDS - 1)]      # member i of every CPU's copy: a strided view
    out, i = {}, 0
    for name, typ in SlotStats._fields_[1:-1]:
        n = ct.sizeof(typ) // 8
        out[name] = cols[i] if n == 1 and not hasattr(typ, "_length_") else cols[i:i + n]
        i += n
    return out


def node_threads(proc: str = "/proc") -> tuple[int, int] | None:
    """(threads on the node now, forks since boot): every thread of a job in an interval was alive at its start
    or forked in it, so their sum bounds the threads whose time an interval can hold. None where unreadable."""
    try:
        with open(f"{proc}/loadavg") as f:
            threads = int(f.read().split()[3].split("/")[1])
        with open(f"{proc}/stat") as f:
            forks = next(int(ln.split()[1]) for ln in f if ln.startswith("processes "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return threads, forks


def settle(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The reading to keep after `before`, given a consistent copy `now`: now itself, or before again (held, its
    `impossible` count up one) where a category's time would be one no interval can hold. A thread is in at most
    one period of a category at a time, so an interval of dt holds at most dt per thread alive in it (at most
    the node's threads at its start plus its forks: node_threads); each reading's error is at most its copy's
    duration (`lag`: one CPU's words are copied at another instant than the next CPU's, and `t` is taken after
    the copy) plus the stamps' skew, per period open then. Anything past that is a bug, caught here and never
    emitted: the held reading's time lands in the next interval that is not. A time a hair (within that error)
    below the last reading's keeps the last one's: it reads 0 in this interval and the next one has it, nothing
    is lost or counted twice."""
    times = [max(a, b) for a, b in zip(now["times"], before["times"])]
    if now.get("node") and before.get("node"):
        threads = before["node"][0] + max(0, now["node"][1] - before["node"][1])
        dt = now["t"] - before["t"]
        slack = threads * (now["lag"] + before["lag"] + 2 * STAMP_SKEW_NS)
        bad = any(a - b > dt * threads + slack or a - b < -slack for a, b in zip(now["times"], before["times"]))
    else:   # the bound's inputs unknown (no /proc/loadavg): only what no skew explains, a negative past 1 s
        bad = any(a - b < -1_000_000_000 for a, b in zip(now["times"], before["times"]))
    if bad:
        return {**before, "impossible": before["impossible"] + 1}
    return {**now, "times": times, **{k: before[k] for k in HELD}}


def time_totals(totals: dict[str, Any], t_ns: int) -> list[int]:
    """Per time category, all time up to t_ns (CLOCK_MONOTONIC, bpf_ktime_get_ns's clock): the finished parts plus
    every open period counted up to t_ns (open_n * t - open_ns). The per-CPU columns are summed modulo 2^64: a
    period opened on one CPU and closed on another leaves one CPU's open_n above and the other's below zero."""
    return [signed64(done + n * t_ns - since)
            for done, n, since in zip(totals["done_ns"], totals["open_n"], totals["open_ns"])]
