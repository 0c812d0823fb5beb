# SPDX-License-Identifier: Apache-2.0
"""cgroup probe. Unit tier on fixture trees (cgroup2 files, /proc); kernel tier on real groups, checked against the
kernel's own cpu.stat read by the test."""
import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import v1_cpu_group, workload
from jobprobe.kernel import threadacct as threadacct_mod
from jobprobe.kernel.host import Host
from jobprobe.kernel.taskstats import ExitRecord
from jobprobe.kernel.threadacct import CLK_TCK, PAGE, PerPid, ThreadAcct, proc_counters
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.cgroup import CgroupProbe, io_stat_bytes, read_kv

TICK_NS = 1_000_000_000 // CLK_TCK
ROOT = Path(__file__).resolve().parent.parent


def write_proc(root: Path, pid: int, utime: int, stime: int, rss_pages: int, rd=0, wr=0, cutime=0, cstime=0,
               ppid=1, file_pages=0):
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = ["S", ppid] + [0] * 9 + [utime, stime, cutime, cstime] + [0] * 30
    (d / "stat").write_text(f"{pid} (a (weird) name) " + " ".join(map(str, rest)) + "\n")
    (d / "statm").write_text(f"1000 {rss_pages} {file_pages} 0 0 0 0\n")
    (d / "io").write_text(f"rchar: 1\nwchar: 2\nread_bytes: {rd}\nwrite_bytes: {wr}\n")
    write_thread_io(root, pid, pid, rd, wr, utime, stime)


def write_thread_io(root: Path, pid: int, tid: int, rd: int, wr: int = 0, utime: int = 0, stime: int = 0):
    t = root / str(pid) / "task" / str(tid)
    t.mkdir(parents=True, exist_ok=True)
    (t / "io").write_text(f"rchar: 1\nwchar: 2\nread_bytes: {rd}\nwrite_bytes: {wr}\n")
    rest = ["S", 1] + [0] * 9 + [utime, stime, 0, 0] + [0] * 30
    (t / "stat").write_text(f"{tid} (thread) " + " ".join(map(str, rest)) + "\n")


def test_readers_on_fixture_files(tmp_path):
    (tmp_path / "cpu.stat").write_text("usage_usec 300\nuser_usec 200\nsystem_usec 100\nnr_periods 0\n")
    (tmp_path / "io.stat").write_text("8:0 rbytes=100 wbytes=5 rios=1 wios=1\n8:16 rbytes=1 wbytes=2 rios=1\n")
    assert read_kv(tmp_path / "cpu.stat")["user_usec"] == 200
    assert io_stat_bytes(tmp_path / "io.stat") == (101, 7)
    assert io_stat_bytes(tmp_path / "nope") is None
    write_proc(tmp_path, 42, 3, 4, 10, rd=7, wr=8)
    c = proc_counters(str(tmp_path), 42)
    assert c["user"] == 3 * TICK_NS and c["system"] == 4 * TICK_NS
    assert c["rss"] == 10 * PAGE and (c["rd"], c["wr"]) == (7, 8)
    assert proc_counters(str(tmp_path), 43) is None


def test_perpid_counts_new_processes_from_zero_and_reaped_tails():
    pp = PerPid({"user": "cuser"})
    k = ("user",)
    assert pp.update({1: {"user": 100, "cuser": 0}}, k) == {"user": 0}           # baseline
    assert pp.update({1: {"user": 150, "cuser": 0}, 2: {"user": 30, "cuser": 0}}, k) == {"user": 80}
    # child 2 ran 30 → 45 and was reaped by 1: 1's cuser grows by 45, of which 30 was counted: tail 15
    assert pp.update({1: {"user": 160, "cuser": 45}}, k) == {"user": 10 + 15}
    # a child born and reaped inside one interval (never seen) counts whole
    assert pp.update({1: {"user": 160, "cuser": 65}}, k) == {"user": 20}


def test_cgroup_probe_on_fixture_tree_hybrid_host(tmp_path):
    """Fixture cgroup2 group without memory/io controllers (as on a hybrid host): falls back to /proc."""
    mount = tmp_path / "cg"
    grp = mount / "job1"
    grp.mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    (grp / "cgroup.procs").write_text("10\n11\n")
    (grp / "cpu.stat").write_text("usage_usec 0\nuser_usec 0\nsystem_usec 0\n")
    (grp / "cpuset.cpus.effective").write_text("0-2,5\n")
    proc = tmp_path / "proc"
    write_proc(proc, 10, 0, 0, 100, rd=0, wr=0)
    write_proc(proc, 11, 0, 0, 50, rd=0, wr=0)
    probe = CgroupProbe(Host(proc=str(proc), mountinfo=str(mountinfo), is_root=False))
    probe.start(CgroupTarget(str(grp), mountinfo=str(mountinfo)))
    (grp / "cpu.stat").write_text("usage_usec 3500\nuser_usec 2500\nsystem_usec 1000\n")
    write_proc(proc, 10, 0, 0, 120, rd=4096, wr=8192, file_pages=30)
    s = probe.sample()
    assert (s["cpu_user_ns"], s["cpu_system_ns"]) == (2_500_000, 1_000_000)
    assert s["mem_bytes"] == (120 + 50) * PAGE and s["mem_peak_bytes"] == s["mem_bytes"]
    assert (s["mem_anon_bytes"], s["mem_file_bytes"]) == ((120 + 50 - 30) * PAGE, 30 * PAGE)
    assert (s["io_read_bytes"], s["io_write_bytes"], s["nprocs"]) == (4096, 8192, 2)
    assert s["cpus_allowed"] == 4 and "mem_limit_bytes" not in s          # no memory controller: no limit to say
    (grp / "memory.current").write_text("1000\n")
    (grp / "memory.max").write_text("4096000\n")
    (grp / "memory.peak").write_text("999999999\n")
    (grp / "memory.stat").write_text("anon 600\nfile 300\nkernel 100\nanon_thp 0\n")
    s = probe.sample()
    assert s["mem_bytes"] == 1000 and s["mem_peak_bytes"] == 999999999 and s["cpu_user_ns"] == 0
    assert s["mem_limit_bytes"] == 4096000
    assert (s["mem_anon_bytes"], s["mem_file_bytes"]) == (600, 300)


class FakeListener:
    """A named fake of jobprobe.kernel.taskstats.ExitListener: hands out the exit records the test queues."""

    def __init__(self):
        self.queue: list[ExitRecord] = []

    def drain(self) -> list[ExitRecord]:
        out, self.queue = self.queue, []
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("given", ["../outside", "job/../../outside", "{mount}/../outside", "/../../outside",
                                   "link", "{mount}/link/x"])
def test_a_cgroup_path_that_leads_out_of_the_cgroup2_mount_is_refused(tmp_path, given):
    """--cgroup names a group inside the cgroup2 hierarchy: `..` (or a link) leading anywhere else is refused in
    one line — a directory elsewhere holding a file named cgroup.procs is not a job (issue 48)."""
    from jobprobe.core.errors import BadInput
    mount = tmp_path / "cg"
    for d in (mount, mount / "job", tmp_path / "outside", tmp_path / "outside" / "x"):
        d.mkdir(parents=True)
        (d / "cgroup.procs").write_text("1\n")
    (mount / "link").symlink_to(tmp_path / "outside")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    with pytest.raises(BadInput) as err:
        CgroupTarget(given.format(mount=mount), mountinfo=str(mountinfo))
    assert "outside the cgroup2 hierarchy" in str(err.value) and "\n" not in str(err.value), str(err.value)
    for fine in ("job", "/job", f"{mount}/job", "job/../job", str(mount)):       # inside: taken, resolved
        t = CgroupTarget(fine, mountinfo=str(mountinfo))
        assert t.cgroup_path == (str(mount) if fine == str(mount) else str(mount / "job")), fine
        t.close()


def rec(tid, tgid, ppid, rd, wr=0, utime_us=0, stime_us=0) -> ExitRecord:
    return ExitRecord(tid, tgid, ppid, rd, wr, utime_us, stime_us, 0)


def io(d: dict) -> tuple[int, int]:
    return d["rd"], d["wr"]


def test_thread_acct_adds_what_threads_did_up_to_their_exit(tmp_path):
    proc = tmp_path / "proc"
    write_thread_io(proc, 10, 10, 100)
    write_thread_io(proc, 10, 11, 50)
    fake = FakeListener()
    tio = ThreadAcct(fake)
    assert io(tio.update(str(proc), [10])) == (0, 0)                                  # baseline
    # thread 11 read 30 more and exited (its record: 80); thread 10 read 50
    (proc / "10" / "task" / "11" / "io").unlink()
    shutil.rmtree(proc / "10" / "task" / "11")
    write_thread_io(proc, 10, 10, 150)
    fake.queue = [rec(11, 10, 1, 80)]
    assert io(tio.update(str(proc), [10])) == (80, 0)
    # a child (20) and its child (21) came and went between two ticks; a stranger's exit counts for nothing
    fake.queue = [rec(21, 21, 20, 7, 3), rec(20, 20, 10, 1000), rec(99, 99, 1, 5555)]
    assert io(tio.update(str(proc), [10])) == (1007, 3)
    # the process exits: a zombie still lists its leader with its final counters; counted once, from the record
    write_thread_io(proc, 10, 10, 170)
    fake.queue = [rec(10, 10, 1, 170)]
    assert io(tio.update(str(proc), [10])) == (20, 0)
    assert io(tio.update(str(proc), [10])) == (0, 0)
    # without a listener, a thread that exits takes its tail with it (the probe's docstring says so)
    plain = ThreadAcct(None)
    write_thread_io(proc, 30, 30, 10)
    assert io(plain.update(str(proc), [30])) == (0, 0)
    write_thread_io(proc, 30, 30, 15)
    assert io(plain.update(str(proc), [30])) == (5, 0)
    assert tio.uncounted == 0 and plain.uncounted == 0      # every exit so far came with its record
    # ... and says so: a thread gone without a record is counted in `uncounted` (exits_uncounted)
    shutil.rmtree(proc / "30")
    assert io(plain.update(str(proc), [30])) == (0, 0) and plain.uncounted == 1


class LateListener(FakeListener):
    """A named fake listener whose queued records reach the socket only at the second drain: the process exited
    after the update's first drain and before its /proc read (a busy host stretches that gap)."""

    def __init__(self):
        super().__init__()
        self.later: list[ExitRecord] = []

    def drain(self) -> list[ExitRecord]:
        out, self.queue, self.later = self.queue, self.later, []
        return out


def test_thread_acct_a_process_that_exits_during_the_walk_keeps_its_tail(tmp_path):
    """The job's last process exits between the drain and the walk (a SLURM array task on a busy host read 28% low:
    its whole last interval). Its record, sent before it left /proc, is taken in the same update; a thread read in
    the walk and gone right after counts from that read."""
    tick = 10**9 // CLK_TCK
    proc = tmp_path / "proc"
    write_thread_io(proc, 10, 10, 100, utime=100)
    write_thread_io(proc, 10, 11, 0, utime=10)
    write_thread_io(proc, 20, 20, 5, utime=1)
    tio = ThreadAcct(LateListener())
    tio.update(str(proc), [10, 20])                                                   # baseline
    shutil.rmtree(proc / "10")
    write_thread_io(proc, 20, 20, 9, utime=3)
    tio.listener.later = [rec(10, 10, 1, 160, 0, utime_us=(130 * tick) // 1000),
                          rec(11, 10, 1, 0, 0, utime_us=(10 * tick) // 1000),
                          rec(20, 20, 1, 12, 0, utime_us=(4 * tick) // 1000), rec(99, 99, 1, 5555)]
    d = tio.update(str(proc), [10, 20])
    assert io(d) == (60 + 7, 0) and d["user"] == (30 + 3) * tick and tio.uncounted == 0, (d, tio.uncounted)
    assert io(tio.update(str(proc), [20])) == (0, 0)                                  # 20's zombie: counted once


def test_thread_acct_counts_a_launched_process_never_read(tmp_path):
    """A job shorter than its first tick: the process the target launched (and a child of it) were born and gone
    before any walk read them. Their exit records are the job's (Target.launched_pids), each claimed once: the same
    pid reused later by a stranger counts for nothing."""
    proc = tmp_path / "proc"
    proc.mkdir()
    tio = ThreadAcct(FakeListener())
    assert io(tio.update(str(proc), [])) == (0, 0)                                    # baseline: nothing yet
    tio.listener.queue = [rec(41, 41, 40, 5000, 7), rec(42, 42, 41, 300), rec(99, 99, 1, 1 << 20)]
    assert io(tio.update(str(proc), [], launched=[41])) == (5300, 7)
    tio.listener.queue = [rec(41, 41, 1, 123456)]                                     # pid 41 reused
    assert io(tio.update(str(proc), [], launched=[41])) == (0, 0)


def test_thread_acct_a_grandchilds_record_before_its_parents_is_the_jobs(tmp_path):
    """A chain that came and went between walks: the grandchild (43, parent 42) exits and is reaped by its parent,
    which exits next — on a busy host its record comes a drain later. The grandchild's record waits for it and is
    counted; a stranger's is dropped after two updates, whatever comes after it."""
    proc = tmp_path / "proc"
    write_thread_io(proc, 41, 41, 0)
    tio = ThreadAcct(FakeListener())
    assert io(tio.update(str(proc), [41])) == (0, 0)                              # the job: 41
    tio.listener.queue = [rec(43, 43, 42, 300), rec(99, 99, 98, 1 << 20)]
    assert io(tio.update(str(proc), [41])) == (0, 0)                              # whose are they? not yet known
    tio.listener.queue = [rec(42, 42, 41, 5000)]
    assert io(tio.update(str(proc), [41])) == (5300, 0)                           # 42 is 41's child: 43 with it
    assert io(tio.update(str(proc), [41])) == (0, 0)
    tio.listener.queue = [rec(98, 98, 41, 7)]                                     # 98 (parent of 99) now the job's
    assert io(tio.update(str(proc), [41])) == (7, 0)                              # 99's record was let go before


def test_thread_acct_quiet_skips_the_walk_and_loses_nothing(tmp_path):
    """`quiet` (the group's CPU usage did not move): /proc is not read — a counter changed under it is not seen
    then — and the next walk counts the whole difference; an exit record of the job makes even a quiet update
    walk, so a thread that read and exited is counted at once."""
    proc = tmp_path / "proc"
    write_thread_io(proc, 10, 10, 100)
    fake = FakeListener()
    tio = ThreadAcct(fake)
    assert io(tio.update(str(proc), [10], quiet=True)) == (0, 0)          # baseline: walked whatever `quiet` says
    write_thread_io(proc, 10, 10, 130)
    assert io(tio.update(str(proc), [10], quiet=True)) == (0, 0)          # not walked
    write_thread_io(proc, 10, 10, 150)
    assert io(tio.update(str(proc), [10])) == (50, 0)                      # the skipped 30 are in this difference
    write_thread_io(proc, 10, 11, 0)
    assert io(tio.update(str(proc), [10])) == (0, 0)                       # thread 11 seen at 0
    shutil.rmtree(proc / "10" / "task" / "11")
    write_thread_io(proc, 10, 10, 160)
    fake.queue = [rec(11, 10, 1, 40), rec(99, 99, 1, 5555)]
    assert io(tio.update(str(proc), [10], quiet=True)) == (50, 0)          # its record: a walk (10 + 40)
    fake.queue = [rec(99, 99, 1, 5555)]                                     # a stranger's record: still quiet
    write_thread_io(proc, 10, 10, 170)
    assert io(tio.update(str(proc), [10], quiet=True)) == (0, 0)
    assert io(tio.update(str(proc), [10])) == (10, 0)


def test_thread_acct_cpu_to_the_exit_and_from_zero(tmp_path):
    """CPU per thread from /proc/PID/task/TID/stat (clock ticks), the tail from the exit record (µs): a PID tree's
    root reaped outside the job loses nothing. from_zero: what the job did before the first read counts."""
    tick = 10**9 // CLK_TCK
    proc = tmp_path / "proc"
    write_thread_io(proc, 10, 10, 0, utime=100, stime=20)
    write_thread_io(proc, 10, 11, 0, utime=50, stime=0)
    fake = FakeListener()
    acct = ThreadAcct(fake, from_zero=True)
    d = acct.update(str(proc), [10])
    assert (d["user"], d["system"]) == (150 * tick, 20 * tick)                        # everything since birth
    d = ThreadAcct(fake, from_zero=True).update(str(proc), [10], cpu=False)
    assert (d["user"], d["system"]) == (0, 0)                                         # CPU not asked for
    write_thread_io(proc, 10, 10, 0, utime=160, stime=30)
    d = acct.update(str(proc), [10])
    assert (d["user"], d["system"]) == (60 * tick, 10 * tick)
    # the whole process exits (reaped by a stranger): its threads' records hold their final times
    shutil.rmtree(proc / "10")
    fake.queue = [rec(11, 10, 1, 0, 0, utime_us=(60 * tick) // 1000), rec(10, 10, 1, 0, 0,
                  utime_us=(161 * tick) // 1000, stime_us=(30 * tick) // 1000)]
    d = acct.update(str(proc), [])
    assert (d["user"], d["system"]) == (11 * tick, 0)                                 # 10 ticks of 11, 1 of 10
    assert acct.update(str(proc), []) == dict.fromkeys(("rd", "wr", "user", "system"), 0)


def run_probe_until_exit(probe, proc, period=0.2, log=None):
    """The probe's CPU time of the job, sampled every `period` until `proc` exits and once after, its target
    refreshed before each sample as the agent's sampler does (a PID tree's children found as they come); `log` (a
    list) gets each sample's (CPU ns, processes, threads gone without an exit record) for a failure's account."""
    from jobprobe.core.errors import TargetGone
    total = {"cpu_user_ns": 0, "cpu_system_ns": 0}

    def sample():
        try:
            probe.target.refresh()
        except TargetGone:
            pass                 # the last sample: what the job's processes left is still counted
        s = probe.sample()
        for k in total:
            total[k] += s[k]
        if log is not None:
            log.append((s["cpu_user_ns"] + s["cpu_system_ns"], s.get("nprocs"), s.get("exits_uncounted")))
    while proc.poll() is None:
        time.sleep(period)
        sample()
    time.sleep(0.05)
    sample()
    probe.stop()       # (its exit-record subscription too: an undrained one would fill the shared socket)
    return total["cpu_user_ns"] + total["cpu_system_ns"]


@pytest.mark.kernel
def test_cpu_time_of_a_burner_matches_cpu_stat(make_cgroup):
    cg = make_cgroup()
    probe = CgroupProbe()
    probe.start(CgroupTarget(str(cg.path)))
    outsider = __import__("subprocess").Popen(workload("burn", 2.5))   # busy beside the job, not in it
    job = cg.spawn(workload("burncpu", 0.5))     # 0.5 s of its own CPU time, however busy the host is
    got = run_probe_until_exit(probe, job)
    outsider.wait()
    want = cg.cpu_usage_ns()
    assert want > 0.2e9   # it ran (the match is the proof)
    assert abs(got - want) / want < 0.02, (got, want)


FORK_AND_BURN = r"""
import os, sys, time
sys.stdin.readline()
if os.fork() == 0:
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    print("burnt", flush=True)
    time.sleep(60)
    os._exit(0)
os.wait()
"""


def test_a_child_forked_before_the_start_is_in_the_baseline():
    """A PID tree made, then a child forked and 0.5 s burnt before the sampler starts (an agent slow to get ready):
    the probes' baseline includes the child (the sampler refreshes the target first), so the first frame holds
    none of that CPU. Before, the child was first seen at the first tick and counted from zero: +0.5 s."""
    from jobprobe.node.sampler import Sampler
    root = subprocess.Popen([sys.executable, "-c", FORK_AND_BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        target = PidTreeTarget([root.pid])
        root.stdin.write("go\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "burnt"
        sampler = Sampler(target, [CgroupProbe()], [], interval=0.2)
        sampler.start()
        time.sleep(0.3)
        target.refresh()                    # as the agent's tick does before sampling
        frame = sampler.tick()
        sampler.stop()
        cg = frame["probes"]["cgroup"]
        print(f"first frame after a child burnt 0.5 s before the start: {cg['cpu_user_ns'] + cg['cpu_system_ns']} ns, "
              f"{cg['nprocs']} processes")
        assert cg["nprocs"] == 2 and cg["cpu_user_ns"] + cg["cpu_system_ns"] < 100_000_000
    finally:
        root.kill()
        with contextlib.suppress(ProcessLookupError):
            for pid in target.pids():
                os.kill(pid, 9)
        root.wait()


@pytest.mark.kernel
def test_pid_tree_cpu_time_includes_children_forked_later(make_cgroup):
    """Independent source: the same processes also run in a cgroup2 group whose cpu.stat the kernel keeps."""
    cg = make_cgroup()
    root = cg.spawn(workload("forktree", 3, 1.0))
    probe = CgroupProbe()
    probe.start(PidTreeTarget([root.pid]))
    log: list = []
    got = run_probe_until_exit(probe, root, period=0.25, log=log)
    want = cg.cpu_usage_ns()
    assert want > 0.5e9
    # /proc counts in clock ticks, and the root's own last interval goes with it (reaped outside the job). With
    # the target never refreshed (before), the children were found only by their exit records, a grandchild's held
    # two samples for its parent's: beside phase 1's tests a grandchild that finished its second of CPU over 0.5 s
    # before its parent lost it whole (2.0 s of 3.0) — a path only a job born and gone within a tick takes in the
    # agent (test_thread_acct_a_grandchilds_record_before_its_parents_is_the_jobs)
    assert abs(got - want) / want < 0.05, (got, want, log)


MAPPER = """
import mmap, sys
anon = mmap.mmap(-1, int(sys.argv[1]) << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # as a heap is
anon.madvise(mmap.MADV_NOHUGEPAGE)
for off in range(0, len(anon), mmap.PAGESIZE):
    anon[off] = 1
with open(sys.argv[2], "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    total = sum(mapped[off] for off in range(0, len(mapped), mmap.PAGESIZE))
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_anon_and_file_memory_of_a_job_that_maps_both(make_cgroup, tmp_path, kind):
    """A job that touches 96 MiB of anonymous memory and maps and reads a 48 MiB file: the split puts each where it
    belongs (the sizes are the workload's own; the interpreter adds a few MiB of each)."""
    data = tmp_path / "data"
    data.write_bytes(b"\x01" * (48 << 20))
    cg = make_cgroup()
    job = cg.spawn([sys.executable, "-c", MAPPER, "96", str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   text=True)
    probe = CgroupProbe()
    try:
        probe.start(CgroupTarget(str(cg.path)) if kind == "cgroup" else PidTreeTarget([job.pid]))
        assert job.stdout.readline().strip() == "ready"
        s = probe.sample()
    finally:
        probe.stop()
        job.communicate("done\n", timeout=60)
    anon, file = s["mem_anon_bytes"] / 2**20, s["mem_file_bytes"] / 2**20
    print(f"{kind}: mem {s['mem_bytes'] / 2**20:.1f} MiB = anon {anon:.1f} + file {file:.1f} MiB")
    assert 96 <= anon <= 96 + 32 and 48 <= file <= 48 + 32
    assert s["mem_anon_bytes"] + s["mem_file_bytes"] <= s["mem_bytes"]


IO_JOB = r"""
import mmap, os, random, sys, threading, time
path, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]


def reader(secs):
    # 64 KiB O_DIRECT reads at random places of the file for secs: storage reads, counted in read_bytes
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 1 << 16)
    blocks = os.fstat(fd).st_size >> 16
    end = time.monotonic() + secs
    while time.monotonic() < end:
        os.preadv(fd, [buf], random.randrange(blocks) << 16)
    os.close(fd)


def report(what):
    # this process's own account, read just before it exits: nothing is read after it
    with open("/proc/self/io") as f:
        rd = int(dict(x.split(": ") for x in f.read().splitlines())["read_bytes"])
    with open(out, "a") as f:
        f.write(f"{what} {os.getpid()} {rd}\n")


report("start")                       # the root's reads before the probe starts are not the probe's to count
print("ready", flush=True)
sys.stdin.readline()
t = threading.Thread(target=reader, args=(seconds / 2,))   # a thread that ends mid-run
t.start()
pid = os.fork()
if pid == 0:                          # a child, reaped by the root (a member) the moment it ends
    for _ in range(3):
        g = os.fork()                 # grandchildren born and gone between two ticks
        if g == 0:
            reader(0.05)
            report("end")
            os._exit(0)
        os.waitpid(g, 0)
        reader(seconds / 4)
    report("end")
    os._exit(0)
reader(seconds)                       # the root reads up to its own exit, and is reaped outside the job
t.join()
os.waitpid(pid, 0)
report("end")
"""


@pytest.mark.kernel
def test_pid_tree_io_bytes_include_what_processes_did_up_to_their_exit(tmp_path):
    """A PID tree reading with O_DIRECT up to its exit, in a thread that ends mid-run, a child reaped by the job
    and grandchildren that live less than a tick: the sum of io_read_bytes is what the root's own /proc/self/io
    said just before its exit, less what it said before the probe started (within 1%; the kernel's exit records
    round to KiB). A process's io file adds the totals of the children it has waited for, so the root's holds the
    whole tree; the children's own accounts, printed too, show the parts."""
    data = tmp_path / "data"
    with open(data, "wb") as f:
        f.write(os.urandom(32 << 20))
        os.fsync(f.fileno())
    acct = tmp_path / "acct"
    root = subprocess.Popen([sys.executable, "-c", IO_JOB, str(data), "3", str(acct)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert root.stdout.readline().strip() == "ready"
    probe = CgroupProbe()
    target = PidTreeTarget([root.pid])
    probe.start(target)
    assert probe.threadacct is not None and probe.threadacct.listener is not None   # root: exit records on
    root.stdin.write("go\n")
    root.stdin.flush()
    reads = []
    while root.poll() is None:
        time.sleep(0.5)
        with contextlib.suppress(Exception):   # as the sampler does: refresh, then sample (TargetGone at the end)
            target.refresh()
        reads.append(probe.sample()["io_read_bytes"])
    reads.append(probe.sample()["io_read_bytes"])       # the last interval: everything has exited
    probe.stop()
    lines = [ln.split() for ln in acct.read_text().splitlines()]
    mine = {what: int(rd) for what, pid, rd in lines if int(pid) == root.pid}
    truth = mine["end"] - mine["start"]
    print(f"io_read_bytes per 0.5 s tick (MB): {[round(r / 1e6, 1) for r in reads]}; sum {sum(reads)}, the "
          f"root's own account {truth}; the others' at their exits: "
          f"{[int(rd) for what, pid, rd in lines if int(pid) != root.pid]}")
    assert len(lines) == 1 + 1 + 1 + 3 and truth > 1 << 20
    assert abs(sum(reads) - truth) <= 0.01 * truth, (sum(reads), truth)


BURSTS = r"""
import mmap, os, sys, time
path, bursts = sys.argv[1], int(sys.argv[2])


def read_bytes():
    with open("/proc/self/io") as f:
        return int(dict(x.split(": ") for x in f.read().splitlines())["read_bytes"])


fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 16)
print("start", read_bytes(), flush=True)
sys.stdin.readline()
for i in range(bursts):                 # 4 MiB of O_DIRECT reads, then a second asleep: quiet ticks
    for k in range(64):
        os.preadv(fd, [buf], ((i * 64 + k) % 512) << 16)
    time.sleep(1.0)
print("end", read_bytes(), flush=True)
sys.stdin.readline()                    # alive until the probe's last sample
"""


@pytest.mark.kernel
def test_a_job_idle_between_io_bursts_is_counted_whole(make_cgroup, tmp_path, monkeypatch):
    """A job in its own group reading 4 MiB with O_DIRECT, then sleeping a second, four times, sampled every
    0.25 s: the sum of io_read_bytes is the job's own /proc/self/io account (exactly: the same counters). Where the
    probe reads the threads' /proc files (controllers on v1), the ticks in which the group used no CPU skip that
    walk (ThreadAcct's `quiet`) — fewer walks than samples here — and lose nothing by it."""
    data = tmp_path / "data"
    with open(data, "wb") as f:
        f.write(os.urandom(32 << 20))
        os.fsync(f.fileno())
    walks = []
    real = threadacct_mod.thread_counters
    monkeypatch.setattr(threadacct_mod, "thread_counters", lambda *a, **k: walks.append(1) or real(*a, **k))
    cg = make_cgroup()
    job = cg.spawn([sys.executable, "-c", BURSTS, str(data), "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   text=True)
    what, before = job.stdout.readline().split()
    assert what == "start"
    probe = CgroupProbe()
    target = CgroupTarget(str(cg.path))
    probe.start(target)
    job.stdin.write("go\n")
    job.stdin.flush()
    reads, samples = [], 0
    end = None
    while end is None:
        time.sleep(0.25)
        reads.append(probe.sample()["io_read_bytes"])
        samples += 1
        if job.stdout in select.select([job.stdout], [], [], 0)[0]:
            what, end = job.stdout.readline().split()
    time.sleep(0.25)
    reads.append(probe.sample()["io_read_bytes"])
    samples += 1
    job.stdin.write("\n")
    job.stdin.flush()
    job.wait(timeout=10)
    probe.stop()
    truth = int(end) - int(before)
    print(f"io_read_bytes per 0.25 s tick (KiB): {[r >> 10 for r in reads]}; sum {sum(reads)}, the job's own "
          f"{truth}; /proc walks {len(walks)} in {samples} samples")
    assert truth == 4 * (4 << 20) and sum(reads) == truth
    if probe.threadacct is not None:
        assert len(walks) < samples - 4, (len(walks), samples)


@pytest.mark.kernel
@pytest.mark.kernel
@pytest.mark.parametrize("mib", [4, 16])
def test_a_job_shorter_than_a_tick_has_its_io_counted(tmp_path, mib):
    """`jobprobe run -- dd` that reads and exits before the first tick (interval 5 s): its one frame holds dd's own
    count of bytes read, in the cgroup probe (on a host whose io controller is on v1: the exit records of the
    process the command target launched) and in blockio (completed bytes, plus any it counted as lost)."""
    data = tmp_path / "dd.dat"
    with open(data, "wb") as f:
        f.write(os.urandom(mib << 20))
    os.sync()
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,blockio", "--interval",
                          "5", "--stdout", "json", "--", "dd", f"if={data}", "of=/dev/null", "bs=64k",
                          "iflag=direct"], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    copied = int(re.search(r"^(\d+) bytes", res.stderr, re.M).group(1))     # dd's own report
    samples = [f for f in map(json.loads, res.stdout.splitlines()) if f["kind"] == "sample"]
    assert copied == mib << 20 and len(samples) == 1, (copied, len(samples))
    cg, bio = samples[0]["probes"]["cgroup"], samples[0]["probes"]["blockio"]
    print(f"dd {copied} B; cgroup {cg['io_read_bytes']} B; blockio {bio['read_bytes']} B + lost "
          f"{bio['read_lost_bytes']} B ({bio['inflight_expired']} requests)")
    # dd's binary may be paged in (a cold cache): read_bytes counts that too, a few pages at most
    assert copied <= cg["io_read_bytes"] <= copied + (1 << 20)
    assert copied <= bio["read_bytes"] + bio["read_lost_bytes"] <= copied + (1 << 20)


@pytest.mark.parametrize("orphans", [1, 12])
def test_orphans_shorter_than_a_tick_are_counted_whoever_their_parent_was(tmp_path, orphans):
    """The job's shell double-forks dd (`(dd … &)`: the subshell exits at once, dd's parent is then init) and dd
    reads 4 MiB with O_DIRECT and exits well within a tick: no walk of the job sees it, its exit record's parent is
    no process of the job — yet it was the job's, by its group, and the membership program said so at its exit. Its
    bytes count in io_read_bytes: the sum over the frames equals what every dd said it copied (dd's binary paged in:
    a little more at most). Twelve at once beside two CPU hogs: the same. (Before, these read 0, nothing counted.)"""
    data = tmp_path / "dd.dat"
    with open(data, "wb") as f:
        f.write(os.urandom(4 << 20))
    os.sync()
    subprocess.run(["dd", f"if={data}", "of=/dev/null", "bs=64k", "iflag=direct"], capture_output=True, check=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if orphans > 1 else 0)]
    script = "; ".join(f"(dd if={data} of=/dev/null bs=64k iflag=direct 2>{tmp_path}/dd{i}.err &)"
                       for i in range(orphans)) + "; sleep 2"
    try:
        res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,blockio", "--interval",
                              "1", "--stdout", "json", "--", "sh", "-c", script], capture_output=True, text=True,
                             timeout=120, cwd=str(ROOT))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert res.returncode == 0, res.stderr
    copied = sum(int(re.search(r"^(\d+) bytes", (tmp_path / f"dd{i}.err").read_text(), re.M).group(1))
                 for i in range(orphans))
    samples = [f for f in map(json.loads, res.stdout.splitlines()) if f["kind"] == "sample"]
    read = sum(f["probes"]["cgroup"]["io_read_bytes"] for f in samples)
    uncounted = sum(f["probes"]["cgroup"]["exits_uncounted"] for f in samples)
    print(f"{orphans} orphan dd: copied {copied} B, cgroup io_read_bytes {read} B, exits_uncounted {uncounted}")
    assert copied == orphans * (4 << 20)
    assert copied <= read <= copied + (1 << 20), (copied, read, uncounted)


def test_fio_reads_counted_to_the_last_interval_on_the_command_line(tmp_path):
    """`jobprobe run --probes cgroup -- fio` with O_DIRECT random reads (here io.stat is on cgroup v1, so the
    cgroup probe reads /proc): the sum of io_read_bytes matches fio's own report, the last frame included."""
    data = tmp_path / "fio.dat"
    with open(data, "wb") as f:
        f.write(os.urandom(64 << 20))
    report = tmp_path / "fio.json"
    # fio once beforehand, outside the job: its binary and libraries are paged in then (read_bytes counts page-ins,
    # which a cold cache adds to the job's first frame), so the job's reads are its O_DIRECT reads alone
    subprocess.run(["fio", "--name=w", f"--filename={data}", "--size=64M", "--rw=randread", "--bs=4k", "--direct=1",
                    "--time_based", "--runtime=1", "--output-format=json", f"--output={tmp_path / 'warm.json'}"],
                   check=True, capture_output=True, timeout=60)
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup", "--interval",
                          "0.5", "--stdout", "json", "--", "fio", "--name=x", f"--filename={data}", "--size=64M",
                          "--rw=randread", "--bs=4k", "--direct=1", "--time_based", "--runtime=3",
                          "--output-format=json", f"--output={report}"],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    samples = [f for f in map(json.loads, res.stdout.splitlines()) if f["kind"] == "sample"]
    fio_bytes = json.loads(report.read_text())["jobs"][0]["read"]["io_bytes"]
    got = sum(f["probes"]["cgroup"]["io_read_bytes"] for f in samples)
    print(f"fio read {fio_bytes} B; cgroup probe {got} B; per 0.5 s frame (MB) "
          f"{[round(f['probes']['cgroup']['io_read_bytes'] / 1e6, 1) for f in samples]}")
    assert abs(got - fio_bytes) <= 0.01 * fio_bytes, (got, fio_bytes)


def test_throttling_from_a_cgroup2_cpu_stat_fixture(tmp_path):
    """cgroup2 with the cpu controller: nr_periods / nr_throttled / throttled_usec as deltas, cpu.max as cores."""
    mount = tmp_path / "cg"
    grp = mount / "job1"
    grp.mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n")
    (grp / "cgroup.procs").write_text("")
    for f, v in (("memory.current", "0"), ("memory.stat", "anon 0\nfile 0\n"), ("io.stat", ""),
                 ("cpu.max", "max 100000")):
        (grp / f).write_text(v + "\n")

    def stat(user, periods, throttled, usec):
        (grp / "cpu.stat").write_text(f"usage_usec {user}\nuser_usec {user}\nsystem_usec 0\nnr_periods {periods}\n"
                                      f"nr_throttled {throttled}\nthrottled_usec {usec}\n")
    stat(0, 7, 2, 900)
    probe = CgroupProbe(Host(proc=str(tmp_path / "proc"), mountinfo=str(mountinfo), is_root=False))
    probe.start(CgroupTarget(str(grp), mountinfo=str(mountinfo)))
    stat(100, 17, 10, 800_900)
    (grp / "cpu.max").write_text("50000 100000\n")
    s = probe.sample()
    assert (s["cpu_periods"], s["cpu_throttled_periods"], s["cpu_throttled_ns"]) == (10, 8, 800_000_000)
    assert s["cpu_limit_cores"] == 0.5
    (grp / "cpu.max").write_text("max 100000\n")
    s = probe.sample()
    assert (s["cpu_periods"], s["cpu_throttled_ns"]) == (0, 0) and "cpu_limit_cores" not in s


@pytest.mark.kernel
@pytest.mark.serial      # its stopped time is a share of the machine: beside load it got its quota late (0.83 s of 2)
def test_a_cpu_limit_throttles_a_burner_and_the_probe_says_how_much(make_cgroup):
    """A burner limited to 0.2 cores (cpu.max where cgroup2 has the cpu controller, else the v1 cpu group's
    cfs_quota_us) for ~2 s: the probe's throttled periods and time equal the kernel's own cpu.stat deltas, and
    the burner was stopped for most of the time (it wants 1 core and gets 0.2)."""
    cg = make_cgroup()
    v2 = "cpu" in (cg.path.parent.parent / "cgroup.subtree_control").read_text().split() \
        if (cg.path.parent.parent / "cgroup.subtree_control").exists() else False
    v1 = None if v2 else v1_cpu_group("throttle")
    if not v2 and v1 is None:
        pytest.fail("no cpu controller on cgroup2 or v1: every Linux host with CFS has one")
    limit_dir = cg.path if v2 else v1
    try:
        if v2:
            (cg.path / "cpu.max").write_text("20000 100000\n")
        else:
            (v1 / "cpu.cfs_period_us").write_text("100000\n")
            (v1 / "cpu.cfs_quota_us").write_text("20000\n")

        def kernel():
            kv = {k: int(v) for k, v in (ln.split() for ln in (limit_dir / "cpu.stat").read_text().splitlines())}
            return (kv["nr_periods"], kv["nr_throttled"],
                    kv.get("throttled_usec", 0) * 1000 + kv.get("throttled_time", 0))
        probe = CgroupProbe()
        job = subprocess.Popen(workload("burn", 2.5), preexec_fn=lambda: (
            (cg.path / "cgroup.procs").write_text(str(os.getpid())),
            v1 is not None and (v1 / "cgroup.procs").write_text(str(os.getpid()))))
        time.sleep(0.2)
        probe.start(CgroupTarget(str(cg.path)))
        before = kernel()
        got = [0, 0, 0]
        for _ in range(4):
            time.sleep(0.5)
            s = probe.sample()
            assert s["cpu_limit_cores"] == 0.2
            for i, k in enumerate(("cpu_periods", "cpu_throttled_periods", "cpu_throttled_ns")):
                got[i] += s[k]
        after = kernel()
        job.kill()
        job.wait()
        probe.stop()
        want = [a - b for a, b in zip(after, before)]
        # the probe's reads bracket the test's within a few ms: a period or two apart at most
        assert abs(got[0] - want[0]) <= 2 and abs(got[1] - want[1]) <= 2, (got, want)
        assert abs(got[2] - want[2]) <= 0.1e9, (got, want)
        assert got[1] >= 0.8 * got[0] > 10 and 1.0e9 < got[2] < 2.0e9, got     # ~2 s, stopped ~80% of it
    finally:
        if v1 is not None:
            for pid in (v1 / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
            time.sleep(0.1)
            v1.rmdir()


V1MEM_JOB = r"""
import os, sys
buf = bytearray(64 << 20)
for i in range(0, len(buf), 4096):
    buf[i] = 1                                  # 64 MiB of anonymous memory, touched
with open(sys.argv[1], "rb") as f:              # 48 MiB read into the page cache, charged to this group
    while f.read(1 << 20):
        pass
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.kernel
def test_a_hybrid_hosts_v1_memory_group_gives_the_jobs_memory_and_its_limit(make_cgroup, make_memcg, tmp_path):
    """On a host whose memory controller is on v1, a job in its own v1 memory group (limit 256 MiB) that holds
    64 MiB of anonymous memory and read 48 MiB of a file: the probe's memory is the group's (page cache included,
    which the processes' RSS leaves out), beside the kernel's own v1 files read right after, and its limit is the
    group's. With a process outside the job in the same v1 group, its figures are not the job's: RSS again, no
    limit."""
    data = Path(f"/var/tmp/jobprobe-v1mem-{os.getpid()}.dat")
    with open(data, "wb") as f:
        f.write(os.urandom(48 << 20))
        f.flush()
        os.fsync(f.fileno())                                # (dirty pages would stay in the cache)
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # read by the job, charged to its group
    os.close(fd)
    cg, memcg = make_cgroup(), make_memcg(256)
    (tmp_path / "job.py").write_text(V1MEM_JOB)
    job = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(data)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, preexec_fn=lambda: (
                               (cg.path / "cgroup.procs").write_text(str(os.getpid())),
                               (memcg / "cgroup.procs").write_text(str(os.getpid()))))
    other = None
    try:
        assert job.stdout.readline().strip() == "ready"
        probe = CgroupProbe()
        probe.start(CgroupTarget(str(cg.path)))
        s = probe.sample()
        usage = int((memcg / "memory.usage_in_bytes").read_text())
        stat = read_kv(str(memcg / "memory.stat"))
        print(f"v1 memory: probe {s['mem_bytes'] >> 20} MiB (anon {s['mem_anon_bytes'] >> 20}, file "
              f"{s['mem_file_bytes'] >> 20}), kernel {usage >> 20} MiB; limit {s.get('mem_limit_bytes')}")
        assert s["mem_limit_bytes"] == 256 << 20
        assert abs(s["mem_bytes"] - usage) <= 1 << 20 and abs(s["mem_file_bytes"] - stat["total_cache"]) <= 1 << 20
        assert s["mem_anon_bytes"] >= 64 << 20 and s["mem_file_bytes"] >= 40 << 20, s
        probe.stop()
        # a process outside the job joins the v1 group: the group is no longer the job's alone
        other = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: (memcg / "cgroup.procs").write_text(
            str(os.getpid())))
        probe = CgroupProbe()
        probe.start(CgroupTarget(str(cg.path)))
        s = probe.sample()
        probe.stop()
        assert "mem_limit_bytes" not in s and s["mem_file_bytes"] < 40 << 20, s   # RSS: the cache is not mapped
    finally:
        job.kill()
        job.wait()
        if other is not None:
            other.kill()
            other.wait()
        data.unlink(missing_ok=True)


def write_stat(root: Path, pid: int, ppid: int, utime: int, stime: int, start: int, cmdline: bytes):
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = ["S", ppid] + [0] * 9 + [utime, stime, 0, 0] + [0] * 4 + [start] + [0] * 25
    (d / "stat").write_text(f"{pid} (python3) " + " ".join(map(str, rest)) + "\n")
    (d / "cmdline").write_bytes(cmdline)


def test_helpers_are_forks_that_kept_their_parents_command_line(tmp_path):
    """A trainer (its parent outside the set), a DataLoader-like fork of it (same command line), a program it
    started (its own command line), a fork too young to judge, a PID used anew: which are helpers, and their CPU
    per update from the first update (or from zero, born later)."""
    (tmp_path / "uptime").write_text("1000.00 0.00\n")        # 100000 ticks since boot at CLK_TCK 100
    now = 1000 * CLK_TCK
    train, exe = b"python3\0train.py\0", b"python3\0-c\0work()\0"
    write_stat(tmp_path, 10, 1, 500, 50, now - 900, train)         # the trainer
    write_stat(tmp_path, 11, 10, 20, 5, now - 500, train)          # a forked worker, there before the first update
    write_stat(tmp_path, 12, 10, 30, 0, now - 500, exe)            # a program the trainer started
    h = threadacct_mod.Helpers(str(tmp_path))
    assert h.update([10, 11, 12]) == (1, 0, 0)                      # the baseline
    write_stat(tmp_path, 11, 10, 70, 9, now - 500, train)
    write_stat(tmp_path, 13, 10, 4, 1, now - 10, train)             # a fork 0.1 s old: not judged yet
    assert h.update([10, 11, 12, 13]) == (1, 50 * TICK_NS, 4 * TICK_NS)
    (tmp_path / "uptime").write_text("1002.00 0.00\n")
    write_stat(tmp_path, 13, 10, 40, 2, now - 10, train)            # now judged: all it did since it was born
    assert h.update([10, 11, 12, 13]) == (2, 40 * TICK_NS, 2 * TICK_NS)
    write_stat(tmp_path, 13, 10, 6, 0, now + 150, train)            # 13 used anew by another fork
    (tmp_path / "uptime").write_text("1003.00 0.00\n")
    write_stat(tmp_path, 11, 10, 71, 9, now - 500, train)
    assert h.update([10, 11, 12, 13]) == (2, 7 * TICK_NS, 0)
    assert h.update([10, 12]) == (0, 0, 0)                          # the helpers gone


@pytest.mark.kernel
def test_the_helpers_cpu_is_what_the_forked_workers_used_themselves(make_cgroup):
    """A real job in its own group: a parent that burns, forks two workers (no exec) and starts a program of its
    own; each process reports its own CPU (getrusage). The probe's helpers are the two workers, their CPU what they
    report, and the rest of the group's CPU what the parent and its program report."""
    cg = make_cgroup()
    probe = CgroupProbe()
    probe.start(CgroupTarget(str(cg.path)))
    job = cg.spawn([sys.executable, "-c", FORKED_WORKERS], stdout=subprocess.PIPE, text=True)
    total = {"cpu_user_ns": 0, "cpu_system_ns": 0, "helper_cpu_user_ns": 0, "helper_cpu_system_ns": 0}
    helpers = set()
    while job.poll() is None:
        time.sleep(0.25)
        s = probe.sample()
        helpers.add(s["helper_nprocs"])
        for k in total:
            total[k] += s[k]
    time.sleep(0.05)
    s = probe.sample()
    probe.stop()
    for k in total:
        total[k] += s[k]
    own = dict(line.split() for line in job.stdout.read().split("\n") if line)
    own = {k: float(v) * 1e9 for k, v in own.items()}
    report = dict(total=total, own=own, helpers=helpers)
    assert own["worker0"] > 0.4e9 and own["worker1"] > 0.4e9 and own["program"] > 0.4e9, report   # they ran
    assert max(helpers) == 2, report
    got = total["helper_cpu_user_ns"] + total["helper_cpu_system_ns"]
    want = own["worker0"] + own["worker1"]
    # /proc counts in ticks; a worker's last moments after its last read go with it (its exit): a few ticks each
    assert abs(got - want) <= 0.03 * want + 8 * TICK_NS, report
    lead = total["cpu_user_ns"] + total["cpu_system_ns"] - got
    assert abs(lead - own["parent"] - own["program"]) <= 0.05 * (own["parent"] + own["program"]) + 8 * TICK_NS, report


FORKED_WORKERS = r"""
import os, resource, subprocess, sys, time
def burn(s):
    end = time.process_time() + s
    while time.process_time() < end:
        pass
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
burn(0.3)
program = subprocess.Popen([sys.executable, "-c", "import time, resource\nend = time.process_time() + 0.8\n"
                            "while time.process_time() < end: pass\ntime.sleep(1.2)\n"
                            "r = resource.getrusage(resource.RUSAGE_SELF)\nprint(r.ru_utime + r.ru_stime)"],
                           stdout=subprocess.PIPE, text=True)
workers = []
for i in range(2):
    r, w = os.pipe()
    if os.fork() == 0:
        time.sleep(1.5)            # older than a tick and the probe's settling time before it burns
        burn(0.6 + 0.2 * i)
        time.sleep(1.2)            # read once more, whole, before it exits
        os.write(w, f"{cpu()}".encode())
        os._exit(0)
    os.close(w)
    workers.append(r)
burn(0.5)
for i, r in enumerate(workers):
    print(f"worker{i}", os.read(r, 100).decode(), flush=True)
    os.wait()
print("program", program.communicate()[0].strip())
print("parent", cpu(), flush=True)
"""
