# SPDX-License-Identifier: Apache-2.0
"""Compiled BPF modules kept between loads (jobprobe/kernel/bpfcache.py): what a record holds, what is refused, and
on the real kernel that a probe started from its record runs the very programs its compile gave and counts the same.

Independent references: the UAPI header compiled by gcc (the structs packed for map, program and BTF loads), the
kernel's own tag of each program (a hash of its instructions without their map fds: the same program gives the
same tag), a workload's own /proc/self/status switch counts, and the record's inode (a compile writes it anew)."""
from __future__ import annotations

import base64
import ctypes as ct
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import bpfcache
from tests.conftest import TESTS, workload

ROOT = TESTS.parent


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | src << 4, off, imm)


def ld_map(fd: int, dst: int = 1) -> bytes:
    return insn(bpfcache.LD_IMM64, dst, bpfcache.PSEUDO_MAP_FD, 0, fd) + insn(0)


EXIT = insn(0x95)                                   # BPF_JMP | BPF_EXIT
MOV0 = insn(0xB7, 0, 0, 0, 0)                       # r0 = 0


def a_record(fd: int = 7) -> bpfcache.Record:
    return bpfcache.Record("GPL", 0, {"on_switch": bpfcache.Prog(5, 0, 0, ld_map(fd) + MOV0 + EXIT)},
                           (bpfcache.MapDef("counts", 2, 4, 8, 1, 0, fd, False, 0, 0),), b"")


# ---------------------------------------------------------------- unit


def test_relocate_puts_each_maps_new_fd_where_its_old_one_was():
    code = ld_map(7) + insn(bpfcache.LD_IMM64, 2, 0, 0, 7) + insn(0) + ld_map(9, dst=3) + MOV0 + EXIT
    out = bpfcache.relocate(code, {7: 41, 9: 43})
    imms = [struct.unpack_from("<i", out, 8 * i + 4)[0] for i in range(len(out) // 8)]
    assert imms == [41, 0, 7, 0, 43, 0, 0, 0]         # the constant 7 (src 0) is not a map: left alone
    with pytest.raises(bpfcache.Rejected, match="map fd 9"):
        bpfcache.relocate(code, {7: 41})
    with pytest.raises(bpfcache.Rejected, match="cut short"):
        bpfcache.relocate(MOV0 + ld_map(7)[:8], {7: 1})
    with pytest.raises(bpfcache.Rejected, match="kind 2"):     # a map value (global data): not bcc's
        bpfcache.relocate(insn(bpfcache.LD_IMM64, 1, 2, 0, 7) + insn(0), {7: 1})


def test_a_record_reads_back_as_written(tmp_path):
    d = tmp_path / "cache"
    rec = a_record()
    bpfcache.write(d, "k1", rec)
    assert bpfcache.read(d / "k1") == rec and bpfcache.read(d / "none") is None
    assert oct(d.stat().st_mode & 0o777) == "0o700" and oct((d / "k1").stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in d.iterdir()] == ["k1"]                 # nothing of the write left beside it


def test_only_the_newest_records_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(bpfcache, "MAX_RECORDS", 3)
    d = tmp_path / "cache"
    for i in range(5):
        bpfcache.write(d, f"k{i}", a_record())
        os.utime(d / f"k{i}", (1000 + i, 1000 + i))
    bpfcache.write(d, "k5", a_record())
    assert sorted(p.name for p in d.iterdir()) == ["k3", "k4", "k5"]


def test_a_record_anyone_else_may_write_or_a_link_is_refused(tmp_path):
    d = tmp_path / "cache"
    bpfcache.write(d, "k", a_record())
    os.chmod(d / "k", 0o666)
    with pytest.raises(bpfcache.Rejected, match="only it may write"):
        bpfcache.read(d / "k")
    os.chmod(d / "k", 0o600)
    os.symlink(d / "k", d / "link")
    with pytest.raises(bpfcache.Rejected, match="cannot open"):
        bpfcache.read(d / "link")
    os.chmod(d, 0o777)
    assert not bpfcache.trusted_dir(d)
    with pytest.raises(OSError, match="only it may write"):
        bpfcache.write(d, "k2", a_record())


def test_the_key_changes_with_the_source_the_flags_the_hooks_and_the_kernel(monkeypatch):
    base = ("int x;", ["-w"], [("sched:sched_switch", "on_switch")], [], [], ["job_of_cgroup"])
    k = bpfcache.key(*base)
    assert bpfcache.key(*base) == k
    assert bpfcache.key("int y;", *base[1:]) != k
    assert bpfcache.key(base[0], ["-w", "-DX"], *base[2:]) != k
    assert bpfcache.key(*base[:2], [("raw:sched:sched_switch", "on_switch")], *base[3:]) != k
    assert bpfcache.key(*base[:5], []) != k
    # where a cgroup program is linked is not part of it: the same instructions for every job's group
    assert bpfcache.key(*base[:3], [("f", "/a", "cgroup_skb/egress")], *base[4:]) == \
        bpfcache.key(*base[:3], [("f", "/b", "cgroup_skb/egress")], *base[4:])
    monkeypatch.setattr(bpfcache, "_kernel", "another kernel")
    assert bpfcache.key(*base) != k


GOOD = bpfcache.dump(a_record())


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(st.binary(max_size=400),
                 st.builds(lambda i, b: GOOD[:i] + bytes([b]) + GOOD[i + 1:],
                           st.integers(0, len(GOOD) - 1), st.integers(0, 255)),
                 st.builds(lambda k, v: json.dumps({**json.loads(GOOD), k: v}).encode(),
                           st.sampled_from(["format", "license", "kern_version", "progs", "maps", "btf"]),
                           st.one_of(st.none(), st.integers(-2**40, 2**40), st.text(max_size=20),
                                     st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5),
                                                                                          st.integers(), max_size=3)))))
def test_a_hostile_record_is_refused_or_read_never_anything_else(data):
    try:
        rec = bpfcache.parse(data)
    except bpfcache.Rejected:
        return
    for p in rec.progs.values():                # what was read is whole: every map it names is in it
        assert len(p.insns) % 8 == 0 and p.insns
        bpfcache.relocate(p.insns, {m.old_fd: 3 for m in rec.maps})


UAPI_CHECK = r"""
#include <stdio.h>
#include <stddef.h>
#include <linux/bpf.h>
#define A(f) printf("attr %s %zu\n", #f, offsetof(union bpf_attr, f))
#define M(f) printf("map_info %s %zu\n", #f, offsetof(struct bpf_map_info, f))
#define B(f) printf("btf_info %s %zu\n", #f, offsetof(struct bpf_btf_info, f))
int main(void) {
  A(map_type); A(key_size); A(value_size); A(max_entries); A(map_flags); A(inner_map_fd); A(numa_node);
  A(map_name); A(map_ifindex); A(btf_fd); A(btf_key_type_id); A(btf_value_type_id);
  A(prog_type); A(insn_cnt); A(insns); A(license); A(kern_version); A(prog_name); A(expected_attach_type);
  A(attach_btf_id); A(btf); A(btf_size); A(btf_log_level);
  M(map_flags); M(ifindex); M(netns_dev); M(btf_id); M(btf_key_type_id); M(btf_value_type_id);
  B(btf); B(btf_size); B(id);
  printf("cmds %d %d %d %d\n", BPF_MAP_CREATE, BPF_PROG_LOAD, BPF_BTF_LOAD, BPF_BTF_GET_FD_BY_ID);
  return 0;
}
"""
CREATE = ("map_type", "key_size", "value_size", "max_entries", "map_flags", "inner_map_fd", "numa_node", "map_name",
          "map_ifindex", "btf_fd", "btf_key_type_id", "btf_value_type_id")


def test_the_structs_packed_for_a_cached_load_match_the_uapi_header(tmp_path):
    if not shutil.which("gcc") or not Path("/usr/include/linux/bpf.h").exists():
        pytest.skip("needs gcc and <linux/bpf.h> (linux-libc-dev) to compile the reference")
    (tmp_path / "uapi.c").write_text(UAPI_CHECK)
    subprocess.run(["gcc", "-o", str(tmp_path / "uapi"), str(tmp_path / "uapi.c")], check=True)
    out = subprocess.run([str(tmp_path / "uapi")], capture_output=True, text=True, check=True).stdout.splitlines()
    checked = 0
    for ln in out:
        what, *rest = ln.split()
        if what == "cmds":
            assert list(map(int, rest)) == [_bpf.MAP_CREATE, _bpf.PROG_LOAD, _bpf.BTF_LOAD, _bpf.BTF_GET_FD_BY_ID]
            continue
        field, off = rest[0], int(rest[1])
        cls = {"map_info": _bpf.MapInfo, "btf_info": _bpf.BtfInfo}.get(what) or (
            _bpf.MapCreateAttr if field in CREATE else _bpf.BtfLoadAttr if field.startswith("btf") else
            _bpf.ProgLoadAttr)
        assert getattr(cls, field).offset == off, (what, field)
        checked += 1
    assert checked == 32


# ---------------------------------------------------------------- kernel tier


def tags(loaded) -> dict[str, bytes]:
    return {n: bytes(_bpf.prog_info(fd).tag) for n, fd in loaded.progs.items()}


def maps_of(loaded) -> dict[str, tuple]:
    out = {}
    for n, m in loaded.maps.items():
        i = _bpf.map_info(m.fd)
        out[n] = (i.type, i.key_size, i.value_size, i.max_entries, i.map_flags)
    return out


@pytest.mark.kernel
def test_a_second_start_runs_the_compiled_programs_from_their_record_and_counts_the_same(make_cgroup, tmp_path,
                                                                                        monkeypatch):
    """The sched probe started twice on a job's group: the first start compiles in a loader and writes the record;
    the second makes no loader, and the kernel's tag of every program and the kind of every map are those of the
    compile; it counts the workload's own context switches as the compiled one does."""
    from jobprobe.node.targets.cgroup import CgroupTarget
    from jobprobe.probes.sched import SchedProbe
    monkeypatch.setenv("JOBPROBE_BPF_CACHE", str(tmp_path / "cache"))
    cg = make_cgroup()
    seen = []
    for _ in range(2):
        probe = SchedProbe()
        probe.start(CgroupTarget(str(cg.path)))
        try:
            proc = cg.spawn(workload("switches", 1000, 500), stdout=subprocess.PIPE, text=True)
            out, _ = proc.communicate(timeout=120)
            expected = sum(map(int, out.split()[-2:]))
            s = probe.sample()
            got = s["voluntary_switches"] + s["involuntary_switches"]
            seen.append((probe.loaded.loader_pid, tags(probe.loaded), maps_of(probe.loaded), got, expected))
        finally:
            probe.stop()
    (pid1, tags1, maps1, got1, want1), (pid2, tags2, maps2, got2, want2) = seen
    print(f"compiled: loader {pid1}, {got1} switches of {want1}; from the record: loader {pid2}, {got2} of {want2}")
    assert pid1 > 0 and pid2 == 0
    assert tags1 == tags2 and len(tags1) >= 1
    assert maps1 == maps2
    for got, want in ((got1, want1), (got2, want2)):
        assert want >= 990 and abs(got - want) <= 0.05 * want


RUN = [sys.executable, "-m", "jobprobe.cli", "run", "--probes", "sched", "--stdout", "json", "--"]


@pytest.mark.kernel
def test_a_record_that_lies_or_that_the_kernel_refuses_is_not_used_and_is_written_anew(tmp_path):
    """`jobprobe run` with one cache, four times: the first compiles (the node's membership module and the sched
    probe's, each record written); the second loads both from their records (none written again: the same inodes);
    then one record's program names a map it does not hold and the other's reads a register never written (the
    verifier refuses it); then a record anyone may write. None of those is used: one line says so for each, the
    module is compiled and its record written anew (a new inode, only its owner may write). Every run counts the
    workload's own context switches."""
    env = {**os.environ, "JOBPROBE_BPF_CACHE": str(tmp_path / "cache")}
    d = tmp_path / "cache"
    splits: list = []

    def run() -> tuple[tuple[int, int], list[str]]:
        r = subprocess.run(RUN + workload("switches", 600, 300), capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        frames = [json.loads(x) for x in lines if x.startswith("{")]
        mine = tuple(map(int, [x for x in lines if not x.startswith("{")][-1].split()))   # the workload's own
        s = [f["probes"]["sched"] for f in frames if f["kind"] == "sample"]
        split = tuple(sum(x.get(f"{k}_switches", 0) for x in s) for k in ("voluntary", "involuntary"))
        splits.append((split, mine))            # (voluntary, involuntary), the probe's and the workload's
        return (sum(split), sum(mine)), r.stderr.splitlines()

    def inodes() -> dict[str, int]:
        return {p.name: p.stat().st_ino for p in d.iterdir()}

    def rewrite(name: str, code: bytes) -> None:
        doc = json.loads((d / name).read_bytes())
        prog = sorted(doc["progs"])[0]
        doc["progs"][prog]["insns"] = base64.b64encode(code).decode()
        (d / name).write_text(json.dumps(doc))
    counts = [run()[0]]
    records = inodes()
    assert len(records) == 2                      # the node's membership module and the sched probe's
    got, said = run()
    counts.append(got)
    assert inodes() == records and said == [], said
    lie, refused = sorted(records)
    rewrite(lie, ld_map(999_999) + MOV0 + EXIT)
    rewrite(refused, insn(0x79, 0, 9) + EXIT)     # r0 = *(u64 *)(r9 + 0): r9 was never written
    got, said = run()
    counts.append(got)
    print("said:", said)
    assert len(said) == 2 and all("not used" in x for x in said), said
    assert any("names map fd 999999" in x for x in said) and any("R9 !read_ok" in x for x in said), said
    now = inodes()
    assert all(now[n] != records[n] for n in records) and all(bpfcache.read(d / n) for n in records)
    records = now
    os.chmod(d / lie, 0o666)
    got, said = run()
    counts.append(got)
    assert len(said) == 1 and "only it may write" in said[0], said
    assert inodes()[lie] != records[lie] and (d / lie).stat().st_mode & 0o777 == 0o600
    print(f"switches counted (by the probe, by the workload): compiled {counts[0]}, from the records {counts[1]}, "
          f"records refused {counts[2:]}")
    for got, own in counts:
        assert own >= 600 and abs(got - own) <= 0.05 * own, f"{counts}; (voluntary, involuntary) {splits}"


@pytest.mark.kernel
def test_a_classic_tracepoint_program_from_its_record_counts_what_the_compiled_one_counts(make_cgroup, tmp_path,
                                                                                        monkeypatch):
    """tests/bpf_loader_test.c on sched:sched_switch as a classic tracepoint (a perf event runs it), twice: compiled,
    then from its record (no loader); each counts the workload's own switches in its per-CPU map."""
    from jobprobe.kernel import bpfload
    from tests.test_bpf_loader import PC, TEST_C
    monkeypatch.setenv("JOBPROBE_BPF_CACHE", str(tmp_path / "cache"))
    cg = make_cgroup()
    seen = []
    for _ in range(2):
        with bpfload.load("loader_test", ["-w"], [("sched:sched_switch", "on_switch")], text=TEST_C.read_text()) as lo:
            lo.maps["watch"].typed(ct.c_uint64, ct.c_uint32).update(cg.id, 1)
            proc = cg.spawn(workload("switches", 1000, 500), stdout=subprocess.PIPE, text=True)
            out, _ = proc.communicate(timeout=120)
            expected = sum(map(int, out.split()[-2:]))
            got = sum(v.switches for v in lo.maps["percpu"].typed(ct.c_uint32, PC).lookup(0))
            seen.append((lo.loader_pid, tags(lo), got, expected))
    print("compiled, then from its record:", seen)
    assert seen[0][0] > 0 and seen[1][0] == 0 and seen[0][1] == seen[1][1]
    for _, _, got, expected in seen:
        assert expected >= 990 and abs(got - expected) <= 0.05 * expected
