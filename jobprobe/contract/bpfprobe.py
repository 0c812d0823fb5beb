# SPDX-License-Identifier: Apache-2.0
"""BpfProbe: what every eBPF probe shares — loading through jobprobe.kernel.bpf against the node's membership maps
(jobprobe/kernel/membership.py), a slot per job, and cumulative per-slot readings turned into per-interval deltas.

A probe subclasses it with: `bpf_name` (its bpf/<name>.c), `handlers` (its own (tracepoint, function) pairs; a
module that defines JOB_ON_EXIT_HOOK / JOB_ON_EXEC_HOOK also gets its job_exit_probe / job_exec_probe program),
`map_types` (ctypes key/value types of its own maps), `reading()` (cumulative counters of its slot) and
`interval(now, before)` (the frame fields of one interval).
Node and jobs: a probe instance serves one job. Given a `node` (the agent's), it takes the job's slot from it and uses
the one load of its programs that serves every job of the node — so a probe's sample must read, sweep and drain only
its own slot's state, and keep per-thread records that carry their slot (release() takes them out with the slot).
Without a node (a probe used on its own) it makes a private one and closes it at stop.

Deep-trace windows (jobprobe/node/tracewin.py): a probe that names `trace_kinds` (record kind → ctypes struct, each
starting with bpf/common.h's struct trace_head) is compiled with -DJOB_DEEP_TRACE where the kernel has BPF ring
buffers; trace_on() sets its job's bit in the module's `slots_traced`, and from then its handlers put one record per
event of the job in `trace_ring`. The ring is the load's, shared by every job: trace_poll() (each sample while
tracing) drains it and hands each record to its slot's list; trace_take() returns the job's records. The probe's
trace_events() turns them into Trace Event Format events.
"""
from __future__ import annotations

import contextlib
import ctypes as ct
import importlib.util
import time
from typing import Any, Callable

from jobprobe.contract import tickmemo
from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import bpfload as _bpfload
from jobprobe.kernel import bpfmap as _bpfmap
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import MEMBERSHIP, Node

MISSED = "bpf_missed"
TRACE_KEEP = 400_000           # records kept per job and window; more are counted, not kept
MISSED_FIELD = Field("int", "count", "runs of this probe's BPF programs that the kernel skipped in the interval, "
                     "node-wide (recursion_misses: an event that fired while another BPF program was running on its "
                     "CPU); 0: every event was seen. Always 0 before Linux 5.12, which does not count them",
                     kind="counter")


class BpfProbe(Probe):
    needs_root = True
    bpf_name = ""
    handlers: tuple[tuple[str, str], ...] = ()
    map_types: dict[str, tuple[Any, Any]] = {}
    cflags: tuple[str, ...] = ()
    trace_kinds: dict[int, Any] = {}    # deep-trace records (kind → ctypes struct); empty: no deep mode
    trace_min_ns = 0                    # the module's threshold for a record (slots_traced[1])

    def __init_subclass__(cls, **kw: Any) -> None:
        """Every eBPF probe reports how many of its events the kernel did not run it for (MISSED_FIELD): the
        figures of an interval with bpf_missed > 0 may be short by that many events."""
        super().__init_subclass__(**kw)
        if "fields" in cls.__dict__ and MISSED not in cls.fields:
            cls.fields = {**cls.fields, MISSED: MISSED_FIELD}

    def __init__(self, host: Host | None = None, node: Node | None = None):
        super().__init__(host)
        self.node = node
        self.slot = -1            # the job's slot in the node's membership maps, while started
        self.loaded: _bpfload.Loaded | None = None   # fds of programs, attachments and maps while started
        self.target: Target | None = None
        self._own_node: Node | None = None
        self.shared: Any = None   # the node's SharedLoad this probe uses, while started
        self._load_key: Any = None
        self._last: Any = None
        self._still: dict[str, Any] | None = None   # the interval of a reading equal to the one before
        self._missed = 0
        self._refused0 = 0        # trace_refused of the job's slot when its window opened
        self.read_ns = 0          # when the slot's counters were last read (slot_sums)

    @classmethod
    def build(cls, host: Host, node: Node | None = None, sinks: Callable[[], dict] | None = None) -> BpfProbe:
        """One job's instance on the agent's `node`: the job takes a slot there and shares the node's one load of
        this probe's programs (without it each job would compile and load its own)."""
        return cls(host, node=node)

    # ---- what a probe provides ---------------------------------------------------------------------------
    def reading(self) -> Any:
        """Cumulative values of this probe's slot (summed over CPUs)."""
        raise NotImplementedError

    def interval(self, now: Any, before: Any) -> dict[str, Any]:
        raise NotImplementedError

    def configure(self) -> None:
        """Decide hooks and C defines from the host before anything is loaded (a probe whose plan needs the host's
        tracefs or BTF): called at start and by preload, so that both name the same load."""

    def prepare(self, loaded: _bpfload.Loaded) -> None:
        """Once per load, before any job counts: fill the module's own tables (syscalls' class table)."""

    def slot_totals(self, map_name: str = "stats") -> dict[str, Any]:
        """This slot's per-CPU struct of u64 counters (scalars and arrays) summed over CPUs: {field: int or list}.
        Summed as flat u64 columns: reading ctypes fields one by one costs ~1 ms a tick on wide structs."""
        table = self.loaded.maps[map_name]
        tot = self.slot_sums(map_name)
        out, i = {}, 0
        for name, typ in table.value_type._fields_:
            n = ct.sizeof(typ) // 8
            out[name] = tot[i] if not hasattr(typ, "_length_") else tot[i:i + n]
            i += n
        return out

    def slot_sums(self, map_name: str = "stats") -> list[int]:
        """This slot's per-CPU value of u64 fields summed over CPUs, as flat columns. In an agent tick the whole
        per-slot array is read once (one batch lookup) for every job, with the time of that read (`read_ns`)."""
        table = self.loaded.maps[map_name]
        if not tickmemo.active():
            self.read_ns = time.monotonic_ns()
            return table.lookup_sums(self.slot)
        raw, self.read_ns = tickmemo.get(("slots", table), lambda: (table.array_raw(), time.monotonic_ns()))
        return table.sums_at(raw, self.slot)

    def hook_handlers(self) -> tuple[tuple[str, str], ...]:
        """The module's own exit / exec programs, where its C keeps per-thread state (bpf/common.h)."""
        from jobprobe import bpf
        text = bpf.source(self.bpf_name) if self.bpf_name else ""
        out = []
        if "#define JOB_ON_EXIT_HOOK" in text:
            out.append(("sched:sched_process_exit", "job_exit_probe"))
        if "#define JOB_ON_EXEC_HOOK" in text:
            out.append(("sched:sched_process_exec", "job_exec_probe"))
        return tuple(out)

    def all_handlers(self) -> tuple[tuple[str, str], ...]:
        """What this probe's module attaches: its hooks, then its exit/exec programs (membership itself is the
        node's: MEMBERSHIP, once)."""
        return tuple(self.handlers) + self.hook_handlers()

    # ---- the contract ------------------------------------------------------------------------------------
    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        missing = [tp for tp, _ in MEMBERSHIP + self.all_handlers()
                   if not host.tracepoint_exists(*_bpf.event_of(tp).split(":"))]
        if missing:
            return f"tracepoint {missing[0]} not found in tracefs"
        if importlib.util.find_spec("bcc") is None:
            return "bcc (python3-bpfcc) is not importable"
        return None

    def base_cflags(self) -> list[str]:
        deep = ["-DJOB_DEEP_TRACE"] if self.trace_kinds and _bpfmap.ringbuf_supported() else []
        return ["-w", *self.cflags, *deep]

    # ---- deep-trace windows ----------------------------------------------------------------------------------
    @property
    def deep(self) -> bool:
        """Can this probe, as loaded, record events one by one for a trace window?"""
        return self.loaded is not None and "trace_ring" in self.loaded.maps

    def _ring(self) -> dict[str, Any]:
        """The load's ring reader and per-slot records (made on first use)."""
        extra = self.shared.extra
        if "ring" not in extra:
            m = self.loaded.maps["trace_ring"]
            ring = _bpfmap.RingBuffer(m.fd, m.max_entries)
            self.shared.closers.insert(0, ring.close)
            extra.update(ring=ring, records={}, dropped={})
        return extra

    def trace_on(self, on: bool) -> None:
        """Record this job's events one by one (on), or stop (off: what was recorded stays for trace_take)."""
        if not self.deep:
            return
        with self.shared.lock:
            ring = self._ring()
            traced = self.shared.extra.get("traced", 0)
            traced = traced | (1 << self.slot) if on else traced & ~(1 << self.slot)
            self.shared.extra["traced"] = traced
            if on:
                ring["records"][self.slot], ring["dropped"][self.slot] = [], 0
                self._refused0 = self._refused()
            table = self.loaded.maps["slots_traced"]
            table.update(ct.c_uint32(1), ct.c_uint64(self.trace_min_ns))
            table.update(ct.c_uint32(0), ct.c_uint64(traced))

    def trace_poll(self) -> None:
        """Drain the load's ring into each traced slot's list (records of a slot no longer traced are dropped)."""
        if not self.deep:
            return
        with self.shared.lock:
            ring = self._ring()
            records, dropped = ring["records"], ring["dropped"]
            for rec in ring["ring"].drain():
                slot = int.from_bytes(rec[4:8], "little")
                mine = records.get(slot)
                if mine is None:
                    continue
                if len(mine) < TRACE_KEEP:
                    mine.append(self.trace_keep(rec))
                else:
                    dropped[slot] += 1

    def trace_keep(self, rec: bytes) -> Any:
        """What of a record is kept until trace_take (its bytes; a probe whose records carry stacks keeps one copy
        of each stack)."""
        return rec

    def _refused(self) -> int:
        """Records of this slot the kernel's ring refused since the load (bpf/common.h trace_refused)."""
        table = self.loaded.maps.get("trace_refused")
        raw = table.lookup(ct.c_uint32(self.slot)) if table is not None else None
        return int.from_bytes(bytes(raw)[:8], "little") if raw is not None else 0

    def trace_take(self) -> tuple[list[Any], int]:
        """This job's records since trace_on (decoded by kind), and how many were lost: not kept (over
        TRACE_KEEP), or refused by the kernel's ring (full, or its lock not taken: counted in the kernel)."""
        if not self.deep:
            return [], 0
        self.trace_poll()
        with self.shared.lock:
            ring = self._ring()
            raw = ring["records"].pop(self.slot, [])
            dropped = ring["dropped"].pop(self.slot, 0) + self._refused() - self._refused0
        out = []
        for rec in raw:
            head, tail = rec if isinstance(rec, tuple) else (rec, None)
            t = self.trace_kinds.get(int.from_bytes(head[:4], "little"))
            if t is not None and len(head) >= ct.sizeof(t):
                out.append(t.from_buffer_copy(head[:ct.sizeof(t)]))
                out[-1].tail = tail if tail is not None else head[ct.sizeof(t):]   # what follows the struct
        return out, dropped

    def trace_events(self, records: list[Any], clock: Any) -> list[dict[str, Any]]:
        """Trace Event Format events of this probe's records; clock.us(ktime_ns) places a kernel time in the
        window's timeline (µs since its start)."""
        return []

    def pinned(self) -> dict[str, int]:
        """The node's membership maps, for the loader (bpf/common.h JOB_PIN_DIR)."""
        return self.node_in_use().pinned()

    def node_in_use(self) -> Node:
        node = self.node or self._own_node
        if node is None:
            raise RuntimeError("BpfProbe: not started")
        return node

    def load(self, target: Target) -> _bpfload.Loaded:
        """Compile and attach in a loader subprocess; ProbeUnavailable carries the compiler/verifier's words. A
        probe that attaches more than tracepoints (cgroup programs, uprobes) overrides this."""
        return _bpfload.load(self.bpf_name, self.base_cflags(), self.all_handlers(), sys_root=self.host.sys,
                         pinned=self.pinned())

    def _load_typed(self, target: Target) -> _bpfload.Loaded:
        loaded = self.load(target)
        try:
            maps = loaded.maps
            maps["job_of_cgroup"].typed(ct.c_uint64, ct.c_uint32)
            maps["job_of_tgid"].typed(ct.c_uint32, ct.c_uint32)
            maps["job_kinds"].typed(ct.c_uint32, ct.c_uint32)
            maps["slots_on"].typed(ct.c_uint32, ct.c_uint64)
            for name, (key, value) in self.map_types.items():
                maps[name].typed(key, value)
            self.prepare(loaded)
        except BaseException:
            loaded.close()
            raise
        return loaded

    def load_key(self) -> Any:
        return (type(self), tuple(self.base_cflags()), self.all_handlers())

    def preload(self, target: Target | None = None) -> None:
        """Load this probe's programs into the node now (the agent's start), so that attaching a job later compiles
        nothing (the agent's node keeps its loads)."""
        self.configure()
        self.node.shared(self.load_key(), lambda: self._load_typed(target))
        self.node.unshare(self.load_key())

    def start(self, target: Target) -> None:
        self.target = target
        self.configure()
        try:
            if self.node is None:
                self._own_node = Node(self.host)
            node = self.node_in_use()
            self.slot = node.attach(target)
            self._load_key = self.load_key()
            shared = node.shared(self._load_key, lambda: self._load_typed(target))
            self.shared, self.loaded = shared, shared.loaded
            self.release()                  # a slot reused: nothing of its last job is left
            self._last = self.reading()
            self._missed = self.missed_total()
            shared.set_slot(self.slot, True)
        except ProbeUnavailable:
            self.stop()
            raise
        except (OSError, KeyError, ValueError) as err:  # /proc and /sys; a full map (E2BIG); a layout mismatch
            self.stop()
            raise ProbeUnavailable(f"cannot register the job with the {self.name} probe: {err}") from err

    def sample(self) -> dict[str, Any]:
        if self.loaded is None:
            return {}
        self.sync_members()
        if self.shared is not None and (self.shared.extra.get("traced", 0) >> self.slot) & 1:
            self.trace_poll()              # a window is open: the ring is drained each tick, never left to fill
        now = self.reading()
        if now == self._last:   # nothing happened (an idle job): the zero interval, worked out once
            if self._still is None:
                self._still = self.interval(now, now)
            out = dict(self._still)
        else:
            out = self.interval(now, self._last)
        self._last = now
        missed = self.missed_total()
        out[MISSED], self._missed = missed - self._missed, missed
        return out

    def missed_total(self) -> int:
        """Runs the kernel skipped, summed over this probe's programs since they were loaded."""
        if self.loaded is None:
            return 0
        loaded = self.loaded     # a shared load's counts are the same for every job of a tick: read once
        return tickmemo.get(("missed", loaded),
                            lambda: sum(s.recursion_misses for s in loaded.prog_stats().values()))

    def release(self) -> None:
        """Take this slot's state out of the module's maps: the per-slot counters zeroed, every entry whose value
        names the slot deleted (per-thread records of the job's threads)."""
        if self.loaded is None or self.slot < 0:
            return
        def has_slot(t: Any) -> bool:
            return t is not None and any(f == "slot" for f, _ in getattr(t, "_fields_", ()))
        for name, (key_t, value_t) in self.map_types.items():   # records first: they may still add to the counters
            if name == "stats" or not (has_slot(key_t) or has_slot(value_t)):
                continue
            table = self.loaded.maps[name]
            for key, val in table.items():
                if (key if has_slot(key_t) else val).slot == self.slot:
                    table.delete(key)
        if "stats" in self.map_types:
            table, value = self.loaded.maps["stats"], self.map_types["stats"][1]
            table.update(self.slot, [value()] * table.ncpus if table.percpu else value())

    def stop(self) -> None:
        """Stop counting for the job, release its slot's state and the load (its programs detach when no job
        uses them), the job's membership (when no other probe of the job holds it). Idempotent."""
        node = self.node or self._own_node
        if node is not None and self.shared is not None:
            if (self.shared.extra.get("traced", 0) >> self.slot) & 1:
                with contextlib.suppress(OSError):
                    self.trace_on(False)
                self.shared.extra["records"].pop(self.slot, None)
            self.shared.set_slot(self.slot, False)
            with contextlib.suppress(OSError):
                self.release()
            self.loaded = None
            node.unshare(self._load_key)
        if node is not None and self.target is not None and self.slot >= 0:
            node.detach(self.target)
        self.slot, self.target, self.shared = -1, None, None
        if self._own_node is not None:
            self._own_node.close()
            self._own_node = None

    # ---- job membership (jobprobe/kernel/membership.py) ----------------------------------------------------------
    def sync_members(self) -> None:
        """What the kernel cannot see by itself (a cgroup made after attach, a SLURM step started by slurmstepd
        outside the tree) has been found by the target's refresh: add it (once per tick for the job)."""
        if self.target is not None:
            self.node_in_use().sync(self.target)

    def members(self) -> set[int]:
        """tgids (and member threads' tids) in the kernel's job_of_tgid map for this probe's slot."""
        node = self.node or self._own_node
        if node is None or self.slot < 0:
            return set()
        return node.members(self.slot)
