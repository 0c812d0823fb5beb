# SPDX-License-Identifier: Apache-2.0
"""What a job to attach is: JobSpec, the request a scheduler or a person makes (and what the agent's state file
keeps, one per job), with the target it names; spec_key, the job's name when the request gives none; waitable, whether
its processes may appear after the request (a prolog runs before them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobprobe.contract.target import Target
from jobprobe.core.errors import BadInput


@dataclass
class JobSpec:
    """What a scheduler or a person asked to attach (also what the state file keeps)."""
    cgroup: str | None = None
    pid: int | None = None
    slurm_job: str | None = None
    k8s_pod: str | None = None
    job: str | None = None
    probes: str | None = None
    labels: dict[str, str] | None = None   # the scheduler's names for the job (user, partition, …): in its frames
    from_start: bool = False               # attached as it starts (a prolog): count what it did before the attach
    note: str | None = None                # what the one who asked wants said in status (a refused probe)

    def target(self) -> Target:
        from jobprobe.node.targets.cgroup import CgroupTarget
        from jobprobe.node.targets.k8s import k8s_pod_target
        from jobprobe.node.targets.pidtree import PidTreeTarget
        from jobprobe.node.targets.slurm import slurm_target
        given = [x for x in (self.cgroup, self.pid, self.slurm_job, self.k8s_pod) if x is not None]
        if len(given) != 1:
            raise BadInput("give exactly one of --cgroup PATH, --pid PID, --slurm-job ID, --k8s-pod UID")
        if self.cgroup is not None:
            target: Target = CgroupTarget(self.cgroup, job=self.job)
        elif self.pid is not None:
            target = PidTreeTarget([int(self.pid)], job=self.job)
        elif self.slurm_job is not None:
            target = slurm_target(str(self.slurm_job), job=self.job)
        else:
            target = k8s_pod_target(str(self.k8s_pod), job=self.job)
        target.from_start = self.from_start
        target.static_labels = {**target.static_labels, **(self.labels or {})}   # the scheduler's, then ours
        return target

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        known = {f: d[f] for f in cls.__dataclass_fields__ if d.get(f) is not None}
        for f in ("cgroup", "k8s_pod", "job", "probes", "note", "slurm_job"):
            v = known.get(f)
            if v is not None and not (isinstance(v, str) or f == "slurm_job" and type(v) is int):
                raise BadInput(f"{f} must be a string, got {repr(v)[:40]}")
        if "pid" in known:
            try:
                known["pid"] = int(known["pid"])
            except (TypeError, ValueError):
                raise BadInput(f"pid must be a number, got {known['pid']!r}") from None
        labels = known.get("labels")
        if labels is not None and (not isinstance(labels, dict) or len(labels) > 32 or not all(
                isinstance(k, str) and isinstance(v, (str, int)) and len(k) <= 64 and len(str(v)) <= 256
                for k, v in labels.items())):
            raise BadInput("labels must be a map of at most 32 names (≤ 64 characters) to strings (≤ 256)")
        if labels is not None:
            known["labels"] = {k: str(v) for k, v in labels.items()}
        if not isinstance(known.get("from_start", False), bool):
            raise BadInput(f"from_start must be true or false, got {known['from_start']!r}")
        return cls(**known)


def waitable(spec: JobSpec) -> bool:
    """Targets whose processes may appear after the attach (a SLURM prolog runs before them; a pod's cgroup is
    made when its containers start). A --pid or --cgroup that does not exist is a mistake, said at once."""
    return spec.slurm_job is not None or spec.k8s_pod is not None


def spec_key(spec: JobSpec) -> str:
    if spec.slurm_job is not None:
        return str(spec.slurm_job)
    if spec.k8s_pod is not None:
        return f"pod-{str(spec.k8s_pod).lower().replace('_', '-')}"
    return f"pid-{spec.pid}" if spec.pid is not None else str(spec.cgroup)
