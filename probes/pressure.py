# SPDX-License-Identifier: Apache-2.0
"""pressure — how long the job stalled, by the kernel's own pressure stall information (PSI) for the job's cgroup2
group: time in which at least one of its tasks (`some`), or all of its non-idle tasks at once (`full`), waited for a
CPU, for memory (reclaim, refaults of its working set, swap-in, compaction, throttling at memory.high) or for I/O;
and the time IRQ handling took from it (`irq`, full only). `full` time is time the job made no progress at all.

Hooks: cpu.pressure, memory.pressure, io.pressure, irq.pressure in the job's group (their `total=` stall time, µs),
descendants included (a job's steps and containers count). Kernel: 4.20+ with CONFIG_PSI, not booted with psi=0
(/proc/pressure then exists); cgroup cpu `full` 5.13+; irq.pressure 6.1+ with CONFIG_IRQ_TIME_ACCOUNTING (else
null). A hybrid host's cgroup2 groups report PSI although the controllers sit on v1. Needs a cgroup target: a
process tree has no group of its own, and the node-wide /proc/pressure is not the job's. Cost: four small reads
per tick (three in a tick the job used no CPU: its IRQ time cannot have moved), no root.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.kernel import procfs
from jobprobe.kernel.host import Host

RESOURCES = {"cpu": "a CPU (runnable, not running)", "mem": "memory", "io": "I/O", "irq": "IRQ handling"}
FILES = {"cpu": "cpu.pressure", "mem": "memory.pressure", "io": "io.pressure", "irq": "irq.pressure"}


def read_pressure(path: Path | str, read: Callable[[str], str | None] = procfs.read_small) -> dict[str, int] | None:
    """{"some": total µs, "full": total µs} of a *.pressure file (lines `some avg10=… total=N`); None if absent.
    The probe reads through its OpenFiles: this runs four times a job a tick."""
    text = read(str(path))
    if text is None:
        return None
    out = {}
    for line in text.split("\n"):
        at = line.rfind(" total=")
        if at > 0 and line[at + 7:].isdigit():
            out[line[:line.find(" ")]] = int(line[at + 7:])
    return out


def fields() -> dict[str, Field]:
    out = {}
    for res, what in RESOURCES.items():
        for kind in ("some", "full"):
            if (res, kind) == ("irq", "some"):
                continue            # the kernel keeps only `full` for IRQ time
            who = "at least one of the job's tasks" if kind == "some" else "all of the job's non-idle tasks at once"
            out[f"{res}_{kind}_ns"] = Field("int", "ns", f"time {who} waited for {what} this interval "
                                            "(PSI total delta; null: this kernel does not report it)")
    return out


class PressureProbe(Probe):
    name = "pressure"
    default = True
    summary = "how long the job stalled for CPU, memory, I/O, IRQ (the kernel's PSI for the job's cgroup2 group)"
    fields = fields()

    def __init__(self, host: Host | None = None):
        super().__init__(host)
        self.dir: Path | None = None
        self.target: Target | None = None
        self.paths: dict[str, str] = {}
        self.prev: dict[str, int | None] = {}
        self.files = procfs.OpenFiles()

    def check(self, host: Host) -> str | None:
        if not Path(host.proc, "pressure", "cpu").exists():
            return "the kernel keeps no pressure stall information (CONFIG_PSI off, or booted with psi=0)"
        return super().check(host)

    def start(self, target: Target) -> None:
        if not target.cgroup_path:
            raise ProbeUnavailable("needs a cgroup target (--cgroup, --k8s-pod, -- CMD, a SLURM job with a group): "
                                   "a process tree has no pressure figures of its own")
        self.dir = Path(target.cgroup_path)
        self.target = target
        if read_pressure(self.dir / FILES["cpu"]) is None:
            raise ProbeUnavailable(f"cannot read {self.dir / FILES['cpu']} (PSI disabled for cgroups?)")
        # files this kernel does not have (irq before 6.1) are not looked for again every tick
        self.paths = {res: f"{self.dir}/{name}" for res, name in FILES.items() if (self.dir / name).exists()}
        self.prev = self._read()

    def _read(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        # IRQ time is charged to the group of the task the interrupt took it from: none while no task of the job
        # ran since the last tick (Target.quiet), so irq.pressure is not read then (the next read has the rest).
        quiet = self.target is not None and self.target.quiet() and self.prev.get("irq_full_ns") is not None
        for res in FILES:
            if res == "irq" and quiet:
                out["irq_full_ns"] = self.prev["irq_full_ns"]
                continue
            got = read_pressure(self.paths[res], self.files.read) if res in self.paths else None
            if got is None and res == "cpu" and not (self.dir / "cgroup.procs").exists():
                raise TargetGone(f"cgroup {self.dir} was removed")   # (else PSI turned off for it: nulls)
            for kind in ("some", "full"):
                if f"{res}_{kind}_ns" in self.fields:
                    out[f"{res}_{kind}_ns"] = None if got is None or kind not in got else got[kind] * 1000
        return out

    def sample(self) -> dict:
        if self.dir is None:
            return {}
        cur = self._read()
        self.files.sweep()
        prev, self.prev = self.prev, cur
        return {k: None if v is None or prev.get(k) is None else delta(v, prev[k]) for k, v in cur.items()}

    def stop(self) -> None:
        self.dir, self.paths, self.target = None, {}, None
        self.files.close()
