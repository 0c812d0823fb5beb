# SPDX-License-Identifier: Apache-2.0
"""blockio — the job's block I/O: requests, bytes and device latency, reads and writes apart.

Measures, per interval, for requests the job submitted: completed read and write requests (as the device saw
them, after merges), their exact bytes (partial completions included), errors, and the device latency (issue →
completion) as a log2 µs histogram with sum, p50 and p99.
Hooks: eBPF on block:block_io_start (6.5+; else block:block_bio_queue with block_bio_backmerge and block_split),
block_bio_frontmerge, block_rq_merge, block_rq_issue, block_rq_complete (bpf/blockio.c), plus fork/exit of
bpf/common.h. The owner is decided at submission, in the submitting task's context, and found again at issue and
completion by (dev, sector). Raw tracepoint programs where the kernel has them (4.17) and its BTF
(/sys/kernel/btf/vmlinux) gives the 5.11+ prototypes and the offsets of the struct request/bio/gendisk fields they
read (raw_cflags); else classic tracepoint programs on the format records (classic_why says why). Why raw: the
kernel skips a classic program whenever any classic/kprobe BPF program is already running on its CPU, and a
block_rq_complete in softirq keeps interrupting submit/issue programs under load (12-20k completions missed in 10 s
of fio inside and outside the job, bytes short); a raw program is skipped only when it would re-enter itself.
Oldest kernel: 4.18 (classic); raw programs 5.11 with BTF; the block_io_start mode 6.5 (chosen when it exists).
Cost (bpf_stats, 6.18 VM, 4 KiB O_DIRECT on a loop device, raw programs): a request of the job ~1.1-1.4 µs in all
(per-run averages over its and others' requests: submit hook 455-550 ns, issue 325-360 ns, completion 360-490 ns);
any other request of the node less: its issue and completion are each 4-5 field reads and one missed lookup.
Classic programs ran 140-280 ns each, but that excludes the kernel filling the tracepoint's record for them (the
rwbs string, the command), which raw programs do not need.
sample(): one per-CPU map lookup (~125 µs of Python); every SWEEP_NS a walk of the in-flight map (~45 µs when empty)
drops entries older than STALE_NS (requests that never complete, e.g. on a removed device), counted in
inflight_expired with their bytes in *_lost_bytes; while the job has no process the walk is made each tick and
gives up every entry left (a completion the kernel did not report: bpf/blockio.c), so a job's last frame counts
them. Start: ~70 ms more to index the kernel's BTF.
What can be short, and where it is counted: requests whose completion is not seen (inflight_expired,
*_lost_bytes); runs the kernel skipped (bpf_missed). A job's bio merged into another task's request (contiguous
sectors: rare) counts for that request's owner — not counted.
Not the job's, by design: buffered writes flushed later by writeback kworkers, the filesystem journal (jbd2),
I/O on bio-based devices (dm, md, zram: no requests) — only their lower devices' requests are seen.
bpf_missed can still be nonzero: with classic programs (no raw tracepoints or BTF); with raw ones only when a
completion in hard-irq context (multi-queue devices, e.g. NVMe) interrupts on_rq_complete_raw already running on
that CPU for another completion (softirq or task context); and the classic membership hooks of bpf/common.h (task
context) if a classic/kprobe BPF program is running under them on their CPU.
"""
from __future__ import annotations

import ctypes as ct
import functools
import struct
import time
from pathlib import Path
from typing import Any, Callable

from jobprobe.contract.bpfprobe import BpfProbe
from jobprobe.contract.probe import Field
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta, log2_percentile
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import tracefs
from jobprobe.kernel.bpf import RAW
from jobprobe.kernel.btf import Btf
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node

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

# Raw tracepoint programs (bpf/blockio.c RAW_BLOCK) get the tracepoints' C arguments. The prototypes they are written
# for (5.11+: no request_queue argument), checked against the running kernel's BTF (its btf_trace_<event> typedefs,
# 5.5+); any other shape and the classic programs are used.
RAW_PROTOS = {
    "block_rq_complete": ("struct request *", "blk_status_t", "unsigned int"),
    "block_rq_issue": ("struct request *",), "block_rq_merge": ("struct request *",),
    "block_io_start": ("struct request *",), "block_bio_frontmerge": ("struct bio *",),
    "block_bio_backmerge": ("struct bio *",), "block_bio_queue": ("struct bio *",),
    "block_split": ("struct bio *", "unsigned int"),
}
# -D<name>=<byte offset> for bpf/blockio.c: (struct, member path, size in bytes), from the running kernel's BTF, never
# from the compiled headers (which need not be this kernel's: here 6.12 headers on a 6.18 kernel).
RAW_OFFSETS = {
    "RQ_Q": ("request", "q", 8), "RQ_SECTOR": ("request", "__sector", 8),
    "RQ_DATA_LEN": ("request", "__data_len", 4), "RQ_CMD_FLAGS": ("request", "cmd_flags", 4),
    "Q_DISK": ("request_queue", "disk", 8),
    "DISK_MAJOR": ("gendisk", "major", 4), "DISK_FIRST_MINOR": ("gendisk", "first_minor", 4),
    "BIO_BDEV": ("bio", "bi_bdev", 8), "BIO_OPF": ("bio", "bi_opf", 4),
    "BIO_SECTOR": ("bio", "bi_iter.bi_sector", 8), "BIO_SIZE": ("bio", "bi_iter.bi_size", 4),
    "BDEV_DISK": ("block_device", "bd_disk", 8),
}


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
    """Field names of a tracepoint "category:event"; None when it does not exist."""
    return tracefs.event_fields(sys_root, *tracepoint.split(":"))


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


@functools.lru_cache(maxsize=4)
def raw_flags_once(btf_path: str, events: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """raw_cflags, worked out once per process: indexing the kernel's BTF takes ~70 ms and ~12 MiB of small
    objects, which every job the agent attaches would otherwise pay again (and leave as heap the process keeps)."""
    flags, why = raw_cflags(btf_path, list(events))
    return tuple(flags), why


def raw_cflags(btf_path: str | Path, events: list[str]) -> tuple[list[str], str | None]:
    """The -D flags (struct offsets) of the raw programs for these block events, or why they cannot be used."""
    try:
        btf = Btf(Path(btf_path).read_bytes(),
                  names=[*(f"btf_trace_{e}" for e in events), *(name for name, _, _ in RAW_OFFSETS.values())])
    except (OSError, ValueError, struct.error) as err:
        return [], f"no kernel BTF ({err})"
    for event in events:
        got = btf.tracepoint_args(event)
        if got != RAW_PROTOS[event]:
            return [], f"raw tracepoint {event} has arguments {got}, not {RAW_PROTOS[event]}"
    flags = ["-DRAW_BLOCK"]
    for define, (name, path, want) in RAW_OFFSETS.items():
        try:
            off, size = btf.offset(name, path)
        except (KeyError, struct.error, IndexError) as err:
            return [], f"kernel BTF has no {err}"
        if size != want:
            return [], f"{name}.{path} is {size} bytes in the kernel's BTF, not {want}"
        flags.append(f"-D{define}={off}")
    return flags, None


def interval(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """This interval's fields from two cumulative readings {"read": {counter: int, "hist": [...]}, "write": ...,
    "expired": int, "lost_bytes": [read, write]}."""
    out: dict[str, Any] = {}
    for i, d in enumerate(DIRS):
        a, b = now[d], before[d]
        for k in COUNTERS:
            out[f"{d}_{k}"] = delta(a[k], b[k])
        hist = [delta(x, y) for x, y in zip(a["hist"], b["hist"])]
        out[f"{d}_lat_us_log2"] = hist
        out[f"{d}_lat_p50_us"] = log2_percentile(hist, 0.50)
        out[f"{d}_lat_p99_us"] = log2_percentile(hist, 0.99)
        out[f"{d}_lost_bytes"] = now["lost_bytes"][i] - before["lost_bytes"][i]
    out["inflight_expired"] = now["expired"] - before["expired"]
    return out


def zero_reading() -> dict[str, Any]:
    return {**{d: {**{k: 0 for k in COUNTERS}, "hist": [0] * NBUCKETS} for d in DIRS}, "expired": 0,
            "lost_bytes": [0, 0]}


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
        f"{d}_lost_bytes": Field("int", "bytes", f"bytes of the job's {d} requests given up this interval "
                                 f"(inflight_expired): not in {d}_bytes, the shortfall counted"),
    }


class BlockioProbe(BpfProbe):
    name = "blockio"
    default = True
    needs_root = True
    summary = "block I/O requests, bytes and device latency the job submitted, reads and writes apart (eBPF)"
    fields = {**_dir_fields("read"), **_dir_fields("write"),
              "inflight_expired": Field("int", "count", f"requests of the job whose completion was never seen, given"
                                        f" up this interval: not completed {STALE_NS // 10**9} s after submission "
                                        f"(device gone; I/O on a bio-based device such as dm, which makes no "
                                        f"requests; a completion the kernel did not report), or still pending when "
                                        f"the job had no process left; their bytes are in *_lost_bytes, not in "
                                        f"*_bytes or *_requests")}

    bpf_name = "blockio"
    # One load for every job of the node: sample() reads and sweeps its own slot only; in-flight records carry their
    # slot.
    map_types = {"inflight": (RqKey, RqVal), "stats": (ct.c_uint32, SlotStats)}

    def __init__(self, host: Host | None = None, node: Node | None = None, mode: str | None = None,
                 clock: Callable[[], int] = time.monotonic_ns, raw: bool | None = None):
        super().__init__(host, node)
        self.mode = mode or choose_mode(self.host.sys)   # "io_start" | "bio_queue"; tests force the other one
        self.clock = clock                               # CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns()
        self.sweep_every_ns = SWEEP_NS
        self._expired = 0
        self._lost_bytes = [0, 0]    # per DIRS: bytes of the requests given up
        self._swept = 0
        self.raw = raw              # raw tracepoint programs? None: decided once, by raw_plan(); tests force False
        self.classic_why: str | None = None   # why the classic programs are used, when they are
        self._raw_flags: list[str] = []

    def raw_plan(self) -> bool:
        """Raw tracepoint programs where the kernel has them (4.17) and its BTF gives the prototypes and struct
        offsets they need; else classic ones, the reason kept in classic_why. Decided once. A classic program is
        skipped whenever any classic/kprobe BPF program already runs on its CPU (a completion in softirq interrupting
        a submit hook: thousands a second under fio); a raw one only when it would re-enter itself."""
        if self.raw is None or (self.raw and not self._raw_flags):
            why = None if self.host.has_raw_tracepoints else "no raw tracepoints (Linux 4.17+)"
            if why is None:
                events = [tp.split(":")[1] for tp, _ in plan(self.host.sys, self.mode)[0]]
                flags, why = raw_flags_once(f"{self.host.sys}/kernel/btf/vmlinux", tuple(events))
                self._raw_flags = list(flags)
            if why and self.raw:
                raise ProbeUnavailable(f"raw tracepoint programs asked for: {why}")
            self.raw, self.classic_why = why is None, why
        return bool(self.raw)

    # BpfProbe.check() asks that every handler's tracepoint exists: the optional ones are only listed if they do.
    def all_handlers(self) -> tuple[tuple[str, str], ...]:
        hooks = plan(self.host.sys, self.mode)[0]
        if self.raw_plan():
            hooks = [(RAW + tp, fn + "_raw") for tp, fn in hooks]
        return tuple(hooks) + self.hook_handlers()

    def base_cflags(self) -> list[str]:
        return super().base_cflags() + (self._raw_flags if self.raw_plan() else [])

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        return plan(host.sys, self.mode)[1]

    def start(self, target: Target) -> None:
        self._expired, self._lost_bytes, self._swept = 0, [0, 0], self.clock()
        why = plan(self.host.sys, self.mode)[1]
        if why:
            raise ProbeUnavailable(why)
        super().start(target)

    def sweep(self, everything: bool = False) -> int:
        """Give up this slot's in-flight entries older than STALE_NS (`everything`: all of them — the job has no
        process left, so none of its requests can still be in flight); how many, their bytes added to
        _lost_bytes. The LRU bounds the map anyway, but an entry that nothing will consume should not wait for
        memory pressure to go, and its request must be counted."""
        table = self.loaded.maps["inflight"]
        now, gone = self.clock(), 0
        for key, val in table.items():
            if val.slot == self.slot and (everything or now - val.born_ns > STALE_NS) and table.delete(key):
                gone += 1
                self._lost_bytes[1 if val.op == 1 else 0] += val.left
        self._swept = now
        return gone

    def reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot, summed over CPUs, and the entries given up so far."""
        if self.target is not None and not self.target.pids():
            self._expired += self.sweep(everything=True)     # its last frame, or a group empty for now
        elif self.clock() - self._swept >= self.sweep_every_ns:
            self._expired += self.sweep()
        # Summed as flat u64 columns (DirStats: the COUNTERS, then hist, per direction): reading ctypes fields one
        # by one costs ~0.1 ms a job a tick.
        tot = self.slot_sums()
        out: dict[str, Any] = {"expired": self._expired, "lost_bytes": list(self._lost_bytes)}
        width = len(COUNTERS) + NBUCKETS
        for i, d in enumerate(DIRS):
            cols = tot[i * width:(i + 1) * width]
            out[d] = dict(zip(COUNTERS, cols))
            out[d]["hist"] = cols[len(COUNTERS):]
        return out

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return interval(now, before)
