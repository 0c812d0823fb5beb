# SPDX-License-Identifier: Apache-2.0
"""The jobs a node agent takes on with no request: those of the agent before it, kept in the state file (StateFile:
written on every change of the job table; restore() attaches again those still running), and SLURM's jobs running
on the node whose prolog found no agent (adopt_slurm).

Parts the Agent holds or calls, with what they need passed in: the state file's path; `attach(spec)` (the agent's
attach, wait=0) and `known(job)` (whether the agent has the job already).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable

from jobprobe.core.errors import BadInput, UnsafeFile
from jobprobe.core.safefile import Dir
from jobprobe.node.jobspec import JobSpec

log = logging.getLogger("jobprobe.node.agent")


class StateFile:
    """The agent's jobs, as specs, in one JSON file: 0600, replaced at once (a temp file made O_EXCL in a directory
    of the agent's alone: core/safefile.py)."""

    def __init__(self, path: str):
        self.path = Path(path)

    def save(self, specs: Iterable[JobSpec]) -> None:
        try:
            with Dir(str(self.path.parent), narrow=False) as d:
                d.write_atomic(self.path.name, json.dumps({"jobs": [asdict(s) for s in specs]}).encode())
        except (OSError, UnsafeFile) as err:
            log.error("cannot write %s: %s", self.path, err)

    def load(self) -> list[Any]:
        """The entries the file holds (each meant to be a job spec); [] without a file. A file that cannot be read
        as a list of jobs (a crash mid-write, a full disk, a hand edit) is said: the agent starts with none."""
        try:
            with Dir(str(self.path.parent), narrow=False) as d:
                raw = d.read(self.path.name)
            if raw is None:
                return []
            data = json.loads(raw)
        except (OSError, ValueError, UnsafeFile) as err:  # (not UTF-8 is a ValueError too)
            log.error("cannot read %s: %s; starting with no jobs", self.path, err)
            data = {}
        specs = data.get("jobs") if isinstance(data, dict) else None
        if not isinstance(specs, list):
            if data:
                log.error("%s holds no list of jobs; starting with no jobs", self.path)
            return []
        return specs


def restore(entries: list[Any], attach: Callable[[JobSpec], dict[str, Any]]) -> list[dict[str, Any]]:
    """Attach again the jobs a previous agent had, those still running; the others go (said, with why)."""
    out = []
    for d in entries:
        if not isinstance(d, dict):
            log.warning("not attached again: %s is not a job", repr(d)[:80])
            out.append({"job": None, "state": "gone", "why": "not a job"})
            continue
        try:
            spec = JobSpec.from_dict(d)
            spec.from_start = False    # the agent before this one reported the job's start already
            out.append(attach(spec))
        except BadInput as err:
            log.warning("not attached again: %s: %s", repr(d)[:200], err)
            out.append({"job": d.get("job"), "state": "gone", "why": str(err)})
    return out


def adopt_slurm(node: str, known: Callable[[str], bool],
                attach: Callable[[JobSpec], dict[str, Any]]) -> list[dict[str, Any]]:
    """Attach the SLURM jobs running on this node that no one asked for: those whose prolog found no agent
    (down, restarting). They count from now (their hello says so): their start was missed."""
    from jobprobe.node.targets.slurm import slurm_running_jobs
    try:
        running = slurm_running_jobs(node)
    except BadInput as err:
        log.warning("cannot list this node's SLURM jobs: %s", err)
        return []
    out = []
    for job_id, labels in running:
        if known(job_id):
            continue
        try:
            out.append(attach(JobSpec(slurm_job=job_id, job=job_id, labels=labels)))
        except BadInput as err:
            out.append({"job": job_id, "state": "not attached", "why": str(err)})
    return out
