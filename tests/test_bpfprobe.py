# SPDX-License-Identifier: Apache-2.0
"""What every eBPF probe shares (jobprobe/contract/bpfprobe.py): the job-membership maps stay exact through exec;
bpf_missed
is the interval's skipped runs (the kernel's recursion_misses; the net retransmit test prints real ones)."""
import subprocess
import sys
import time

import pytest

from jobprobe.contract.bpfprobe import MISSED, MISSED_FIELD, BpfProbe
from jobprobe.contract.probe import Field
from jobprobe.kernel import bpfload as _bpfload
from jobprobe.node import registry
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.sched import SchedProbe

# waits for a line on stdin (sent once the probe is attached, however long its compile took), then execs from a thread
EXEC_FROM_A_THREAD = ("import os, sys, threading; sys.stdin.readline(); "
                      "t = threading.Thread(target=lambda: os.execv('/bin/sleep', ['sleep', '1.5'])); "
                      "t.start(); t.join()")


@pytest.mark.kernel
def test_exec_from_a_thread_leaves_no_stale_member():
    """A non-leader thread that calls execve takes over the process's pid; its old tid never exits. Without the
    exec handler of bpf/common.h that tid would stay in job_of_tgid forever."""
    proc = subprocess.Popen([sys.executable, "-c", EXEC_FROM_A_THREAD], stdin=subprocess.PIPE)
    probe = SchedProbe()
    try:
        probe.start(PidTreeTarget([proc.pid]))
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        for _ in range(250):                  # wait for the thread to be created and to exec (after the attach)
            if open(f"/proc/{proc.pid}/comm").read().strip() == "sleep":
                break
            time.sleep(0.02)
        time.sleep(0.1)
        assert probe.members() == {proc.pid}, probe.members()
        proc.wait(timeout=10)
        time.sleep(0.1)
        assert probe.members() == set()
    finally:
        probe.stop()
        proc.kill()
        proc.wait()



class CountingProbe(BpfProbe):
    """Test only: an eBPF probe whose programs are stood in for by prog_stats() figures (named fake)."""
    name = "counting_test"
    fields = {"n": Field("int", "count", "test only")}

    def __init__(self, misses):
        super().__init__()
        self.misses = misses
        self.loaded = self       # stands in for _bpfload.Loaded: prog_stats() is all that bpf_missed reads

    def prog_stats(self):
        return {name: _bpfload.ProgStats(0, 0, m) for name, m in zip(("a", "b"), self.misses)}

    def sync_members(self):
        pass

    def reading(self):
        return 0

    def interval(self, now, before):
        return {"n": now - before}


def test_bpf_missed_is_the_interval_delta_summed_over_programs():
    probe = CountingProbe([3, 4])               # skips before start are not the job's interval's
    probe._last, probe._missed = probe.reading(), probe.missed_total()   # what start() sets
    assert probe.sample() == {"n": 0, MISSED: 0}
    probe.misses = [5, 10]
    assert probe.sample() == {"n": 0, MISSED: 8}
    assert probe.sample() == {"n": 0, MISSED: 0}


def test_every_bpf_probe_declares_bpf_missed():
    assert CountingProbe.fields[MISSED] is MISSED_FIELD
    bpf_probes = [cls for cls in registry.all_probes().values() if issubclass(cls, BpfProbe)]
    assert {cls.name for cls in bpf_probes} >= {"sched", "net", "blockio"}
    for cls in bpf_probes:
        assert MISSED in cls.fields, cls.name


@pytest.mark.kernel
def test_in_an_agent_tick_every_jobs_slot_comes_from_one_read_equal_to_its_own_lookup(make_cgroup):
    """The agent reads a module's per-slot array once per tick (one batch lookup) for all its jobs: each job's
    summed counters from that read equal a lookup of its own slot, for sched, blockio and net, and two jobs of one
    node read through one shared load."""
    from jobprobe.contract import tickmemo
    from jobprobe.kernel.membership import Node
    from jobprobe.node.targets.cgroup import CgroupTarget
    from jobprobe.probes.blockio import BlockioProbe
    from jobprobe.probes.net import NetProbe
    node = Node()
    groups = [make_cgroup(), make_cgroup()]
    busy = [g.spawn(["sleep", "60"]) for g in groups]
    probes = []
    try:
        targets = [CgroupTarget(str(g.path)) for g in groups]    # one per job, its probes' (one slot each)
        for cls in (SchedProbe, BlockioProbe, NetProbe):
            for t in targets:
                p = cls(node=node)
                p.start(t)
                probes.append(p)
        for n, g in zip((300, 400), groups):
            g.spawn(["sh", "-c", f"for i in $(seq {n}); do sleep 0.001; done"]).wait()
        time.sleep(0.5)                     # the loops are done: the jobs sleep, their counters stand still
        assert len({id(p.loaded) for p in probes if isinstance(p, SchedProbe)}) == 1
        tickmemo.begin()
        try:
            got = [p.slot_sums() for p in probes]
            reads = {p.read_ns for p in probes}
        finally:
            tickmemo.end()
        for p, g in zip(probes, got):
            assert g == p.loaded.maps["stats"].lookup_sums(p.slot), p.name
        sched = [g for p, g in zip(probes, got) if isinstance(p, SchedProbe)]
        assert sched[0][0] >= 300 and sched[1][0] >= 400 and sched[0] != sched[1]   # voluntary switches, each its own
        assert len(reads) == 3                  # one read (and its time) per module, shared by both jobs
    finally:
        for p in probes:
            p.stop()
        for b in busy:
            b.kill()
            b.wait()
        node.close()
