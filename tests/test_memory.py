# SPDX-License-Identifier: Apache-2.0
"""memory probe: pure helpers on fixtures (unit), then real eBPF on real workloads in real cgroups (kernel tier).

Independent references measured in the same run: perf's page-faults counter (probes/perf.py) on the same job and
window; the workload's own getrusage (ru_minflt, ru_majflt) around its work; a v1 memory cgroup's memory.failcnt
(reclaim follows a failed charge); the number of populated zones (/proc/zoneinfo) that one write to
/proc/sys/vm/compact_memory compacts; the pid the OOM killer's SIGKILL ended.
"""
from __future__ import annotations

import ctypes as ct
import os
import re
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobprobe import bpf
from jobprobe.contract.bpfprobe import MEMBERSHIP, MISSED
from jobprobe.contract.probe import EVENTS_KEY
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel.btf import enum_values as btf_enum_values
from jobprobe.kernel.host import Host
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.memory import (
    COUNTERS,
    NBUCKETS,
    PARTS,
    SLOT_NONE,
    SLOT_PENDING,
    MemoryProbe,
    OomRec,
    SlotStats,
    interval,
    oom_cflags,
    oom_event,
    plan,
    zero_reading,
)
from tests.conftest import bpf_fds
from tests.workloads_memory import failcnt, go, memwork, populated_zones, said, spawn, window

# ---------------------------------------------------------------- unit


def btf_blob(enums: list[tuple[int, list[tuple[str, int]]]]) -> bytes:
    """A small BTF: an int, a struct, then each (kind 6 or 19, [(member, value)]) enum."""
    strs = bytearray(b"\0")

    def name(s: str) -> int:
        strs.extend(s.encode() + b"\0")
        return len(strs) - len(s) - 1

    types = struct.pack("<IIII", name("int"), 1 << 24, 4, 32)                         # INT + encoding
    types += struct.pack("<III", name("s"), 4 << 24 | 2, 8) + struct.pack("<III", name("a"), 1, 0) \
        + struct.pack("<III", name("b"), 1, 32)                                      # STRUCT, 2 members
    for kind, members in enums:
        types += struct.pack("<III", name("E"), kind << 24 | len(members), 8 if kind == 19 else 4)
        for m, v in members:
            types += (struct.pack("<Ii", name(m), v) if kind == 6 else
                      struct.pack("<IIi", name(m), v & 0xFFFFFFFF, v >> 32))
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strs))
    return hdr + types + bytes(strs)


def test_btf_enum_values_takes_both_from_one_enum(tmp_path):
    f = tmp_path / "vmlinux"
    # a decoy enum that has only one of the names, then the real one (as ENUM and as ENUM64)
    for kind in (6, 19):
        f.write_bytes(btf_blob([(6, [("PGFAULT", 5), ("OTHER", 6)]),
                                (kind, [("PGPGIN", 0), ("PGFAULT", 23), ("PGMAJFAULT", 24)])]))
        assert btf_enum_values(f, ("PGFAULT", "PGMAJFAULT")) == {"PGFAULT": 23, "PGMAJFAULT": 24}
    f.write_bytes(btf_blob([(6, [("PGFAULT", 5)])]))
    assert btf_enum_values(f, ("PGFAULT", "PGMAJFAULT")) == {}
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError):
        btf_enum_values(f, ("PGFAULT",))
    if Path("/sys/kernel/btf/vmlinux").exists():             # this kernel's: adjacent in enum vm_event_item
        got = btf_enum_values("/sys/kernel/btf/vmlinux", ("PGFAULT", "PGMAJFAULT"))
        assert got and got["PGMAJFAULT"] == got["PGFAULT"] + 1


MARK_VICTIM_NEW = ("\tfield:int pid;\toffset:8;\n\tfield:__data_loc char[] comm;\toffset:12;\n"
                   "\tfield:unsigned long total_vm;\toffset:16;\n\tfield:unsigned long anon_rss;\toffset:24;\n"
                   "\tfield:uid_t uid;\toffset:48;\n\tfield:unsigned long pgtables;\toffset:56;\n"
                   "\tfield:short oom_score_adj;\toffset:64;\n")


def test_oom_cflags_follow_the_format_file():
    assert oom_cflags("\tfield:int pid;\toffset:8;\tsize:4;\n") == []
    assert set(oom_cflags(MARK_VICTIM_NEW)) == {"-DOOM_HAS_COMM_LOC", "-DOOM_HAS_RSS", "-DOOM_HAS_UID",
                                                "-DOOM_HAS_PGTABLES", "-DOOM_HAS_SCORE_ADJ"}
    assert oom_cflags("\tfield:char comm[16];\toffset:12;\n") == ["-DOOM_HAS_COMM"]


def fake_sys(tmp_path: Path, tracepoints: list[str], memcg_enabled: str = "1") -> Host:
    for tp in tracepoints:
        d = tmp_path / "sys/kernel/tracing/events" / tp.replace(":", "/")
        d.mkdir(parents=True)
        (d / "format").write_text(MARK_VICTIM_NEW if tp == "oom:mark_victim" else "")
    (tmp_path / "sys/kernel/btf").mkdir(parents=True)
    (tmp_path / "sys/kernel/btf/vmlinux").write_bytes(btf_blob([(6, [("PGFAULT", 23), ("PGMAJFAULT", 24)])]))
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cgroups").write_text(f"#subsys_name\thierarchy\tnum_cgroups\tenabled\n"
                                           f"cpu\t2\t1\t1\nmemory\t4\t64\t{memcg_enabled}\n")
    return Host(sys=str(tmp_path / "sys"), proc=str(tmp_path / "proc"), is_root=True)


ALL_TPS = [tp for hooks, _ in PARTS.values() for tp, _ in hooks]


def test_plan_attaches_what_exists_and_says_why_the_rest_is_absent(tmp_path):
    host = fake_sys(tmp_path, [tp for tp in ALL_TPS if not tp.startswith(("compaction", "vmscan:mm_vmscan_direct"))])
    handlers, cflags, absent = plan(host)
    assert ("memcg:count_memcg_events", "on_memcg_event") in handlers
    assert not any(tp.startswith("compaction") for tp, _ in handlers)
    assert {"-DHAVE_FAULTS", "-DHAVE_MEMCG_EVENTS", "-DPGFAULT_ITEM=23", "-DPGMAJFAULT_ITEM=24", "-DHAVE_OOM",
            "-DOOM_HAS_COMM_LOC", "-DHAVE_MEMCG_RECLAIM"} <= set(cflags)
    assert "-DHAVE_COMPACTION" not in cflags and "-DHAVE_DIRECT_RECLAIM" not in cflags
    assert set(absent) == {"compaction_stalls", "compaction_ns", "direct_reclaim_stalls", "direct_reclaim_ns"}
    assert "compaction:mm_compaction_end not found" in absent["compaction_ns"]
    # every end is attached before its begin
    tps = [tp for tp, _ in handlers]
    assert tps.index("vmscan:mm_vmscan_memcg_reclaim_end") < tps.index("vmscan:mm_vmscan_memcg_reclaim_begin")


def test_plan_without_memcg_or_reclaim(tmp_path):
    host = fake_sys(tmp_path, [tp for tp in ALL_TPS if not tp.startswith("vmscan")], memcg_enabled="0")
    handlers, cflags, absent = plan(host)
    assert "disabled" in absent["major_faults"] and "minor_faults" in absent
    assert not any("ITEM" in c for c in cflags)
    assert {"reclaimed_pages", "reclaim_us_log2", "memcg_reclaim_ns"} <= set(absent)
    assert ("exceptions:page_fault_user", "on_fault_user") in handlers


def test_check_reports_why(tmp_path):
    assert MemoryProbe().check(Host(is_root=False, sys=str(tmp_path))) == "needs root"
    assert "not found" in MemoryProbe().check(Host(is_root=True, sys=str(tmp_path)))
    host = fake_sys(tmp_path, [tp for tp, _ in MEMBERSHIP])
    assert "none of its tracepoints" in MemoryProbe().check(host)


def test_interval_deltas_minor_faults_and_wrap():
    before = {**zero_reading(), "faults": (1 << 64) - 5}
    now = {**zero_reading(), "faults": 7, "acct_faults": 100, "major_faults": 30, "memcg_reclaim": 2}
    now["hist"] = [0, 0, 0, 0, 2] + [0] * (NBUCKETS - 5)
    out = interval(now, before)
    assert out["page_faults"] == 12 and out["major_faults"] == 30 and out["minor_faults"] == 70
    assert out["memcg_reclaim_stalls"] == 2 and out["reclaim_us_log2"] == now["hist"]
    # a major counted before its PGFAULT (a tick in between): never negative
    assert interval({**zero_reading(), "major_faults": 1}, zero_reading())["minor_faults"] == 0


def test_every_emitted_field_is_declared():
    out = interval(zero_reading(), zero_reading())
    assert set(out) | {"oom_kills", MISSED} == set(MemoryProbe.fields)
    assert set(f for _, fields in PARTS.values() for f in fields) <= set(MemoryProbe.fields)
    assert all(f.type and f.unit and f.meaning for f in MemoryProbe.fields.values())
    p = MemoryProbe()
    p.unavailable = {"major_faults": "x", "minor_faults": "x"}
    assert "major_faults" not in p.interval(zero_reading(), zero_reading())


def c_members(src: str, struct_name: str) -> list[tuple[str, str, str | None]]:
    body = src[src.index(f"struct {struct_name} {{"):]
    body = body[body.index("{") + 1:body.index("};")]
    return re.findall(r"^\s*(u64|u32|s32|char) (\w+)(?:\[(\w+)\])?;", body, re.M)


def test_python_and_c_agree_on_layout():
    src = bpf.source("memory")
    assert re.search(rf"#define NBUCKETS {NBUCKETS}\b", src)
    assert re.search(rf"#define SLOT_PENDING {SLOT_PENDING}\b", src)
    assert re.search(rf"#define SLOT_NONE {SLOT_NONE}\b", src)
    stats = c_members(src, "slot_stats")
    assert [n for _, n, _ in stats] == [n for n, _ in SlotStats._fields_]
    assert [n for _, n, _ in stats][:len(COUNTERS)] == list(COUNTERS)
    assert ct.sizeof(SlotStats) == 8 * (len(COUNTERS) + NBUCKETS)
    size = {"u64": 8, "u32": 4, "s32": 4, "char": 1}
    rec = c_members(src, "oom_rec")
    assert [(n, size[t] * int(d or 1)) for t, n, d in rec] == [(n, ct.sizeof(t)) for n, t in OomRec._fields_]
    for _, fn in MemoryProbe().all_handlers():
        assert re.search(rf"^int {fn}\(struct tracepoint__", src, re.M), fn


def test_oom_event_converts_units_and_time():
    rec = OomRec(ts_ns=9_000_000_000, slot=0, pid=42, total_vm_kb=2, anon_rss_kb=3, comm=b"hog")
    ev = oom_event(rec, ["-DOOM_HAS_RSS", "-DOOM_HAS_COMM_LOC"], now_unix=1000.0, now_mono_ns=10_000_000_000)
    assert ev["event"] == "oom_kill" and ev["pid"] == 42 and ev["comm"] == "hog"
    assert ev["t"] == pytest.approx(999.0) and ev["total_vm_bytes"] == 2048 and ev["anon_rss_bytes"] == 3072
    assert "uid" not in ev and "pgtables_bytes" not in ev
    assert set(oom_event(rec, [], 0.0, 0)) == {"event", "t", "pid"}   # an old kernel's mark_victim: the pid only


class FakeMap(dict):
    resolve: dict[int, int] = {}    # pid → the slot its exit sets between the walk and the second look

    def items(self):                # a list, as bpfmap.Map gives
        return list(super().items())

    def lookup(self, k):
        if k in self.resolve and k in self:
            self[k].slot = self.resolve[k]
        return self.get(k)

    def delete(self, k):
        return self.pop(k, None) is not None


def test_drain_oom_emits_ours_drops_the_decided_keeps_the_dying(tmp_path):
    for pid in (11, 12):      # alive
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (x) S 1\n")
    ours = 2                  # the job's slot (start() takes it from the node; -1 before start)
    table = FakeMap({10: OomRec(pid=10, slot=ours, ts_ns=2 << 30), 11: OomRec(pid=11, slot=SLOT_PENDING),
                     12: OomRec(pid=12, slot=3), 13: OomRec(pid=13, slot=SLOT_NONE),
                     14: OomRec(pid=14, slot=SLOT_PENDING), 15: OomRec(pid=15, slot=SLOT_PENDING, ts_ns=1 << 30)})
    table.resolve = {15: ours}   # exited (no /proc entry) and decided by its exit after the walk
    p = MemoryProbe(Host(proc=str(tmp_path)))
    p.loaded, p.slot = SimpleNamespace(maps={"oom_victims": table}), ours
    events = p.drain_oom()
    p.loaded = None
    assert [e["pid"] for e in events] == [15, 10]      # ordered by time
    # 11 still dying: decided at its exit; 12 another job's (slot 3): left for that job's own drain
    assert set(table) == {11, 12}


# ---------------------------------------------------------------- kernel tier


@pytest.fixture
def probe():
    p = MemoryProbe()
    why = p.check(p.host)
    assert why is None, f"memory probe cannot run on this (root) host: {why}"
    yield p
    p.stop()


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_page_faults_agree_with_perf_for_the_same_job(probe, make_cgroup, kind):
    """Two mechanisms on the same job and window: eBPF on the exceptions tracepoints vs perf's software counter."""
    from jobprobe.probes.perf import PerfProbe
    perf = PerfProbe()
    cg = make_cgroup()
    try:
        if kind == "cgroup":
            target = CgroupTarget(str(cg.path))
            probe.start(target)
            perf.start(target)
            proc = spawn(memwork("anon", 4096, 20), [cg.path / "cgroup.procs"])
        else:
            proc = spawn(memwork("anon", 4096, 20))
            target = PidTreeTarget([proc.pid])
            probe.start(target)
            perf.start(target)
        (ru,), (s, p) = window([proc], [probe, perf])
    finally:
        perf.stop()
    print(f"memory[{kind}]: page_faults {s['page_faults']}, perf page_faults {p['page_faults']}, minor "
          f"{s['minor_faults']} (getrusage {ru[0]}), major {s['major_faults']} (getrusage {ru[1]})")
    assert p["page_faults"] >= 4096 * 20
    assert abs(s["page_faults"] - p["page_faults"]) <= 0.02 * p["page_faults"]
    assert abs(s["minor_faults"] - ru[0]) <= 0.02 * ru[0]


@pytest.mark.kernel
def test_major_and_minor_faults_match_getrusage(probe, make_cgroup, cold_file):
    path = cold_file(32)                                 # 8192 pages, none of them in the page cache
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    mapped = spawn(memwork("filemap", path), [cg.path / "cgroup.procs"])
    (ru,), (s,) = window([mapped], [probe])
    print(f"memory: major {s['major_faults']} (getrusage {ru[1]}), minor {s['minor_faults']} (getrusage {ru[0]}), "
          f"page_faults {s['page_faults']}")
    assert ru[1] >= 0.9 * 8192
    assert abs(s["major_faults"] - ru[1]) <= 0.02 * ru[1]
    assert abs(s["minor_faults"] - ru[0]) <= max(0.02 * ru[0], 20)
    anon = spawn(memwork("anon", 4096, 4), [cg.path / "cgroup.procs"])
    (ru,), (s,) = window([anon], [probe])
    print(f"memory: anonymous touches: minor {s['minor_faults']} (getrusage {ru[0]}), major {s['major_faults']}")
    assert abs(s["minor_faults"] - ru[0]) <= 0.02 * ru[0] and s["major_faults"] == ru[1] == 0


@pytest.mark.kernel
def test_busy_process_outside_the_job_counts_nothing(probe, make_cgroup, make_memcg, cold_file):
    """Outside the job: a process faulting hard, one reclaiming in a small memory cgroup. The job's counts are
    its own workload's."""
    path = cold_file(64)
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    job = spawn(memwork("anon", 4096, 5), [cg.path / "cgroup.procs"])
    faulter = spawn(memwork("anon", 4096, 40))
    squeezed = make_memcg(16)
    reclaimer = spawn(memwork("readfile", path), [squeezed / "cgroup.procs"])
    (ru, ru_out, _), (s,) = window([job, faulter, reclaimer], [probe])
    print(f"memory: job minor {s['minor_faults']} (its getrusage {ru[0]}), page_faults {s['page_faults']}; "
          f"outside minor {ru_out[0]}, outside memcg failcnt {failcnt(squeezed)}, job memcg reclaims "
          f"{s['memcg_reclaim_stalls']}")
    assert ru_out[0] >= 4096 * 40 and failcnt(squeezed) > 0
    assert abs(s["minor_faults"] - ru[0]) <= 0.02 * ru[0]
    assert abs(s["page_faults"] - ru[0]) <= 0.02 * ru[0]
    assert s["memcg_reclaim_stalls"] == 0 and s["reclaimed_pages"] == 0 and s["compaction_stalls"] == 0


@pytest.mark.kernel
def test_memcg_reclaim_of_a_job_in_a_small_memory_cgroup(probe, make_cgroup, make_memcg, cold_file):
    path = cold_file(128)
    mem, cg = make_memcg(32), make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    reader = spawn(memwork("readfile", path), [mem / "cgroup.procs", cg.path / "cgroup.procs"])
    fails = []
    _, (s,) = window([reader], [probe], before=lambda: fails.append(failcnt(mem)))
    fails.append(failcnt(mem))
    n, pages = s["memcg_reclaim_stalls"], s["reclaimed_pages"]
    print(f"memory: {n} memcg reclaims ({s['memcg_reclaim_ns'] / 1e6:.1f} ms, {pages} pages), failcnt +"
          f"{fails[1] - fails[0]}, histogram {s['reclaim_us_log2']}")
    # Every reclaim follows a failed charge (equal here; smaller limits fail non-blocking charges too, and thrash).
    assert 0 < n <= fails[1] - fails[0]
    assert s["memcg_reclaim_ns"] > 0 and sum(s["reclaim_us_log2"]) == n + s["direct_reclaim_stalls"]
    # 128 MiB read through a 32 MiB limit: at least the 96 MiB above it were reclaimed, at most all of it.
    assert 0.95 * (96 << 8) <= pages <= (128 << 8) + (16 << 8)
    assert probe.loaded.maps["stalls"].keys() == []       # every begin met its end


@pytest.mark.kernel
def test_stalls_the_full_table_cannot_time_are_counted(make_cgroup, make_memcg, cold_file):
    """The stall table made to hold two threads and filled by others: the job's reclaim stalls cannot be timed —
    none is counted as a stall, and every one is in untracked_stalls (as many as the memcg's failed charges)."""
    class SmallTable(MemoryProbe):
        def configure(self) -> None:
            super().configure()
            self.cflags += ("-DMAX_STALLED=2",)
    probe = SmallTable()
    try:
        path = cold_file(64)
        mem, cg = make_memcg(16), make_cgroup()
        probe.start(CgroupTarget(str(cg.path)))
        table = probe.loaded.maps["stalls"]
        for key in ((99 << 32) | 1, (99 << 32) | 2):       # another kind's stalls hold every entry
            table.update(key, bytes(table.value_size))
        reader = spawn(memwork("readfile", path), [mem / "cgroup.procs", cg.path / "cgroup.procs"])
        fails = []
        _, (s,) = window([reader], [probe], before=lambda: fails.append(failcnt(mem)))
        fails.append(failcnt(mem))
        print(f"memory, a stall table of two, full: {s['memcg_reclaim_stalls']} timed, {s['untracked_stalls']} "
              f"untracked, failcnt +{fails[1] - fails[0]}")
        assert s["memcg_reclaim_stalls"] == 0 and s["memcg_reclaim_ns"] == 0
        assert 0 < s["untracked_stalls"] <= fails[1] - fails[0]
    finally:
        probe.stop()


@pytest.mark.kernel
def test_compaction_run_by_the_job_counts_each_zone_once(probe, make_cgroup):
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    job = spawn(memwork("compact"), [cg.path / "cgroup.procs"])
    outside = spawn(memwork("compact"))                   # compacts the same zones, outside the job
    _, (s,) = window([job, outside], [probe])
    print(f"memory: {s['compaction_stalls']} compactions in {s['compaction_ns'] / 1e6:.1f} ms, "
          f"{populated_zones()} populated zones")
    assert s["compaction_stalls"] == populated_zones()
    assert s["compaction_ns"] > 0
    assert probe.loaded.maps["stalls"].keys() == []


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_oom_kill_of_a_job_process_is_one_event(probe, make_cgroup, make_memcg, kind):
    """The job's process and one outside it each allocate past a 64 MiB v1 memory limit; the OOM killer ends both.
    Only the job's is an event. cgroup: decided at the victim's exit (its cgroup2 id); pids: at the mark."""
    job_mem, other_mem, cg = make_memcg(64, memsw=True), make_memcg(64, memsw=True), make_cgroup()
    t0 = time.time()
    if kind == "cgroup":
        probe.start(CgroupTarget(str(cg.path)))
        victim = spawn(memwork("hog", 1024), [job_mem / "cgroup.procs", cg.path / "cgroup.procs"])
    else:
        victim = spawn(memwork("hog", 1024), [job_mem / "cgroup.procs"])
        probe.start(PidTreeTarget([victim.pid]))
    other = spawn(memwork("hog", 1024), [other_mem / "cgroup.procs"])
    for p in (victim, other):
        said(p, "ready")
    probe.sample()
    for p in (victim, other):
        go(p)
    assert victim.wait(timeout=120) == -9 and other.wait(timeout=120) == -9   # SIGKILL from the OOM killer
    s = probe.sample()
    events = s.get(EVENTS_KEY, [])
    print(f"memory[{kind}]: oom_kills {s['oom_kills']}, events {events}")
    assert s["oom_kills"] == 1 and len(events) == 1
    ev = events[0]
    assert ev["event"] == "oom_kill" and ev["pid"] == victim.pid
    assert ev["comm"].startswith("python") and ev["anon_rss_bytes"] >= 32 << 20
    assert t0 <= ev["t"] <= time.time()
    again = probe.sample()
    assert again["oom_kills"] == 0 and EVENTS_KEY not in again
    assert probe.loaded.maps["oom_victims"].keys() == []    # the outside victim's entry is gone too


@pytest.mark.kernel
def test_absent_parts_are_absent_not_zero(probe, monkeypatch, make_cgroup):
    real = probe.host.tracepoint_exists
    monkeypatch.setattr(probe.host, "tracepoint_exists",
                        lambda cat, ev: cat not in ("memcg", "compaction") and real(cat, ev))
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    proc = spawn(memwork("anon", 1024, 2), [cg.path / "cgroup.procs"])
    (ru,), (s,) = window([proc], [probe])
    assert not {"major_faults", "minor_faults", "compaction_stalls", "compaction_ns"} & set(s)
    assert "count_memcg_events not found" in probe.unavailable["major_faults"]
    assert s["page_faults"] >= 2048 and "oom_kills" in s and "memcg_reclaim_ns" in s


@pytest.mark.kernel
def test_stop_leaves_no_bpf_program_fd(probe):
    before, maps, perf = bpf_fds("prog"), bpf_fds("map"), bpf_fds("perf")
    probe.start(PidTreeTarget([os.getpid()]))
    # its own hooks and job_exit_probe (JOB_ON_EXIT_HOOK: stalls and OOM victims are per-thread state)
    assert probe.hook_handlers() == (("sched:sched_process_exit", "job_exit_probe"),)
    # the probe's programs, and its private node's membership handlers; all classic tracepoints: a perf event each
    assert bpf_fds("prog") == before + len(probe.all_handlers()) + len(MEMBERSHIP)
    assert bpf_fds("perf") == perf + len(probe.all_handlers()) + len(MEMBERSHIP)
    # the node's job_of_cgroup, job_of_tgid, job_kinds, job_exited, job_exited_n; the module's fds of the first
    # three (pinned for its loader); slots_on, stats, stalls, oom_victims
    assert bpf_fds("map") == maps + 5 + 3 + 4
    assert probe.loaded.maps["stats"].value_size == ct.sizeof(SlotStats)
    assert probe.loaded.maps["oom_victims"].value_size == ct.sizeof(OomRec)
    probe.stop()
    assert bpf_fds("prog") == before and bpf_fds("map") == maps and bpf_fds("perf") == perf
    probe.stop()
    assert probe.sample() == {}


@pytest.mark.serial
@pytest.mark.kernel
def test_cost_per_fault(probe, make_cgroup):
    """ns per program run from bpf_stats while a job takes ~100k minor faults (the runs include every other
    fault and memcg event on the node)."""
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    proc = spawn(memwork("anon", 4096, 25), [cg.path / "cgroup.procs"])
    with _bpf.stats_enabled():
        a = probe.loaded.prog_stats()
        _, (s,) = window([proc], [probe])
        b = probe.loaded.prog_stats()
    runs = {n: (b[n].run_cnt - a[n].run_cnt, b[n].run_time_ns - a[n].run_time_ns) for n in b}
    for n, (cnt, ns) in sorted(runs.items()):
        if cnt:
            print(f"memory cost: {n}: {cnt} runs, {ns / cnt:.0f} ns/run")
    fault_runs = runs["on_fault_user"][0] + runs["on_fault_kernel"][0]
    fault_ns = runs["on_fault_user"][1] + runs["on_fault_kernel"][1] + runs["on_memcg_event"][1]
    print(f"memory cost: {fault_ns / fault_runs:.0f} ns per page fault (fault + memcg event programs), "
          f"job page_faults {s['page_faults']}")
    assert fault_runs >= s["page_faults"] >= 4096 * 25
