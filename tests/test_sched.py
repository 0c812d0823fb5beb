"""sched probe: pure helpers on fixtures (unit), then real eBPF on real workloads in real cgroups (kernel tier).

The independent reference for switch counts is the kernel's own per-task count (/proc/PID/status
voluntary_ctxt_switches + nonvoluntary_ctxt_switches), printed by the workload itself just before it exits.
"""
from __future__ import annotations

import ctypes as ct
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bpf
from jobprobe.errors import ProbeUnavailable
from jobprobe.host import Host
from jobprobe.target import CgroupTarget, PidTreeTarget
from probes.sched import (COUNTERS, HANDLERS, NBUCKETS, SchedProbe, SlotStats, exit_has_group_dead, interval,
                          proc_gone, trim_log, zero_reading)
from tests.conftest import workload

# ---------------------------------------------------------------- unit


def test_trim_log_keeps_last_nonempty_lines():
    log = "warning 1\n\nR1 type=ctx\n" + "\n".join(f"{i}: insn" for i in range(40)) + "\ninvalid access\n\n"
    assert trim_log(log, 2) == "39: insn | invalid access"
    assert trim_log("") == ""


def test_exit_has_group_dead(tmp_path):
    fmt = tmp_path / "kernel/tracing/events/sched/sched_process_exit/format"
    assert not exit_has_group_dead(str(tmp_path))
    fmt.parent.mkdir(parents=True)
    fmt.write_text("\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n")
    assert not exit_has_group_dead(str(tmp_path))
    fmt.write_text(fmt.read_text() + "\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n")
    assert exit_has_group_dead(str(tmp_path))


def test_proc_gone(tmp_path):
    for pid, state in ((10, "S"), (11, "Z"), (12, "R")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a) b) {state} 1 1 1 0 -1\n")
    assert not proc_gone(str(tmp_path), 10)
    assert proc_gone(str(tmp_path), 11)       # zombie: its exit tracepoint has fired
    assert not proc_gone(str(tmp_path), 12)   # ')' inside comm does not confuse the parser
    assert proc_gone(str(tmp_path), 13)


def test_interval_deltas_and_percentiles():
    before = zero_reading()
    now = {**{k: 10 for k in COUNTERS}, "hist": [0] * NBUCKETS}
    now["hist"][3] = 10                        # ten waits of 8..16 µs
    out = interval(now, before)
    assert out["voluntary_switches"] == 10 and out["runq_events"] == 10
    assert out["runq_lat_us_log2"][3] == 10 and sum(out["runq_lat_us_log2"]) == 10
    assert 8 <= out["runq_lat_p50_us"] <= out["runq_lat_p99_us"] <= 16
    empty = interval(now, now)
    assert empty["runq_events"] == 0 and empty["runq_lat_p50_us"] is None and empty["runq_lat_p99_us"] is None


def test_interval_survives_counter_wrap():
    before = {**zero_reading(), "offcpu_ns": (1 << 64) - 5}
    now = {**zero_reading(), "offcpu_ns": 7}
    assert interval(now, before)["offcpu_ns"] == 12


def test_every_emitted_field_is_declared():
    out = interval(zero_reading(), zero_reading())
    assert set(out) == set(SchedProbe.fields)
    assert all(f.type and f.unit and f.meaning for f in SchedProbe.fields.values())


def test_python_and_c_agree_on_layout():
    src = bpf.source("sched")
    assert re.search(rf"#define NBUCKETS {NBUCKETS}\b", src)
    struct = src[src.index("struct slot_stats {"):]
    body = struct[struct.index("{") + 1:struct.index("};")]
    # The C members in order, each u64 (arrays with their length), against the ctypes struct read from the map.
    members = re.findall(r"^\s*u64 (\w+)(?:\[(\w+)\])?;", body, re.M)
    assert [(n, 8 * (NBUCKETS if d == "NBUCKETS" else 1)) for n, d in members] == \
        [(n, ct.sizeof(t)) for n, t in SlotStats._fields_]
    assert [n for n, _ in members][:len(COUNTERS)] == list(COUNTERS)
    assert ct.sizeof(SlotStats) == 8 * (len(COUNTERS) + NBUCKETS)
    for _, fn in SchedProbe().all_handlers():
        assert re.search(rf"^int {fn}\(struct tracepoint__", src, re.M), fn


def test_check_reports_why(tmp_path):
    assert SchedProbe().check(Host(is_root=False, sys=str(tmp_path))) == "needs root"
    assert "not found" in SchedProbe().check(Host(is_root=True, sys=str(tmp_path)))


# ---------------------------------------------------------------- kernel tier


def bpf_fds(kind: str = "prog") -> int:
    """Open fds of this process that are BPF programs ("prog"), maps ("map") or perf events ("perf": the
    tracepoint attachments)."""
    want = "anon_inode:[perf_event]" if kind == "perf" else f"anon_inode:bpf-{kind}"
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == want
        except OSError:
            pass  # the fd of the listing itself, already closed
    return n


@pytest.fixture
def probe():
    p = SchedProbe()
    why = p.check(p.host)
    assert why is None, f"sched probe cannot run on this (root) host: {why}"
    yield p
    p.stop()


def switches_of(proc: subprocess.Popen) -> int:
    out, _ = proc.communicate(timeout=120)
    vol, invol = map(int, out.split()[-2:])
    return vol + invol


def job_switches(s: dict) -> int:
    return s["voluntary_switches"] + s["involuntary_switches"]


@pytest.mark.kernel
def test_cgroup_switches_match_the_kernels_count(probe, make_cgroup):
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    proc = cg.spawn(workload("switches", 2000, 500), stdout=subprocess.PIPE, text=True)
    expected = switches_of(proc)
    s = probe.sample()
    print(f"sched: {job_switches(s)} switches, kernel's own count {expected}")
    assert expected >= 2000
    assert abs(job_switches(s) - expected) <= 0.05 * expected
    assert s["offcpu_ns"] >= 0.9 * 2000 * 500_000   # at least the sleeps themselves


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_switches_agree_with_perf_context_switches_for_the_same_job(probe, make_cgroup, kind):
    """Two independent mechanisms on the same job and window: eBPF tracepoints vs perf's software counter."""
    from probes.perf import PerfProbe
    perf = PerfProbe()
    cg = make_cgroup()
    if kind == "cgroup":
        target = CgroupTarget(str(cg.path))
        probe.start(target)
        perf.start(target)
        proc = cg.spawn(workload("switches", 3000, 300), stdout=subprocess.PIPE, text=True)
    else:
        proc = cg.spawn([sys.executable, "-c", "import sys,time; sys.stdin.readline(); "
                         "import runpy; sys.argv=sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                         *workload("switches", 3000, 300)[1:]],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        target = PidTreeTarget([proc.pid])
        probe.start(target)
        perf.start(target)
        proc.stdin.write("go\n")
        proc.stdin.flush()
    try:
        switches_of(proc)
        s, p = probe.sample(), perf.sample()
    finally:
        perf.stop()
    print(f"{kind}: sched {job_switches(s)} switches, perf context_switches {p['context_switches']}")
    assert p["context_switches"] >= 3000
    assert abs(job_switches(s) - p["context_switches"]) <= 0.05 * p["context_switches"]


@pytest.mark.kernel
def test_busy_process_outside_the_group_adds_nothing(probe, make_cgroup):
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    noise = subprocess.Popen(workload("switches", 4000, 200), stdout=subprocess.PIPE, text=True)
    proc = cg.spawn(workload("switches", 2000, 500), stdout=subprocess.PIPE, text=True)
    expected = switches_of(proc)
    noisy = switches_of(noise)
    s = probe.sample()
    print(f"sched: {job_switches(s)} switches, job's own {expected}, outside process {noisy}")
    assert noisy >= 4000
    assert abs(job_switches(s) - expected) <= 0.05 * expected


@pytest.mark.kernel
def test_cgroup_made_after_start_is_picked_up_by_sample(probe, make_cgroup):
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    sub = cg.path / "step0"
    sub.mkdir()
    try:
        probe.sample()                                   # the tick that notices the new group
        proc = subprocess.Popen(workload("switches", 1000, 500), stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: (sub / "cgroup.procs").write_text(str(os.getpid())))
        expected = switches_of(proc)
        s = probe.sample()
        assert abs(job_switches(s) - expected) <= 0.05 * expected
    finally:
        for _ in range(100):
            try:
                sub.rmdir()
                break
            except OSError:
                time.sleep(0.02)


ROOT_THEN_CHILD = """
import subprocess, sys
sys.stdin.readline()
out = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True).stdout
print(out, flush=True)
"""


@pytest.mark.kernel
def test_pid_tree_follows_children_forked_after_attach(probe):
    root = subprocess.Popen([sys.executable, "-c", ROOT_THEN_CHILD, *workload("switches", 1000, 500)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probe.start(PidTreeTarget([root.pid]))
    assert probe.members() == {root.pid}
    out, _ = root.communicate("go\n", timeout=120)
    child = sum(map(int, out.split()[-2:]))
    s = probe.sample()
    print(f"sched: {job_switches(s)} switches, child's own count {child}")
    # The child's switches, plus the root's few (reading stdin, fork, waitpid, exit).
    assert 0.95 * child <= job_switches(s) <= 1.05 * child + 50
    assert probe.members() == set()                    # both exited: nothing left behind


@pytest.mark.kernel
def test_runq_latency_when_the_job_waits_for_a_cpu(probe, make_cgroup):
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    cpus = sorted(os.sched_getaffinity(0))[:2]
    procs = [cg.spawn(workload("burn", 1.5)), cg.spawn(workload("burn", 1.5)),
             subprocess.Popen(workload("burn", 1.5))]   # the third, outside the job, makes 3 runners on 2 cores
    for p in procs:
        os.sched_setaffinity(p.pid, cpus)
    for p in procs:
        assert p.wait(timeout=60) == 0
    s = probe.sample()
    print(f"sched: {s['runq_events']} runq events, p50 {s['runq_lat_p50_us']} µs, p99 {s['runq_lat_p99_us']} µs, "
          f"{s['involuntary_switches']} involuntary")
    assert s["runq_events"] > 0 and s["involuntary_switches"] > 0
    assert sum(s["runq_lat_us_log2"]) == s["runq_events"]
    assert len(s["runq_lat_us_log2"]) == NBUCKETS
    assert s["runq_lat_ns"] > 0 and s["runq_lat_p50_us"] is not None
    assert s["offcpu_ns"] >= s["runq_lat_ns"]          # waiting for a CPU is part of being off it


@pytest.mark.kernel
def test_stop_leaves_no_bpf_program_fd(probe):
    before, maps, perf = bpf_fds("prog"), bpf_fds("map"), bpf_fds("perf")
    probe.start(PidTreeTarget([os.getpid()]))
    assert bpf_fds("prog") == before + len(probe.all_handlers())
    assert bpf_fds("perf") == perf + len(probe.all_handlers())   # one attachment per tracepoint, held here
    assert bpf_fds("map") == maps + 4                  # job_of_cgroup, job_of_tgid, start, stats
    assert probe.loaded.maps["stats"].value_size == ct.sizeof(SlotStats)   # the kernel's size, from the loader
    assert probe.members() == {os.getpid()}
    probe.stop()
    assert bpf_fds("prog") == before and bpf_fds("map") == maps and bpf_fds("perf") == perf
    probe.stop()                                       # idempotent
    assert probe.sample() == {}


@pytest.mark.kernel
@pytest.mark.parametrize("old, new, said", [
    # on_switch fails the verifier after job_fork and job_exit are already attached
    ("if (b >= NBUCKETS)\n                b = NBUCKETS - 1;", "", "invalid access to map value"),
    ("return 0;\n}\n\n/* Fired", "return 0;\n}\n}\n/* Fired", "error:"),    # a compile error
])
def test_failed_start_says_why_and_releases_everything(probe, monkeypatch, old, new, said):
    real = bpf.source("sched")
    assert old in real
    monkeypatch.setattr(bpf, "source", lambda name: real.replace(old, new))
    before, maps, perf = bpf_fds("prog"), bpf_fds("map"), bpf_fds("perf")
    with pytest.raises(ProbeUnavailable, match=said) as err:
        probe.start(PidTreeTarget([os.getpid()]))
    print(f"sched: {err.value}")
    assert len(str(err.value)) < 2000                  # trimmed to the last lines of the log
    assert bpf_fds("prog") == before and bpf_fds("map") == maps and bpf_fds("perf") == perf


FORK_STORM = """
import os, sys, threading
sys.stdin.readline()
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
for _ in range(int(sys.argv[2])):   # threads get keys too (fork cannot tell them apart); they must go as well
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
print("done", flush=True)
sys.stdin.readline()
"""


@pytest.mark.kernel
@pytest.mark.parametrize("group_dead", [True, False], ids=["group_dead", "older-kernel"])
def test_fork_exit_storm_leaves_only_live_members(probe, monkeypatch, group_dead):
    if group_dead and not exit_has_group_dead():
        pytest.skip("this kernel's sched_process_exit has no group_dead field")
    monkeypatch.setattr("probes.sched.exit_has_group_dead", lambda sys_root: group_dead)
    root = subprocess.Popen([sys.executable, "-c", FORK_STORM, "2000", "200"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        probe.start(PidTreeTarget([root.pid]))
        root.stdin.write("go\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "done"
        s = probe.sample()
        # Each child waited for a CPU once after wake_up_new_task: counted only if fork made it a member.
        assert s["runq_events"] >= 2000
        assert probe.members() == {root.pid}
        start = set(probe.loaded.maps["start"].keys())
        assert all(Path(f"/proc/{tid}").exists() for tid in start), "off-CPU entries of exited tasks"
    finally:
        root.communicate("\n", timeout=30)
    assert probe.members() == set()
