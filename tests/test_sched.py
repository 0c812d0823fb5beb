# SPDX-License-Identifier: Apache-2.0
"""sched probe: pure helpers on fixtures (unit), then real eBPF on real workloads in real cgroups (kernel tier).

The independent reference for switch counts is the kernel's own per-task count (/proc/PID/status
voluntary_ctxt_switches + nonvoluntary_ctxt_switches), printed by the workload itself just before it exits.
"""
from __future__ import annotations

import ctypes as ct
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobprobe import bpf
from jobprobe.contract.bpfprobe import MISSED
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import procfs
from jobprobe.kernel.bpf import trim_log
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import MEMBERSHIP, Node, exit_has_group_dead, proc_gone
from jobprobe.kernel.schedread import ARRAYS, COUNTERS, NBUCKETS, NTIMES, READ_TRIES, SlotStats, settle, time_totals
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.sched import (
    HANDLERS,
    RAW_SYSCALL_HANDLERS,
    REASONS,
    SYSCALL_HANDLERS,
    TIMES,
    OffRec,
    SchedProbe,
    btf_sched,
    interval,
    raw_sched,
    syscall_from_regs,
    zero_reading,
)
from tests.conftest import TESTS, account, bpf_fds, sched_workload, steal_ns, wait_for, workload

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
    # past its exit tracepoint but not yet a zombie: PF_EXITING (0x4) in flags, one thread left
    rest = lambda flags, threads: " ".join(["1", "1", "1", "0", "-1", str(flags)] + ["0"] * 10 + [str(threads)])
    for pid, flags, threads in ((14, 0x400004, 1), (15, 0x400004, 3), (16, 0x400000, 1)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a) R {rest(flags, threads)} 0 0\n")
    assert proc_gone(str(tmp_path), 14)
    assert not proc_gone(str(tmp_path), 15)   # the leader exiting while other threads live: still a member
    assert not proc_gone(str(tmp_path), 16)


def test_interval_deltas_and_percentiles():
    before = zero_reading()
    now = {**zero_reading(), **{k: 10 for k in COUNTERS}}
    now["hist"][3] = 10                        # ten waits of 8..16 µs
    out = interval(now, before)
    assert out["voluntary_switches"] == 10 and out["runq_events"] == 10
    assert out["runq_lat_us_log2"][3] == 10 and sum(out["runq_lat_us_log2"]) == 10
    assert 8 <= out["runq_lat_p50_us"] <= out["runq_lat_p99_us"] <= 16
    empty = interval(now, now)
    assert empty["runq_events"] == 0 and empty["runq_lat_p50_us"] is None and empty["runq_lat_p99_us"] is None


def test_interval_survives_counter_wrap():
    before = {**zero_reading(), "voluntary": (1 << 64) - 5}
    now = {**zero_reading(), "voluntary": 7}
    assert interval(now, before)["voluntary_switches"] == 12


def test_open_periods_count_up_to_the_reading_across_cpus():
    """A sleep opened on CPU 0 at 1000 ns and a preemption opened on CPU 1 at 4000 ns; the sleep's wakeup came on
    CPU 1 (its close there: open_n -1, modulo 2^64) at 3000 ns. Read at 10000 ns: the sleep counts 2000 (done), the
    preemption 6000 (open, counted to the reading) and the wakeup wait 7000 (open since 3000)."""
    u = lambda x: x % (1 << 64)   # noqa: E731  what a u64 column holds
    idx = {n: i for i, n in enumerate(TIMES)}
    cpu0 = {"done_ns": [0] * NTIMES, "open_n": [0] * NTIMES, "open_ns": [0] * NTIMES}
    cpu1 = {"done_ns": [0] * NTIMES, "open_n": [0] * NTIMES, "open_ns": [0] * NTIMES}
    cpu0["open_n"][idx["sleep"]] += 1
    cpu0["open_ns"][idx["sleep"]] += 1000
    cpu1["open_n"][idx["sleep"]] = u(-1)
    cpu1["open_ns"][idx["sleep"]] = u(-1000)
    cpu1["done_ns"][idx["sleep"]] = 2000
    for c in ("wakeup", "runq"):
        cpu1["open_n"][idx[c]] += 1
        cpu1["open_ns"][idx[c]] += 3000
    for c in ("preempt", "runq"):
        cpu1["open_n"][idx[c]] += 1
        cpu1["open_ns"][idx[c]] += 4000
    summed = {k: [a + b for a, b in zip(cpu0[k], cpu1[k])] for k in cpu0}   # as slot_totals sums the columns
    t = time_totals(summed, 10_000)
    assert (t[idx["sleep"]], t[idx["preempt"]], t[idx["wakeup"]], t[idx["runq"]]) == (2000, 6000, 7000, 13000)
    out = interval({**zero_reading(), "times": t}, zero_reading())
    assert out["offcpu_ns"] == 2000 + 6000 + 7000 and out["runq_lat_ns"] == 13000
    # a later reading: the same open periods, 1000 ns more each
    later = interval({**zero_reading(), "times": time_totals(summed, 11_000)}, {**zero_reading(), "times": t})
    assert (later["offcpu_sleep_ns"], later["offcpu_preempt_ns"], later["offcpu_wakeup_ns"]) == (0, 1000, 1000)


class ScriptedStats:
    """The probe's `stats` map, handing out the per-CPU copies it is given, one per lookup, as the kernel would."""

    def __init__(self, copies: list[list[SlotStats]]):
        self.ncpus, self.copies, self.lookups = 2, list(copies), 0

    def lookup(self, key: int) -> list[SlotStats]:
        self.lookups += 1
        return self.copies.pop(0)


class ScriptedLoad:
    def __init__(self, stats: ScriptedStats):
        self.maps = {"stats": stats}

    def prog_stats(self) -> dict:
        return {}


def runq_copy(seq: tuple[int, int], open_n: int = 0, open_ns: int = 0, done_ns: int = 0) -> SlotStats:
    """One CPU's copy: its seqcount (done, begun) and its run-queue category."""
    v = SlotStats(seq_done=seq[0], seq_begun=seq[1])
    v.open_n[0], v.open_ns[0], v.done_ns[0] = open_n % (1 << 64), open_ns % (1 << 64), done_ns
    return v


def scripted_probe(tmp_path, copies: list[list[SlotStats]]) -> SchedProbe:
    (tmp_path / "loadavg").write_text("0.10 0.20 0.30 2/40 999\n")
    (tmp_path / "stat").write_text("cpu  1 2 3 4\nprocesses 5000\n")
    p = SchedProbe(Host(proc=str(tmp_path)))
    p.loaded, p.slot = ScriptedLoad(ScriptedStats(copies)), 0
    return p


def test_a_torn_copy_is_read_again_and_a_whole_one_gives_the_exact_time(tmp_path):
    """A wait opened on CPU 0 at `since` closes on CPU 1 at `end`. A copy of CPU 1 taken while its close was half
    written (open_ns moved, open_n not yet: seq_done one below seq_begun) would put `since` itself, the machine's
    uptime, in the interval; it is copied again, and the whole copy gives exactly end - (the baseline's instant)."""
    since = time.monotonic_ns() - 1_000_000
    p = scripted_probe(tmp_path, [[runq_copy((3, 3), open_n=1, open_ns=since), runq_copy((7, 7))]])
    p._last = p.reading()
    t0 = p._last["t"]                      # the baseline counted the open wait up to here
    end = time.monotonic_ns()
    torn = [runq_copy((3, 3), open_n=1, open_ns=since), runq_copy((7, 8), open_n=0, open_ns=-since)]
    whole = [runq_copy((3, 3), open_n=1, open_ns=since), runq_copy((8, 8), open_n=-1, open_ns=-since,
                                                                   done_ns=end - since)]
    p.loaded.maps["stats"].copies += [torn, whole]
    s = p.sample()
    assert p.loaded.maps["stats"].lookups == 3
    assert s["torn_reads"] == 0 and s["impossible"] == 0
    assert s["runq_lat_ns"] == end - t0    # exact: the rest of the wait, no skew, nothing clamped


def test_a_slot_torn_in_every_copy_is_held_and_counted_nothing_lost(tmp_path):
    since = time.monotonic_ns() - 1_000_000
    p = scripted_probe(tmp_path, [[runq_copy((3, 3), open_n=1, open_ns=since), runq_copy((7, 7))]])
    p._last = p.reading()
    t0 = p._last["t"]
    end = time.monotonic_ns()
    torn = [runq_copy((3, 3), open_n=1, open_ns=since), runq_copy((7, 8), open_n=0, open_ns=-since)]
    whole = [runq_copy((3, 3), open_n=1, open_ns=since), runq_copy((8, 8), open_n=-1, open_ns=-since,
                                                                   done_ns=end - since)]
    p.loaded.maps["stats"].copies += [torn] * READ_TRIES + [whole]
    held = p.sample()
    assert p.loaded.maps["stats"].lookups == 1 + READ_TRIES
    assert held["torn_reads"] == 1 and held["impossible"] == 0
    assert held["runq_lat_ns"] == 0 and held["offcpu_ns"] == 0     # nothing emitted from a torn copy
    nxt = p.sample()
    assert nxt["torn_reads"] == 0
    assert nxt["runq_lat_ns"] == end - t0                          # the held interval's time, all of it, here


def test_a_time_no_interval_can_hold_is_counted_and_held():
    """settle(): over dt per thread the node had (or below 0 past the copies' skew) is a bug, held and counted;
    a hair below the last reading (the copies' own skew) keeps the last one's time and is not lost."""
    uptime = 10_334_539_718_872
    before = {**zero_reading(), "times": [5_000] * NTIMES, "t": 10**9, "lag": 20_000, "node": (100, 5000)}
    # 1 s later, 100 threads then and 2 forks since: at most 102 s per category (+ the skew allowance)
    ok = {**zero_reading(), "times": [5_000 + 100 * 10**9] * NTIMES, "t": 2 * 10**9, "lag": 20_000,
          "node": (100, 5002)}
    assert settle(ok, before)["times"] == ok["times"]
    torn = {**ok, "times": [5_000 + uptime] + ok["times"][1:]}
    held = settle(torn, before)
    assert held["times"] == before["times"] and held["t"] == before["t"] and held["impossible"] == 1
    out = interval(held, before)
    assert out["impossible"] == 1 and out["runq_lat_ns"] == 0 and out["offcpu_ns"] == 0
    below = {**ok, "times": [5_000 - 3_000] + ok["times"][1:]}      # 3 µs under: a period crossing CPUs mid-copy
    kept = settle(below, before)
    assert kept["impossible"] == 0 and kept["times"][0] == 5_000 and interval(kept, before)["runq_lat_ns"] == 0
    assert settle({**below, "times": [5_000 - 10**9] + ok["times"][1:]}, before)["impossible"] == 1


def test_every_emitted_field_is_declared():
    out = interval(zero_reading(), zero_reading())
    assert set(out) | {MISSED} == set(SchedProbe.fields)   # bpf_missed: added by sample()
    assert all(f.type and f.unit and f.meaning for f in SchedProbe.fields.values())


def test_python_and_c_agree_on_layout():
    src = bpf.source("sched")
    assert re.search(rf"#define NBUCKETS {NBUCKETS}\b", src)
    struct = src[src.index("struct slot_stats {"):]
    body = struct[struct.index("{") + 1:struct.index("};")]
    # The C members in order, each u64 (arrays with their length), against the ctypes struct read from the map.
    members = re.findall(r"^\s*u64 (\w+)(?:\[(\w+)\])?;", body, re.M)
    dims = {"NBUCKETS": NBUCKETS, "NTIMES": NTIMES, "": 1}
    assert [(n, 8 * dims[d]) for n, d in members] == [(n, ct.sizeof(t)) for n, t in SlotStats._fields_]
    # the seqcount's halves are the first and the last word: the kernel copies a per-CPU value in address order
    assert members[0][0] == "seq_done" and members[-1][0] == "seq_begun"
    assert [n for n, _ in members][1:1 + len(COUNTERS)] == list(COUNTERS)
    assert ct.sizeof(SlotStats) == 8 * (2 + len(COUNTERS) + len(ARRAYS) * NTIMES + NBUCKETS)
    assert re.search(rf"#define NTIMES {NTIMES}\b", src) and re.search(r"#define T_RUNQ 0\b", src)
    assert re.search(rf"#define T_WAKEUP {TIMES.index('wakeup')}\b", src)
    for r in REASONS:
        assert re.search(rf"#define R_{r.upper()} {TIMES.index(r)}\b", src), r
    for _, fn in SchedProbe().all_handlers():
        assert re.search(rf"^int {fn}\((struct (tracepoint__|bpf_raw_tracepoint_args)|u64 \*ctx\))", src, re.M), fn


def test_check_reports_why(tmp_path):
    assert SchedProbe().check(Host(is_root=False, sys=str(tmp_path))) == "needs root"
    assert "not found" in SchedProbe().check(Host(is_root=True, sys=str(tmp_path)))


def offcpu_parts(s: dict) -> int:
    """The reasons plus the wait for a CPU after a wakeup: what offcpu_ns must equal."""
    return sum(s[f"offcpu_{r}_ns"] or 0 for r in REASONS) + s["offcpu_wakeup_ns"]


def test_interval_splits_offcpu_by_reason():
    before = zero_reading()
    parts = {"preempt": 5, "io": 7, "lock": 11, "sleep": 13, "wait": 17, "wakeup": 19, "stopped": 23}
    now = {**zero_reading(), "times": [parts.get(n, 0) for n in TIMES],
           "events": [{"lock": 3, "io": 2, "stopped": 1}.get(n, 0) for n in TIMES]}
    out = interval(now, before)
    assert (out["offcpu_io_ns"], out["offcpu_lock_ns"], out["offcpu_lock_events"]) == (7, 11, 3)
    assert (out["offcpu_stopped_ns"], out["offcpu_stopped_events"]) == (23, 1)
    assert offcpu_parts(out) == out["offcpu_ns"] == 95
    # Without the sys_enter hook lock and sleep are unknown, not zero: their time is in wait.
    out = interval(now, before, syscall_reasons=False)
    assert out["offcpu_lock_ns"] is None and out["offcpu_sleep_events"] is None and out["offcpu_wait_ns"] == 17
    assert out["offcpu_io_events"] == 2 and set(out) | {MISSED} == set(SchedProbe.fields)


def test_raw_tracepoints_from_5_18(tmp_path):
    """5.18 gave sched_switch its prev_state argument: from there the sched hooks are raw tracepoint programs and
    `start` is keyed by task address; before, classic ones keyed by thread id."""
    old, new = (SchedProbe(Host(kernel=k), syscall_source="hook", btf=False) for k in ("5.17.3", "6.18.44-x"))
    assert [fn for _, fn in old.handlers][:3] == [fn for _, fn in HANDLERS] and "-DRAW_SCHED" not in old.cflags
    assert [fn for _, fn in new.handlers][:3] == ["on_switch_raw", "on_wakeup_raw", "on_wakeup_new_raw"]
    assert "-DRAW_SCHED" in new.cflags and new.map_types["start"][0] is ct.c_uint64
    assert old.map_types["start"][0] is ct.c_uint32
    # with the kernel's BTF (this host's): BTF tracepoint programs, records in task storage, offsets from the BTF
    flags, why = btf_sched(Host())
    btf = SchedProbe(Host(kernel="6.18.44-x"))
    assert btf.btf == (why is None) and (why is None or "BTF" in why or "btf" in why)
    if btf.btf:
        assert [fn for _, fn in btf.handlers][:3] == ["on_switch_btf", "on_wakeup_btf", "on_wakeup_new_btf"]
        assert "-DBTF_SCHED" in btf.cflags and "start" not in btf.map_types
        assert any(f.startswith("-DTASK_PID_OFF=") for f in btf.cflags)
    assert not SchedProbe(Host(kernel="5.17.3")).btf        # BTF ones only where the raw ones can be
    # the syscall hook follows: raw with raw sched hooks (a classic one would hide sys_enter from perf users)
    if new.syscall_reasons:
        assert new.handlers[-1] == RAW_SYSCALL_HANDLERS[0] and "-DSYSCALL_ARG2_OFF=104" in new.cflags
    if old.syscall_reasons:
        assert old.handlers[-1] == SYSCALL_HANDLERS[0]
    src = bpf.source("sched")
    for fn in ("on_switch", "on_wakeup", "on_wakeup_new", "on_switch_raw", "on_wakeup_raw", "on_wakeup_new_raw",
               "on_sys_enter", "on_sys_enter_raw"):
        assert re.search(rf"^int {fn}\(struct ", src, re.M), fn
    body = src[src.index("struct off_rec {"):]
    members = re.findall(r"^\s*(u64|u32|s32) (\w+);", body[:body.index("};")], re.M)
    assert [n for _, n in members] == [n for n, _ in OffRec._fields_]
    assert sum({"u64": 8, "u32": 4, "s32": 4}[t] for t, _ in members) == ct.sizeof(OffRec)


def test_syscall_read_from_registers_where_the_kernel_can(tmp_path):
    """5.15+ with BTF: the syscall a sleeping thread is in is read at its switch-out (bpf_task_pt_regs): no syscall
    hook, no in_call map. Older, or without BTF: the hook."""
    (tmp_path / "kernel/btf").mkdir(parents=True)
    (tmp_path / "kernel/btf/vmlinux").write_bytes(b"")
    (tmp_path / "kernel/tracing/events/raw_syscalls/sys_enter").mkdir(parents=True)
    regs = SchedProbe(Host(is_root=True, sys=str(tmp_path), kernel="6.18.0"), machine="x86_64")
    assert regs.syscall_reasons and regs.from_regs and not regs.syscall_hook
    assert not any(fn.startswith("on_sys_enter") for _, fn in regs.all_handlers()) and "in_call" not in regs.map_types
    assert {"-DSYSCALL_FROM_REGS", "-DSYSCALL_NR_OFF=120", "-DSYSCALL_ARG2_OFF=104", "-DNR_FUTEX=202"} <= \
        set(regs.cflags) and "-DSYSCALL_HOOK" not in regs.cflags
    assert "-DSYSCALL_NR_OFF=280" in SchedProbe(Host(is_root=True, sys=str(tmp_path), kernel="6.18.0"),
                                                machine="aarch64").cflags
    nobtf = tmp_path / "nobtf"
    (nobtf / "kernel/tracing/events/raw_syscalls/sys_enter").mkdir(parents=True)
    for host in (Host(is_root=True, sys=str(tmp_path), kernel="5.14.0"),     # no bpf_task_pt_regs yet
                 Host(is_root=True, sys=str(nobtf), kernel="6.18.0")):       # no BTF
        hook = SchedProbe(host, machine="x86_64")
        assert hook.syscall_hook and not hook.from_regs and "-DSYSCALL_HOOK" in hook.cflags
        assert "in_call" in hook.map_types and any(fn.startswith("on_sys_enter") for _, fn in hook.all_handlers())


def test_syscall_hook_is_chosen_from_the_host(tmp_path):
    events = tmp_path / "kernel/tracing/events"
    for tp, _ in MEMBERSHIP + SchedProbe().all_handlers() + SYSCALL_HANDLERS:
        (events / _bpf.event_of(tp).replace(":", "/")).mkdir(parents=True, exist_ok=True)
    host = Host(is_root=True, sys=str(tmp_path), kernel="5.15.0")
    p = SchedProbe(host, machine="x86_64")
    assert p.syscall_reasons and p.syscall_reasons_off is None
    assert ("raw_syscalls:sys_enter", "on_sys_enter") in p.all_handlers()
    assert "-DSYSCALL_REASONS" in p.cflags and "-DNR_FUTEX=202" in p.cflags and "-DNR_CLOCK_NANOSLEEP=230" in p.cflags
    assert "-DNR_FUTEX=98" in SchedProbe(host, machine="aarch64").cflags
    for probe, why in ((SchedProbe(host, syscall_reasons=False), "turned off"),
                       (SchedProbe(host, machine="mips"), "syscall numbers of mips unknown")):
        assert not probe.syscall_reasons and why in probe.syscall_reasons_off
        assert not any(f.startswith(("-DSYSCALL", "-DNR_")) for f in probe.cflags)
        assert all(not fn.startswith("on_sys_enter") for _, fn in probe.all_handlers())
    (events / "raw_syscalls/sys_enter").rmdir()
    p = SchedProbe(host, machine="x86_64")
    assert "raw_syscalls:sys_enter not found" in p.syscall_reasons_off
    assert p.check(host) is None or "bcc" in p.check(host)   # only lock/sleep are lost, not the probe


# ---------------------------------------------------------------- kernel tier




@pytest.fixture
def probe():
    p = SchedProbe()
    why = p.check(p.host)
    assert why is None, f"sched probe cannot run on this (root) host: {why}"
    yield p
    p.stop()


@pytest.fixture(params=["regs", "hook", "regs-classic"])
def by_source(request):
    """The probe with each way of telling lock and sleep from wait: the syscall read from the sleeping thread's
    registers (5.15+ with BTF), or the raw_syscalls:sys_enter hook (older kernels; forced here); and the register
    read from the classic tracepoint programs that 5.15-5.17 use (chosen by telling the probe it runs on 5.17)."""
    source, _, classic = request.param.partition("-")
    if source == "regs" and not syscall_from_regs(Host()):
        pytest.skip("this kernel cannot read a thread's syscall from its registers (5.15+ with BTF)")
    # the hook is what kernels without BTF use: with it, the raw programs and their hash of records (5.18+)
    p = SchedProbe(Host(kernel="5.17.0") if classic else Host(), syscall_source=source, btf=source == "regs")
    assert p.raw == (not classic and raw_sched(Host()))
    assert p.btf == (source == "regs" and not classic and not btf_sched(Host())[1])
    assert p.syscall_reasons, p.syscall_reasons_off
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
    assert expected >= 0.99 * 2000   # the sleeps switched (a nanosleep can end before it sleeps: no switch)
    assert abs(job_switches(s) - expected) <= 0.05 * expected
    assert s["offcpu_ns"] >= 0.9 * 2000 * 500_000   # at least the sleeps themselves


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_switches_agree_with_perf_context_switches_for_the_same_job(probe, make_cgroup, kind):
    """Two independent mechanisms on the same job and window: eBPF tracepoints vs perf's software counter."""
    from jobprobe.probes.perf import PerfProbe
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
    assert p["context_switches"] >= 0.99 * 3000   # the sleeps switched (a nanosleep can end before it sleeps)
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
    assert noisy >= 3800        # it was busy switching (a 200 µs nanosleep can end before it sleeps)
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
import resource, subprocess, sys
sys.stdin.readline()
out = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True).stdout
r = resource.getrusage(resource.RUSAGE_SELF)
print(out, r.ru_nvcsw, r.ru_nivcsw, flush=True)
"""


@pytest.mark.kernel
def test_pid_tree_follows_children_forked_after_attach(probe):
    root = subprocess.Popen([sys.executable, "-c", ROOT_THEN_CHILD, *workload("switches", 1000, 500)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probe.start(PidTreeTarget([root.pid]))
    assert probe.members() == {root.pid}
    out, _ = root.communicate("go\n", timeout=120)
    child = sum(map(int, out.split()[-4:-2]))
    own = sum(map(int, out.split()[-2:]))       # the root's own, since it started (before the attach too)
    s = probe.sample()
    print(f"sched: {job_switches(s)} switches, child's own count {child}, the root's {own}")
    # The child's switches, plus the root's (reading stdin, fork, waitpid, and the preemptions a busy machine
    # gives it: counted by the kernel for it), plus the few of its exit.
    assert 0.95 * child <= job_switches(s) <= 1.05 * (child + own) + 10
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
    before, maps, perf, links = bpf_fds("prog"), bpf_fds("map"), bpf_fds("perf"), bpf_fds("link")
    probe.start(PidTreeTarget([os.getpid()]))
    raw = sum(_bpf.linked(tp) for tp, _ in probe.all_handlers())
    assert raw == ((3 + probe.syscall_hook) if probe.raw else 0)
    # the probe's programs, and its private node's membership handlers (classic tracepoints: perf events)
    assert bpf_fds("prog") == before + len(probe.all_handlers()) + len(MEMBERSHIP)
    # one attachment per tracepoint, held here: a perf event, or a bpf_link for a raw one
    assert bpf_fds("perf") == perf + len(probe.all_handlers()) - raw + len(MEMBERSHIP)
    assert bpf_fds("link") == links + raw
    # the node's job_of_cgroup, job_of_tgid, job_kinds, job_exited, job_exited_n; the module's fds of the first three;
    # slots_on, start, stats, job_cache, and in_call with the sys_enter hook; idle_task with raw programs (slot_epoch
    # with BTF ones instead), and cpu_clock with BTF ones where the kernel's BTF has the run queue's clock (and
    # read_at where it has the kernel's stamp of a switch-in too); with a deep mode (5.8+) slots_traced,
    # trace_ring, trace_refused, trace_stacks and trace_scratch
    rq_clock = probe.btf and "cpu_clock" in probe.loaded.maps
    read_at = "read_at" in probe.loaded.maps
    assert read_at <= rq_clock
    assert bpf_fds("map") == maps + 5 + 3 + 4 + probe.syscall_hook + probe.raw + rq_clock + read_at + \
        5 * probe.deep
    assert probe.loaded.maps["stats"].value_size == ct.sizeof(SlotStats)   # the kernel's size, from the loader
    assert probe.members() == {os.getpid()}
    probe.stop()
    assert bpf_fds("prog") == before and bpf_fds("map") == maps and bpf_fds("perf") == perf
    assert bpf_fds("link") == links
    probe.stop()                                       # idempotent
    assert probe.sample() == {}


@pytest.mark.kernel
@pytest.mark.parametrize("old, new, said", [
    # on_switch fails the verifier after the node's membership handlers are already attached
    ("if (b >= NBUCKETS)\n                b = NBUCKETS - 1;", "", "invalid access to map value"),
    ("return 0;\n}\n\n/* Fired", "return 0;\n}\n}\n/* Fired", "error:"),    # a compile error
])
def test_failed_start_says_why_and_releases_everything(probe, monkeypatch, old, new, said):
    real, source = bpf.source("sched"), bpf.source
    assert old in real
    monkeypatch.setattr(bpf, "source", lambda name: real.replace(old, new) if name == "sched" else source(name))
    before, maps, perf = bpf_fds("prog"), bpf_fds("map"), bpf_fds("perf")
    with pytest.raises(ProbeUnavailable, match=said) as err:
        probe.start(PidTreeTarget([os.getpid()]))
    print(f"sched: {err.value}")
    assert len(str(err.value)) < 2000                  # trimmed to the last lines of the log
    assert bpf_fds("prog") == before and bpf_fds("map") == maps and bpf_fds("perf") == perf




@pytest.mark.kernel
@pytest.mark.parametrize("group_dead", [True, False], ids=["group_dead", "older-kernel"])
def test_fork_exit_storm_leaves_only_live_members(probe, monkeypatch, group_dead):
    """The older-kernel variant also takes the raw programs with a hash of records (what a kernel without BTF gets),
    whose entries can be listed: none is left of an exited task. BTF ones keep records in task storage, which goes
    with its task."""
    if group_dead and not exit_has_group_dead():
        pytest.skip("this kernel's sched_process_exit has no group_dead field")
    monkeypatch.setattr("jobprobe.kernel.membership.exit_has_group_dead", lambda sys_root: group_dead)
    if not group_dead:
        probe = SchedProbe(btf=False)
    root = subprocess.Popen([sys.executable, str(TESTS / "workloads_syscalls.py"), "storm", "2000", "200"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        probe.start(PidTreeTarget([root.pid]))
        root.stdin.write("go\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "done"
        s = probe.sample()
        # Each child waited for a CPU once after wake_up_new_task: counted only if fork made it a member.
        assert s["runq_events"] >= 2000
        # A joined thread may still be on its way out (join returns before the kernel's exit tracepoint): settled
        assert wait_for(lambda: probe.members() == {root.pid}), probe.members()
        start = start_tids(probe)
        assert all(tid and Path(f"/proc/{tid}").exists() for tid in start), "off-CPU entries of exited tasks"
    finally:
        root.communicate("\n", timeout=30)
    assert probe.members() == set()
    probe.stop()


# ---------------------------------------------------------------- kernel tier: why the job was off CPU


def start_tids(probe: SchedProbe) -> list[int]:
    """Thread ids of the `start` entries (keyed by tid, or by task address on raw tracepoints: the value says which
    thread; 0 for a new task not switched out yet). None with BTF programs: their records are task storage, which
    user space cannot list and which goes with its task."""
    return [] if probe.btf else [rec.tid for _, rec in probe.loaded.maps["start"].items()]


def show(s: dict, acct: dict) -> str:
    return " ".join(f"{r} {(s[f'offcpu_{r}_ns'] or 0) / 1e6:.1f}" for r in REASONS) + \
        f" wakeup {s['offcpu_wakeup_ns'] / 1e6:.1f} = offcpu {s['offcpu_ns'] / 1e6:.1f} ms; the workload's own " \
        f"account: blocked {acct['asleep_ns'] / 1e6:.1f} ms, run-queue {acct['runq_ns'] / 1e6:.1f} ms"


def check_reason(s: dict, reason: str, acct: dict, low: int | None = None) -> None:
    """The reasons sum to offcpu_ns; `reason` holds nearly all of the job's sleeping; and its time matches the
    workload's own account of its blocked time (wall - CPU - run-queue wait, from kernel clocks, no tracepoint)
    within 2% + 2 ms + 20 µs per period (steal time while a thread ran counts as blocked there, and each period's
    edges sit a few µs apart in the two clocks; `low`: a lower reference without steal time)."""
    assert offcpu_parts(s) == s["offcpu_ns"]
    got = s[f"offcpu_{reason}_ns"]
    assert got >= 0.9 * sum(s[f"offcpu_{r}_ns"] for r in REASONS if r != "preempt")
    low = acct["asleep_ns"] if low is None else low
    slack = 2_000_000 + 20_000 * s[f"offcpu_{reason}_events"]
    assert 0.98 * low - slack <= got <= 1.02 * acct["asleep_ns"] + slack


@pytest.mark.kernel
def test_sleeps_are_sleep_and_outside_locks_count_for_nothing(by_source, make_cgroup):
    n, ms = 50, 20
    cg = make_cgroup()
    by_source.start(CgroupTarget(str(cg.path)))
    noise = subprocess.Popen(sched_workload("lock", 40, 10), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    proc = cg.spawn(sched_workload("sleep", n, ms), stdout=subprocess.PIPE, text=True)
    ref = account(proc)
    noisy = account(noise, "go\n")
    s = by_source.sample()
    print(f"sleep {n} x {ms} ms: {show(s, ref)}; outside lock holds {noisy['hold_ns'] / 1e6:.0f} ms")
    check_reason(s, "sleep", ref)
    # Not shorter than asked, less the µs from arming the timer to leaving the CPU; longer by the timer slack
    # (50 µs) and the wakeup's latency (a vCPU not running when the timer fires): 10% is 2 ms a sleep.
    # One exception, on a loaded machine: a thread preempted between arming its timer and calling schedule() waits
    # on the run queue, and when the timer fires meanwhile it never sleeps. That is preemption here (it was
    # runnable), while schedstat's run_delay, which the workload's account relies on, misses the wait (it starts
    # counting only for tasks switched out in TASK_RUNNING) and so calls it asleep. Allow at most the preemption
    # the reference did not see (an upper bound: it also holds the interpreter's start-up, outside the account).
    # Seen once in 12 runs with two busy loops beside the test: sleep 982.7 ms, preempt 32.3 vs run_delay 5.0 ms.
    blind = max(0, s["offcpu_preempt_ns"] - ref["runq_ns"])
    assert n * ms * 1e6 * 0.99 - blind <= s["offcpu_sleep_ns"] <= n * ms * 1e6 * 1.1
    assert s["offcpu_sleep_events"] + s["offcpu_preempt_events"] >= n   # each sleep slept, or (above) waited runnable
    assert s["offcpu_lock_ns"] <= 0.001 * s["offcpu_ns"]


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_futex_waits_are_lock(by_source, make_cgroup, kind):
    n, ms = 40, 20
    cg = make_cgroup()
    if kind == "cgroup":
        by_source.start(CgroupTarget(str(cg.path)))
    proc = cg.spawn(sched_workload("lock", n, ms), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if kind == "pids":
        by_source.start(PidTreeTarget([proc.pid]))
    ref = account(proc, "go\n")
    s = by_source.sample()
    print(f"{kind}: lock held {n} x {ms} ms ({ref['hold_ns'] / 1e6:.1f} ms): {show(s, ref)}")
    check_reason(s, "lock", ref, low=ref["main_asleep_ns"])
    # The main thread sleeps through every hold (its futex waits ≈ the hold time), less its waits for a CPU.
    assert s["offcpu_lock_ns"] >= ref["hold_ns"] - s["offcpu_wakeup_ns"] - s["offcpu_preempt_ns"] - n * 1_000_000
    assert s["offcpu_lock_events"] >= n


@pytest.mark.kernel
def test_direct_io_and_fsync_are_io(probe, make_cgroup, tmp_path):
    n = 256
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    steal0 = steal_ns()
    proc = cg.spawn(sched_workload("io", tmp_path / "data", n), stdout=subprocess.PIPE, text=True)
    ref = account(proc)
    steal = steal_ns() - steal0
    s = probe.sample()
    print(f"io: {n} x 64 KiB written, fsync, {n} O_DIRECT reads, {s['offcpu_io_events']} io periods: "
          f"{show(s, ref)}; the host's steal meanwhile {steal / 1e6:.0f} ms")
    # the workload's blocked time counts the hypervisor's steal while it ran (a CI run saw 23.6 ms of io against
    # 49.8 ms "blocked"): the lower reference leaves out the steal /proc/stat saw meanwhile (10 ms ticks)
    check_reason(s, "io", ref, low=max(0, ref["asleep_ns"] - steal - 10_000_000 * (steal > 0)))


@pytest.mark.kernel
def test_pipe_reads_are_wait(by_source, make_cgroup):
    n, ms = 40, 20
    cg = make_cgroup()
    by_source.start(CgroupTarget(str(cg.path)))
    proc = cg.spawn(sched_workload("pipe", n), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    for i in range(n):                 # one line every `ms`, written from outside the job
        time.sleep(ms / 1000)
        proc.stdin.write(f"{i}\n")
        proc.stdin.flush()
    ref = account(proc)
    s = by_source.sample()
    print(f"pipe: {n} lines, one per {ms} ms: {show(s, ref)}")
    assert ref["lines"] == n
    check_reason(s, "wait", ref)
    assert s["offcpu_wait_ns"] >= 0.9 * (n - 1) * ms * 1e6


@pytest.mark.kernel
def test_a_stopped_process_is_stopped_not_waiting(by_source, make_cgroup):
    """SIGSTOP, then SIGCONT 1.5 s later, to a sleeping process of the job: the time between them is `stopped`
    (its own reason), not `wait` — a paused rank must not look like one waiting for its peers. Checked against the
    test's own clock between the two signals and the kernel's word that the process was stopped (state T)."""
    cg = make_cgroup()
    by_source.start(CgroupTarget(str(cg.path)))
    proc = cg.spawn(["sleep", "30"])
    try:
        time.sleep(0.3)
        by_source.sample()
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert wait_for(lambda: procfs.read_stat("/proc", proc.pid).state == "T", 5), "the process did not stop"
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGCONT)
        cont = time.monotonic()
        stopped = cont - t0
        time.sleep(0.2)
        s = by_source.sample()
        after = time.monotonic() - cont
    finally:
        proc.kill()
        proc.wait()
    print(f"stopped {stopped * 1e3:.1f} ms by the test's clock: " + " ".join(
        f"{r} {(s[f'offcpu_{r}_ns'] or 0) / 1e6:.1f}" for r in REASONS))
    assert offcpu_parts(s) == s["offcpu_ns"] and s["offcpu_stopped_events"] == 1
    # from the stop's switch-out (after SIGSTOP, a few µs) to SIGCONT's wakeup (before the test reads its clock)
    assert stopped - 0.02 <= s["offcpu_stopped_ns"] / 1e9 <= stopped + 0.002, (s["offcpu_stopped_ns"], stopped)
    # the rest of its time asleep is after SIGCONT (its sleep restarted: restart_syscall, a wait), none before it
    assert s["offcpu_wait_ns"] + (s["offcpu_sleep_ns"] or 0) <= (after + 0.02) * 1e9, s


# serial: beside other tests' load on the same CPU the preempted time read 2.4% above run_delay (bound 2%):
# a finding under study (docs/PERFORMANCE.md, "The test suite"), not a bound to widen
@pytest.mark.serial
@pytest.mark.kernel
def test_two_burners_on_one_cpu_are_preempted(probe, make_cgroup):
    seconds = 1.5
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    proc = cg.spawn(sched_workload("preempt", seconds), stdout=subprocess.PIPE, text=True)
    ref = account(proc)
    s = probe.sample()
    print(f"preempt: 2 burners x {seconds} s on one CPU, {s['offcpu_preempt_events']} preemptions, "
          f"{s['involuntary_switches']} involuntary switches: {show(s, ref)}")
    assert offcpu_parts(s) == s["offcpu_ns"]
    assert s["offcpu_preempt_ns"] >= 0.9 * s["offcpu_ns"]
    # Two burners of `seconds` each on one CPU run `seconds` together at most: each waits about half the time.
    assert ref["runq_ns"] >= 0.8 * seconds * 1e9
    # The kernel's own run-queue wait of the burners (run_delay). 2%: a switch-in the kernel does not deliver to
    # the program drops a whole period (see bpf/sched.c).
    assert abs(s["offcpu_preempt_ns"] - ref["runq_ns"]) <= 0.02 * ref["runq_ns"] + 2_000_000
    # Counted at switch-out vs at switch-in: now and then (under other BPF users' load) a burst of switch-ins is
    # not seen, and its periods are lost, time and count (the time check above holds them to 2%).
    assert 0.95 * s["involuntary_switches"] - 2 <= s["offcpu_preempt_events"] <= s["involuntary_switches"], \
        f"programs skipped by the kernel (recursion_misses): {recursion_misses(probe)}"


def recursion_misses(probe: SchedProbe) -> dict[str, int]:
    """bpf_prog_info.recursion_misses (5.12+), right after run_cnt: runs the kernel skipped."""
    class Info(ct.Structure):
        _fields_ = _bpf.ProgInfo._fields_ + [("recursion_misses", ct.c_uint64)]
    return {n: _bpf.obj_info(fd, Info()).recursion_misses for n, fd in probe.loaded.progs.items()}


HOLD_FOREVER = """
import sys, threading
sys.stdin.readline()
lk = threading.Lock()
lk.acquire()
for _ in range(8):
    threading.Thread(target=lk.acquire, daemon=True).start()
sys.stdin.readline()
"""


@pytest.mark.kernel
def test_threads_killed_inside_a_futex_wait_leave_no_entry():
    """The syscall hook (older kernels; forced here) keeps no sys_exit hook: a thread that never leaves its futex
    wait is forgotten when it exits (common.h hook)."""
    probe = SchedProbe(syscall_source="hook", btf=False)
    assert probe.syscall_hook, probe.syscall_reasons_off
    root = subprocess.Popen([sys.executable, "-c", HOLD_FOREVER], stdin=subprocess.PIPE, text=True)
    try:
        probe.start(PidTreeTarget([root.pid]))
        root.stdin.write("go\n")      # only now the threads start: their futex waits are seen
        root.stdin.flush()
        in_call = probe.loaded.maps["in_call"]
        # Thread.start() waits on a futex until the new thread runs: the main thread is briefly in_call too, so
        # wait for the eight and only the eight (seen once: the main thread and seven)
        def eight_waiting() -> bool:
            threads = {int(t) for t in os.listdir(f"/proc/{root.pid}/task")} - {root.pid}
            return len(threads) == 8 and set(in_call.keys()) == threads
        assert wait_for(eight_waiting), (sorted(in_call.keys()), root.pid)
    finally:
        root.kill()
        root.wait(timeout=30)
    assert in_call.keys() == []
    # wait() returns once the threads are unhashed (exit_notify); one preempted after that still has to run
    # do_task_dead, and its `start` entry goes at that switch-in. They must all go, soon.
    try:
        assert wait_for(lambda: not [t for t in start_tids(probe) if not t or not Path(f"/proc/{t}").exists()])
    finally:
        probe.stop()


@pytest.mark.kernel
@pytest.mark.serial      # node-wide event counts: other tests' BPF programs and tracers move them
def test_perf_users_still_see_sched_events_while_attached(by_source):
    """A classic tracepoint program returning 0 makes the kernel drop the event for perf too: perf stat reads 0
    sched_switch events node-wide while the classic programs (kernels before 5.18) are attached, as it read 0
    raw_syscalls:sys_enter while the classic syscall hook was. Raw tracepoint programs leave perf's view alone."""
    by_source.start(PidTreeTarget([os.getpid()]))
    try:
        missed0 = by_source.missed_total()
        res = subprocess.run(["perf", "stat", "-x,", "-e",
                              "sched:sched_switch,sched:sched_wakeup,raw_syscalls:sys_enter", "-a", "--",
                              sys.executable, str(TESTS / "workloads.py"), "sleepwake", "200", "500"],
                             capture_output=True, text=True, timeout=60)
        # the runs of its programs the kernel skipped meanwhile (a CI run once saw 5 wakeups let through: whether
        # they were these is what the failure says)
        missed = by_source.missed_total() - missed0
    finally:
        by_source.stop()
    counts = {line.split(",")[2]: int(line.split(",")[0]) for line in res.stderr.splitlines()
              if line.count(",") >= 3 and line.split(",")[0].isdigit()}
    print(f"sched attached ({'raw' if by_source.raw else 'classic'} programs); perf counted {counts}; "
          f"its programs skipped {missed} runs")
    # the workload alone sleeps and wakes 200 times, each sleep a clock_nanosleep call
    if by_source.raw:
        assert counts.get("sched:sched_switch", 0) >= 200 and counts.get("sched:sched_wakeup", 0) >= 200, res.stderr
    else:     # what the raw programs fixed, shown: the classic ones hide every event they are attached to — all
        # but the few the kernel let through without running the program (another BPF program was running on
        # that CPU: bpf_missed), against >= 200 of each with raw programs
        assert counts.get("sched:sched_switch", 0) <= 4 and counts.get("sched:sched_wakeup", 0) <= 4, \
            f"{res.stderr}; its programs' skipped runs meanwhile: {missed}"
    if by_source.syscall_reasons:     # a raw syscall hook, or none: `perf trace` and friends keep seeing syscalls
        assert counts.get("raw_syscalls:sys_enter", 0) >= 200, res.stderr


def overlap(a: int, b: int, spans: list[tuple[int, int]]) -> int:
    """ns of the spans [t0, t1] that fall inside [a, b]."""
    return sum(max(0, min(b, t1) - max(a, t0)) for t0, t1 in spans)


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_offcpu_time_lands_in_the_intervals_it_was_spent(probe, make_cgroup, kind):
    """Threads asleep 3, 6 and 10 s in one time.sleep each, sampled every 0.5 s: each interval's sleep time is the
    part of the sleeps inside that interval (by the workload's own clocks), also while they still sleep at the tick;
    never more than dt per thread; and the sum over the intervals is the sum of the sleeps."""
    secs = (3, 6, 10)
    cg = make_cgroup()
    proc = cg.spawn(sched_workload("sleepers", *secs), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    probe.start(CgroupTarget(str(cg.path)) if kind == "cgroup" else PidTreeTarget([proc.pid]))
    marks = [time.monotonic_ns()]
    probe.sample()                              # a baseline after the start: the interpreter's start-up is not here
    marks.append(time.monotonic_ns())
    proc.stdin.write("go\n")
    proc.stdin.flush()
    ticks = []                                  # (read no earlier than, read no later than, sample)
    while True:
        done = proc.poll() is not None
        time.sleep(0.5)
        a = time.monotonic_ns()
        s = probe.sample()
        ticks.append((a, time.monotonic_ns(), s))
        if done:
            break
    spans = json.loads(proc.stdout.read().splitlines()[-1])["sleeps"]
    assert len(ticks) >= 20
    prev = (marks[0], marks[1])
    for a, b, s in ticks:
        # The interval runs from the previous reading to this one, each somewhere inside its bracket.
        longest = b - prev[0]
        hi, lo = overlap(prev[0], b, spans), overlap(prev[1], a, spans)
        got = s["offcpu_sleep_ns"]
        # a sleep's own edges: the clock read around the call (µs) and the wakeup's wait for a CPU, which the probe
        # counts apart (`offcpu_wakeup_ns`) — µs on a quiet machine, 7.7 ms once beside phase 1's load, where the
        # sleep alone read 483 ms of the workload's 491
        woke = s["offcpu_wakeup_ns"]
        assert 0.99 * lo - 2_000_000 <= got + woke, (got, woke, lo, ticks.index((a, b, s)))
        assert got <= hi + 1_000_000, (got, hi, ticks.index((a, b, s)))
        assert got <= len(secs) * longest + 1_000_000
        # all four threads (the main one joins) never make more than 4 x dt of off-CPU time
        assert s["offcpu_ns"] <= (len(secs) + 1) * longest + 1_000_000, s
        assert s["runq_lat_ns"] <= (len(secs) + 1) * longest + 1_000_000, s
        prev = (a, b)
    total = sum(s["offcpu_sleep_ns"] for _, _, s in ticks)
    woke = sum(s["offcpu_wakeup_ns"] for _, _, s in ticks)
    truth = sum(t1 - t0 for t0, t1 in spans)
    per_tick = [round(s["offcpu_sleep_ns"] / 1e9, 2) for _, _, s in ticks]
    print(f"{kind}: sleeps {secs} s: per 0.5 s tick {per_tick}; sum {total / 1e9:.4f} s (+ {woke / 1e6:.1f} ms of "
          f"wakeups' waits for a CPU), the workload's {truth / 1e9:.4f} s")
    # the workload's clock of each sleep holds its wakeup's wait for a CPU, which the probe counts apart, as each
    # tick's check above allows (a CI run beside phase 1: the sleeps alone 19.000 s of the workload's 19.026)
    assert 0.999 * truth - 2_000_000 <= total + woke and total <= truth, (total, woke, truth)
    # the middle of the run: all three asleep throughout a tick reads three ticks' worth, not 0 — the tick's own
    # length known only within its two readings' brackets (a reading delayed 70 ms beside phase 1 read 3.14 and
    # 2.86 ticks' worth of a tick measured from the start of each bracket)
    whole = [(s["offcpu_sleep_ns"], a - prev_b, b - prev_a) for (prev_a, prev_b, _), (a, b, s) in zip(ticks, ticks[1:])
             if max(t0 for t0, _ in spans) < prev_a and b < min(t1 for _, t1 in spans)]
    assert len(whole) >= 3 and all(3 * 0.99 * short <= got <= 3 * 1.01 * long for got, short, long in whole), whole


def _voluntary(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt_switches"))


SCHED_DEBUG = Path("/sys/kernel/debug/sched/debug")


def sched_debug_clocks() -> tuple[int, int, bool]:
    """(CLOCK_MONOTONIC, the scheduler's clock, sched_clock_stable()) as the kernel prints them together at the top
    of its sched debug file (ktime, cpu_clk — local_clock(), what rq->clock is stamped from — read back to back;
    ms with ns digits)."""
    if not SCHED_DEBUG.exists():
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], capture_output=True)
    if not SCHED_DEBUG.exists():
        pytest.skip(f"no {SCHED_DEBUG} (debugfs, CONFIG_SCHED_DEBUG) to read the kernel's clocks from")
    head = dict(re.findall(r"^(\S+(?:\(\))?)\s*:\s*(\S+)", SCHED_DEBUG.read_text()[:2000], re.M))
    ns = lambda v: int(v.replace(".", ""))           # "11608546.205481" ms with 6 decimals -> ns
    return ns(head["ktime"]), ns(head["cpu_clk"]), head.get("sched_clock_stable()") == "1"


@pytest.mark.kernel
def test_switch_outs_and_wakeups_are_stamped_with_the_run_queues_clock(probe, make_cgroup):
    """BTF programs take a member's switch-out and wakeup instants from its run queue's clock (no clock read),
    turned into CLOCK_MONOTONIC by a per-run-queue offset learnt at switch-ins (bpf/sched.c stamp_ns). Each offset
    against the kernel's own: its sched debug file prints CLOCK_MONOTONIC and the scheduler's clock together. (The
    times these stamps make are checked against the workloads' own clocks and the kernel's run_delay by the tests
    above: they run with the stamps on this kernel.)"""
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    if "cpu_clock" not in probe.loaded.maps:
        pytest.skip(f"the sched programs read the clock here (BTF programs: {probe.btf}; the kernel's BTF has no "
                    "task_struct.se.cfs_rq without CONFIG_FAIR_GROUP_SCHED)")
    proc = cg.spawn(sched_workload("sleep", 50, 2), stdout=subprocess.PIPE, text=True)
    account(proc)
    s = probe.sample()
    assert s["offcpu_sleep_events"] >= 40
    mono, sched_clk, stable = sched_debug_clocks()
    kernel_off = mono - sched_clk
    offs = []
    for off, at in rq_offsets(probe):
        assert at <= sched_clk
        offs.append(off)
    print(f"CLOCK_MONOTONIC - scheduler clock: the kernel's {kernel_off} ns (sched_clock_stable() {stable}); "
          f"per CPU here {offs}")
    assert offs, "no CPU learnt an offset: the stamps were never used"
    for off in offs:
        # ours is the least (clock read at the tracepoint) - (stamp at __schedule's clock update) of its recent
        # reads, grown by ≤ 2000 ppm of the time since: µs after the kernel's back-to-back pair; never before it
        # but by the two clocks' drift (NTP's correction: ≤ 500 ppm), and a wrong clock would be off by ms or more
        assert -100_000 <= off - kernel_off <= 500_000, (off, kernel_off)


@pytest.mark.kernel
def test_the_per_cpu_membership_answer_follows_attach_and_detach():
    """sched keeps each CPU's last membership answer (bpf/common.h job_slot_cached). A process pinned to one CPU,
    sleeping 1 ms at a time, is asked about at every switch: first as no job's (another job is attached), then
    attached as a job of its own — its switches are counted from then on (the voluntary_ctxt_switches the kernel
    keeps for it) — then let go, and a third, idle process attached in the slot it had: none of the first one's
    switches lands there, nor in the slot it left."""
    from jobprobe.kernel.membership import Node
    node = Node()
    spin = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                             "import time\nwhile True: time.sleep(0.001)"])
    other = subprocess.Popen(["sleep", "60"])
    third = subprocess.Popen(["sleep", "60"])
    probes = []
    try:
        a = SchedProbe(node=node)
        a.start(PidTreeTarget([other.pid]))              # the module loaded, the spinner asked about: no job
        probes.append(a)
        time.sleep(1.0)
        b = SchedProbe(node=node)
        b.start(PidTreeTarget([spin.pid]))
        probes.append(b)
        v0 = _voluntary(spin.pid)
        time.sleep(1.5)
        got, v1 = b.sample()["voluntary_switches"], _voluntary(spin.pid)
        print(f"attached: probe {got} voluntary switches, the kernel {v1 - v0}")
        assert got >= 0.99 * (v1 - v0) > 300, (got, v1 - v0)   # (a cached "no job" kept: ~0.96 here)
        slot, stats = b.slot, b.loaded.maps["stats"]
        b.stop()
        probes.remove(b)
        c = SchedProbe(node=node)
        c.start(PidTreeTarget([third.pid]))
        probes.append(c)
        time.sleep(1.5)
        got_c, left = c.sample()["voluntary_switches"], stats.lookup_sums(slot)[0]
        print(f"after the detach: the idle third job {got_c} voluntary switches; the released slot {left}")
        assert got_c <= 5 and left == 0, (got_c, left)
    finally:
        for p in probes:
            p.stop()
        for x in (spin, other, third):
            x.kill()
            x.wait()
        node.close()


@pytest.mark.kernel
def test_a_released_slots_records_count_nowhere_for_its_next_job():
    """BTF programs keep each thread's record in task storage, which user space cannot list: a job let go leaves
    the records of its threads off CPU, and the next job in its slot must not get their ends. The slot's epoch
    moves at release; such a record closes into nothing. (With the hash, release deletes them; both checked.)"""
    for btf in (True, False):
        node = Node(keep_loads=True)
        old = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
        new = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        first = second = None
        try:
            time.sleep(0.3)                            # both started; `new` now blocks for good
            first = SchedProbe(node=node, btf=btf)
            assert first.btf == (btf and not btf_sched(Host())[1])
            first.start(PidTreeTarget([old.pid]))
            time.sleep(0.3)                            # `old` left the CPU a few times: records made
            first.sample()
            time.sleep(0.3)
            assert first.sample()["offcpu_sleep_events"] > 0
            slot = first.slot
            first.stop()                               # mostly while `old` sleeps: a record of it is open
            node._free.remove(slot)                    # (the node hands slots out first in, first out: this
            node._free.appendleft(slot)                # one would come back after the 63 others)
            second = SchedProbe(node=node, btf=btf)
            second.start(PidTreeTarget([new.pid]))
            assert second.slot == slot                 # the same slot, the same programs and maps
            old.kill()                                 # its last sleep ends: woken, switched in, gone
            old.wait(timeout=30)
            time.sleep(0.2)
            s = second.sample()
            # `new` has not run since it was attached: nothing of `old` may show as its own
            assert s["voluntary_switches"] == 0 and s["runq_events"] == 0, s
            assert s["offcpu_sleep_events"] == 0 and s["offcpu_sleep_ns"] == 0, s
        finally:
            for p in (old, new):
                p.kill()
                p.wait()
            for p in (first, second):
                if p is not None:
                    p.stop()
            node.close()


# Seven tasks that switch all the time on the machine's CPUs: two pairs of threads ping-ponging bytes over pipes
# (each os.read a sleep, each GIL hand-over a futex wait) and two forked burners that keep the CPUs taken, so that
# every wakeup waits on a run queue. All of them block (nothing runnable) before "go" and after "done".
BUSY_JOB = r"""
import os, sys, threading, time
n = int(sys.argv[1])
go_r, go_w = os.pipe()
done_r, done_w = os.pipe()
for _ in range(2):
    if os.fork() == 0:
        os.close(go_w)
        os.read(go_r, 1)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
        os.write(done_w, b"x")
        os.read(go_r, 1)          # blocks until the parent is gone (EOF)
        os._exit(0)
start, finished, stop = threading.Event(), threading.Semaphore(0), threading.Event()
def side(rfd, wfd, first):
    start.wait()
    for _ in range(n):
        if first:
            os.write(wfd, b"x"); os.read(rfd, 1)
        else:
            os.read(rfd, 1); os.write(wfd, b"x")
    finished.release()
    stop.wait()
threads = []
for _ in range(2):
    (a_r, b_w), (b_r, a_w) = os.pipe(), os.pipe()
    threads += [threading.Thread(target=side, args=(a_r, a_w, True)),
                threading.Thread(target=side, args=(b_r, b_w, False))]
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.readline()
os.write(go_w, b"xx")
start.set()
for _ in threads:
    finished.acquire()
os.read(done_r, 1); os.read(done_r, 1)
print("done", flush=True)
sys.stdin.readline()
stop.set()
"""


def schedstats(pids: list[int]) -> dict[int, tuple[int, int]]:
    """{tid: (ns on CPU, ns waiting on a run queue)} of every thread of `pids` (/proc/PID/task/TID/schedstat)."""
    out = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait = map(int, f.read().split()[:2])
            out[int(tid)] = (run, wait)
    return out


def irq_steal_ns() -> int:
    """Time the CPUs spent in interrupts and stolen by the hypervisor so far (/proc/stat `cpu`, USER_HZ ticks)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return sum(int(x) for x in fields[6:9]) * 10_000_000


@pytest.mark.kernel
def test_a_busy_job_sampled_fast_never_reads_an_impossible_interval(probe, make_cgroup):
    """Hundreds of intervals a few ms long over a job that switches ~10^5 times a second: every interval's
    run-queue and off-CPU time lies in [0, dt x the job's 7 tasks] (the torn copy this guards against read the
    machine's uptime), no reading was held, and the sums over the intervals agree with the kernel's own schedstats
    of every task: run-queue time with run_delay, off-CPU time with wall - on-CPU time."""
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))      # before the job: every task's sleeps are seen from its birth
    proc = cg.spawn([sys.executable, "-c", BUSY_JOB, "20000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)                              # every task now blocked
    a0 = time.monotonic_ns()
    probe.sample()                               # the baseline
    b0 = time.monotonic_ns()
    pids = cg.pids()
    ref0, sys0 = schedstats(pids), irq_steal_ns()
    tasks = len(ref0)
    assert tasks == 7, ref0
    proc.stdin.write("go\n")
    proc.stdin.flush()
    ticks, prev, done = [], (a0, b0), False
    import select
    while not done:
        done = bool(select.select([proc.stdout], [], [], 0.004)[0])
        if done:
            assert proc.stdout.readline().strip() == "done"
            time.sleep(0.1)                      # blocked again: nothing open on a run queue
        a = time.monotonic_ns()
        s = probe.sample()
        b = time.monotonic_ns()
        longest = b - prev[0]                    # the interval, from somewhere in one bracket to the next
        for f in ("runq_lat_ns", "offcpu_ns"):
            # 100 µs per task: the stamps of a period's edges sit µs from user space's clock (bpf/sched.c)
            assert 0 <= s[f] <= tasks * (longest + 100_000), (f, s[f], longest, len(ticks))
        ticks.append(s)
        prev = (a, b)
    ref1, sys1 = schedstats(pids), irq_steal_ns()
    proc.stdin.write("end\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0
    assert set(ref1) == set(ref0)
    run = sum(ref1[t][0] - ref0[t][0] for t in ref0)
    run_delay = sum(ref1[t][1] - ref0[t][1] for t in ref0)
    runq = sum(s["runq_lat_ns"] for s in ticks)
    offcpu = sum(s["offcpu_ns"] for s in ticks)
    events = sum(s["runq_events"] for s in ticks)
    missed = sum(s[MISSED] for s in ticks)
    over = sum(s["switch_in_missed_ns"] for s in ticks)
    window = (prev[0] - b0, prev[1] - a0)        # from the baseline's reading to the last one's
    print(f"{len(ticks)} intervals, {events} run-queue waits: run-queue {runq / 1e6:.1f} ms (run_delay "
          f"{run_delay / 1e6:.1f}); off-CPU {offcpu / 1e6:.1f} ms (wall - run: {(tasks * window[0] - run) / 1e6:.1f}"
          f"..{(tasks * window[1] - run) / 1e6:.1f}); irq+steal {(sys1 - sys0) / 1e6:.1f} ms; bpf_missed {missed}; "
          f"switch-ins missed {sum(s['switch_ins_missed'] for s in ticks)} ({over / 1e6:.1f} ms counted after them)")
    assert len(ticks) >= 100 and events >= 10_000
    assert sum(s["torn_reads"] for s in ticks) == 0 and sum(s["impossible"] for s in ticks) == 0
    # run_delay and these waits start at the same run-queue clock stamps; 2% + 2 ms as the burners' test above (a
    # switch-in the kernel does not deliver to the program drops a period), and end at the same stamp too (the one
    # __schedule takes before its pick; read as the clock at the tracepoint, after the pick, they ran 1.5..4 µs
    # per wait longer, as the host's load went: +465 ms over 113958 waits). Within 1 µs per wait: the offset
    # between the two clocks is the least of its run queue's recent reads (bpf/sched.c; measured +0.0..0.4 µs).
    # Above that only what the probe counted itself: a switch-in no program saw (one that ends a kernel worker's
    # run, a few per run here) leaves its period open until the thread's next switch-out, which closes it where
    # the kernel stamped that switch-in — or at the last reading that already counted it open (switch_in_missed_ns:
    # 0..530 ms over 10 runs, +290 ms of a burner's run once before it was counted)
    assert -0.02 * run_delay - 2_000_000 <= runq - run_delay <= 0.02 * run_delay + 2_000_000 + 1_000 * events + \
        over, clock_state(probe)
    # off CPU = wall - on CPU, per task over the same window; on-CPU time (rq_clock_task) leaves out interrupts
    # and steal while a task ran, so wall - run can only be larger, by at most the CPUs' irq + steal time
    # — and each wait ends at the run-queue stamp the kernel starts the task's run time at, to the same 1 µs per
    # wait as above (read as the clock at the tracepoint: +461 ms over 113958 waits)
    low, high = tasks * window[0] - run, tasks * window[1] - run
    assert low - (sys1 - sys0) - 0.02 * low - 2_000_000 <= offcpu <= high + 2_000_000 + 1_000 * events + over


def clock_state(probe) -> str:
    """What each run queue's offset holds (bpf/sched.c cpu_clock: offset, and how long ago by the scheduler's clock
    now), beside the kernel's own offset: for a failure's message."""
    if "cpu_clock" not in probe.loaded.maps:
        return "no cpu_clock: the clock is read at every switch"
    try:
        mono, sched_clk, stable = sched_debug_clocks()
    except BaseException as err:             # (a skip inside: no sched debug file)
        return f"cpu_clock unread: {err!r}"
    cpus = [(off - (mono - sched_clk), (sched_clk - at) // 1000) for off, at in rq_offsets(probe)]
    return f"per run queue (offset - the kernel's ns, last read µs ago): {cpus}; sched_clock_stable {stable}"


def rq_offsets(probe) -> list[tuple[int, int]]:
    """(offset ns, rq clock at its last read) of each run queue that learnt one (bpf/sched.c cpu_clock)."""
    out = []
    for cpu in range(os.cpu_count()):
        raw = probe.loaded.maps["cpu_clock"].lookup(ct.c_uint32(cpu))
        off, at = ct.c_int64.from_buffer_copy(raw[:8]).value, ct.c_uint64.from_buffer_copy(raw[8:16]).value
        if at:
            out.append((off, at))
    return out


PINGPONG = r"""
import os, sys
os.sched_setaffinity(0, {1})
n = int(sys.argv[1])
(a_r, b_w), (b_r, a_w) = os.pipe(), os.pipe()
print("ready", flush=True)
sys.stdin.readline()
child = os.fork()
rfd, wfd = (b_r, b_w) if child == 0 else (a_r, a_w)
for _ in range(n):
    if child:
        os.write(wfd, b"x"); os.read(rfd, 1)
    else:
        os.read(rfd, 1); os.write(wfd, b"x")
if child == 0:
    os.read(rfd, 1)            # blocks until the parent says
    os._exit(0)
print("done", child, flush=True)
sys.stdin.readline()
os.write(wfd, b"x")
os.waitpid(child, 0)
"""


@pytest.mark.kernel
def test_a_cpu_switching_only_between_members_keeps_its_waits_on_the_kernels_stamps(probe, make_cgroup):
    """Two processes of the job pinned to one CPU, ping-ponging over pipes: every switch there goes from one member
    to the other, never through idle. Each wait still ends at the run queue's stamp (bpf/sched.c stamp_ns) — the
    sum of the waits is the two processes' schedstat run_delay. (When a CPU's offset had gone stale, a switch-out
    read the clock and the switch-in once took that read instead of renewing the offset: from then on every wait on
    the CPU ended at the tracepoint's clock, µs late each — +3.8 µs per wait in a CI run of the busy job above.)
    The kernel's figure is taken over the same interval: the parent's run_delay before it includes its interpreter's
    start, which beside other load waits tens of ms (the interval once read 13% under the whole-life figure)."""
    if os.cpu_count() < 2:
        pytest.skip("needs a second CPU to pin the job to")
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    if "cpu_clock" not in probe.loaded.maps:
        pytest.skip(f"the sched programs read the clock at every switch here (BTF programs: {probe.btf})")
    proc = cg.spawn([sys.executable, "-c", PINGPONG, "60000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.1)                               # the CPU's epoch runs out while nothing of the job runs
    probe.sample()
    # the parent's waits so far (its interpreter's start: beside load, tens of ms) are before the interval
    start = schedstats([proc.pid])
    proc.stdin.write("go\n")
    proc.stdin.flush()
    done = proc.stdout.readline().split()
    assert done[0] == "done", done
    time.sleep(0.05)                              # both blocked: no wait open
    s = probe.sample()
    ref = schedstats([proc.pid, int(done[1])])
    run_delay = sum(w for _, w in ref.values()) - sum(w for _, w in start.values())
    proc.stdin.write("end\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) == 0
    waits, runq = s["runq_events"], s["runq_lat_ns"]
    print(f"{waits} waits: run-queue {runq / 1e6:.2f} ms, the kernel's run_delay {run_delay / 1e6:.2f} ms "
          f"({(runq - run_delay) / max(waits, 1):+.0f} ns per wait); switch-ins missed {s['switch_ins_missed']} "
          f"({s['switch_in_missed_ns'] / 1e6:.2f} ms)")
    assert waits >= 100_000, waits
    # (1 ns per wait beside CPU, pipe and switch hogs; a period whose switch-in no program saw is counted apart)
    assert abs(runq - run_delay) <= 0.01 * run_delay + 1_000_000 + s["switch_in_missed_ns"], (runq, run_delay, waits)
