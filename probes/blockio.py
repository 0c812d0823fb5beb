"""blockio — the job's block I/O: requests, bytes and device latency, reads and writes apart.

Measures, per interval, for requests the job submitted: completed read and write requests (as the device saw
them, after merges), their exact bytes (partial completions included), errors, and the device latency (issue →
completion) as a log2 µs histogram with sum, p50 and p99.
Hooks: eBPF on tracepoints block:block_io_start (6.5+; else block:block_bio_queue with block_bio_backmerge and
block_split), block_bio_frontmerge, block_rq_merge, block_rq_issue, block_rq_complete (bpf/blockio.c), plus
fork/exit of bpf/common.h. The owner is decided at submission, in the submitting task's context, and found again
at issue and completion by (dev, sector). Only tracepoint arguments are read, never struct request.
Oldest kernel: 4.18; the block_io_start mode needs 6.5 (chosen when the tracepoint exists).
Cost (bpf_stats, 6.18 VM, 4 KiB O_DIRECT reads on a loop device): a request of the job ~0.65-1.5 µs in all
(submit hook 370-810 ns, most of it the LRU insert; issue ~100 ns; completion 180-630 ns); any other request of
the node ~0.35-0.6 µs (submit 75-160 ns, issue and completion one missed lookup each). sample(): one per-CPU map
lookup (~125 µs of Python); every SWEEP_NS a walk of the in-flight map (~45 µs when empty) drops entries older
than STALE_NS (requests that never complete, e.g. on a removed device), counted in inflight_expired.
Not the job's, by design: buffered writes flushed later by writeback kworkers, the filesystem journal (jbd2),
I/O on bio-based devices (dm, md, zram: no requests) — only their lower devices' requests are seen.
"""
from __future__ import annotations

import ctypes as ct
import time
from pathlib import Path
from typing import Any, Callable

from jobprobe.errors import ProbeUnavailable
from jobprobe.host import Host
from jobprobe.probe import Field, delta, log2_percentile
from jobprobe.target import Target
from probes._bpfprobe import MEMBERSHIP, BpfProbe

NBUCKETS = 27                 # bpf/blockio.c NBUCKETS
DIRS = ("read", "write")      # bpf/blockio.c OP_READ, OP_WRITE: the index into slot_stats.dir
COUNTERS = ("requests", "bytes", "lat_ns", "errors")
STALE_NS = 60 * 10**9         # an entry this old belongs to a request that will not complete (SCSI gives up at 30 s)
SWEEP_NS = 10 * 10**9         # how often sample() walks the in-flight map for them

# (tracepoint, handler, required fields of its format file). Order of attachment: completion first and the submit
# hook last, so that no entry is ever made without the handlers that consume or move it already in place.
COMMON = (
    ("block:block_rq_complete", "on_rq_complete", ("dev", "sector", "nr_sector", "error", "rwbs")),
    ("block:block_rq_issue", "on_rq_issue", ("dev", "sector", "nr_sector", "rwbs")),
    ("block:block_rq_merge", "on_rq_merge", ("dev", "sector")),
    ("block:block_bio_frontmerge", "on_frontmerge", ("dev", "sector", "nr_sector")),
)
BY_MODE = {
    "io_start": (("block:block_io_start", "on_io_start", ("dev", "sector", "nr_sector", "rwbs")),),
    "bio_queue": (("block:block_bio_backmerge", "on_backmerge", ("dev", "sector")),
                  ("block:block_split", "on_split", ("dev", "sector", "new_sector")),
                  ("block:block_bio_queue", "on_bio_queue", ("dev", "sector", "nr_sector", "rwbs"))),
}
# Without these the counts stay right; their stale entries are left to the sweep and the LRU.
OPTIONAL = {"block:block_rq_merge", "block:block_bio_frontmerge", "block:block_bio_backmerge", "block:block_split"}


class RqKey(ct.Structure):
    """bpf/blockio.c struct rq_key."""
    _fields_ = [("sector", ct.c_uint64), ("dev", ct.c_uint32), ("pad", ct.c_uint32)]


class RqVal(ct.Structure):
    """bpf/blockio.c struct rq_val."""
    _fields_ = [("born_ns", ct.c_uint64), ("issue_ns", ct.c_uint64), ("left", ct.c_uint64), ("slot", ct.c_uint32),
                ("op", ct.c_uint32)]


class DirStats(ct.Structure):
    """bpf/blockio.c struct dir_stats."""
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS] + [("hist", ct.c_uint64 * NBUCKETS)]


class SlotStats(ct.Structure):
    """bpf/blockio.c struct slot_stats, one per job slot and CPU."""
    _fields_ = [("dir", DirStats * len(DIRS))]


def tp_fields(sys_root: str, tracepoint: str) -> set[str] | None:
    """Field names of a tracepoint, from its format file ("field:unsigned int nr_sector;" → nr_sector); None
    when the tracepoint does not exist."""
    category, event = tracepoint.split(":")
    for base in ("kernel/tracing", "kernel/debug/tracing"):
        try:
            text = Path(sys_root, base, "events", category, event, "format").read_text()
        except OSError:
            continue
        names = set()
        for line in text.splitlines():
            decl = line.strip().partition(";")[0]
            if decl.startswith("field:"):
                names.add(decl.split()[-1].partition("[")[0])
        return names
    return None


def choose_mode(sys_root: str) -> str:
    """block_io_start where the kernel has it (one entry per request, nothing to undo on merges and splits)."""
    return "io_start" if tp_fields(sys_root, "block:block_io_start") is not None else "bio_queue"


def plan(sys_root: str, mode: str) -> tuple[list[tuple[str, str]], str | None]:
    """The (tracepoint, handler) pairs to attach in this mode, and why the probe cannot run (a required tracepoint
    or field missing), or None."""
    out = []
    for tp, fn, need in COMMON + BY_MODE[mode]:
        fields = tp_fields(sys_root, tp)
        if fields is None:
            if tp in OPTIONAL:
                continue
            return out, f"tracepoint {tp} not found in tracefs"
        missing = [f for f in need if f not in fields]
        if missing:
            return out, f"tracepoint {tp} has no field {missing[0]}"
        out.append((tp, fn))
    return out, None


def interval(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """This interval's fields from two cumulative readings {"read": {counter: int, "hist": [...]}, "write": ...,
    "expired": int}."""
    out: dict[str, Any] = {}
    for d in DIRS:
        a, b = now[d], before[d]
        for k in COUNTERS:
            out[f"{d}_{k}"] = delta(a[k], b[k])
        hist = [delta(x, y) for x, y in zip(a["hist"], b["hist"])]
        out[f"{d}_lat_us_log2"] = hist
        out[f"{d}_lat_p50_us"] = log2_percentile(hist, 0.50)
        out[f"{d}_lat_p99_us"] = log2_percentile(hist, 0.99)
    out["inflight_expired"] = now["expired"] - before["expired"]
    return out


def zero_reading() -> dict[str, Any]:
    return {**{d: {**{k: 0 for k in COUNTERS}, "hist": [0] * NBUCKETS} for d in DIRS}, "expired": 0}


def _dir_fields(d: str) -> dict[str, Field]:
    return {
        f"{d}_requests": Field("int", "count", f"{d} requests the job submitted that completed (as the device saw "
                               f"them, after merges; a split bio is several)"),
        f"{d}_bytes": Field("int", "bytes", f"bytes of the job's {d} requests completed without error"),
        f"{d}_errors": Field("int", "count", f"completions of the job's {d} requests with an error"),
        f"{d}_lat_ns": Field("int", "ns", f"sum of the device latency (issue → completion) of the {d} requests"),
        f"{d}_lat_us_log2": Field("list[int]", "count", f"{d} latency histogram (issue → completion): bucket i "
                                  f"counts [2^i, 2^(i+1)) µs (bucket 0: [0, 2)), {NBUCKETS} buckets, the last "
                                  f"open-ended"),
        f"{d}_lat_p50_us": Field("float", "us", f"median {d} latency (from the histogram; None if no requests)"),
        f"{d}_lat_p99_us": Field("float", "us", f"99th percentile {d} latency (from the histogram; None if no "
                                 f"requests)"),
    }


class BlockioProbe(BpfProbe):
    name = "blockio"
    default = True
    needs_root = True
    summary = "block I/O requests, bytes and device latency the job submitted, reads and writes apart (eBPF)"
    fields = {**_dir_fields("read"), **_dir_fields("write"),
              "inflight_expired": Field("int", "count", f"requests of the job still not completed {STALE_NS // 10**9}"
                                        f" s after submission, given up (device gone; or I/O on a bio-based "
                                        f"device such as dm, which makes no requests)")}

    bpf_name = "blockio"
    map_types = {"inflight": (RqKey, RqVal), "stats": (ct.c_uint32, SlotStats)}

    def __init__(self, host: Host | None = None, slot: int = 0, mode: str | None = None,
                 clock: Callable[[], int] = time.monotonic_ns):
        super().__init__(host, slot)
        self.mode = mode or choose_mode(self.host.sys)   # "io_start" | "bio_queue"; tests force the other one
        self.clock = clock                               # CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns()
        self.sweep_every_ns = SWEEP_NS
        self._expired = 0
        self._swept = 0

    # BpfProbe.check() asks that every handler's tracepoint exists: the optional ones are only listed if they do.
    def all_handlers(self) -> tuple[tuple[str, str], ...]:
        return MEMBERSHIP + tuple(plan(self.host.sys, self.mode)[0])

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        return plan(host.sys, self.mode)[1]

    def start(self, target: Target) -> None:
        self._expired, self._swept = 0, self.clock()
        why = plan(self.host.sys, self.mode)[1]
        if why:
            raise ProbeUnavailable(why)
        super().start(target)

    def sweep(self) -> int:
        """Drop this slot's in-flight entries older than STALE_NS; how many. The LRU bounds the map anyway, but an
        entry that nothing will consume should not wait for memory pressure to go."""
        table = self.loaded.maps["inflight"]
        now, gone = self.clock(), 0
        for key, val in table.items():
            if val.slot == self.slot and now - val.born_ns > STALE_NS and table.delete(key):
                gone += 1
        self._swept = now
        return gone

    def reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs, and the entries given up so far."""
        if self.clock() - self._swept >= self.sweep_every_ns:
            self._expired += self.sweep()
        per_cpu = self.loaded.maps["stats"].lookup(self.slot)
        out: dict[str, Any] = {"expired": self._expired}
        for i, d in enumerate(DIRS):
            out[d] = {k: sum(getattr(s.dir[i], k) for s in per_cpu) for k in COUNTERS}
            out[d]["hist"] = [sum(s.dir[i].hist[b] for s in per_cpu) for b in range(NBUCKETS)]
        return out

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return interval(now, before)
