# SPDX-License-Identifier: Apache-2.0
"""The node's eBPF state that every probe and job share: one membership owner, one load of each probe's programs.

What: `Node` loads bpf/membership.c once — the maps job_of_cgroup, job_of_tgid, job_kinds and their upkeep at fork,
  exit and exec — and hands each job a slot (0..MAX_SLOTS-1): attach(target) writes the job's cgroup ids or
  processes in, sync(target) adds what the kernel cannot see by itself (a group made later, a step started from
  outside the tree), detach(target) takes every entry of the slot out again. Every eBPF probe's module is compiled
  against the same three maps (handed to its loader by fd, pinned where only the loader sees them: bpf/common.h,
  jobprobe/kernel/bpf_loader.py), so the node runs one set of membership handlers whatever the number of probes
  and jobs.
  `Node.shared(key, load)` keeps one load of a probe's programs for all the jobs that use it (reference-counted);
  each job's slot bit in the module's `slots_on` says whether that probe counts for that job.
Slots are reused least-recently-freed first, and a probe zeroes what it kept for a slot when the slot is released
  (BpfProbe.release), so a new job never inherits another's figures.
Hooks: sched:sched_process_fork, sched_process_exit, sched_process_exec (bpf/membership.c). Kernel: 4.18.
Cost: one compile at the node's start (~0.3 s); attach/detach: one map write per cgroup or process (and a walk of
  job_of_tgid at detach for the processes forked since).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes as ct
import threading
import time
from typing import Any, Callable, Protocol

from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.kernel import bpfload as _bpfload
from jobprobe.kernel import procfs, tracefs
from jobprobe.kernel.host import Host


class Target(Protocol):
    """What membership needs of a job the node hands down (jobprobe/contract/target.py's Target is one): its kind
    ("cgroup": members by cgroup2 id; else by tgid), its groups' ids, its processes, and refresh() (raises
    TargetGone once it has ended). Declared here, so that the kernel room imports nothing above it."""
    kind: str

    def cgroup_ids(self) -> list[int]: ...

    def pids(self) -> list[int]: ...

    def refresh(self) -> None: ...


MAX_SLOTS = 64                        # bpf/common.h MAX_SLOTS
JOB_BY_CGROUP, JOB_BY_TGID = 1, 2     # bpf/common.h job_kinds bits
MEMBERSHIP = (("sched:sched_process_fork", "job_fork"), ("sched:sched_process_exit", "job_exit"),
              ("sched:sched_process_exec", "job_exec"))
SHARED_MAPS = ("job_of_cgroup", "job_of_tgid", "job_kinds")
SYNC_EVERY = 0.05                     # s: probes of one job sampled in one tick sync its members once


def exit_has_group_dead(sys_root: str = "/sys") -> bool:
    """Whether sched_process_exit carries group_dead (recent kernels), read from the tracepoint's format file."""
    return "group_dead" in (tracefs.event_fields(sys_root, "sched", "sched_process_exit") or ())


PF_EXITING = 0x4   # include/linux/sched.h: set in do_exit before the sched_process_exit tracepoint fires


def proc_gone(proc: str, pid: int) -> bool:
    """True when pid has exited or is past its exit tracepoint: no /proc entry, a zombie/dead task, or a
    single-threaded process already exiting (PF_EXITING is set before sched_process_exit fires, and the process is
    not yet a zombie for a while after: a key inserted then would never be deleted by the kernel)."""
    st = procfs.read_stat(proc, pid)
    if st is None or st.state in ("Z", "X"):
        return True
    return bool(st.flags & PF_EXITING) and st.num_threads == 1


class Job:
    """One attached target's place in the membership maps."""

    def __init__(self, target: Target, slot: int):
        self.target, self.slot = target, slot
        self.refs = 0
        self.cg_ids: set[int] = set()
        self.synced = 0.0
        self.noted_base = 0    # job_exited_n[slot] when the job took the slot (a slot is reused)
        self.noted = 0         # its exit notes taken (or counted lost) since


class SharedLoad:
    """One load of a probe's module, used by every job that runs the probe."""

    def __init__(self, loaded: _bpfload.Loaded):
        self.loaded = loaded
        self.refs = 0
        self.slots = 0                # the bits written to the module's slots_on
        self.extra: dict[str, Any] = {}          # what the probe keeps for every job of this load (cuda's uprobes)
        self.closers: list[Callable[[], None]] = []
        self.lock = threading.Lock()

    def close(self) -> None:
        """What the probe attached for the load first (its closers), then the programs and maps."""
        for fn in self.closers:
            fn()
        self.closers = []
        self.loaded.close()

    def set_slot(self, slot: int, on: bool) -> None:
        with self.lock:
            self.slots = self.slots | (1 << slot) if on else self.slots & ~(1 << slot)
            self.loaded.maps["slots_on"].update(0, self.slots)


class Node:
    """Membership and shared loads for one node. start() is implicit on the first attach. Thread-safe."""

    def __init__(self, host: Host | None = None, keep_loads: bool = False):
        """keep_loads: a load stays when its last job goes (the agent: programs are compiled once, at its start or
        at the first job that needs them, never per job)."""
        self.host = host or Host()
        self.keep_loads = keep_loads
        self.loaded: _bpfload.Loaded | None = None
        self.jobs: dict[int, Job] = {}                  # id(target) → its job
        self.loads: dict[Any, SharedLoad] = {}
        self._free = collections.deque(range(MAX_SLOTS))
        self.gen = 0                                    # job_kinds[1]: the membership maps' generation
        self._lock = threading.RLock()
        self._load_locks: dict[Any, threading.Lock] = collections.defaultdict(threading.Lock)

    # ---- the membership module ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.loaded is not None:
                return
            cflags = ["-w"] + (["-DJOB_EXIT_HAS_GROUP_DEAD"] if exit_has_group_dead(self.host.sys) else [])
            loaded = _bpfload.load("membership", cflags, MEMBERSHIP, sys_root=self.host.sys)
            try:
                loaded.maps["job_of_cgroup"].typed(ct.c_uint64, ct.c_uint32)
                loaded.maps["job_of_tgid"].typed(ct.c_uint32, ct.c_uint32)
                loaded.maps["job_kinds"].typed(ct.c_uint32, ct.c_uint32)
                loaded.maps["job_exited"].typed(ct.c_uint32, ct.c_uint32)
                loaded.maps["job_exited_n"].typed(ct.c_uint32, ct.c_uint64)
            except (KeyError, ValueError) as err:
                loaded.close()
                raise ProbeUnavailable(f"membership maps: {err}") from err
            self.loaded = loaded

    def pinned(self) -> dict[str, int]:
        """The membership maps' fds, by the names bpf/common.h declares them with."""
        self.start()
        return {name: self.loaded.maps[name].fd for name in SHARED_MAPS}

    def close(self) -> None:
        """Release everything: every shared load, the membership module. Idempotent."""
        with self._lock:
            for shared in self.loads.values():
                shared.close()
            self.loads.clear()
            self.jobs.clear()
            self._free = collections.deque(range(MAX_SLOTS))
            loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.close()

    # ---- jobs ------------------------------------------------------------------------------------------
    def attach(self, target: Target) -> int:
        """The target's slot, writing its members in on its first attach (each probe of a job attaches it)."""
        self.start()
        with self._lock:
            job = self.jobs.get(id(target))
            if job is None:
                if not self._free:
                    raise ProbeUnavailable(f"no free job slot: {MAX_SLOTS} jobs are attached on this node")
                job = Job(target, self._free.popleft())
                self.jobs[id(target)] = job
                try:
                    self._register(job)
                except BaseException:
                    self._forget(job)
                    raise
            job.refs += 1
            return job.slot

    def detach(self, target: Target) -> None:
        with self._lock:
            job = self.jobs.get(id(target))
            if job is None:
                return
            job.refs -= 1
            if job.refs <= 0:
                self._forget(job)

    def exited(self) -> dict[int, tuple[set[int], int]]:
        """slot → (the tgids of its job's processes that exited since the last call, how many such notes were lost
        since the last call): the membership program's job_exited, drained — whose an exit record is when its
        process left the job's tree first (a double fork) — and its per-slot count of notes written, against which
        what the table no longer held (a burst past its size between two calls) is counted."""
        out: dict[int, tuple[set[int], int]] = {}
        if self.loaded is None:
            return out
        table, written = self.loaded.maps["job_exited"], self.loaded.maps["job_exited_n"]
        got: dict[int, set[int]] = {}
        for tgid, slot in table.items():
            got.setdefault(int(slot), set()).add(int(tgid))
            table.delete(tgid)
        with self._lock:
            for job in self.jobs.values():
                n = written.lookup(job.slot) or 0
                mine = got.get(job.slot, set())
                job.noted += len(mine)
                lost = max(0, n - job.noted_base - job.noted)
                job.noted += lost                  # said once
                out[job.slot] = (mine, lost)
        return out

    def slot_of(self, target: Target) -> int | None:
        job = self.jobs.get(id(target))
        return None if job is None else job.slot

    def _forget(self, job: Job) -> None:
        """Every entry of the job's slot out of the membership maps; the slot goes to the back of the free list."""
        self.jobs.pop(id(job.target), None)
        if self.loaded is not None:
            for name in ("job_of_cgroup", "job_of_tgid"):
                table = self.loaded.maps[name]
                for key, slot in table.items():
                    if slot == job.slot:
                        table.delete(key)
            self._set_kinds()
        self._free.append(job.slot)

    def _set_kinds(self) -> None:
        """Which membership maps the programs ask, from the jobs attached now."""
        kinds = 0
        for job in self.jobs.values():
            kinds |= JOB_BY_CGROUP if job.target.kind == "cgroup" else JOB_BY_TGID
        self.loaded.maps["job_kinds"].update(0, kinds)
        self._moved()

    def _register(self, job: Job) -> None:
        """Put the job's cgroups or processes in the membership maps. For a PID tree, the in-kernel fork handler
        follows forks only of processes already in the map, so the tree is scanned again afterwards to catch
        children forked between the first scan and the insert."""
        target = job.target
        # the slot's exit notes so far are an earlier job's: left behind, never this one's
        job.noted_base = self.loaded.maps["job_exited_n"].lookup(job.slot) or 0
        exited = self.loaded.maps["job_exited"]
        for tgid, slot in exited.items():
            if slot == job.slot:
                exited.delete(tgid)
        self._set_kinds()
        if target.kind == "cgroup":
            self._sync_cgroups(job)
            return
        self._add_pids(job, target.pids())
        with contextlib.suppress(TargetGone):  # every process already exited: nothing more to add
            target.refresh()
        self._add_pids(job, target.pids())

    def sync(self, target: Target) -> None:
        """What the kernel cannot see by itself (a cgroup made after attach, a SLURM step started by slurmstepd
        outside the tree) has been found by the target's refresh: add it. Once per tick for all of a job's
        probes."""
        with self._lock:
            job = self.jobs.get(id(target))
            if job is None or self.loaded is None:
                return
            now = time.monotonic()
            if now - job.synced < SYNC_EVERY:
                return
            job.synced = now
            if target.kind == "cgroup":
                self._sync_cgroups(job)
            else:
                self._add_pids(job, target.pids())

    def _sync_cgroups(self, job: Job) -> None:
        """Add ids of groups created since the last call (new steps, sub-containers), drop those removed."""
        table = self.loaded.maps["job_of_cgroup"]
        ids = set(job.target.cgroup_ids())
        for cg in ids - job.cg_ids:
            table.update(cg, job.slot)
        for cg in job.cg_ids - ids:
            table.delete(cg)
        if ids != job.cg_ids:
            self._moved()
        job.cg_ids = ids

    def _add_pids(self, job: Job, pids: list[int]) -> None:
        table = self.loaded.maps["job_of_tgid"]
        added = False
        for pid in pids:
            if pid in table:
                continue
            table.update(pid, job.slot)
            added = True
            # Insert first, then look: a process that exits after the look finds its key and deletes it in the
            # kernel; one that exited before it is removed here. Either way no stale key stays.
            if proc_gone(self.host.proc, pid):
                table.delete(pid)
        if added:
            self._moved()

    def _moved(self) -> None:
        """The membership maps changed: a new generation (job_kinds[1]), so that no program keeps an answer it
        cached before (bpf/common.h, job_slot_cached)."""
        self.gen = (self.gen + 1) & 0xFFFFFFFF
        self.loaded.maps["job_kinds"].update(1, self.gen)

    def members(self, slot: int) -> set[int]:
        """tgids (and member threads' tids) in the kernel's job_of_tgid map for a slot."""
        if self.loaded is None:
            return set()
        return {k for k, v in self.loaded.maps["job_of_tgid"].items() if v == slot}

    # ---- shared loads ----------------------------------------------------------------------------------
    def shared(self, key: Any, load: Callable[[], _bpfload.Loaded]) -> SharedLoad:
        """The one load of `key` (made by `load()` on first use), with a reference taken."""
        with self._load_locks[key]:            # one compile per key, while other keys compile side by side
            with self._lock:
                shared = self.loads.get(key)
            if shared is None:
                shared = SharedLoad(load())
                with self._lock:
                    self.loads[key] = shared
            with self._lock:
                shared.refs += 1
            return shared

    def unshare(self, key: Any) -> None:
        """Drop a reference; the last one closes the load (its programs detach)."""
        with self._lock:
            shared = self.loads.get(key)
            if shared is None:
                return
            shared.refs -= 1
            if shared.refs > 0 or self.keep_loads:
                return
            del self.loads[key]
        shared.close()
