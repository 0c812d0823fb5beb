# SPDX-License-Identifier: Apache-2.0
"""`Target`: what a probe is given — a job we watch, answering three questions: which cgroup (if any), which
processes now, and is the job still there. The kinds of target are the other modules of this package; a probe
imports only this one.
"""
from __future__ import annotations

from typing import Callable

from jobprobe.kernel import procfs


class Target:
    """Base: a job we watch. kind is "cgroup" (membership by cgroup2 id) or "pids" (membership by tgid)."""

    kind = "pids"
    job = "job"
    cgroup_path: str | None = None
    from_start = False                   # attached as the job starts (a prolog): probes that can count from zero do
    static_labels: dict[str, str] = {}   # who the job is, as its scheduler names it (frames' `labels`)
    steps: Callable[[], list[str]] | None = None   # the scheduler's steps running now (SLURM), for `labels`

    def describe(self) -> dict:
        return {"kind": self.kind, "job": self.job}

    def labels(self) -> dict[str, str]:
        """The frames' `labels`: what the scheduler said of the job, and the steps running now."""
        out = dict(self.static_labels)
        if self.steps is not None:
            steps = self.steps()
            if steps:
                out["slurm_steps"] = ",".join(steps)
        return out

    def pids(self) -> list[int]:
        raise NotImplementedError

    def ended_pids(self) -> list[int]:
        """Members that have exited but are not yet reaped (zombies): gone from pids(), but /proc still holds
        their final CPU and I/O totals, so a probe can count their last interval."""
        return []

    def launched_pids(self) -> list[int]:
        """Processes this target started itself (`-- CMD`'s child): the job's even when they are born and gone
        before any tick reads the group, so a probe can claim their exit records (a job shorter than a tick)."""
        return []

    def cpu_stat(self) -> dict[str, int] | None:
        """The job's group's cpu.stat ({key: int}; usage_usec, user_usec, system_usec, and nr_periods … with the
        cpu controller); None without a group, or once it is gone."""
        return procfs.read_kv(f"{self.cgroup_path}/cpu.stat") if self.cgroup_path else None

    def quiet(self) -> bool:
        """True when no task of the job has run since the previous agent tick: counters that only move while one
        of its tasks runs (perf_event counts of its group, the threads' own I/O accounts) cannot have moved, so a
        probe may skip reading them this tick — what a task does in a run too short to show is in the next read,
        never lost. False where that is not known (outside a tick, a process tree)."""
        return False

    def refresh(self) -> None:
        """Called once per tick before the probes sample; raises TargetGone when the job has ended."""

    def exit_status(self) -> dict[str, int]:
        """How the job's lead process ended, where this target knows it: {"exit_code": 0..255} or {"signal": N};
        {} where it does not (a group or tree it did not start) or it has not ended."""
        return {}

    def scheduler_end(self) -> dict[str, str]:
        """Asked once the job ended: the scheduler's cause where it ended the job — {"cause": "timeout" | "requeued" |
        "preempted" | "node_fail", "scheduler": its words} (core/ends.py) —, {} where it did not or cannot say."""
        return {}

    def close(self) -> None:
        """Release what the target made (a cgroup we created, a child we started). Idempotent."""
