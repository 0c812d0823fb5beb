# SPDX-License-Identifier: Apache-2.0
"""energy: RAPL package and DRAM energy by the job's share of CPU time. This VM has no RAPL (no /sys/class/powercap
zones), so the counters are a FIXTURE powercap tree (two packages with DRAM subzones, CPU 0 on package 0 and CPU 1
on package 1) written by the test tick by tick — one wraps mid-run — while the job is real: a burner pinned to CPU
1 in a real cgroup2 group, its CPU time read back from the kernel's own accounting (cpu.stat) and the package's busy
time from /proc/stat."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest

from jobprobe.kernel.host import Host
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.probes.energy import EnergyProbe, busy_ticks, wrapped

TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def powercap(root: Path) -> Path:
    for cpu, pkg in ((0, 0), (1, 1)):
        d = root / f"devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
    for pkg in (0, 1):
        z = root / f"class/powercap/intel-rapl:{pkg}"
        (z / f"intel-rapl:{pkg}:0").mkdir(parents=True)
        (z / "name").write_text(f"package-{pkg}\n")
        (z / "energy_uj").write_text("1000000\n")
        (z / "max_energy_range_uj").write_text("262143328850\n")
        (z / f"intel-rapl:{pkg}:0/name").write_text("dram\n")
        (z / f"intel-rapl:{pkg}:0/energy_uj").write_text("0\n")
        (z / f"intel-rapl:{pkg}:0/max_energy_range_uj").write_text("65712999613\n")
    return root


def set_uj(root: Path, pkg: int, uj: int, dram: int | None = None) -> None:
    (root / f"class/powercap/intel-rapl:{pkg}/energy_uj").write_text(f"{uj}\n")
    if dram is not None:
        (root / f"class/powercap/intel-rapl:{pkg}/intel-rapl:{pkg}:0/energy_uj").write_text(f"{dram}\n")


def test_a_counter_wrap_is_one_range_more():
    assert wrapped(5_000_000, 262143328850 - 3_000_000, 262143328850) == 8_000_001
    assert wrapped(7, 5, 100) == 2


@pytest.mark.serial
@pytest.mark.kernel
@pytest.mark.skipif(os.cpu_count() < 2, reason="needs two CPUs to pin the burner to CPU 1")
def test_the_jobs_cpu_energy_is_each_package_delta_times_its_cpu_share(make_cgroup, tmp_path):
    root = powercap(tmp_path / "sys")
    probe = EnergyProbe(dataclasses.replace(Host(), sys=str(root)))
    assert probe.check(probe.host) is None
    cg = make_cgroup()
    burner = cg.spawn(["taskset", "-c", "1", sys.executable, "-c",
                       "import time\nend = time.time() + 6\nwhile time.time() < end: pass"])
    time.sleep(0.3)
    probe.start(CgroupTarget(str(cg.path)))
    cpu0, busy0 = cg.cpu_usage_ns(), busy_ticks("/proc")[1]
    e0 = e1 = 1_000_000
    max1 = 262143328850
    total_j = want_j = 0.0
    for i in range(4):
        time.sleep(1.0)
        e0 += 5_000_000
        e1 = (max1 - 3_000_000) if i == 1 else (5_000_000 if i == 2 else e1 + 8_000_000)   # a wrap at tick 3
        set_uj(root, 0, e0, dram=(i + 1) * 400_000)
        set_uj(root, 1, e1, dram=(i + 1) * 900_000)
        s = probe.sample()
        cpu1, busy1 = cg.cpu_usage_ns(), busy_ticks("/proc")[1]
        share = (cpu1 - cpu0) / ((busy1 - busy0) * TICK_NS)            # the kernel's own figures
        pkg1_j = (8_000_001 if i == 2 else (max1 - 3_000_000 - 9_000_000 if i == 1 else 8_000_000)) / 1e6
        print(f"energy tick {i}: job {s['cpu_energy_j']:.4f} J of {s['package_energy_j']:.4f}; share "
              f"{s['cpu_share']:.4f} (kernel: {share:.4f} of CPU 1); package 1 delta {pkg1_j:.6f} J")
        if i != 1:              # (tick 2 sets package 1 to just below its range: a huge delta, then the wrap)
            total_j += s["cpu_energy_j"]
            want_j += pkg1_j * share
        assert s["packages"] == 2 and 0.3 < s["cpu_share"] <= 1.0
        assert abs(s["dram_energy_j"] - 0.9 * share) <= 0.02 * 0.9 * share      # package 1's DRAM, same share
        cpu0, busy0 = cpu1, busy1
    burner.kill()
    burner.wait()
    probe.stop()
    assert abs(total_j - want_j) <= 0.02 * want_j, (total_j, want_j)


def test_on_this_host_without_rapl_the_probe_says_so():
    p = EnergyProbe()
    if any(Path("/sys/class/powercap").glob("intel-rapl:*")):
        pytest.skip("this host has RAPL")
    assert p.check(p.host) == "no RAPL (/sys/class/powercap has no intel-rapl or amd-rapl zone)"


@pytest.mark.serial
def test_a_thread_born_mid_interval_counts_its_first_interval(make_cgroup, tmp_path):
    """The job's only busy thread is started between two ticks: its CPU time in its first interval is the job's
    share of that interval (the kernel's cpu.stat against /proc/stat's busy time of its CPU), not zero."""
    root = powercap(tmp_path / "sys")
    probe = EnergyProbe(dataclasses.replace(Host(), sys=str(root)))
    cg = make_cgroup()
    job = cg.spawn(["taskset", "-c", "1", sys.executable, "-c",
                    "import threading, time\ntime.sleep(1.5)\n"
                    "def burn():\n    end = time.time() + 2.5\n    while time.time() < end: pass\n"
                    "t = threading.Thread(target=burn); t.start(); t.join()"])
    time.sleep(0.3)
    probe.start(CgroupTarget(str(cg.path)))
    cpu0, busy0 = cg.cpu_usage_ns(), busy_ticks("/proc")[1]
    e1 = 1_000_000
    try:
        for i in range(3):
            time.sleep(1.0)
            e1 += 10_000_000
            set_uj(root, 1, e1)
            s = probe.sample()
            cpu1, busy1 = cg.cpu_usage_ns(), busy_ticks("/proc")[1]
            share = (cpu1 - cpu0) / ((busy1 - busy0) * TICK_NS) if busy1 > busy0 else 0.0   # the kernel's own
            print(f"energy tick {i}: job {s['cpu_energy_j']:.3f} J of package 1's 10 J; kernel share {share:.3f}")
            assert abs(s["cpu_energy_j"] - 10 * share) <= 0.5 + 0.1 * 10 * share, (i, s, share)
            if i == 1:          # the thread was born in this interval (at ~1.2 s of the 1 s–2 s window)
                assert share > 0.3 and s["cpu_energy_j"] > 3.0
            cpu0, busy0 = cpu1, busy1
    finally:
        job.kill()
        job.wait()
        probe.stop()
