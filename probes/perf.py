# SPDX-License-Identifier: Apache-2.0
"""perf: CPU time, context switches, migrations and page faults of the job, plus cycles, instructions, cache and
branch misses and IPC where the host has a hardware PMU.

Hooks: perf_event_open(2) counting events (no sampling, no BPF).
- cgroup target: one event group per online CPU on the job's cgroup2 directory (PERF_FLAG_PID_CGROUP), which counts
  the group and its descendants; the per-CPU counts are summed. Software and hardware events are two separate
  groups per CPU, so the software counts are never multiplexed along with the PMU ones.
- pids target: one inherited event (inherit=1, any CPU) per thread of every process, opened at start; processes
  forked later by a counted task are counted by inheritance, so the probe opens events only for new processes
  whose parent it was not already counting (new job steps started from outside the tree).
Oldest kernel: 4.11 for cgroup targets (perf_event on the cgroup2 hierarchy), 3.14 for pid targets
(PERF_FLAG_FD_CLOEXEC).
Cost: no work per event; the kernel switches the cgroup events on each context switch into or out of the job
(tens of ns). File descriptors: (4 + 4 with a PMU) per online CPU, or per thread of a pids target at attach.
One read(2) per group per sample.
Accuracy: task_clock_ns is perf's task clock, which charges CPU time to whatever task is on the CPU, switch to
switch. The scheduler (cgroup cpu.stat, getrusage, GNU time; the `cgroup` probe) charges the few µs between a
wakeup and the preemption it causes to the task woken. So when tasks outside the job keep waking up on the job's
CPUs and preempting it, task_clock_ns reads above cpu.stat by that interval per involuntary switch: +5.2..5.9 µs
(cgroup target) and +3.2..3.8 µs (PID tree, which starts counting later in the switch) on the 6.18 VM one day,
+7.5 and +6.4 µs another, i.e. +5..10% with ~25k preemptions/s; the preempting tasks' own task clock is short by as
much: the time moves, it is not made up (issue 8: +6.5% with 89994 switches in 4 s). The job's own wakeups that
preempt other tasks move time the other way. Otherwise within 2% of cpu.stat plus the hypervisor's steal time, which
perf counts and cpu.stat leaves out. Software counts are never scaled for multiplexing (running == enabled to the ns on
every group measured; see _perf.SOFTWARE). Tests: tests/test_perf.py.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeFailed, ProbeUnavailable
from jobprobe.kernel import perf as _perf
from jobprobe.kernel.host import Host
from jobprobe.kernel.procfs import read_ppid

# _perf event name → field name (task-clock is a time, so it carries its unit in the name).
FIELD_OF = {"task_clock": "task_clock_ns", "context_switches": "context_switches",
            "cpu_migrations": "cpu_migrations", "page_faults": "page_faults", "cycles": "cycles",
            "instructions": "instructions", "cache_misses": "cache_misses", "branch_misses": "branch_misses"}


class PerfProbe(Probe):
    name = "perf"
    default = True
    needs_root = True  # cgroup-scoped counters and other users' tasks need CAP_PERFMON/CAP_SYS_ADMIN
    summary = "CPU time, context switches, migrations, page faults; cycles, instructions, IPC with a PMU"
    fields = {
        "task_clock_ns": Field("int", "ns", "CPU time the job's tasks ran (task-clock)"),
        "context_switches": Field("int", "count", "context switches of the job's tasks"),
        "cpu_migrations": Field("int", "count", "moves of the job's tasks from one CPU to another"),
        "page_faults": Field("int", "count", "page faults (minor and major) of the job's tasks"),
        "cycles": Field("int", "count", "CPU cycles spent in the job (PMU only; scaled for multiplexing)"),
        "instructions": Field("int", "count", "instructions retired by the job (PMU only; scaled)"),
        "cache_misses": Field("int", "count", "last-level cache misses of the job (PMU only; scaled)"),
        "branch_misses": Field("int", "count", "mispredicted branches of the job (PMU only; scaled)"),
        "ipc": Field("float", "ratio", "instructions / cycles this interval (PMU only; absent when no cycles)"),
        "running_ratio": Field("float", "ratio", "time_running / time_enabled, the lowest over all counter "
                                                 "groups this interval: 1.0 = no multiplexing"),
    }

    def __init__(self, host: Host | None = None):
        super().__init__(host)
        self.sources: list[_perf.Source] = []
        self.unavailable: dict[str, str] = {}  # field → why it is not emitted (recorded once, at start)
        self._target: Target | None = None
        self._events: tuple[str, ...] = _perf.SOFTWARE
        self._seen: set[int] = set()  # pids whose counts we have: opened by us or inherited from one we opened

    @property
    def fds(self) -> list[int]:
        return [fd for s in self.sources for fd in s.fds]

    def check(self, host: Host) -> str | None:
        if self.needs_root and not host.is_root:
            return "needs root"
        if not _perf.NR_PERF_EVENT_OPEN.get(os.uname().machine):
            return f"perf_event_open syscall number unknown on {os.uname().machine}"
        return None

    def start(self, target: Target) -> None:
        self.stop()
        self._target = target
        self.unavailable = {}
        self._events = _perf.SOFTWARE
        hw = self.host.has_pmu
        if not hw:
            self._mark_no_pmu("no hardware PMU (no /sys/bus/event_source/devices/cpu)")
        try:
            if target.kind == "cgroup":
                self._start_cgroup(target.cgroup_path or "", hw)
            else:
                self._start_pids(target, hw)
        except BaseException:
            self.stop()  # a failed start leaves nothing open
            raise

    def _mark_no_pmu(self, reason: str) -> None:
        for ev in (*_perf.HARDWARE, "ipc"):
            self.unavailable[FIELD_OF.get(ev, ev)] = reason

    def _start_cgroup(self, path: str, hw: bool) -> None:
        try:
            dirfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise ProbeUnavailable(f"cannot open cgroup {path}: {err.strerror}") from err
        try:
            cpus = self.host.online_cpus()
            for cpu in cpus:  # cgroup events need a CPU: the kernel gives EINVAL for cpu=-1
                self.sources.append(_perf.CgroupGroup(dirfd, cpu, _perf.SOFTWARE, f"cgroup {path}"))
            if hw:
                try:
                    for cpu in cpus:
                        self.sources.append(_perf.CgroupGroup(dirfd, cpu, _perf.HARDWARE, f"cgroup {path}"))
                    self._events = _perf.SOFTWARE + _perf.HARDWARE
                except ProbeUnavailable as err:
                    # A PMU without these events (some VMs, some ARM cores) costs the PMU fields, not the probe.
                    self._drop_hw()
                    self._mark_no_pmu(str(err))
        finally:
            os.close(dirfd)  # the events hold their own reference to the cgroup

    def _drop_hw(self) -> None:
        keep = []
        for s in self.sources:
            if s.events[0] in _perf.HARDWARE:
                s.close()
            else:
                keep.append(s)
        self.sources = keep

    def _start_pids(self, target: Target, hw: bool) -> None:
        self._events = _perf.SOFTWARE + (_perf.HARDWARE if hw else ())
        pids = target.pids()
        alive = [self._attach(pid) for pid in pids]
        if pids and not any(alive):
            raise ProbeUnavailable(f"every process of {target.job} exited before perf counters could be opened")

    def _attach(self, pid: int) -> bool:
        """Open an inherited event per thread of pid; False if the process is gone. A vanished thread is skipped.

        Threads created between listing /proc/PID/task and the open of their creator are missed; the window is
        microseconds, and opening them later could count them twice (once inherited, once on their own)."""
        self._seen.add(pid)
        proc = self.host.proc
        try:
            tids = sorted(int(t) for t in os.listdir(Path(proc, str(pid), "task")))
        except OSError:
            return False  # the process is gone
        for tid in tids:
            for ev in self._events:
                try:
                    self.sources.append(_perf.TaskEvent(tid, ev))
                except _perf.ThreadGone:
                    break
                except ProbeUnavailable as err:
                    if ev not in _perf.HARDWARE:
                        raise
                    self._events = _perf.SOFTWARE
                    self._drop_hw()
                    self._mark_no_pmu(str(err))
                    break
        return True

    def _attach_new(self) -> None:
        """Open events for processes that joined the target and are not counted by inheritance yet.

        A process is inherited when its parent was counted before this round (it forked after our open), or when
        its parent is itself inherited. A new process whose parent we open only now existed before that open, so
        it needs its own events too."""
        assert self._target is not None
        proc = self.host.proc
        new = [p for p in self._target.pids() if p not in self._seen]
        before = set(self._seen)
        inherited: dict[int, bool] = {}

        def is_inherited(pid: int, depth: int = 0) -> bool:
            if pid not in inherited:
                ppid = read_ppid(proc, pid)
                if ppid in before:
                    inherited[pid] = True
                elif ppid in new_set and depth < 64:  # deep chains are rare; the cap only stops cycles
                    inherited[pid] = is_inherited(ppid, depth + 1)
                else:
                    inherited[pid] = False
            return inherited[pid]

        new_set = set(new)
        for pid in new:
            if is_inherited(pid):
                self._seen.add(pid)
            else:
                self._attach(pid)

    def sample(self) -> dict[str, Any]:
        if self._target is not None and self._target.kind == "pids":
            try:
                self._attach_new()
            except ProbeUnavailable as err:  # e.g. out of fds for a new job step: the probe stops, says why
                raise ProbeFailed(str(err)) from err
        totals = {ev: 0 for ev in self._events}
        ratio = 1.0
        # A group whose tasks did not run since the last tick counted nothing (its events count only while one of
        # them is on a CPU): not read — one read per CPU saved per idle job; the next read has any remainder.
        quiet = self._target is not None and self._target.quiet()
        for src in () if quiet else self.sources:
            try:
                counts, r = src.delta()
            except OSError:
                continue  # a read on a torn-down event: nothing to add this interval
            for ev, v in counts.items():
                totals[ev] = totals.get(ev, 0) + v
            if r is not None:
                ratio = min(ratio, r)
        out: dict[str, Any] = {FIELD_OF[ev]: v for ev, v in totals.items()}
        if "cycles" in totals and totals["cycles"] > 0:
            out["ipc"] = totals["instructions"] / totals["cycles"]
        out["running_ratio"] = ratio
        return out

    def stop(self) -> None:
        # Close every source's fds; a source whose fds are already closed is a no-op, so stop() is idempotent.
        for s in self.sources:
            s.close()
        self.sources = []
        self._seen = set()
