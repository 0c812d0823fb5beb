# SPDX-License-Identifier: Apache-2.0
"""perf probe: unit tests of the perf_event wrapper (struct layout, parsing, scaling, deltas, pid bookkeeping) and
kernel-tier tests that compare the counts with the kernel's own cgroup cpu.stat on real workloads.

Why the kernel tests allow for steal time: perf's task-clock runs on perf_clock(), which keeps ticking while the
hypervisor runs another guest on our vCPU, whereas cpu.stat's usage_usec comes from rq_clock_task(), which has
paravirt steal time subtracted (CONFIG_PARAVIRT_TIME_ACCOUNTING). On a busy VM perf is higher by up to the steal
of the run (measured here: +0.7..+7% with 0.1..0.26 s of steal over a 3 s burner); on bare metal that bound is ~0.

Why the preemption test allows a few µs per involuntary switch (issue 8): when a task outside the job wakes and
preempts a job task, the scheduler charges the interval from the wakeup to the switch (the rest of the interrupt,
the way into schedule(), the pick) to the task woken (cpu.stat, getrusage), while perf's task clock keeps counting
it for the task that was on the CPU until the switch (prepare_task_switch). The likely kernel reason: a wakeup that
sets need_resched on the running task asks the next schedule() to skip its run-queue clock update
(kernel/sched/core.c, wakeup_preempt → rq_clock_skip_update), so the preempted task's runtime stops, and the woken
task's starts, at the clock of the wakeup. Measured here, 2 burners in the job and
4 sleepwake(20 µs) wakers outside: +5.2..5.9 µs per involuntary switch for the cgroup target, +3.2..3.8 µs for the
PID-tree target (which starts counting later, at finish_task_switch), with running == enabled on every group and
0..20 ms of steal; the wakers' cpu.stat was above their own perf count by 0.8..1.4 times the job's excess (the
time moved, it was not made up). No scaling is involved.
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PREEMPT_SKEW_NS, steal_ns, wait_for, workload
from jobprobe.contract.probe import Field
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.kernel import perf as _perf
from jobprobe.kernel.host import Host
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.perf import PerfProbe

SW_FIELDS = {"task_clock_ns", "context_switches", "cpu_migrations", "page_faults", "running_ratio"}
HW_FIELDS = {"cycles", "instructions", "cache_misses", "branch_misses", "ipc"}


# ---------------------------------------------------------------- unit tier

def test_attr_layout_matches_the_kernel_abi():
    assert ctypes.sizeof(_perf.PerfEventAttr) == _perf.PERF_ATTR_SIZE_VER5 == 112
    off = {name: getattr(_perf.PerfEventAttr, name).offset for name, _ in _perf.PerfEventAttr._fields_}
    assert (off["config"], off["read_format"], off["flags"], off["config1"]) == (8, 32, 40, 56)
    assert (off["branch_sample_type"], off["clockid"], off["sample_regs_intr"]) == (72, 92, 96)
    a = _perf.make_attr("task_clock", 7, disabled=True, inherit=True)
    assert (a.type, a.config, a.size, a.read_format, a.flags) == (1, 1, 112, 7, 0b11)
    assert _perf.make_attr("cycles", 0).type == _perf.PERF_TYPE_HARDWARE


def test_scale_for_multiplexing():
    assert _perf.scale(1000, 100, 100) == 1000        # ran the whole time
    assert _perf.scale(1000, 100, 25) == 4000         # ran a quarter of the time: extrapolate
    assert _perf.scale(0, 100, 0) == 0                # never scheduled
    assert _perf.scale(500, 0, 0) == 500              # nothing to scale by


def test_parse_group_matches_members_by_id():
    buf = struct.pack("=QQQ", 2, 1000, 500) + struct.pack("=QQQQ", 11, 70, 22, 71)
    assert _perf.parse_group(buf) == (1000, 500, {70: 11, 71: 22})


class FakeSource(_perf.Source):
    events = ("cycles", "instructions")

    def __init__(self, readings):
        super().__init__()
        self.readings = iter(readings)

    def read(self):
        return next(self.readings)


def test_source_delta_scales_each_interval_by_its_own_ratio():
    src = FakeSource([({"cycles": 100, "instructions": 200}, 1000, 1000),   # not multiplexed
                      ({"cycles": 150, "instructions": 300}, 2000, 1500),   # ran half of this interval
                      ({"cycles": 150, "instructions": 300}, 2000, 1500)])  # not scheduled at all
    assert src.delta() == ({"cycles": 100, "instructions": 200}, 1.0)
    assert src.delta() == ({"cycles": 100, "instructions": 200}, 0.5)
    assert src.delta() == ({"cycles": 0, "instructions": 0}, None)


class FakeSoftware(FakeSource):
    events = ("task_clock", "context_switches")


def test_software_events_are_never_scaled():
    # A cgroup group's time_enabled runs on the cgroup's clock; a gap between it and time_running must not inflate
    # a task clock, which is exact (software groups are never multiplexed).
    src = FakeSoftware([({"task_clock": 900, "context_switches": 3}, 1000, 900)])
    assert src.delta() == ({"task_clock": 900, "context_switches": 3}, 0.9)


def test_source_delta_survives_a_counter_wrap():
    top = (1 << 64) - 10
    src = FakeSource([({"cycles": top, "instructions": 0}, 10, 10), ({"cycles": 5, "instructions": 0}, 20, 20)])
    src.delta()
    assert src.delta()[0]["cycles"] == 15


def test_explain_gives_actionable_reasons():
    assert _perf.explain(OSError(errno.ENOENT, "x"), "cycles", "cgroup /a cpu 0").startswith("no hardware PMU")
    assert "not permitted" in _perf.explain(OSError(errno.EACCES, "x"), "task_clock", "thread 1")
    assert "ulimit" in _perf.explain(OSError(errno.EMFILE, "x"), "task_clock", "thread 1")
    assert "not a cgroup2" in _perf.explain(OSError(errno.EBADF, "x"), "task_clock", "cgroup /tmp cpu 0")


def test_close_fds_is_idempotent():
    r, w = os.pipe()
    fds = [r, w]
    _perf.close_fds(fds)
    _perf.close_fds(fds)
    assert fds == []
    with pytest.raises(OSError):
        os.fstat(r)


def test_fields_declared_and_check_needs_root():
    assert SW_FIELDS | HW_FIELDS == set(PerfProbe.fields)
    assert all(isinstance(f, Field) and f.type in ("int", "float") for f in PerfProbe.fields.values())
    assert PerfProbe().check(Host(is_root=False)) == "needs root"


def _fake_proc(root: Path, parents: dict[int, int]) -> None:
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} (py thon) S {ppid} 1 1 0")


class ListTarget(Target):
    def __init__(self, pids):
        self.now = list(pids)

    def pids(self):
        return self.now


def test_new_pids_opened_only_when_not_inherited(tmp_path, monkeypatch):
    # 10 was counted at start. 11 forked from 10 later (inherited), 12 from 11 (inherited too). 20 is a new root
    # from outside (opened), and 21, its child seen in the same round, existed before our open of 20 (opened).
    _fake_proc(tmp_path, {10: 1, 11: 10, 12: 11, 20: 1, 21: 20})
    probe = PerfProbe(Host(proc=str(tmp_path)))
    opened = []
    monkeypatch.setattr(probe, "_attach", lambda pid: (opened.append(pid), probe._seen.add(pid))[0] or True)
    target = ListTarget([10])
    probe.start(target)
    assert opened == [10]
    target.now = [10, 11, 12, 20, 21]
    probe.sample()
    probe.sample()
    assert opened == [10, 20, 21]  # each pid decided once, in the first round it shows up


# ---------------------------------------------------------------- kernel tier

# PREEMPT_SKEW_NS (conftest) bounds the tests with a few switches. The preemption test, with 10^5 switches, measures
# the time moved against the preempting tasks' own shortfall in the same run instead (assert_cpu_moved; a mutant that
# added 4.5% to task-clock failed it).


def assert_cpu_close(perf_ns: int, kernel_ns: int, steal: int, rel: float, switches: int = 0,
                     kind: str = "cgroup") -> None:
    """perf agrees with cpu.stat within rel, plus on the high side at most the steal time of the run and
    PREEMPT_SKEW_NS per involuntary switch of the job's processes (their own rusage)."""
    skew = PREEMPT_SKEW_NS[kind] * switches
    assert kernel_ns * (1 - rel) <= perf_ns <= kernel_ns * (1 + rel) + steal + skew, \
        f"{kind}: perf {perf_ns / 1e9:.3f} s vs cpu.stat {kernel_ns / 1e9:.3f} s (steal {steal / 1e9:.3f} s, " \
        f"{switches} involuntary switches: {(perf_ns - kernel_ns) / max(switches, 1):+.0f} ns each)"


def reap(proc: subprocess.Popen):
    """The rusage of proc (and of the children it waited for) once it has exited, else None. Reaped here with
    wait4, since Popen.poll() throws the kernel's rusage away."""
    if proc.returncode is None:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == 0:
            return None
        proc.returncode, proc.rusage = os.waitstatus_to_exitcode(status), usage
    return proc.rusage


def run_sampling(probes, procs, targets=(), every=0.3) -> tuple[list[int], int]:
    """Sample each probe every `every` s until all procs exit, then once more: (task_clock_ns summed per probe,
    involuntary context switches of the procs from their rusage)."""
    total = [0] * len(probes)
    done = False
    while not done:
        done = all(reap(p) is not None for p in procs)
        time.sleep(0 if done else every)
        for t in targets:
            try:
                t.refresh()  # the agent refreshes targets before each sample
            except TargetGone:
                pass  # the last one exited: the final sample below still collects its counts
        for i, probe in enumerate(probes):
            frame = probe.sample()
            assert set(frame) == SW_FIELDS and all(v >= 0 for v in frame.values())
            total[i] += frame["task_clock_ns"]
    return total, sum(reap(p).ru_nivcsw for p in procs)


@pytest.mark.kernel
@pytest.mark.serial   # the time charged per preemption (module docstring) grows with who preempts: other tests' load
def test_cgroup_burner_matches_cpu_stat(make_cgroup):
    cg = make_cgroup()
    probe = PerfProbe()
    probe.start(CgroupTarget(str(cg.path)))
    try:
        assert len(probe.fds) == 4 * len(Host().online_cpus())
        s0 = steal_ns()
        burner = cg.spawn(workload("burncpu", 1.0))     # 1 s of its own CPU time, however busy the host
        (total,), switches = run_sampling([probe], [burner])
        assert_cpu_close(total, cg.cpu_usage_ns(), steal_ns() - s0, 0.02, switches)
        assert total > 0.5e9      # it ran (the match above is the proof)
    finally:
        probe.stop()


BURST_THEN_SLEEP = r"""
import time
for _ in range(4):                     # 0.3 s on the CPU, then 0.9 s asleep
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    time.sleep(0.9)
"""


@pytest.mark.kernel
@pytest.mark.serial   # its task clock against cpu.stat moves with the preemptions other tests' load brings (+7% once)
def test_a_job_idle_between_bursts_is_not_read_while_quiet_and_loses_nothing(make_cgroup, monkeypatch):
    """Sampled every 0.2 s in agent ticks (tickmemo): in a tick where the group used no CPU (Target.quiet) its
    events are not read — fewer reads than samples × CPUs — and the sum of task_clock_ns still matches cpu.stat."""
    from jobprobe.contract import tickmemo
    reads = []
    real = _perf.Source.delta
    monkeypatch.setattr(_perf.Source, "delta", lambda self: reads.append(1) or real(self))
    cg = make_cgroup()
    probe = PerfProbe()
    target = CgroupTarget(str(cg.path))
    probe.start(target)
    try:
        ncpu, s0 = len(probe.sources), steal_ns()
        job = cg.spawn([sys.executable, "-c", BURST_THEN_SLEEP])
        total, samples, done = 0, 0, False
        while not done:
            done = reap(job) is not None
            time.sleep(0 if done else 0.2)
            tickmemo.begin()
            try:
                total += probe.sample()["task_clock_ns"]
            finally:
                tickmemo.end()
            samples += 1
        print(f"task_clock {total / 1e9:.3f} s, cpu.stat {cg.cpu_usage_ns() / 1e9:.3f} s; {len(reads)} reads in "
              f"{samples} samples × {ncpu} CPUs")
        assert_cpu_close(total, cg.cpu_usage_ns(), steal_ns() - s0, 0.02, reap(job).ru_nivcsw)
        assert len(reads) <= (samples - 5) * ncpu, (len(reads), samples, ncpu)
    finally:
        probe.stop()


@pytest.mark.kernel
@pytest.mark.serial   # as above: beside phase 1's tests +19.6 µs per involuntary switch once (7.5 allowed)
def test_cgroup_ignores_a_busy_process_outside(make_cgroup):
    job, other = make_cgroup("job"), make_cgroup("other")
    probe = PerfProbe()
    probe.start(CgroupTarget(str(job.path)))
    try:
        s0 = steal_ns()
        procs = [job.spawn(workload("burn", 3)), other.spawn(workload("burn", 3))]
        (total,), _ = run_sampling([probe], procs)
        mine, theirs = job.cpu_usage_ns(), other.cpu_usage_ns()
        assert_cpu_close(total, mine, steal_ns() - s0, 0.02, reap(procs[0]).ru_nivcsw)
        assert theirs > 0.5e9 and total < mine + theirs / 2, (total, mine, theirs)
    finally:
        probe.stop()


@pytest.mark.kernel
def test_task_clock_with_a_busy_neighbour_preempting_the_job(make_cgroup):
    # Issue 8: stress-ng --cpu 2 read 6.5% above cpu.stat with 89994 involuntary switches. The same shape here: two
    # burners in the job, four wakers outside it that sleep 20 µs at a time on the same 2 CPUs, until the job has
    # been switched out >= 10^5 times.
    # A busy host stretches each switch's cost beyond what the tolerance allows (a CI run: +11.6 µs per switch
    # with 0.29 s of steal): then it is measured once more, in fresh groups; twice out of bounds fails.
    for attempt in range(2):
        try:
            _busy_neighbour_once(make_cgroup, attempt)
            return
        except AssertionError:
            if attempt:
                raise


def _busy_neighbour_once(make_cgroup, attempt: int) -> None:
    job, outside = make_cgroup(f"job{attempt}"), make_cgroup(f"wakers{attempt}")
    try:
        _busy_neighbour_in(job, outside)
    finally:
        outside.remove()
        job.remove()


def _busy_neighbour_in(job, outside) -> None:
    for _ in range(4):
        outside.spawn(workload("sleepwake", 10 ** 9, 20))
    by_cgroup, by_pids, by_wakers = PerfProbe(), PerfProbe(), PerfProbe()
    by_cgroup.start(CgroupTarget(str(job.path)))
    by_wakers.start(CgroupTarget(str(outside.path)))
    try:
        burners = [job.spawn(workload("burn", 60)) for _ in range(2)]
        by_pids.start(PidTreeTarget([b.pid for b in burners]))
        u0, w0, s0 = job.cpu_usage_ns(), outside.cpu_usage_ns(), steal_ns()
        by_cgroup.sample()  # the three probes count from here
        by_wakers.sample()
        probes = {"cgroup": by_cgroup, "pids": by_pids, "wakers": by_wakers}
        totals, switches, ratios = dict.fromkeys(probes, 0), 0, []
        deadline = time.monotonic() + 45  # ~25k switches/s here; the assert below says if it fell short
        while switches < 1.2e5 and time.monotonic() < deadline:
            time.sleep(0.3)
            for kind, probe in probes.items():
                frame = probe.sample()
                totals[kind] += frame["task_clock_ns"]
                ratios.append(frame["running_ratio"])
                switches += frame["context_switches"] if kind == "pids" else 0  # the PID tree's own count
        for b in burners:
            b.kill()
        involuntary = sum(wait_for(lambda: reap(b)).ru_nivcsw for b in burners)
        for kind, probe in probes.items():
            totals[kind] += probe.sample()["task_clock_ns"]
        kernel, steal = job.cpu_usage_ns() - u0, steal_ns() - s0
        moved = outside.cpu_usage_ns() - w0 - totals.pop("wakers")
        assert involuntary >= 1e5, f"the wakers preempted the job only {involuntary} times"
        assert set(ratios) == {1.0}  # software counters: never multiplexed, so nothing was ever scaled
        for kind, total in totals.items():
            assert_cpu_moved(total, kernel, steal, 0.02, moved, involuntary, kind)
    finally:
        by_wakers.stop()
        by_pids.stop()
        by_cgroup.stop()


def assert_cpu_moved(perf_ns: int, kernel_ns: int, steal: int, rel: float, moved: int, switches: int,
                     kind: str) -> None:
    """perf agrees with cpu.stat within rel, plus on the high side at most the steal time of the run and the time
    that moved to the job from the tasks that preempted it: what cpu.stat gave the wakers beyond their own perf
    task clock (module docstring). What a switch costs varies from host to host and hour to hour (3.2..7.8 µs here),
    but it is charged to one side or the other, never made up: the job's excess is measured against the wakers'
    shortfall in the same run."""
    assert kernel_ns * (1 - rel) <= perf_ns <= kernel_ns * (1 + rel) + steal + max(moved, 0), \
        f"{kind}: perf {perf_ns / 1e9:.3f} s vs cpu.stat {kernel_ns / 1e9:.3f} s (steal {steal / 1e9:.3f} s, " \
        f"{switches} involuntary switches: {(perf_ns - kernel_ns) / max(switches, 1):+.0f} ns each; the wakers' " \
        f"perf below their cpu.stat by {moved / max(switches, 1):.0f} ns per switch)"


@pytest.mark.kernel
@pytest.mark.serial   # the time charged per preemption grows with who preempts (module docstring): +15.9 µs once
def test_pid_tree_counts_children_forked_after_attach(make_cgroup):
    # The forktree runs in a cgroup so the kernel's cpu.stat and a cgroup-mode probe give independent figures.
    cg = make_cgroup()
    by_cgroup = PerfProbe()
    by_cgroup.start(CgroupTarget(str(cg.path)))
    by_pids = PerfProbe()
    try:
        tree = cg.spawn(workload("forktree", 3, 2))
        target = PidTreeTarget([tree.pid])
        by_pids.start(target)
        u0, s0 = cg.cpu_usage_ns(), steal_ns()
        by_cgroup.sample()  # both probes count from here
        (pids_total, cg_total), switches = run_sampling([by_pids, by_cgroup], [tree], [target])
        assert_cpu_close(pids_total, cg.cpu_usage_ns() - u0, steal_ns() - s0, 0.03, switches, "pids")
        # The two targets start counting at different points of a switch (module docstring): ~2 µs apart each.
        assert abs(pids_total - cg_total) <= 0.03 * cg_total + PREEMPT_SKEW_NS["pids"] * switches, \
            (pids_total, cg_total, switches)
        # 3 burners × 2 s of CPU each (however long the shared cores take to give it): the cpu.stat match above is
        # the real proof that the children were counted; this floor only says that they ran.
        assert pids_total > 0.5e9
        assert len(by_pids.fds) == 4  # the children were inherited, never opened separately
    finally:
        by_pids.stop()
        by_cgroup.stop()


WAIT_THEN_BURN = r"""
import sys, time
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + 1.5
while time.monotonic() < end:
    pass
"""


@pytest.mark.kernel
@pytest.mark.serial   # the time charged per preemption grows with who preempts (module docstring): +15.9 µs once
def test_pid_tree_opens_a_new_root_from_outside(make_cgroup):
    # A second job step started by something outside the tree (slurmstepd) must get its own counters, from the
    # sample that first sees it. What it ran before that sample (its interpreter's start) is not the probe's to
    # count: taken off the cgroup's figure, read from the kernel (schedstat) while it waits to be let go.
    cg = make_cgroup()
    first = cg.spawn(workload("burn", 2))
    extra: list[int] = []
    target = PidTreeTarget([first.pid], extra_roots=lambda: extra)
    probe = PerfProbe()
    probe.start(target)
    try:
        u0, s0 = cg.cpu_usage_ns(), steal_ns()
        second = cg.spawn([sys.executable, "-c", WAIT_THEN_BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
        assert second.stdout.readline().strip() == "ready"
        wait_for(lambda: Path(f"/proc/{second.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S")  # on stdin
        before = int(Path(f"/proc/{second.pid}/schedstat").read_text().split()[0])
        extra.append(second.pid)
        target.refresh()
        total = probe.sample()["task_clock_ns"]          # opens the second root's counters
        assert len(probe.fds) == 8
        second.stdin.write("go\n")
        second.stdin.flush()
        (rest,), switches = run_sampling([probe], [first, second], [target], every=0.1)
        assert_cpu_close(total + rest, cg.cpu_usage_ns() - u0 - before, steal_ns() - s0, 0.02, switches, "pids")
    finally:
        probe.stop()


class NotACgroup(Target):
    kind = "cgroup"

    def __init__(self, path):
        self.cgroup_path = path


@pytest.mark.kernel
def test_stop_closes_every_fd_and_failed_start_leaks_none(make_cgroup, tmp_path):
    def fd_count() -> int:
        return len(os.listdir("/proc/self/fd"))

    cg = make_cgroup()
    before = fd_count()
    probe = PerfProbe()
    probe.start(CgroupTarget(str(cg.path)))
    assert fd_count() == before + len(probe.fds) > before
    sleeper = subprocess.Popen(workload("sleepwake", 50, 10000))
    try:
        probe.start(PidTreeTarget([sleeper.pid]))  # a restart releases the old counters first
        assert probe.fds and fd_count() == before + len(probe.fds)
        probe.stop()
        assert probe.fds == [] and fd_count() == before
        probe.stop()
        assert fd_count() == before
        with pytest.raises(ProbeUnavailable, match="not a cgroup2"):
            probe.start(NotACgroup(str(tmp_path)))
        assert probe.fds == [] and fd_count() == before
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.kernel
def test_no_pmu_means_software_fields_only_with_a_reason(make_cgroup, tmp_path):
    # A /sys without the PMU device, so this runs the same on any host.
    cpu = tmp_path / "devices/system/cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(Path("/sys/devices/system/cpu/online").read_text())
    cg = make_cgroup()
    probe = PerfProbe(Host(sys=str(tmp_path)))
    probe.start(CgroupTarget(str(cg.path)))
    try:
        assert set(probe.sample()) == SW_FIELDS
        assert set(probe.unavailable) == HW_FIELDS
        assert all(r.startswith("no hardware PMU") for r in probe.unavailable.values())
    finally:
        probe.stop()
    if not Host().has_pmu:  # and on this host, the kernel itself says so
        with pytest.raises(ProbeUnavailable, match="no hardware PMU"):
            _perf.TaskEvent(os.getpid(), "cycles")


@pytest.mark.kernel
@pytest.mark.pmu
def test_pmu_counts_cycles_and_ipc(make_cgroup):
    if not Host().has_pmu:
        pytest.skip("no hardware PMU on this host")
    cg = make_cgroup()
    probe = PerfProbe()
    probe.start(CgroupTarget(str(cg.path)))
    try:
        cg.spawn(workload("burn", 1)).wait()
        frame = probe.sample()
        assert set(frame) == SW_FIELDS | HW_FIELDS, probe.unavailable
        assert frame["cycles"] > 1e8 and frame["instructions"] > 1e8 and frame["ipc"] > 0
        assert 0 < frame["running_ratio"] <= 1.0
    finally:
        probe.stop()
