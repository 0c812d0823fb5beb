"""BpfProbe: what every eBPF probe shares — loading through probes._bpf, the job-membership maps of bpf/common.h
kept current, and cumulative per-slot readings turned into per-interval deltas.

A probe subclasses it with: `bpf_name` (its bpf/<name>.c), `handlers` (its own (tracepoint, function) pairs; the
membership handlers job_fork/job_exit/job_exec are attached first, so forks are followed before the job is registered),
`map_types` (ctypes key/value types of its own maps), `reading()` (cumulative counters of its slot) and
`interval(now, before)` (the frame fields of one interval).
"""
from __future__ import annotations

import array
import contextlib
import ctypes as ct
import importlib.util
from pathlib import Path
from typing import Any

from jobprobe.errors import ProbeUnavailable, TargetGone
from jobprobe.host import Host
from jobprobe.probe import Field, Probe
from jobprobe.target import Target
from probes import _bpf

JOB_BY_CGROUP, JOB_BY_TGID = 1, 2     # bpf/common.h job_kinds bits
MEMBERSHIP = (("sched:sched_process_fork", "job_fork"), ("sched:sched_process_exit", "job_exit"),
              ("sched:sched_process_exec", "job_exec"))


def exit_has_group_dead(sys_root: str = "/sys") -> bool:
    """Whether sched_process_exit carries group_dead (recent kernels), read from the tracepoint's format file."""
    for base in ("kernel/tracing", "kernel/debug/tracing"):
        try:
            return "group_dead" in Path(sys_root, base, "events/sched/sched_process_exit/format").read_text()
        except OSError:
            continue
    return False


def proc_gone(proc: str, pid: int) -> bool:
    """True when pid has exited: no /proc entry, or a zombie/dead task (its exit tracepoint has fired)."""
    try:
        stat = Path(proc, str(pid), "stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")


MISSED = "bpf_missed"
MISSED_FIELD = Field("int", "count", "runs of this probe's BPF programs that the kernel skipped in the interval, "
                     "node-wide (recursion_misses: an event that fired while another BPF program was running on its "
                     "CPU); 0: every event was seen. Always 0 before Linux 5.12, which does not count them")


class BpfProbe(Probe):
    needs_root = True
    bpf_name = ""
    handlers: tuple[tuple[str, str], ...] = ()
    map_types: dict[str, tuple[Any, Any]] = {}
    cflags: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        """Every eBPF probe reports how many of its events the kernel did not run it for (MISSED_FIELD): the
        figures of an interval with bpf_missed > 0 may be short by that many events."""
        super().__init_subclass__(**kw)
        if "fields" in cls.__dict__ and MISSED not in cls.fields:
            cls.fields = {**cls.fields, MISSED: MISSED_FIELD}

    def __init__(self, host: Host | None = None, slot: int = 0):
        super().__init__(host)
        self.slot = slot          # job slot in the membership maps (one job per probe instance for now)
        self.loaded: _bpf.Loaded | None = None   # fds of programs, attachments and maps while started
        self.target: Target | None = None
        self._cg_ids: set[int] = set()
        self._last: Any = None
        self._missed = 0

    # ---- what a probe provides ---------------------------------------------------------------------------
    def reading(self) -> Any:
        """Cumulative values of this probe's slot (summed over CPUs)."""
        raise NotImplementedError

    def interval(self, now: Any, before: Any) -> dict[str, Any]:
        raise NotImplementedError

    def slot_totals(self, map_name: str = "stats") -> dict[str, Any]:
        """This slot's per-CPU struct of u64 counters (scalars and arrays) summed over CPUs: {field: int or list}.
        Summed as flat u64 columns: reading ctypes fields one by one costs ~1 ms a tick on wide structs."""
        per_cpu = self.loaded.maps[map_name].lookup(self.slot)
        tot = [sum(col) for col in zip(*(array.array("Q", bytes(s)) for s in per_cpu))]
        out, i = {}, 0
        for name, typ in type(per_cpu[0])._fields_:
            n = ct.sizeof(typ) // 8
            out[name] = tot[i] if not hasattr(typ, "_length_") else tot[i:i + n]
            i += n
        return out

    def all_handlers(self) -> tuple[tuple[str, str], ...]:
        return MEMBERSHIP + tuple(self.handlers)

    # ---- the contract ------------------------------------------------------------------------------------
    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        missing = [tp for tp, _ in self.all_handlers()
                   if not host.tracepoint_exists(*tp.removeprefix(_bpf.RAW).split(":"))]
        if missing:
            return f"tracepoint {missing[0]} not found in tracefs"
        if importlib.util.find_spec("bcc") is None:
            return "bcc (python3-bpfcc) is not importable"
        return None

    def base_cflags(self) -> list[str]:
        cflags = ["-w", *self.cflags]
        if exit_has_group_dead(self.host.sys):
            cflags.append("-DJOB_EXIT_HAS_GROUP_DEAD")
        return cflags

    def load(self, target: Target) -> _bpf.Loaded:
        """Compile and attach in a loader subprocess; ProbeUnavailable carries the compiler/verifier's words. A
        probe that attaches more than tracepoints (cgroup programs, uprobes) overrides this."""
        return _bpf.load(self.bpf_name, self.base_cflags(), self.all_handlers(), sys_root=self.host.sys)

    def start(self, target: Target) -> None:
        self.target = target
        try:
            self.loaded = self.load(target)
            maps = self.loaded.maps
            maps["job_of_cgroup"].typed(ct.c_uint64, ct.c_uint32)
            maps["job_of_tgid"].typed(ct.c_uint32, ct.c_uint32)
            maps["job_kinds"].typed(ct.c_uint32, ct.c_uint32)
            for name, (key, value) in self.map_types.items():
                maps[name].typed(key, value)
            self._register()
            self._last = self.reading()
            self._missed = self.missed_total()
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
        now = self.reading()
        out = self.interval(now, self._last)
        self._last = now
        missed = self.missed_total()
        out[MISSED], self._missed = missed - self._missed, missed
        return out

    def missed_total(self) -> int:
        """Runs the kernel skipped, summed over this probe's programs since they were loaded."""
        if self.loaded is None:
            return 0
        return sum(s.recursion_misses for s in self.loaded.prog_stats().values())

    def stop(self) -> None:
        """Detach every tracepoint, close program and map fds. Idempotent."""
        loaded, self.loaded = self.loaded, None
        self._cg_ids, self.target = set(), None
        if loaded is not None:
            loaded.close()

    # ---- job membership (bpf/common.h) -------------------------------------------------------------------
    def _register(self) -> None:
        """Put the job's cgroups or processes in the membership maps. For a PID tree, the in-kernel fork handler
        follows forks only of processes already in the map, so the tree is scanned again afterwards to catch
        children forked between the first scan and the insert."""
        target = self.target
        if target is None:
            return
        kinds = self.loaded.maps["job_kinds"]
        kinds.update(0, (kinds.lookup(0) or 0) | (JOB_BY_CGROUP if target.kind == "cgroup" else JOB_BY_TGID))
        if target.kind == "cgroup":
            self._sync_cgroups()
            return
        self._add_pids(target.pids())
        with contextlib.suppress(TargetGone):  # every process already exited: nothing more to add
            target.refresh()
        self._add_pids(target.pids())

    def sync_members(self) -> None:
        """What the kernel cannot see by itself (a cgroup made after attach, a SLURM step started by slurmstepd
        outside the tree) has been found by the target's refresh: add it."""
        if self.target is None:
            return
        if self.target.kind == "cgroup":
            self._sync_cgroups()
        else:
            self._add_pids(self.target.pids())

    def _sync_cgroups(self) -> None:
        """Add ids of groups created since the last call (new steps, sub-containers), drop those removed."""
        table = self.loaded.maps["job_of_cgroup"]
        ids = set(self.target.cgroup_ids())
        for cg in ids - self._cg_ids:
            table.update(cg, self.slot)
        for cg in self._cg_ids - ids:
            table.delete(cg)
        self._cg_ids = ids

    def _add_pids(self, pids: list[int]) -> None:
        table = self.loaded.maps["job_of_tgid"]
        for pid in pids:
            if pid in table:
                continue
            table.update(pid, self.slot)
            # Insert first, then look: a process that exits after the look finds its key and deletes it in the
            # kernel; one that exited before it is removed here. Either way no stale key stays.
            if proc_gone(self.host.proc, pid):
                table.delete(pid)

    def members(self) -> set[int]:
        """tgids (and member threads' tids) in the kernel's job_of_tgid map for this probe's slot."""
        if self.loaded is None:
            return set()
        return {k for k, v in self.loaded.maps["job_of_tgid"].items() if v == self.slot}
