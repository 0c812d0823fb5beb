"""cgroup probe. Unit tier on fixture trees (cgroup2 files, /proc); kernel tier on real groups, checked against the
kernel's own cpu.stat read by the test."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import workload
from jobprobe.host import Host
from jobprobe.target import CgroupTarget, PidTreeTarget
from probes.cgroup import CLK_TCK, PAGE, CgroupProbe, PerPid, io_stat_bytes, proc_counters, read_kv

TICK_NS = 1_000_000_000 // CLK_TCK


def write_proc(root: Path, pid: int, utime: int, stime: int, rss_pages: int, rd=0, wr=0, cutime=0, cstime=0,
               ppid=1, file_pages=0):
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = ["S", ppid] + [0] * 9 + [utime, stime, cutime, cstime] + [0] * 30
    (d / "stat").write_text(f"{pid} (a (weird) name) " + " ".join(map(str, rest)) + "\n")
    (d / "statm").write_text(f"1000 {rss_pages} {file_pages} 0 0 0 0\n")
    (d / "io").write_text(f"rchar: 1\nwchar: 2\nread_bytes: {rd}\nwrite_bytes: {wr}\n")


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
    proc = tmp_path / "proc"
    write_proc(proc, 10, 0, 0, 100, rd=0, wr=0)
    write_proc(proc, 11, 0, 0, 50, rd=0, wr=0)
    probe = CgroupProbe(Host(proc=str(proc), mountinfo=str(mountinfo)))
    probe.start(CgroupTarget(str(grp), mountinfo=str(mountinfo)))
    (grp / "cpu.stat").write_text("usage_usec 3500\nuser_usec 2500\nsystem_usec 1000\n")
    write_proc(proc, 10, 0, 0, 120, rd=4096, wr=8192, file_pages=30)
    s = probe.sample()
    assert (s["cpu_user_ns"], s["cpu_system_ns"]) == (2_500_000, 1_000_000)
    assert s["mem_bytes"] == (120 + 50) * PAGE and s["mem_peak_bytes"] == s["mem_bytes"]
    assert (s["mem_anon_bytes"], s["mem_file_bytes"]) == ((120 + 50 - 30) * PAGE, 30 * PAGE)
    assert (s["io_read_bytes"], s["io_write_bytes"], s["nprocs"]) == (4096, 8192, 2)
    (grp / "memory.current").write_text("1000\n")
    (grp / "memory.peak").write_text("999999999\n")
    (grp / "memory.stat").write_text("anon 600\nfile 300\nkernel 100\nanon_thp 0\n")
    s = probe.sample()
    assert s["mem_bytes"] == 1000 and s["mem_peak_bytes"] == 999999999 and s["cpu_user_ns"] == 0
    assert (s["mem_anon_bytes"], s["mem_file_bytes"]) == (600, 300)


def run_probe_until_exit(probe, proc, period=0.2):
    total = {"cpu_user_ns": 0, "cpu_system_ns": 0}
    while proc.poll() is None:
        time.sleep(period)
        s = probe.sample()
        for k in total:
            total[k] += s[k]
    time.sleep(0.05)
    s = probe.sample()
    for k in total:
        total[k] += s[k]
    return total["cpu_user_ns"] + total["cpu_system_ns"]


@pytest.mark.kernel
def test_cpu_time_of_a_burner_matches_cpu_stat(make_cgroup):
    cg = make_cgroup()
    probe = CgroupProbe()
    probe.start(CgroupTarget(str(cg.path)))
    outsider = __import__("subprocess").Popen(workload("burn", 2.5))   # busy beside the job, not in it
    job = cg.spawn(workload("burn", 2))
    got = run_probe_until_exit(probe, job)
    outsider.wait()
    want = cg.cpu_usage_ns()
    assert want > 0.5e9   # (2 s of wall time; less CPU when the host is busy)
    assert abs(got - want) / want < 0.02, (got, want)


@pytest.mark.kernel
def test_pid_tree_cpu_time_includes_children_forked_later(make_cgroup):
    """Independent source: the same processes also run in a cgroup2 group whose cpu.stat the kernel keeps."""
    cg = make_cgroup()
    root = cg.spawn(workload("forktree", 3, 1.0))
    probe = CgroupProbe()
    probe.start(PidTreeTarget([root.pid]))
    got = run_probe_until_exit(probe, root, period=0.25)
    want = cg.cpu_usage_ns()
    assert want > 0.5e9
    # /proc counts in clock ticks, and the root's own last interval goes with it (reaped outside the job)
    assert abs(got - want) / want < 0.05, (got, want)


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
        job.communicate("done\n", timeout=60)
    anon, file = s["mem_anon_bytes"] / 2**20, s["mem_file_bytes"] / 2**20
    print(f"{kind}: mem {s['mem_bytes'] / 2**20:.1f} MiB = anon {anon:.1f} + file {file:.1f} MiB")
    assert 96 <= anon <= 96 + 32 and 48 <= file <= 48 + 32
    assert s["mem_anon_bytes"] + s["mem_file_bytes"] <= s["mem_bytes"]
