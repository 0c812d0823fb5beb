# SPDX-License-Identifier: Apache-2.0
"""The jobs a node agent takes on with no request: those of the agent before it, kept in the state file (_save writes
it on every change of the job table, restore attaches again those still running), and SLURM's jobs running on the
node whose prolog found no agent (adopt_slurm).

A mixin of Agent (jobprobe/node/agent.py): it uses the agent's cfg, host, lock, jobs, pending, persist and attach.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jobprobe.core.errors import BadInput, UnsafeFile
from jobprobe.core.safefile import Dir
from jobprobe.node.jobspec import JobSpec

log = logging.getLogger("jobprobe.node.agent")


class Adoption:
    """The agent's state file, and the jobs it attaches at start."""

    def _save(self) -> None:
        if not self.persist:
            return
        specs = [asdict(j.spec) for j in self.jobs.values() if j.spec is not None and not j.leaving]
        specs += [asdict(s) for s, _, _ in self.pending.values()]
        path = Path(self.cfg.state)
        try:     # 0600, replaced at once through a temp file made O_EXCL in a directory of ours alone (safefile)
            with Dir(str(path.parent), narrow=False) as d:
                d.write_atomic(path.name, json.dumps({"jobs": specs}).encode())
        except (OSError, UnsafeFile) as err:
            log.error("cannot write %s: %s", path, err)

    def restore(self) -> list[dict[str, Any]]:
        """Attach again the jobs a previous agent had (its state file), those still running; the others go. A file
        that cannot be read as a list of jobs (a crash mid-write, a full disk, a hand edit) is said and replaced:
        the agent starts with the jobs it could read."""
        path = Path(self.cfg.state)
        try:
            with Dir(str(path.parent), narrow=False) as d:
                raw = d.read(path.name)
            if raw is None:
                return []
            data = json.loads(raw)
        except (OSError, ValueError, UnsafeFile) as err:  # (not UTF-8 is a ValueError too)
            log.error("cannot read %s: %s; starting with no jobs", self.cfg.state, err)
            data = {}
        specs = data.get("jobs") if isinstance(data, dict) else None
        if not isinstance(specs, list):
            if data:
                log.error("%s holds no list of jobs; starting with no jobs", self.cfg.state)
            specs = []
        out = []
        for d in specs:
            if not isinstance(d, dict):
                log.warning("not attached again: %s is not a job", repr(d)[:80])
                out.append({"job": None, "state": "gone", "why": "not a job"})
                continue
            try:
                spec = JobSpec.from_dict(d)
                spec.from_start = False    # the agent before this one reported the job's start already
                out.append(self.attach(spec, wait=0))
            except BadInput as err:
                log.warning("not attached again: %s: %s", repr(d)[:200], err)
                out.append({"job": d.get("job"), "state": "gone", "why": str(err)})
        self._save()
        return out

    def adopt_slurm(self, node: str | None = None) -> list[dict[str, Any]]:
        """Attach the SLURM jobs running on this node that no one asked for: those whose prolog found no agent
        (down, restarting). They count from now (their hello says so): their start was missed."""
        from jobprobe.node.targets.slurm import slurm_running_jobs
        try:
            running = slurm_running_jobs(node or self.cfg.slurm_node or self.host.node.split(".")[0])
        except BadInput as err:
            log.warning("cannot list this node's SLURM jobs: %s", err)
            return []
        out = []
        for job_id, labels in running:
            with self.lock:
                if job_id in self.jobs or job_id in self.pending:
                    continue
            try:
                out.append(self.attach(JobSpec(slurm_job=job_id, job=job_id, labels=labels), wait=0))
            except BadInput as err:
                out.append({"job": job_id, "state": "not attached", "why": str(err)})
        return out
