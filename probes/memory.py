# SPDX-License-Identifier: Apache-2.0
"""memory — what memory pressure does to the job: page faults (major, minor), reclaim and compaction stalls, OOM
kills.

Measures, per interval, for the job's threads: page faults (hardware faults on user addresses, the count perf's
page-faults event gives), major and minor faults (the kernel's own PGMAJFAULT / PGFAULT accounting, as in
getrusage's ru_majflt / ru_minflt and memory.stat), direct reclaim and memcg reclaim stalls (count, ns, a log2 µs
histogram, pages reclaimed), compaction stalls (count, ns); and each OOM kill of a job process as an `oom_kill`
event frame (pid, comm, sizes from the tracepoint).
Hooks: eBPF on tracepoints (bpf/memory.c): exceptions:page_fault_user + page_fault_kernel (all faults: perf's
software counter is not a tracepoint, and kprobes are not assumed), memcg:count_memcg_events for majors/minors (no
tracepoint marks a major fault itself; this one carries the PGFAULT/PGMAJFAULT items, whose enum values are read
from BTF, never from headers), vmscan:mm_vmscan_{direct,memcg}_reclaim_{begin,end},
compaction:mm_compaction_{begin,end}, oom:mark_victim; fork/exit of bpf/common.h. Each part whose tracepoints are
missing is left out and its fields are absent (listed in `unavailable` with the reason), not zero.
Oldest kernel: 4.18; exceptions:* x86 only; count_memcg_events 6.14 (and memcg not disabled); mark_victim's comm
and sizes 6.8.
Cost, measured in the 6.18 VM with bpf_stats (tests/test_memory.py::test_cost_per_fault, ~100k anonymous faults
of a job in a cgroup): on_fault_user ~70 ns per run, on_memcg_event ~50 ns per run and ~2 runs per fault (PGFAULT,
and the charge's PGPGIN on v1 memcg): ~175 ns per page fault in all. Stalls: one hash update + delete per stall of
a job thread; an exiting task: one lookup in oom_victims. sample(): one per-CPU lookup and one walk of a (nearly
always empty) 256-entry hash. Start: ~0.5 s to compile in the loader subprocess; BTF scan ~10 ms.
"""
from __future__ import annotations

import ctypes as ct
import functools
import struct
import time
from pathlib import Path
from typing import Any

from jobprobe.contract.bpfprobe import MEMBERSHIP, BpfProbe
from jobprobe.contract.probe import EVENTS_KEY, Field
from jobprobe.core.counters import delta
from jobprobe.kernel import tracefs
from jobprobe.kernel.btf import enum_values
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node, proc_gone

NBUCKETS = 27       # bpf/memory.c NBUCKETS
SLOT_PENDING, SLOT_NONE = -2, -1
COUNTERS = ("faults", "acct_faults", "major_faults", "direct_reclaim", "direct_reclaim_ns", "memcg_reclaim",
            "memcg_reclaim_ns", "reclaimed_pages", "compaction", "compaction_ns", "untracked_stalls")

# part → (tracepoints and handlers in attach order, fields it gives). Ends are attached before their begins, so a
# begin seen is always followed by its end and no stall entry is left behind.
PARTS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[str, ...]]] = {
    "faults": ((("exceptions:page_fault_user", "on_fault_user"), ("exceptions:page_fault_kernel", "on_fault_kernel")),
               ("page_faults",)),
    "memcg_events": ((("memcg:count_memcg_events", "on_memcg_event"),), ("major_faults", "minor_faults")),
    "direct_reclaim": ((("vmscan:mm_vmscan_direct_reclaim_end", "on_direct_end"),
                        ("vmscan:mm_vmscan_direct_reclaim_begin", "on_direct_begin")),
                       ("direct_reclaim_stalls", "direct_reclaim_ns")),
    "memcg_reclaim": ((("vmscan:mm_vmscan_memcg_reclaim_end", "on_memcg_end"),
                       ("vmscan:mm_vmscan_memcg_reclaim_begin", "on_memcg_begin")),
                      ("memcg_reclaim_stalls", "memcg_reclaim_ns")),
    "compaction": ((("compaction:mm_compaction_end", "on_compact_end"),
                    ("compaction:mm_compaction_begin", "on_compact_begin")), ("compaction_stalls", "compaction_ns")),
    "oom": ((("oom:mark_victim", "on_mark_victim"),), ("oom_kills",)),
}
RECLAIM_FIELDS = ("reclaimed_pages", "reclaim_us_log2")   # present with either reclaim part
OOM_FIELDS = {"total_vm": "OOM_HAS_RSS", "pgtables": "OOM_HAS_PGTABLES", "uid": "OOM_HAS_UID",
              "oom_score_adj": "OOM_HAS_SCORE_ADJ"}

# The `oom_kill` event frame's own fields (docs/FRAMES.md, event frames); sizes only where the kernel gives them.
EVENT_FIELDS = {
    "pid": Field("int", "pid", "the victim's pid (the task the OOM killer chose)"),
    "comm": Field("str", "—", "the victim's command name"),
    "total_vm_bytes": Field("int", "bytes", "the victim's virtual memory size when chosen"),
    "anon_rss_bytes": Field("int", "bytes", "its anonymous resident memory"),
    "file_rss_bytes": Field("int", "bytes", "its file-backed resident memory"),
    "shmem_rss_bytes": Field("int", "bytes", "its shared-memory resident memory"),
    "pgtables_bytes": Field("int", "bytes", "its page tables"),
    "uid": Field("int", "—", "its user id"),
    "oom_score_adj": Field("int", "—", "its oom_score_adj"),
}


class SlotStats(ct.Structure):
    """bpf/memory.c struct slot_stats, one per job slot and CPU (the map checks the size at start)."""
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS] + [("reclaim_hist", ct.c_uint64 * NBUCKETS)]


class OomRec(ct.Structure):
    """bpf/memory.c struct oom_rec."""
    _fields_ = [("ts_ns", ct.c_uint64), ("slot", ct.c_int32), ("pid", ct.c_uint32), ("total_vm_kb", ct.c_uint64),
                ("anon_rss_kb", ct.c_uint64), ("file_rss_kb", ct.c_uint64), ("shmem_rss_kb", ct.c_uint64),
                ("pgtables_kb", ct.c_uint64), ("uid", ct.c_uint32), ("oom_score_adj", ct.c_int32),
                ("comm", ct.c_char * 16)]


# ---- feature detection (pure: every path under a root) ---------------------------------------------------------
def tracepoint_format(sys_root: str, tp: str) -> str:
    return tracefs.event_format(sys_root, *tp.split(":")) or ""


def memcg_disabled(proc: str) -> bool:
    """cgroup_disable=memory: /proc/cgroups says memory is not enabled (then no memcg event fires)."""
    try:
        for line in Path(proc, "cgroups").read_text().splitlines():
            cols = line.split()
            if cols and cols[0] == "memory":
                return cols[-1] == "0"
    except OSError:
        pass
    return False


def plan(host: Host) -> tuple[list[tuple[str, str]], list[str], dict[str, str]]:
    """What this host offers: (handlers to attach, cflags, {absent field: why})."""
    handlers: list[tuple[str, str]] = []
    cflags: list[str] = []
    absent: dict[str, str] = {}
    for part, (hooks, fields) in PARTS.items():
        missing = [tp for tp, _ in hooks if not host.tracepoint_exists(*tp.split(":"))]
        why = f"tracepoint {missing[0]} not found in tracefs" if missing else None
        if why is None and part == "memcg_events":
            why, items = memcg_items(host)
            cflags += [f"-D{k}_ITEM={v}" for k, v in items.items()]
        if why is None and part == "oom":
            cflags += oom_cflags(tracepoint_format(host.sys, "oom:mark_victim"))
        if why:
            absent.update({f: why for f in fields})
            continue
        handlers += hooks
        cflags.append(f"-DHAVE_{part.upper()}")
    if "direct_reclaim_ns" in absent and "memcg_reclaim_ns" in absent:
        absent.update({f: "no reclaim tracepoints" for f in RECLAIM_FIELDS})
    return handlers, cflags, absent


@functools.lru_cache(maxsize=4)
def pgfault_items(btf_path: str) -> dict[str, int]:
    """The kernel's numbers of PGFAULT and PGMAJFAULT, read once per process (the BTF file is ~5 MiB and every job
    the agent attaches asks again). Do not change the result."""
    return enum_values(btf_path, ("PGFAULT", "PGMAJFAULT"))


def memcg_items(host: Host) -> tuple[str | None, dict[str, int]]:
    if memcg_disabled(host.proc):
        return "the memory cgroup controller is disabled (cgroup_disable=memory)", {}
    try:
        items = pgfault_items(f"{host.sys}/kernel/btf/vmlinux")
    except (OSError, ValueError, struct.error) as err:
        return f"no kernel BTF to number PGFAULT/PGMAJFAULT: {err}", {}
    return (None if items else "PGFAULT/PGMAJFAULT not found in the kernel's BTF"), items


def oom_cflags(fmt: str) -> list[str]:
    flags = [flag for field, flag in OOM_FIELDS.items() if f" {field};" in fmt]
    if "__data_loc char[] comm;" in fmt:
        flags.append("OOM_HAS_COMM_LOC")
    elif "char comm[" in fmt:
        flags.append("OOM_HAS_COMM")
    return [f"-D{f}" for f in flags]


# ---- readings → frame fields ----------------------------------------------------------------------------------
def interval(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Every sample field of one interval from two cumulative readings {counter: int, "hist": [int]*NBUCKETS}."""
    d = {k: delta(now[k], before[k]) for k in COUNTERS}
    return {
        "page_faults": d["faults"],
        "major_faults": d["major_faults"],
        # PGFAULT is counted as a fault ends, PGMAJFAULT while it waits: a tick between the two could go below 0.
        "minor_faults": max(0, d["acct_faults"] - d["major_faults"]),
        "direct_reclaim_stalls": d["direct_reclaim"],
        "direct_reclaim_ns": d["direct_reclaim_ns"],
        "memcg_reclaim_stalls": d["memcg_reclaim"],
        "memcg_reclaim_ns": d["memcg_reclaim_ns"],
        "reclaimed_pages": d["reclaimed_pages"],
        "reclaim_us_log2": [delta(a, b) for a, b in zip(now["hist"], before["hist"])],
        "compaction_stalls": d["compaction"],
        "compaction_ns": d["compaction_ns"],
        "untracked_stalls": d["untracked_stalls"],
    }


def zero_reading() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, "hist": [0] * NBUCKETS}


def oom_event(rec: OomRec, cflags: list[str], now_unix: float, now_mono_ns: int) -> dict[str, Any]:
    """The event of one recorded victim; only the details its tracepoint gave."""
    ev: dict[str, Any] = {"event": "oom_kill", "t": now_unix - max(0, now_mono_ns - rec.ts_ns) / 1e9,
                          "pid": rec.pid}
    has = {f[2:] for f in cflags}
    if "OOM_HAS_COMM_LOC" in has or "OOM_HAS_COMM" in has:
        ev["comm"] = rec.comm.decode(errors="replace")
    if "OOM_HAS_RSS" in has:   # the tracepoint gives kB
        for k in ("total_vm", "anon_rss", "file_rss", "shmem_rss"):
            ev[f"{k}_bytes"] = getattr(rec, f"{k}_kb") * 1024
    if "OOM_HAS_PGTABLES" in has:
        ev["pgtables_bytes"] = rec.pgtables_kb * 1024
    if "OOM_HAS_UID" in has:
        ev["uid"] = rec.uid
    if "OOM_HAS_SCORE_ADJ" in has:
        ev["oom_score_adj"] = rec.oom_score_adj
    return ev


class MemoryProbe(BpfProbe):
    name = "memory"
    default = False   # every page fault on the node passes it (~200 ns): opt in with --probes +memory
    needs_root = True
    summary = "page faults (major/minor), reclaim and compaction stalls, OOM kills of the job (eBPF, mm tracepoints)"
    fields = {
        "page_faults": Field("int", "count", "page faults of the job's threads on user addresses, from user or "
                             "kernel mode (what perf's page-faults counts)"),
        "major_faults": Field("int", "count", "major faults: the page had to be read (file not in the page cache, "
                              "or swap-in); the kernel's PGMAJFAULT"),
        "minor_faults": Field("int", "count", "faults served without I/O: the kernel's PGFAULT minus PGMAJFAULT"),
        "direct_reclaim_stalls": Field("int", "count", "times a job thread reclaimed memory itself because the "
                                       "node ran low (direct reclaim)"),
        "direct_reclaim_ns": Field("int", "ns", "time the job's threads spent in direct reclaim"),
        "memcg_reclaim_stalls": Field("int", "count", "times a job thread reclaimed because its memory cgroup "
                                      "hit its limit"),
        "memcg_reclaim_ns": Field("int", "ns", "time the job's threads spent in memory-cgroup reclaim"),
        "reclaimed_pages": Field("int", "pages", "pages freed by the job's direct and memcg reclaim stalls"),
        "reclaim_us_log2": Field("list[int]", "count", f"direct + memcg reclaim stall histogram: bucket i counts "
                                 f"stalls of [2^i, 2^(i+1)) µs (bucket 0: [0, 2)), {NBUCKETS} buckets"),
        "compaction_stalls": Field("int", "count", "zone compactions run in the job's threads: direct compaction "
                                   "for an allocation (once per zone tried), or a write to compact_memory"),
        "compaction_ns": Field("int", "ns", "time the job's threads spent compacting memory"),
        "oom_kills": Field("int", "count", "job processes chosen by the OOM killer (each also an oom_kill event)"),
        "untracked_stalls": Field("int", "count", "reclaim or compaction stalls of the job begun while the node's "
                                  "stall table (10 240 threads at once) was full: not in the stall counts and "
                                  "times above — the shortfall counted"),
    }

    bpf_name = "memory"
    # One load for every job of the node: sample() reads its slot; drain_oom() takes only its own and undecided-not-
    # ours records.
    map_types = {"stats": (ct.c_uint32, SlotStats), "stalls": (ct.c_uint64, None),
                 "oom_victims": (ct.c_uint32, OomRec)}

    def __init__(self, host: Host | None = None, node: Node | None = None):
        super().__init__(host, node)
        self.unavailable: dict[str, str] = {}   # field → why it is absent on this host (decided at start)
        self.handlers: tuple[tuple[str, str], ...] = ()

    def check(self, host: Host) -> str | None:
        if self.needs_root and not host.is_root:
            return "needs root"
        missing = [tp for tp, _ in MEMBERSHIP if not host.tracepoint_exists(*tp.split(":"))]
        if missing:
            return f"tracepoint {missing[0]} not found in tracefs"
        handlers, _, _ = plan(host)
        if not handlers:
            return "none of its tracepoints (exceptions, memcg, vmscan, compaction, oom) found in tracefs"
        return super().check(host)   # bcc importable; every tracepoint of all_handlers() (self.host's plan)

    def all_handlers(self) -> tuple[tuple[str, str], ...]:
        if not self.handlers:
            self.handlers = tuple(plan(self.host)[0])
        return self.handlers + self.hook_handlers()

    def configure(self) -> None:
        handlers, cflags, self.unavailable = plan(self.host)
        self.handlers, self.cflags = tuple(handlers), tuple(cflags)

    def reading(self) -> dict[str, Any]:
        out = self.slot_totals()
        out["hist"] = out.pop("reclaim_hist")
        return out

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in interval(now, before).items() if k not in self.unavailable}

    def sample(self) -> dict[str, Any]:
        out = super().sample()
        if self.loaded is None or "oom_kills" in self.unavailable:
            return out
        events = self.drain_oom()
        out["oom_kills"] = len(events)
        if events:
            out[EVENTS_KEY] = events
        return out

    def drain_oom(self) -> list[dict[str, Any]]:
        """Events of this job's victims; they, and entries decided as no job's, leave the map (another job's stay for
        its own drain, and go with its slot at its detach). A victim not decided yet (still
        dying) stays for a later tick, unless its process is gone: then its exit said "no job" just now, or it
        exited before we attached — either way not ours."""
        table = self.loaded.maps["oom_victims"]
        now_unix, now_mono = time.time(), time.monotonic_ns()
        events = []
        for pid, rec in table.items():
            if rec.slot == SLOT_PENDING and proc_gone(self.host.proc, pid):
                rec = table.lookup(pid) or rec   # decided by its exit between the walk and the look
            if rec.slot == SLOT_PENDING and not proc_gone(self.host.proc, pid):
                continue
            if rec.slot >= 0 and rec.slot != self.slot:
                continue                         # another job's, on a node where jobs share the program: its own
            if rec.slot == self.slot:
                events.append(oom_event(rec, list(self.cflags), now_unix, now_mono))
            table.delete(pid)
        return sorted(events, key=lambda e: e["t"])
