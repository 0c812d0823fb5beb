# SPDX-License-Identifier: Apache-2.0
"""The cuda probe (probes/cuda.py, bpf/cuda.c, jobprobe/kernel/elf.py): unit tests of the ELF reader, the maps scan, the
attach plan and the interval arithmetic; then real uprobes on TEST FAKES of libcuda.so.1, libcudart.so.12 and
libnccl.so.2 (tests/fake_cuda/, compiled here with gcc, exporting the real symbol names with the real argument
order), called by a real program in a real cgroup2 group or process tree (kernel tier).

Independent references: the fake program's own account of its calls (exact counts and bytes, and its own clock
around each synchronize and collective), the fakes' known sleeps (a lower bound nanosleep guarantees), the dynamic
linker's dlsym addresses against /proc/PID/maps (file offsets), and the int3 bytes the kernel writes into every
mapping of a probed file (read by the probed process itself).
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
from jobprobe.kernel import elf as _elf
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import MEMBERSHIP
from jobprobe.kernel.uprobe import UprobePmu
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.cuda import (
    COLLECTIVES,
    DIRS,
    NBUCKETS,
    PROGRAMS,
    SYMBOLS,
    CudaProbe,
    CudaStats,
    interval,
    mapped_libraries,
    plan_library,
    zero_reading,
)
from tests.conftest import TESTS, bpf_fds
from tests.fake_cuda.build import LIBS, build
from tests.fake_cuda.prog import Prog, file_offsets_from_the_linker

ROOT = TESTS.parent
WAITING = "no CUDA/NCCL library mapped by the job yet"


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("fake_cuda"))


# ---------------------------------------------------------------- unit: the ELF reader


@pytest.mark.parametrize("variant", ["push", "shifted"])
def test_elf_offsets_are_where_the_dynamic_linker_put_the_functions(fakes, tmp_path, variant):
    libdir = fakes if variant == "push" else build(tmp_path / variant, variant)
    prog = Prog(libdir)
    try:
        for lib in ("cuda", "cudart", "nccl"):
            assert prog.cmd(f"load {lib}") == "ok"
        names = [n for n in SYMBOLS]
        expected = file_offsets_from_the_linker(prog, names)
    finally:
        prog.close()
    got = {}
    for soname in LIBS:
        for name, off in _elf.dynamic_functions(str(libdir / soname), SYMBOLS).items():
            got[name] = (str((libdir / soname).resolve()), off)
    assert got == {n: (str(Path(p).resolve()), off) for n, (p, off) in expected.items()}
    if variant == "shifted":   # the case where a symbol's value is not its file offset
        raw = subprocess.run(["nm", "-D", "--defined-only", str(libdir / "libcuda.so.1")], capture_output=True,
                             text=True).stdout
        value = int(next(ln.split()[0] for ln in raw.splitlines() if ln.endswith(" cuLaunchKernel")), 16)
        assert value != got["cuLaunchKernel"][1]


def test_elf_aliases_share_an_offset_and_wanted_filters(fakes):
    every = _elf.dynamic_functions(str(fakes / "libnccl.so.2"))
    assert every["pncclAllReduce"] == every["ncclAllReduce"]       # NCCL_API's alias: one address, two names
    assert set(_elf.dynamic_functions(str(fakes / "libnccl.so.2"), ["ncclSend", "nope"])) == {"ncclSend"}
    assert "fake_cuda_launches" not in _elf.dynamic_functions(str(fakes / "libcuda.so.1"))   # data, not a function


def test_elf_errors_say_why(fakes, tmp_path):
    cases = {"text": b"hello world, not an ELF file at all........................................",
             "elf32": b"\x7fELF\x01\x01\x01" + bytes(60)}
    lib = (fakes / "libcuda.so.1").read_bytes()
    # Section headers stripped: e_shoff (offset 40) and e_shnum (offset 60) zeroed.
    cases["noshdr"] = lib[:40] + bytes(8) + lib[48:60] + bytes(2) + lib[62:]
    cases["short"] = lib[:100]
    want = {"text": "not an ELF", "elf32": "not a 64-bit", "noshdr": "no .dynsym", "short": "truncated"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(_elf.ElfError, match=want[name]):
            _elf.dynamic_functions(str(tmp_path / name))
    with pytest.raises(_elf.ElfError, match="cannot read"):
        _elf.dynamic_functions(str(tmp_path / "missing"))


def test_vaddr_to_offset():
    loads = [(0, 0x10000000, 0x9b0), (0x1000, 0x10001000, 0x581)]
    assert _elf.vaddr_to_offset(0x100011ae, loads) == 0x11ae
    assert _elf.vaddr_to_offset(0x10001581, loads) is None         # past the file-backed part
    assert _elf.vaddr_to_offset(0x5, loads) is None


# ---------------------------------------------------------------- unit: maps, plan, interval, layout

MAPS = b"""\
7f00-7f10 r--p 00000000 fe:01 100 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
7f10-7f20 r-xp 00010000 fe:01 100 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05
7f30-7f40 r-xp 00000000 fe:01 101 /opt/conda/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12
7f50-7f60 r-xp 00000000 fe:01 102 /opt/conda/lib/libnccl.so.2.21.5
7f70-7f80 r-xp 00000000 fe:01 103 /usr/lib/libcudadebugger.so.1
7f90-7fa0 r-xp 00000000 fe:01 104 /usr/lib/libnccl-net.so
7fb0-7fc0 r-xp 00000000 fe:01 105 /old/libcuda.so.1 (deleted)
7fd0-7fe0 rw-p 00000000 00:00 0 [heap]
7ff0-7ff8 rw-p 00000000 00:00 0
"""


def test_mapped_libraries_picks_cuda_runtime_and_nccl_files_only():
    assert mapped_libraries(MAPS) == {
        "/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05",
        "/opt/conda/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
        "/opt/conda/lib/libnccl.so.2.21.5"}
    assert mapped_libraries(b"7f00-7f10 r-xp 00000000 fe:01 1 /usr/lib/libc.so.6\n") == set()


def test_plan_attaches_returns_first_and_each_address_once():
    plan = plan_library({"cudaMemcpy": 0x200, "cudaLaunchKernel": 0x100, "cudaLaunchKernel_ptsz": 0x100,
                         "cuLaunchKernel": 0x300})
    assert plan == [("rt_ret", 0x100, True), ("rt_ret", 0x200, True),
                    ("rt_launch", 0x100, False), ("rt_memcpy", 0x200, False), ("drv_launch", 0x300, False)]


def test_every_symbol_has_its_programs_and_every_fake_exports_them(fakes):
    src = bpf.source("cuda")
    defined = set(re.findall(r"^int (\w+)\(struct pt_regs \*ctx\)", src, re.M))
    defined |= set(re.findall(r"^(?:DRIVER_COPY|COLLECTIVE)\((\w+),", src, re.M))
    assert set(PROGRAMS) <= defined
    exported = set()
    for soname in LIBS:
        exported |= set(_elf.dynamic_functions(str(fakes / soname), SYMBOLS))
    assert exported == set(SYMBOLS)        # the kernel tier exercises every probed function


def test_python_and_c_agree_on_layout():
    src = bpf.source("cuda")
    struct = src[src.index("struct cuda_stats {"):]
    body = struct[struct.index("{") + 1:struct.index("};")]
    sizes = {"NDIRS": len(DIRS), "NCOLL": len(COLLECTIVES), "NBUCKETS": NBUCKETS}
    members = re.findall(r"^\s*u64 (\w+)(?:\[(\w+)\])?;", body, re.M)
    assert [(n, 8 * sizes.get(d, 1)) for n, d in members] == [(n, ct.sizeof(t)) for n, t in CudaStats._fields_]
    assert re.search(rf"#define NBUCKETS {NBUCKETS}\b", src)


def test_interval_is_deltas_and_rate():
    before, now = zero_reading(10.0), zero_reading(12.0)
    now.update(launches=500, sync_calls=3, sync_ns=6_000_000, nccl_unknown_dtype=1, libraries=2)
    now["memcpy_calls"], now["memcpy_bytes"] = [1, 2, 3, 4], [10, 20, 30, 40]
    now["nccl_calls"] = [5, 0, 0, 0, 0, 1, 1]
    now["nccl_bytes"] = [4096, 0, 0, 0, 0, 8, 8]
    now["sync_hist"] = [0] * 11 + [3] + [0] * (NBUCKETS - 12)
    out = interval(now, before)
    assert set(out) | {MISSED} == set(CudaProbe.fields)   # bpf_missed: added by sample()
    assert all(f.type and f.unit and f.meaning for f in CudaProbe.fields.values())
    assert out["kernel_launches"] == 500 and out["kernel_launches_per_s"] == 250.0
    assert [out[f"memcpy_{d}_bytes"] for d in DIRS] == [10, 20, 30, 40]
    assert out["nccl_allreduce_bytes"] == 4096 and out["nccl_send_calls"] == 1 and out["nccl_unknown_dtype_calls"] == 1
    assert 2048 <= out["sync_p50_us"] <= 4096 and out["libraries_probed"] == 2
    assert interval(zero_reading(1.0), zero_reading(1.0))["kernel_launches_per_s"] is None


def test_check_reports_why(tmp_path):
    assert CudaProbe().check(Host(is_root=False, sys=str(tmp_path))) == "needs root"
    events = tmp_path / "kernel/tracing/events/sched"
    for tp in ("sched_process_fork", "sched_process_exit", "sched_process_exec"):
        (events / tp).mkdir(parents=True)
    why = CudaProbe().check(Host(is_root=True, sys=str(tmp_path)))
    assert why is not None and ("uprobe PMU" in why or "bcc" in why)
    pmu = tmp_path / "bus/event_source/devices/uprobe"
    (pmu / "format").mkdir(parents=True)
    (pmu / "type").write_text("8\n")
    (pmu / "format/retprobe").write_text("config:0\n")
    assert UprobePmu(str(tmp_path)).retprobe_bit == 0 and UprobePmu(str(tmp_path)).type == 8
    (pmu / "format/retprobe").write_text("config1:3\n")
    with pytest.raises(ProbeUnavailable, match="unexpected"):
        UprobePmu(str(tmp_path))


def test_uprobe_attr_packing():
    pmu = UprobePmu.__new__(UprobePmu)
    pmu.type, pmu.retprobe_bit = 8, 0
    attr, buf = pmu.attr(b"/lib/libcuda.so.1", 0x11ae, True)
    assert (attr.type, attr.config, attr.config2) == (8, 1, 0x11ae)
    assert ct.string_at(attr.config1) == b"/lib/libcuda.so.1" and attr.config1 == ct.addressof(buf)
    attr, _ = pmu.attr(b"/x", 0x10, False)
    assert attr.config == 0 and attr.size == ct.sizeof(attr)


# ---------------------------------------------------------------- kernel tier

COUNTED = ["kernel_launches", *(f"memcpy_{d}_{k}" for d in DIRS for k in ("calls", "bytes")), "sync_calls",
           *(f"nccl_{c}_{k}" for c in COLLECTIVES for k in ("calls", "bytes")), "nccl_unknown_dtype_calls"]




@pytest.fixture
def probe():
    p = CudaProbe()
    why = p.check(p.host)
    assert why is None, f"cuda probe cannot run on this (root) host: {why}"
    yield p
    p.stop()


@pytest.fixture
def progs():
    made: list[Prog] = []

    def make(libdir: Path, spawn=subprocess.Popen) -> Prog:
        made.append(Prog(libdir, spawn))
        return made[-1]

    yield make
    for p in made:
        p.close()


def add(*accounts: dict) -> dict:
    out: dict = {}
    for a in accounts:
        for k, v in a.items():
            out[k] = out.get(k, 0) + v     # the program's accounts hold ints only
    return out


def run_both(job: Prog, outsider: Prog, phase: str, n: int) -> dict:
    """The same calls in the job and outside it at the same time; the job's own account."""
    job.send(f"run {phase} {n}")
    outsider.send(f"run {phase} {n}")
    mine = json.loads(job.reply())
    json.loads(outsider.reply())
    return mine


def check_against(s: dict, acct: dict) -> None:
    """Counts and bytes exactly; times between the fakes' sleeps (nanosleep never returns early, and the probe's
    entry and return bracket the sleep) and the program's own clock around each call (which brackets the probe's
    entry and return): both bounds are orderings, not tolerances."""
    got = {k: s[k] for k in COUNTED}
    assert got == {k: acct[k] for k in COUNTED}
    assert acct["sync_min_ns"] <= s["sync_ns"] <= acct["sync_wall_ns"]
    assert sum(s["sync_us_log2"]) == s["sync_calls"] and len(s["sync_us_log2"]) == NBUCKETS
    assert sum(s["sync_us_log2"][:9]) == 0           # every synchronize slept ≥ 1 ms = 1000 µs: bucket ≥ 9 (512+)
    for c in COLLECTIVES:
        assert acct[f"nccl_{c}_min_ns"] <= s[f"nccl_{c}_ns"] <= acct[f"nccl_{c}_wall_ns"], c


@pytest.mark.kernel
@pytest.mark.parametrize("kind", ["cgroup", "pids"])
def test_counts_match_the_programs_own_account_and_outsiders_add_nothing(probe, fakes, progs, make_cgroup, kind):
    cg = make_cgroup()
    job = progs(fakes, cg.spawn) if kind == "cgroup" else progs(fakes)
    outsider = progs(fakes)
    for p in (job, outsider):
        assert p.cmd("load cuda") == "ok" and p.cmd("load cudart") == "ok"
    probe.start(CgroupTarget(str(cg.path)) if kind == "cgroup" else PidTreeTarget([job.pid]))
    # Both processes carry the breakpoints: the outsider's calls reach the programs too, and must be dropped there.
    assert job.probed() == outsider.probed() == (30, 30)
    acct = add(run_both(job, outsider, "driver", 60), run_both(job, outsider, "runtime", 60))
    s = probe.sample()
    print(f"cuda[{kind}]: launches {s['kernel_launches']} (own {acct['kernel_launches']}), htod "
          f"{s['memcpy_htod_calls']}/{s['memcpy_htod_bytes']} B, other {s['memcpy_other_calls']}, sync "
          f"{s['sync_calls']} {s['sync_ns'] / 1e6:.2f} ms (sleeps {acct['sync_min_ns'] / 1e6:.2f}, own clock "
          f"{acct['sync_wall_ns'] / 1e6:.2f}), p50 {s['sync_p50_us']} µs")
    check_against(s, acct)
    assert acct["kernel_launches"] == 480 and acct["memcpy_other_calls"] == 480   # every kind was exercised
    assert s["libraries_probed"] == 2
    assert {e["path"] for e in s.pop("_events")} == {str(fakes / "libcuda.so.1"), str(fakes / "libcudart.so.12")}


CALLS = ["kernel_launches", *(f"memcpy_{d}_calls" for d in DIRS), "sync_calls",
         *(f"nccl_{c}_calls" for c in COLLECTIVES)]


@pytest.mark.kernel
def test_calls_the_full_thread_table_cannot_hold_are_counted(fakes, progs, make_cgroup):
    """The per-thread call table made to hold one thread: two processes of the job calling at once leave some calls
    without a record. Those are not counted — and say so: every call of the job is counted or in untracked_calls
    (a runtime call refused a record may refuse its driver call too: untracked can exceed what is missing)."""
    probe = CudaProbe()
    probe.cflags = ("-DMAX_CALL_THREADS=1",)
    try:
        cg = make_cgroup()
        jobs = [progs(fakes, cg.spawn), progs(fakes, cg.spawn)]
        for p in jobs:
            assert p.cmd("load cuda") == "ok" and p.cmd("load cudart") == "ok"
        probe.start(CgroupTarget(str(cg.path)))
        for phase in ("driver", "runtime"):
            for p in jobs:
                p.send(f"run {phase} 60")
        acct = add(*(json.loads(p.reply()) for p in jobs for _ in range(2)))
        s = probe.sample()
        missing = sum(acct[k] for k in CALLS) - sum(s[k] for k in CALLS)
        print(f"cuda, a table of one thread: {sum(acct[k] for k in CALLS)} calls, counted "
              f"{sum(s[k] for k in CALLS)}, untracked {s['untracked_calls']}")
        assert s["untracked_calls"] > 0 and 0 < missing <= s["untracked_calls"], (missing, s["untracked_calls"])
    finally:
        probe.stop()


@pytest.mark.kernel
def test_library_loaded_later_is_probed_from_then_on(probe, fakes, progs, make_cgroup):
    cg = make_cgroup()
    job, outsider = progs(fakes, cg.spawn), progs(fakes)
    for p in (job, outsider):
        assert p.cmd("load cuda") == "ok"
    probe.start(CgroupTarget(str(cg.path)))
    assert probe.sample()["libraries_probed"] == 1
    for p in (job, outsider):
        assert p.cmd("load nccl") == "ok"
    early = job.run("nccl", 5)                 # NCCL mapped but not probed yet: only its launches are seen
    s = probe.sample()                         # this tick finds libnccl in the job's maps and probes it
    assert s["kernel_launches"] == early["kernel_launches"] == 35
    assert all(s[f"nccl_{c}_calls"] == 0 for c in COLLECTIVES)
    assert [e["path"] for e in s["_events"]] == [str(fakes / "libnccl.so.2")] and s["libraries_probed"] == 2
    assert job.probed() == (26, 26)
    late = run_both(job, outsider, "nccl", 28)  # every datatype twice, and two unknown ones per collective
    s = probe.sample()
    print(f"cuda: nccl allreduce {s['nccl_allreduce_calls']} calls {s['nccl_allreduce_bytes']} B "
          f"{s['nccl_allreduce_ns'] / 1e6:.2f} ms (own clock {late['nccl_allreduce_wall_ns'] / 1e6:.2f} ms), "
          f"unknown datatype {s['nccl_unknown_dtype_calls']}")
    check_against(s, late)
    assert late["nccl_unknown_dtype_calls"] == 28 and late["nccl_send_bytes"] > 0


@pytest.mark.kernel
def test_stop_detaches_every_uprobe_and_leaves_no_fd(probe, fakes, progs):
    job = progs(fakes)
    for lib in ("cuda", "cudart", "nccl"):
        assert job.cmd(f"load {lib}") == "ok"
    attachments = sum(len(plan_library(_elf.dynamic_functions(str(fakes / so), SYMBOLS))) for so in LIBS)
    before = {k: bpf_fds(k) for k in ("prog", "map", "perf")}
    probe.start(PidTreeTarget([job.pid]))
    # job_exit_probe only (JOB_ON_EXIT_HOOK: a thread killed inside a call leaves no calls entry)
    assert probe.all_handlers() == (("sched:sched_process_exit", "job_exit_probe"),)
    # perf: job_exit_probe's tracepoint, one uprobe PMU event per attachment, and the private node's membership
    # handlers (classic tracepoints)
    assert bpf_fds("perf") == before["perf"] + len(probe.all_handlers()) + attachments + len(MEMBERSHIP)
    # prog: job_exit_probe, the uprobe programs (loaded unattached, attached per library), the membership handlers
    assert bpf_fds("prog") == before["prog"] + len(probe.all_handlers()) + len(PROGRAMS) + len(MEMBERSHIP)
    # the module's fds of the node's three membership maps (pinned for its loader), its slots_on, calls, stats; with
    # a deep mode (5.8+) slots_traced, trace_ring and trace_refused
    assert set(probe.loaded.maps) == {"job_of_cgroup", "job_of_tgid", "job_kinds", "slots_on", "calls", "stats"} | \
        ({"slots_traced", "trace_ring", "trace_refused"} if probe.deep else set())
    # those, and the node's own fds of its five membership maps (the three, job_exited, job_exited_n)
    assert bpf_fds("map") == before["map"] + len(probe.loaded.maps) + 5
    assert job.probed() == (37, 37) and len(probe.libraries) == 3
    probe.stop()
    assert {k: bpf_fds(k) for k in before} == before
    assert job.probed() == (0, 37)                     # the kernel took every breakpoint out of the process
    probe.stop()                                       # idempotent
    assert probe.sample() == {}


@pytest.mark.kernel
def test_threads_killed_inside_calls_leave_no_entry(probe, fakes, progs):
    job = progs(fakes)
    for lib in ("cuda", "cudart"):
        assert job.cmd(f"load {lib}") == "ok"
    probe.start(PidTreeTarget([job.pid]))
    assert job.cmd("hang 4") == "hung"                # 4 threads inside cuStreamSynchronize, 4 in the runtime's
    tids = {int(t) for t in os.listdir(f"/proc/{job.pid}/task")}
    inside = set(probe.loaded.maps["calls"].keys())
    assert len(inside) == 8 and inside <= tids
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    s = probe.sample()
    assert s["sync_calls"] == 0                        # none returned
    assert probe.loaded.maps["calls"].keys() == [] and probe.members() == set()


@pytest.mark.kernel
def test_command_line_per_second_counts_sum_to_the_programs_account(fakes, tmp_path):
    truth_file = tmp_path / "truth.json"
    env = {**os.environ, "LD_LIBRARY_PATH": str(fakes)}
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,cuda", "--stdout", "json",
                          "--", str(fakes / "cudaprog"), "auto", "40", str(truth_file)],
                         capture_output=True, text=True, timeout=180, cwd=str(ROOT), env=env)
    assert res.returncode == 0, res.stderr
    frames = [json.loads(x) for x in res.stdout.splitlines()]
    samples = [f for f in frames if f["kind"] == "sample"]
    # "ok", or "ok: no CUDA/NCCL library mapped by the job yet" before cudaprog loads them; counting at the end
    assert all(f["status"]["cuda"].startswith("ok") for f in samples), samples[0]["status"]
    assert samples[-1]["status"]["cuda"] == "ok", samples[-1]["status"]
    truth = json.loads(truth_file.read_text())
    per_tick = [f["probes"]["cuda"] for f in samples]
    total = {k: sum(t[k] for t in per_tick) for k in COUNTED}
    print("cuda per tick: launches", [t["kernel_launches"] for t in per_tick])
    assert total == {k: truth[k] for k in COUNTED}
    assert truth["sync_min_ns"] <= sum(t["sync_ns"] for t in per_tick) <= truth["sync_wall_ns"]
    # The rate is over the probe's own interval, between its two map reads: a tick reads its probes one after
    # another, so on a busy machine that interval is tens of ms off the frame's dt (a run beside the suite's other
    # tests: 600 launches x their rates' intervals summed to 615 over dt).
    for t, f in zip(per_tick, samples):
        if t["kernel_launches"]:
            assert abs(t["kernel_launches"] / t["kernel_launches_per_s"] - f["dt"]) <= 0.1, (t, f["dt"])
    assert sum(1 for t in per_tick if t["kernel_launches"]) >= 2    # NCCL came later, in another tick
    events = [f for f in frames if f["kind"] == "event" and f["event"] == "cuda_library"]
    assert sorted(Path(e["path"]).name for e in events) == sorted(LIBS)


FIRST = {"push": "push %rbp (emulated)", "endbr": "endbr64 (single-stepped)", "o2": "mov rip-relative"}


@pytest.mark.serial
@pytest.mark.kernel
def test_cost_per_call(tmp_path):
    """Not a benchmark with limits: prints what a probed call costs (wall time of N calls with the probe on minus
    off, and the programs' own run time from bpf_stats) for each way a function can begin, and checks the run
    counts, which are exact."""
    n = 5000                  # calls per kind: the run counts below are exact at any n; the costs are means
    print(f"\n{'first instruction':28} {'call':5} {'off ns':>7} {'on ns':>7} {'+ns/call':>8}  programs ns/run")
    for variant in FIRST:
        libdir = build(tmp_path / variant, variant)
        job, outsider = Prog(libdir), Prog(libdir)
        probe = CudaProbe()
        try:
            for p in (job, outsider):
                assert p.cmd("load cuda") == "ok" and p.cmd("load cudart") == "ok"
            off = {k: int(job.cmd(f"bench {k} {n}")) for k in ("drv", "rt", "copy")}
            probe.start(PidTreeTarget([job.pid]))
            scan = time.perf_counter()
            probe.scan()
            scan = time.perf_counter() - scan
            on, cost = {}, {}
            with _bpf.stats_enabled():
                for who, prog in (("job", job), ("outsider", outsider)):
                    for k in off:
                        before = probe.loaded.prog_stats()
                        on[who, k] = int(prog.cmd(f"bench {k} {n}"))
                        after = probe.loaded.prog_stats()
                        cost[who, k] = {p: (after[p].run_time_ns - before[p].run_time_ns,
                                            after[p].run_cnt - before[p].run_cnt) for p in PROGRAMS
                                        if after[p].run_cnt > before[p].run_cnt}   # not fork/exit: node-wide
            s = probe.sample()
        finally:
            probe.stop()
            job.close()
            outsider.close()
        assert s["kernel_launches"] == 2 * n and s["memcpy_htod_calls"] == n    # the outsider's: none
        assert {p: c for p, (_, c) in cost["job", "rt"].items()} == {"rt_launch": n, "rt_ret": n, "drv_launch": n}
        assert {p: c for p, (_, c) in cost["outsider", "drv"].items()} == {"drv_launch": n}
        for (who, k), progs in cost.items():
            per_run = ", ".join(f"{p} {t / c:.0f}" for p, (t, c) in sorted(progs.items()))
            print(f"{FIRST[variant]:28} {k + ('' if who == 'job' else '/out'):9} {off[k] / n:7.0f} "
                  f"{on[who, k] / n:7.0f} {(on[who, k] - off[k]) / n:8.0f}  {per_run}")
        print(f"   maps scan of one process: {scan * 1e6:.0f} µs")


@pytest.mark.kernel
def test_gpu_and_cuda_together_on_the_fakes(fakes, tmp_path):
    """The issue's whole GPU side in one run: `jobprobe run --probes +cuda -- <program>` with the fake NVML and the
    fake CUDA/NCCL libraries (both compiled by the tests) shows the job's GPU (found by CUDA_VISIBLE_DEVICES in the
    job's environment) and its CUDA/NCCL calls per second, summing to the program's own account."""
    from tests.fake_nvml.state import FakeState
    from tests.fake_nvml.state import build as build_nvml
    (tmp_path / "nvml").mkdir()
    nvml_dir = build_nvml(tmp_path / "nvml").parent
    state = FakeState(tmp_path / "state").gpu(0, uuid="GPU-fake-0", name="Fake GPU", util="61 12",
                                              mem=f"{16 << 30} {3 << 30}", clocks="1410 1593", power=250000,
                                              energy=1_000_000, temp=50, pcie="1 2", throttle="0x0", ecc="0 0",
                                              remap="0 0 0 0", gpm=0).write()
    truth_file = tmp_path / "truth.json"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{fakes}:{nvml_dir}", "FAKE_NVML_STATE": str(state.path),
           "CUDA_VISIBLE_DEVICES": "0"}
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "+cuda", "--stdout", "json",
                          "--", str(fakes / "cudaprog"), "auto", "40", str(truth_file)],
                         capture_output=True, text=True, timeout=180, cwd=str(ROOT), env=env)
    assert res.returncode == 0, res.stderr
    frames = [json.loads(x) for x in res.stdout.splitlines()]
    # the hello comes before the command starts: cuda says what it waits for
    assert frames[0]["probes"]["gpu"] == "ok", frames[0]["probes"]
    assert frames[0]["probes"]["cuda"] == f"ok: {WAITING}", frames[0]["probes"]
    samples = [f for f in frames if f["kind"] == "sample"]
    gpus = [f["probes"]["gpu"]["gpus"] for f in samples if f["probes"]["gpu"]["gpus"]]
    assert gpus and all(g[0]["rule"] == "env" and g[0]["util_gpu_pct"] == 61 and g[0]["power_mw"] == 250000
                        for g in gpus)
    truth = json.loads(truth_file.read_text())
    total = {k: sum(f["probes"]["cuda"][k] for f in samples) for k in COUNTED}
    assert total == {k: truth[k] for k in COUNTED}


@pytest.mark.kernel
def test_status_says_what_it_waits_for_when_the_job_maps_no_cuda_library():
    """A job with no CUDA at all (this host has none): cuda runs, but its status must not read as if it counted."""
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cuda", "--interval", "0.3",
                          "--stdout", "json", "--", "sleep", "1"],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    frames = [json.loads(x) for x in res.stdout.splitlines()]
    assert frames[0]["probes"] == {"cuda": f"ok: {WAITING}"}, frames[0]
    samples = [f for f in frames if f["kind"] == "sample"]
    assert len(samples) >= 3 and all(f["status"] == {"cuda": f"ok: {WAITING}"} for f in samples), samples
    assert all(f["probes"]["cuda"]["kernel_launches"] == 0 for f in samples)
