# SPDX-License-Identifier: Apache-2.0
"""energy — the energy the job's CPU work drew, from the kernel's RAPL counters (powercap), per interval.

Method: each RAPL package zone (`/sys/class/powercap/intel-rapl:N`, the AMD driver's zones have the same names)
counts the package's energy in µJ, and its `dram` subzone the memory's; a counter wraps at its
`max_energy_range_uj` (a 32-bit MSR: every few minutes on a busy server), which a delta accounts for. The job's
share of a package is its CPU time on that package's CPUs over all the busy CPU time there in the interval: each of
the job's threads' user + system ticks (/proc/PID/task/TID/stat) counted on the package of the CPU it last ran on,
against the busy ticks of the package's CPUs in /proc/stat (CPU → package from
/sys/devices/system/cpu/cpuN/topology/physical_package_id). The job's energy is Σ package delta × share (and the
same for DRAM). Idle power is split among whatever ran, by busy time: a job alone on a package pays for all of it.
GPU energy is the gpu probe's (its `job_energy_mj`).

Hooks: sysfs and procfs reads. Needs root (energy_uj is root-only since Linux 5.10). Kernel: 3.13+ (powercap).
Cost: one read per zone, one /proc/stat, one stat per job thread per tick.
Limits: a thread that moved between packages in the interval is counted where it was last; packages only (no
per-core zones); a VM without RAPL (this machine) has no figures.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any

from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import procfs
from jobprobe.kernel.host import Host

ZONE = re.compile(r"^(intel|amd)-rapl:(\d+)$")


class Package:
    def __init__(self, path: str, pkg: int, max_uj: int, dram: str | None, dram_max: int):
        self.path, self.pkg, self.max_uj, self.dram, self.dram_max = path, pkg, max_uj, dram, dram_max


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def packages(sys_root: str) -> list[Package]:
    out = []
    for d in sorted(glob.glob(f"{sys_root}/class/powercap/*")):
        m = ZONE.match(os.path.basename(d))
        if not m:
            continue
        name = (open(f"{d}/name").read().strip() if os.path.exists(f"{d}/name") else "")
        pkg = int(name.split("-")[1]) if re.match(r"^package-\d+$", name) else int(m.group(2))
        dram, dram_max = None, 0
        for sub in sorted(glob.glob(f"{d}/{os.path.basename(d)}:*")):
            if os.path.exists(f"{sub}/name") and open(f"{sub}/name").read().strip() == "dram":
                dram, dram_max = f"{sub}/energy_uj", _read_int(f"{sub}/max_energy_range_uj") or 0
        out.append(Package(f"{d}/energy_uj", pkg, _read_int(f"{d}/max_energy_range_uj") or 0, dram, dram_max))
    return out


def wrapped(now: int, before: int, max_uj: int) -> int:
    """A counter's delta across at most one wrap at max_uj (its range, as the zone says it)."""
    return now - before if now >= before else now + (max_uj - before) + 1 if max_uj else 0


def cpu_packages(sys_root: str) -> dict[int, int]:
    out = {}
    for p in glob.glob(f"{sys_root}/devices/system/cpu/cpu[0-9]*/topology/physical_package_id"):
        cpu = int(re.search(r"cpu(\d+)/topology", p).group(1))
        v = _read_int(p)
        if v is not None:
            out[cpu] = v
    return out


def busy_ticks(proc: str) -> dict[int, int]:
    """cpu → busy ticks from /proc/stat: user + nice + system + irq + softirq (not idle, iowait, or steal — time
    the CPU was not running anything here; guest time is inside user already)."""
    out = {}
    with open(f"{proc}/stat") as f:
        for line in f:
            m = re.match(r"^cpu(\d+) (.*)", line)
            if m:
                v = [int(x) for x in m.group(2).split()] + [0] * 7
                out[int(m.group(1))] = v[0] + v[1] + v[2] + v[5] + v[6]
    return out


class EnergyProbe(Probe):
    name = "energy"
    default = True
    needs_root = True
    summary = "the CPU package and DRAM energy the job's CPU time drew (RAPL powercap counters, by its CPU share)"
    fields = {
        "cpu_energy_j": Field("float", "J", "the job's share of the CPU packages' energy this interval: Σ package "
                              "delta × the job's share of that package's busy CPU time", kind="counter"),
        "dram_energy_j": Field("float", "J", "the job's share of the DRAM zones' energy, by the same shares "
                               "(absent where RAPL has no dram zone)", kind="counter"),
        "package_energy_j": Field("float", "J", "every package's energy this interval, the job's or not",
                                  kind="counter"),
        "cpu_share": Field("float", "ratio", "the job's CPU time over the packages' busy CPU time this interval",
                           kind="gauge"),
        "packages": Field("int", "count", "RAPL package zones read", kind="gauge"),
    }

    def __init__(self, host: Host | None = None):
        super().__init__(host)
        self.target: Target | None = None
        self.pkgs: list[Package] = []
        self.cpu_pkg: dict[int, int] = {}
        self.prev: dict[str, int] = {}
        self.threads: dict[tuple[int, int], int] = {}     # (pid, tid) → utime + stime at the last tick
        self.primed = False                                 # a first reading (the baseline) has been taken
        self.busy: dict[int, int] = {}

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        if not packages(host.sys):
            return f"no RAPL ({host.sys}/class/powercap has no intel-rapl or amd-rapl zone)"
        return None

    def start(self, target: Target) -> None:
        self.target = target
        self.pkgs = packages(self.host.sys)
        self.cpu_pkg = cpu_packages(self.host.sys)
        if not self.pkgs:
            raise ProbeUnavailable("no RAPL package zone")
        self.prev = self._counters()
        if any(v is None for v in self.prev.values()):
            raise ProbeUnavailable("RAPL energy_uj not readable (root only since Linux 5.10)")
        self.busy = busy_ticks(self.host.proc)
        self.primed = False
        self._job_ticks()

    def _counters(self) -> dict[str, int]:
        out = {}
        for p in self.pkgs:
            out[p.path] = _read_int(p.path)
            if p.dram:
                out[p.dram] = _read_int(p.dram)
        return out

    def _job_ticks(self) -> dict[int, int]:
        """package → the job's ticks since the last call (each thread on the package of the CPU it last ran on)."""
        out: dict[int, int] = {}
        now: dict[tuple[int, int], int] = {}
        for pid in self.target.pids():
            try:
                tids = os.listdir(f"{self.host.proc}/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                st = procfs.read_stat(self.host.proc, f"{pid}/task/{tid}")
                if st is None:
                    continue
                key = (pid, int(tid))
                now[key] = st.utime + st.stime
                d = now[key] - self.threads.get(key, 0)      # a thread not seen before was born since
                pkg = self.cpu_pkg.get(st.processor, 0)
                out[pkg] = out.get(pkg, 0) + max(0, d)
        first, self.primed = not self.primed, True
        self.threads = now
        return {} if first else out

    def sample(self) -> dict[str, Any]:
        if self.target is None:
            return {}
        cur, busy = self._counters(), busy_ticks(self.host.proc)
        job = self._job_ticks()
        pkg_busy: dict[int, int] = {}
        for cpu, b in busy.items():
            pkg = self.cpu_pkg.get(cpu, 0)
            pkg_busy[pkg] = pkg_busy.get(pkg, 0) + max(0, b - self.busy.get(cpu, b))
        out = {"cpu_energy_j": 0.0, "package_energy_j": 0.0, "packages": len(self.pkgs)}
        dram = None
        job_all = sum(job.values())
        for p in self.pkgs:
            share = min(1.0, job.get(p.pkg, 0) / pkg_busy[p.pkg]) if pkg_busy.get(p.pkg) else 0.0
            d = wrapped(cur[p.path], self.prev[p.path], p.max_uj) / 1e6
            out["package_energy_j"] += d
            out["cpu_energy_j"] += d * share
            if p.dram and cur.get(p.dram) is not None and self.prev.get(p.dram) is not None:
                dram = (dram or 0.0) + wrapped(cur[p.dram], self.prev[p.dram], p.dram_max) / 1e6 * share
        if dram is not None:
            out["dram_energy_j"] = round(dram, 6)
        total_busy = sum(pkg_busy.values())
        out["cpu_share"] = round(min(1.0, job_all / total_busy), 4) if total_busy else 0.0
        out["cpu_energy_j"] = round(out["cpu_energy_j"], 6)
        out["package_energy_j"] = round(out["package_energy_j"], 6)
        self.prev, self.busy = cur, busy
        return out

    def stop(self) -> None:
        self.target = None
