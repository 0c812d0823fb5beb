# SPDX-License-Identifier: Apache-2.0
"""The loader/reader split (jobprobe/kernel/bpf.py, bpfmap.py, bpfload.py, bpf_loader.py): unit tests of the bpf(2)
attr packing, per-CPU sizing and the fd-passing reply, then real programs and maps on the real kernel (kernel tier).

Independent references: the UAPI header compiled by gcc (struct offsets, enum values), the kernel's own view of
each map (BPF_OBJ_GET_INFO_BY_FD), a workload's own /proc/self/status switch counts, and /proc/PID/maps.
"""
from __future__ import annotations

import ctypes as ct
import errno
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import bpfload as _bpfload
from jobprobe.kernel import bpfmap as _bpfmap
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.probes.sched import SchedProbe
from tests.conftest import TESTS, prog_exists, workload

TEST_C = TESTS / "bpf_loader_test.c"
ROOT = TESTS.parent
MiB = 1 << 20


class PC(ct.Structure):
    """tests/bpf_loader_test.c struct pc: 12 bytes, so per-CPU buffers pad it to 16."""
    _fields_ = [("switches", ct.c_uint32), ("tag", ct.c_uint32), ("spare", ct.c_uint32)]


@pytest.fixture(autouse=True)
def compiled_each_time(monkeypatch):
    """These tests are of the loader and the compile: no load here comes from a record (tests/test_bpfcache.py)."""
    monkeypatch.setenv("JOBPROBE_BPF_CACHE", "off")


def load_test(cflags=(), tracepoints=()) -> _bpfload.Loaded:
    return _bpfload.load("loader_test", ["-w", *cflags], list(tracepoints), text=TEST_C.read_text())


def open_fds() -> set[tuple[str, str]]:
    """This process's open fds, each as (number, what it is: "anon_inode:bpf-prog", "socket:[…]", a path). An fd
    that is in a later table and not in an earlier one was opened between them and left open; one that went away
    was closed (another test's object collected meanwhile: seen in CI, 4 pipes gone during a failed load)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            continue  # the listing's own fd, closed by now
    return fds


# ---------------------------------------------------------------- unit: attr packing, sizing, the reply

UAPI_CHECK = r"""
#include <stdio.h>
#include <stddef.h>
#include <linux/bpf.h>
#define OFF(t, f) printf("%s %zu\n", #t "." #f, offsetof(t, f))
int main(void) {
  OFF(union bpf_attr, map_fd); OFF(union bpf_attr, key); OFF(union bpf_attr, value);
  OFF(union bpf_attr, next_key); OFF(union bpf_attr, flags);
  OFF(union bpf_attr, batch.in_batch); OFF(union bpf_attr, batch.out_batch); OFF(union bpf_attr, batch.keys);
  OFF(union bpf_attr, batch.values); OFF(union bpf_attr, batch.count); OFF(union bpf_attr, batch.map_fd);
  OFF(union bpf_attr, batch.elem_flags); OFF(union bpf_attr, batch.flags);
  OFF(union bpf_attr, info.bpf_fd); OFF(union bpf_attr, info.info_len); OFF(union bpf_attr, info.info);
  OFF(struct bpf_prog_info, type); OFF(struct bpf_prog_info, id); OFF(struct bpf_prog_info, name);
  OFF(struct bpf_prog_info, run_time_ns); OFF(struct bpf_prog_info, run_cnt);
  OFF(struct bpf_map_info, type); OFF(struct bpf_map_info, key_size); OFF(struct bpf_map_info, value_size);
  OFF(struct bpf_map_info, max_entries); OFF(struct bpf_map_info, name);
  printf("cmds %d %d %d %d %d %d %d %d\n", BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM,
         BPF_MAP_GET_NEXT_KEY, BPF_OBJ_GET_INFO_BY_FD, BPF_MAP_LOOKUP_BATCH, BPF_ENABLE_STATS, BPF_STATS_RUN_TIME);
  printf("percpu %d %d %d %d\n", BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY,
         BPF_MAP_TYPE_LRU_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE);
  printf("flags %d %d %d\n", BPF_ANY, BPF_NOEXIST, BPF_EXIST);
  return 0;
}
"""


def test_attr_layout_matches_the_uapi_header(tmp_path):
    """Offsets of every field we pack, against the C compiler's view of <linux/bpf.h>."""
    if not shutil.which("gcc") or not Path("/usr/include/linux/bpf.h").exists():
        pytest.skip("needs gcc and <linux/bpf.h> (linux-libc-dev) to compile the reference")
    (tmp_path / "uapi.c").write_text(UAPI_CHECK)
    subprocess.run(["gcc", "-o", str(tmp_path / "uapi"), str(tmp_path / "uapi.c")], check=True)
    out = subprocess.run([str(tmp_path / "uapi")], capture_output=True, text=True, check=True).stdout
    c = dict(line.rsplit(" ", 1) for line in out.splitlines() if not line.startswith(("cmds", "percpu", "flags")))
    ours = {"union bpf_attr": (_bpf.ElemAttr, ""), "union bpf_attr.batch": (_bpf.BatchAttr, "batch."),
            "union bpf_attr.info": (_bpf.InfoAttr, "info."), "struct bpf_prog_info": (_bpf.ProgInfo, ""),
            "struct bpf_map_info": (_bpf.MapInfo, "")}
    checked = 0
    for key, off in c.items():
        owner, field = key.rsplit(".", 1)
        struct_, prefix = ours[owner]
        name = "value" if field == "next_key" else field    # they share offset 16 in the union
        assert getattr(struct_, name).offset == int(off), key
        checked += 1
    assert checked == 26
    lines = {ln.split()[0]: list(map(int, ln.split()[1:])) for ln in out.splitlines()
             if ln.startswith(("cmds", "percpu", "flags"))}
    assert lines["cmds"] == [_bpf.MAP_LOOKUP_ELEM, _bpf.MAP_UPDATE_ELEM, _bpf.MAP_DELETE_ELEM, _bpf.MAP_GET_NEXT_KEY,
                             _bpf.OBJ_GET_INFO_BY_FD, _bpf.MAP_LOOKUP_BATCH, _bpf.ENABLE_STATS, _bpf.STATS_RUN_TIME]
    assert set(lines["percpu"]) == _bpfmap.PERCPU_TYPES
    assert lines["flags"] == [_bpf.ANY, _bpf.NOEXIST, _bpf.EXIST]


def test_attr_sizes_without_a_compiler():
    assert (ct.sizeof(_bpf.ElemAttr), ct.sizeof(_bpf.BatchAttr), ct.sizeof(_bpf.InfoAttr)) == (32, 56, 16)
    assert (_bpf.BatchAttr.count.offset, _bpf.BatchAttr.map_fd.offset) == (32, 36)
    assert (_bpf.ProgInfo.run_time_ns.offset, _bpf.ProgInfo.run_cnt.offset, _bpf.ProgInfo.recursion_misses.offset,
            ct.sizeof(_bpf.ProgInfo)) == (192, 200, 208, 216)


def test_possible_cpus_and_percpu_stride(tmp_path):
    f = tmp_path / "devices/system/cpu/possible"
    f.parent.mkdir(parents=True)
    for text, n in (("0\n", 1), ("0-3\n", 4), ("0,2-3\n", 3), ("0-63\n", 64)):
        f.write_text(text)
        assert _bpfmap.possible_cpus(str(tmp_path)) == n
    assert [_bpfmap.percpu_stride(s) for s in (1, 8, 12, 16, 256)] == [8, 8, 16, 16, 256]


class FakeKernel:
    """Stands in for sys_bpf: one hash map of 4-byte keys in a dict, batch ops refused (a kernel before 5.6)."""

    def __init__(self, value_len: int):
        self.data: dict[bytes, bytes] = {}
        self.value_len, self.calls = value_len, []

    def __call__(self, cmd: int, attr: ct.Structure) -> int:
        self.calls.append(cmd)
        if cmd == _bpf.MAP_LOOKUP_BATCH:
            raise OSError(errno.EINVAL, "unknown command")
        key = ct.string_at(attr.key, 4) if attr.key else None
        if cmd == _bpf.MAP_UPDATE_ELEM:
            self.data[key] = ct.string_at(attr.value, self.value_len)
        elif cmd == _bpf.MAP_LOOKUP_ELEM:
            if key not in self.data:
                raise FileNotFoundError(errno.ENOENT, "no key")
            ct.memmove(attr.value, self.data[key], self.value_len)
        elif cmd == _bpf.MAP_GET_NEXT_KEY:
            keys = sorted(self.data)
            later = [k for k in keys if key is None or k > key]
            if not later:
                raise FileNotFoundError(errno.ENOENT, "last key")
            ct.memmove(attr.value, later[0], 4)
        return 0


def test_percpu_values_are_padded_to_8_bytes_per_cpu(monkeypatch):
    fake = FakeKernel(value_len=3 * 16)
    monkeypatch.setattr(_bpfmap, "sys_bpf", fake)
    m = _bpfmap.Map(7, "pc", 6, 4, 12, 4, ncpus=3).typed(ct.c_uint32, PC)
    assert m.percpu and m.stride == 16
    m.update(2, [PC(i, 100 + i, 0) for i in range(3)])
    raw = fake.data[struct.pack("I", 2)]
    assert [struct.unpack_from("III", raw, 16 * i) for i in range(3)] == [(i, 100 + i, 0) for i in range(3)]
    assert raw[12:16] == raw[28:32] == b"\0" * 4                     # the padding the kernel expects
    assert [(v.switches, v.tag) for v in m.lookup(2)] == [(0, 100), (1, 101), (2, 102)]
    with pytest.raises(ValueError, match="3 CPUs"):
        m.update(2, [PC()])


@pytest.mark.parametrize("ncpus", [2, 8])
def test_sums_at_sums_each_column_over_cpus_and_sums_again_only_what_changed(ncpus):
    """sums_at() on array_raw()'s bytes (4 slots × ncpus × 3 u64 fields): each column summed over CPUs (both ways
    of summing: few CPUs, many); a slot whose
    bytes did not change is answered from the last sums, one that did is summed anew; a caller changing the list
    it got changes nothing."""
    m = _bpfmap.Map(-1, "stats", 6, 4, 24, 4, ncpus=ncpus)
    assert m.stride == 24

    def raw_of(vals):   # vals[slot][cpu] = (a, b, c)
        return b"".join(struct.pack("QQQ", *vals[s][c]) for s in range(4) for c in range(ncpus))
    vals = [[(s + c, 2**63 + c, 10 * s) for c in range(ncpus)] for s in range(4)]
    raw = raw_of(vals)
    want = [[sum(v[i] for v in vals[s]) for i in range(3)] for s in range(4)]
    assert [m.sums_at(raw, s) for s in range(4)] == want            # exact (no wrap past 2^64)
    got = m.sums_at(raw, 1)
    got[0] = -1
    assert m.sums_at(raw, 1) == want[1]
    vals[1][ncpus - 1] = (1, 2, 3)
    raw2 = raw_of(vals)
    assert m.sums_at(raw2, 1) == [sum(v[i] for v in vals[1]) for i in range(3)] != want[1]
    assert m.sums_at(raw2, 2) == want[2]


def test_items_fall_back_to_per_key_lookups_when_batch_is_refused(monkeypatch):
    fake = FakeKernel(value_len=8)
    monkeypatch.setattr(_bpfmap, "sys_bpf", fake)
    m = _bpfmap.Map(7, "h", 1, 4, 8, 64).typed(ct.c_uint32, ct.c_uint64)
    for k in (5, 1, 3):
        m.update(k, k * 10)
    assert m.items() == [(1, 10), (3, 30), (5, 50)] and m.keys() == [1, 3, 5]
    assert not m._batch_ok
    fake.calls.clear()
    m.items()
    assert _bpf.MAP_LOOKUP_BATCH not in fake.calls                 # asked once, then remembered
    assert m.lookup(2) is None and 3 in m and 2 not in m


def test_typed_checks_sizes_and_raw_bytes_work_untyped():
    m = _bpfmap.Map(-1, "h", 1, 4, 8, 64)
    with pytest.raises(ValueError, match="key type c_ulong is 8 bytes"):
        m.typed(ct.c_uint64, ct.c_uint64)
    with pytest.raises(TypeError):
        m._key_buf(5)                                              # an int needs a key type
    with pytest.raises(ValueError, match="3 bytes given"):
        m._key_buf(b"abc")
    assert m._key_buf(b"abcd").raw == b"abcd" and m._key_buf(ct.c_uint32(1)).raw == b"\1\0\0\0"


@pytest.mark.parametrize("n", [1, _bpf.CLOSE_ALONE + 1, 200])
def test_close_all_closes_every_fd_one_by_one_or_from_threads(n):
    """However many (one by one up to CLOSE_ALONE, beyond it from threads): every fd closed, one already closed
    and one never opened no error."""
    before = open_fds()
    pipes = [os.pipe() for _ in range(n)]
    fds = [fd for p in pipes for fd in p]
    os.close(fds[0])
    _bpf.close_all([fds[0], 1 << 20] + fds)
    assert open_fds() - before == set()      # (another test's objects may be collected meanwhile: fewer is fine)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_receive_takes_fds_close_on_exec_and_closes_them_on_a_bad_reply():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        socket.send_fds(b, [json.dumps({"nfds": 2}).encode()], [r, w])
        meta, fds = _bpfload.receive(a)
        assert meta == {"nfds": 2} and len(fds) == 2
        assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds)
        for fd in fds:
            os.close(fd)
        before = open_fds()
        socket.send_fds(b, [json.dumps({"nfds": 1}).encode()], [r, w])     # says 1, sends 2
        with pytest.raises(OSError, match="sent 2 fds"):
            _bpfload.receive(a)
        assert open_fds() - before == set()
        b.close()
        with pytest.raises(OSError, match="without a reply"):
            _bpfload.receive(a)
    finally:
        os.close(r), os.close(w), a.close(), b.close()


# ---------------------------------------------------------------- kernel tier


def switches_of(proc: subprocess.Popen) -> int:
    out, _ = proc.communicate(timeout=120)
    return sum(map(int, out.split()[-2:]))


@pytest.mark.kernel
def test_programs_stay_attached_after_the_loader_exits(make_cgroup):
    """The sched probe, through its real code path: the loader is gone, the job's switches are still counted."""
    probe = SchedProbe()
    cg = make_cgroup()
    probe.start(CgroupTarget(str(cg.path)))
    try:
        pid = probe.loaded.loader_pid
        assert pid > 0 and not Path(f"/proc/{pid}").exists(), "the loader should have exited and been reaped"
        ids = [_bpf.prog_info(fd).id for fd in probe.loaded.progs.values()]
        proc = cg.spawn(workload("switches", 1000, 500), stdout=subprocess.PIPE, text=True)
        expected = switches_of(proc)
        s = probe.sample()
        got = s["voluntary_switches"] + s["involuntary_switches"]
        print(f"loader {pid} gone; sched counted {got} switches, the workload's own count {expected}")
        assert expected >= 990 and abs(got - expected) <= 0.05 * expected
    finally:
        probe.stop()
    # Closing our fds was the last reference: the programs are freed (after an RCU grace period), not left behind.
    deadline = time.monotonic() + 5
    while any(map(prog_exists, ids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(prog_exists, ids))


AGENT = r"""
import json, os, sys, time
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.sched import SchedProbe
p = SchedProbe()
p.start(PidTreeTarget([os.getpid()]))
switches = 0
for _ in range(3):
    for _ in range(50):
        time.sleep(0.001)
    s = p.sample()
    switches += s["voluntary_switches"] + s["involuntary_switches"]
loader = p.loaded.loader_pid
libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if any(x in ln for x in ("libbcc", "LLVM", "clang"))})
st = dict(ln.split(":", 1) for ln in open("/proc/self/status").read().splitlines())
p.stop()
print(json.dumps({"libs": libs, "bcc": any(m == "bcc" or m.startswith("bcc.") for m in sys.modules),
                  "rss_kib": int(st["VmRSS"].split()[0]), "hwm_kib": int(st["VmHWM"].split()[0]),
                  "switches": switches, "loader_alive": os.path.exists(f"/proc/{loader}")}))
"""


@pytest.mark.kernel
def test_agent_process_never_maps_bcc_or_llvm_and_stays_small():
    """A fresh process loads the sched probe the real way and samples; cwd "/" checks the loader is found anyway."""
    out = subprocess.run([sys.executable, "-c", AGENT], cwd="/", capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    print(f"agent: RSS {r['rss_kib'] / 1024:.1f} MiB, peak {r['hwm_kib'] / 1024:.1f} MiB, libs {r['libs']}, "
          f"{r['switches']} switches")
    assert r["libs"] == [] and not r["bcc"] and not r["loader_alive"]
    assert r["switches"] >= 100                      # it measured itself: 150 sleeps
    assert r["rss_kib"] * 1024 < 40 * MiB and r["hwm_kib"] * 1024 < 40 * MiB


@pytest.mark.kernel
@pytest.mark.parametrize("cflags, tracepoints, said", [
    (["-DBREAK_COMPILE"], [("sched:sched_switch", "on_switch")], r"Failed to compile BPF module .*error: expected ';'"),
    (["-DBREAK_VERIFIER"], [("sched:sched_switch", "on_switch")],
     r"Failed to load BPF program b'on_switch': .*(invalid access to map value|unbounded)"),
    ([], [("sched:no_such_event", "on_switch")], r"Failed to attach BPF program b'on_switch'"),
    ([], [("sched:sched_switch", "no_such_function")], r"Unknown program b'no_such_function'"),
], ids=["compile", "verifier", "no-tracepoint", "no-function"])
def test_a_failed_load_says_why_and_leaves_no_fd(cflags, tracepoints, said):
    before = open_fds()
    with pytest.raises(ProbeUnavailable, match=said) as err:
        load_test(cflags, tracepoints)
    print(f"loader_test: {err.value}")
    assert str(err.value).startswith("cannot load bpf/loader_test.c: ") and len(str(err.value)) < 2000
    assert open_fds() - before == set()     # no program, map, perf event, socket or log file left open


@pytest.mark.kernel
def test_hash_map_ops_match_the_kernels_view(monkeypatch):
    with load_test() as loaded:                           # maps only: nothing attached
        assert loaded.progs == {} and loaded.links == [] and set(loaded.maps) == {"counts", "percpu", "watch"}
        for m in loaded.maps.values():                    # what the loader said, against the kernel's own record
            info = _bpf.map_info(m.fd)
            assert (info.type, info.key_size, info.value_size, info.max_entries, info.name.decode()) == \
                (m.type, m.key_size, m.value_size, m.max_entries, m.name)
        m = loaded.maps["counts"]
        m.update(struct.pack("I", 5), struct.pack("Q", 9))          # raw bytes, untyped
        assert m.lookup(struct.pack("I", 5)) == struct.pack("Q", 9) and m.lookup(b"\0" * 4) is None
        m.typed(ct.c_uint32, ct.c_uint64)
        assert m.delete(5) and not m.delete(5)
        for k in range(300):
            m.update(k, k * k)
        assert m.lookup(7) == 49 and 7 in m and 300 not in m
        with pytest.raises(FileExistsError):
            m.update(7, 0, flags=_bpf.NOEXIST)
        with pytest.raises(FileNotFoundError):
            m.update(1000, 0, flags=_bpf.EXIST)
        assert sorted(m.keys()) == list(range(300))
        monkeypatch.setattr(_bpfmap, "BATCH", 64)         # several batch calls, the last one ending in ENOENT
        assert sorted(m.items()) == [(k, k * k) for k in range(300)] and m._batch_ok
        m._batch_ok = False
        assert sorted(m.items()) == [(k, k * k) for k in range(300)]
        assert m.delete(7) and m.lookup(7) is None and len(m.keys()) == 299
    assert m.fd == -1                                     # closed: a stale Map cannot reach a reused fd number


@pytest.mark.kernel
def test_percpu_array_ops():
    with load_test() as loaded:
        pa = loaded.maps["percpu"].typed(ct.c_uint32, PC)
        assert pa.percpu and (pa.value_size, pa.stride, pa.ncpus) == (12, 16, _bpfmap.possible_cpus())
        vals = [PC(i + 1, 100 + i, 7) for i in range(pa.ncpus)]
        pa.update(2, vals)
        assert [(v.switches, v.tag, v.spare) for v in pa.lookup(2)] == [(i + 1, 100 + i, 7) for i in range(pa.ncpus)]
        items = pa.items()
        assert [k for k, _ in items] == [0, 1, 2, 3] and pa._batch_ok
        assert [v.tag for v in items[2][1]] == [100 + i for i in range(pa.ncpus)]
        assert all(v.switches == 0 for v in items[0][1])
        pa._batch_ok = False
        assert [[bytes(v) for v in vs] for _, vs in pa.items()] == [[bytes(v) for v in vs] for _, vs in items]
        with pytest.raises(OSError) as err:
            pa.delete(0)                                  # arrays have no delete
        assert err.value.errno == errno.EINVAL
        assert pa.lookup(4) is None                       # past max_entries


@pytest.mark.kernel
def test_kernel_written_percpu_counts_match_the_workloads_own(make_cgroup):
    cg = make_cgroup()
    with load_test(tracepoints=[("sched:sched_switch", "on_switch")]) as loaded:
        assert set(loaded.progs) == {"on_switch"} and [t for t, _, _ in loaded.links] == ["sched:sched_switch"]
        loaded.maps["watch"].typed(ct.c_uint64, ct.c_uint32).update(cg.id, 1)
        pa = loaded.maps["percpu"].typed(ct.c_uint32, PC)
        with _bpf.stats_enabled():
            proc = cg.spawn(workload("switches", 1000, 500), stdout=subprocess.PIPE, text=True)
            expected = switches_of(proc)
            stats = loaded.prog_stats()["on_switch"]
        got = sum(v.switches for v in pa.lookup(0))
        print(f"per-CPU {[v.switches for v in pa.lookup(0)]} sum {got}, the workload's own count {expected}; "
              f"on_switch ran {stats.run_cnt} times, {stats.run_time_ns / max(stats.run_cnt, 1):.0f} ns each")
        assert expected >= 990 and abs(got - expected) <= 0.05 * expected
        assert stats.run_cnt >= got and stats.run_time_ns > 0      # it runs for every switch on the node


def test_the_loader_takes_struct_offsets_from_the_kernels_btf():
    """-DNAME=@btf:struct.member:size is resolved in the loader (the agent never reads the BTF): the offset the
    kernel's own BTF gives, the size checked, a missing member or a wrong size said."""
    from jobprobe.kernel.bpf_loader import btf_flag
    from jobprobe.kernel.btf import Btf
    vmlinux = Path("/sys/kernel/btf/vmlinux")
    if not vmlinux.exists():
        pytest.skip("no kernel BTF on this host (/sys/kernel/btf/vmlinux)")
    off, size = Btf(vmlinux.read_bytes()).offset("task_struct", "pid")
    assert size == 4 and btf_flag("-DTASK_PID_OFF=@btf:task_struct.pid:4") == f"-DTASK_PID_OFF={off}"
    assert btf_flag("-DPLAIN=3") == "-DPLAIN=3"
    with pytest.raises(Exception, match="is 4 bytes in the kernel's BTF, not 8"):
        btf_flag("-DX=@btf:task_struct.pid:8")
    with pytest.raises(Exception, match="has no.*no_such_member"):
        btf_flag("-DX=@btf:task_struct.no_such_member:4")
    # optional (@btf?:): a member the kernel lacks is -1, one it has its offset; nested paths across structs
    assert btf_flag("-DX=@btf?:task_struct.no_such_member:4") == "-DX=-1"
    cfs, _ = Btf(vmlinux.read_bytes()).offset("task_struct", "se")
    inner, _ = Btf(vmlinux.read_bytes()).offset("sched_entity", "exec_start")
    assert btf_flag("-DX=@btf?:task_struct.se.exec_start:8") == f"-DX={cfs + inner}"


PINNED_C = r"""
BPF_TABLE_PINNED("hash", u32, u64, shared, 1024, JOB_PIN_DIR "/shared");
"""


def pin_dirs(where: Path) -> list[str]:
    return sorted(p.name for p in where.iterdir() if p.name.startswith("jobprobe-pins-"))


@pytest.mark.kernel
@pytest.mark.parametrize("how", ["loaded", "compile-error", "timeout"])
def test_a_load_that_pins_leaves_no_directory_behind(how, tmp_path, monkeypatch):
    """The loader pins the shared maps in a bpffs mounted on a fresh directory of the temp directory (in its own
    mount namespace): that directory goes when the loader does, whether the load worked, failed or was cut short.
    The temp directory is the test's own, so another process's loads at the same moment are not counted."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert tempfile.gettempdir() == str(tmp_path)
    seen: list[str] = []
    real = _bpfload.run_loader

    def run_loader(*args, **kwargs):                      # the directory exists while the loader runs
        seen.extend(pin_dirs(tmp_path))
        return real(*args, **kwargs)
    monkeypatch.setattr(_bpfload, "run_loader", run_loader)
    with load_test() as owner:
        mine = owner.maps["counts"]
        mine.typed(ct.c_uint32, ct.c_uint64)
        mine.update(7, 49)
        text = PINNED_C + ("this is not C;" if how == "compile-error" else "")
        if how == "loaded":
            with _bpfload.load("pinned_test", ["-w"], [], text=text, pinned={"shared": mine.fd}) as loaded:
                got = loaded.maps["shared"]
                assert _bpf.map_info(got.fd).id == _bpf.map_info(mine.fd).id      # the very map, by its pin
                assert got.typed(ct.c_uint32, ct.c_uint64).lookup(7) == 49
        else:
            with pytest.raises(ProbeUnavailable):
                _bpfload.load("pinned_test", ["-w"], [], text=text, pinned={"shared": mine.fd},
                          timeout=0.05 if how == "timeout" else 120.0)
    assert len(seen) == 1 and seen[0].startswith("jobprobe-pins-")
    assert pin_dirs(tmp_path) == []
