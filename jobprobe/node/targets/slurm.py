# SPDX-License-Identifier: Apache-2.0
"""SLURM jobs: `slurm_target()` (the job's cgroup2 group, found by its `job_<id>` name or from where its processes
sit, else its process tree), the scontrol / squeue helpers (`scontrol listpids`, the job's labels from squeue,
`slurm_running_jobs()` for a node), and the job's steps (`step_<id>` groups, or listpids' step column).
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from jobprobe.contract.target import Target
from jobprobe.core.errors import BadInput
from jobprobe.kernel import procfs
from jobprobe.kernel.host import find_cgroup2_mount
from jobprobe.node.targets.cgroup import CgroupTarget
from jobprobe.node.targets.pidtree import PidTreeTarget

log = logging.getLogger("jobprobe.node.slurm")


def slurm_job_cgroup(job_id: str, mount: str) -> str | None:
    """Where SLURM's cgroup/v2 plugin puts a job: .../system.slice/slurmstepd.scope/job_<id> (or any job_<id>)."""
    for cand in (Path(mount, "system.slice", "slurmstepd.scope", f"job_{job_id}"),):
        if cand.is_dir():
            return str(cand)
    for root, subdirs, _ in os.walk(mount):
        if f"job_{job_id}" in subdirs:
            return str(Path(root, f"job_{job_id}"))
        # don't descend into other jobs' trees
        subdirs[:] = [d for d in subdirs if not d.startswith("job_")]
    return None


def slurm_group_of(proc: str, pid: int, mount: str) -> str | None:
    """The job-level group a SLURM process sits in, read from its own /proc/PID/cgroup: the directory right below
    `slurmstepd.scope` (or `<nodename>_slurmstepd.scope`, multiple-slurmd builds) — `job_<id>`, or the job's SLUID
    where Slurm 26.05+ names groups by it (`…/slurmstepd.scope/s5K1KKYAYG5D00/step_0/…`)."""
    path = procfs.cgroup2_path(proc, pid)
    parts = Path(path).parts if path else ()
    for i, part in enumerate(parts[:-1]):
        if part.endswith("slurmstepd.scope") and parts[i + 1] != "system":   # `system`: slurmstepd itself
            d = Path(mount, *parts[1:i + 2])
            return str(d) if d.is_dir() else None
    return None


def scontrol_listpids_steps(job_id: str, scontrol: str = "scontrol") -> list[tuple[int, str]]:
    """(pid, step id) of each process of the job on this node: `batch`, `extern`, `0`, … ([] if none)."""
    try:
        out = subprocess.run([scontrol, "listpids", str(job_id)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BadInput(f"cannot run {scontrol} to find SLURM job {job_id}: {err}") from err
    if out.returncode != 0:
        return []
    rows = []
    for line in out.stdout.splitlines()[1:]:  # header: PID JOBID STEPID LOCALID GLOBALID
        cols = line.split()
        if cols and cols[0].isdigit():
            rows.append((int(cols[0]), cols[2] if len(cols) > 2 else "?"))
    return rows


PF_KTHREAD = 0x00200000      # a kernel thread (include/linux/sched.h), in /proc/PID/stat's flags


def of_the_job(rows: list[tuple[int, str]], job_id: str, proc: str = "/proc") -> list[tuple[int, str]]:
    """listpids' rows, unless they name PID 1 or a kernel thread — never a job's process: with proctrack/linuxproc,
    listpids walks the process tree down from the step's slurmstepd, and as a batch script ends (its task's PID
    listed as -1) SLURM 22.05 here answered once in six short jobs with every process on the node (78 of them, PID 1,
    2, 3… first), whose whole lives' CPU then counted as the job's (637 s in a job that burned 1 s). Such an answer
    is said in one line and none of it is used ([])."""
    def kernel_thread(pid: int) -> bool:
        st = procfs.read_stat(proc, pid)
        return st is not None and bool(st.flags & PF_KTHREAD)
    bad = [p for p, _ in rows if p == 1 or kernel_thread(p)]
    if bad:
        log.warning("scontrol listpids %s named %d processes, PID %d among them (%s): not the job's; not used",
                    job_id, len(rows), bad[0], "init" if bad[0] == 1 else "a kernel thread")
        return []
    return rows


# squeue's fields that no job's owner writes (ids, user, partition, account): a line of them cannot be forged by a job
# name, comment or path — a name may hold "|", spaces, "JobId=…" or a newline and a whole made-up line, which SLURM
# prints as it is (`scontrol -o show job` took JobId=999 and array ids from a job's name; squeue's line split by a
# name's newline left the job unadopted and another line in its place). The name is asked for alone (_with_name).
SQUEUE_FORMAT = "%A|%F|%K|%u|%U|%P|%a"
SQUEUE_LABELS = ("slurm_job_id", "array_job_id", "array_task_id", "user", "uid", "partition", "account")


def _squeue(squeue: str, *args: str) -> str:
    try:
        out = subprocess.run([squeue, "--noheader", *args], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BadInput(f"cannot run {squeue}: {err}") from err
    if out.returncode != 0:
        raise BadInput(f"{squeue} failed: {out.stderr.strip()[:200]}")
    return out.stdout


def _squeue_jobs(squeue: str, *args: str) -> list[dict[str, str]]:
    """squeue's jobs (SQUEUE_FORMAT) as label maps; a line that is not one of its jobs' is skipped."""
    jobs = []
    for line in _squeue(squeue, *args, "--format", SQUEUE_FORMAT).splitlines():
        cols = line.split("|")
        if len(cols) != len(SQUEUE_LABELS) or not cols[0].isdigit():
            continue
        labels = dict(zip(SQUEUE_LABELS, cols))
        if not labels["array_task_id"].isdigit():       # not an array task (N/A)
            del labels["array_task_id"], labels["array_job_id"]
        jobs.append({k: v for k, v in labels.items() if v and v != "(null)"})
    return jobs


def _with_name(labels: dict[str, str], squeue: str) -> dict[str, str]:
    """The labels and the job's name, asked for alone: the whole of squeue's answer for it (newlines and all)."""
    try:
        name = _squeue(squeue, "--jobs", labels["slurm_job_id"], "--format", "%j")
    except BadInput:             # ended since
        return labels
    name = name[:-1] if name.endswith("\n") else name
    return {**labels, "job_name": name} if name and name != "(null)" else labels


def slurm_job_labels(job_id: str, squeue: str = "squeue") -> dict[str, str]:
    """The job's names as slurmctld has them (squeue): what a prolog's environment may lack (array ids, account,
    job name before Slurm 23). {} if squeue cannot say."""
    try:
        jobs = [j for j in _squeue_jobs(squeue, "--jobs", str(job_id)) if j["slurm_job_id"] == str(job_id)]
    except BadInput:
        return {}
    return _with_name(jobs[0], squeue) if jobs else {}


def slurm_running_jobs(node: str, squeue: str = "squeue") -> list[tuple[str, dict[str, str]]]:
    """The jobs running on SLURM node `node`, each with its labels (the names the prolog would have given)."""
    return [(labels["slurm_job_id"], _with_name(labels, squeue))
            for labels in _squeue_jobs(squeue, "--nodelist", node, "--states", "RUNNING")]


def step_dirs(target: CgroupTarget) -> list[str]:
    """The step ids of a SLURM job's cgroup2 group: its `step_<id>` children (`batch`, `extern`, `0`, …)."""
    top = target.cgroup_path.rstrip("/")
    return sorted(d[len(top) + 6:] for d in target.dirs()
                  if d.startswith(top + "/step_") and "/" not in d[len(top) + 1:])


def with_steps(target: CgroupTarget) -> CgroupTarget:
    target.steps = lambda: step_dirs(target)
    return target


# squeue's state, reason and restart count of one job (-O: fields no job's owner writes, `|` after each)
STATE_FORMAT = "JobID:|,State:|,Reason:|,RestartCnt:|"
# SLURM's base states and reasons that name why the scheduler ended a job (squeue's words for them)
SCHEDULER_STATES = {"TIMEOUT": "timeout", "PREEMPTED": "preempted", "NODE_FAIL": "node_fail"}
SCHEDULER_REASONS = {"TimeLimit": "timeout", "NodeDown": "node_fail"}


def slurm_job_state(job_id: str, squeue: str = "squeue") -> dict[str, str]:
    """The job's state, reason and restart count as slurmctld has them now: {"state", "reason", "restarts"}, {}
    where squeue cannot say (the job purged, squeue failing)."""
    try:
        out = _squeue(squeue, "--jobs", str(job_id), "--states", "all", "-O", STATE_FORMAT)
    except BadInput:
        return {}
    for line in out.splitlines():
        cols = line.split("|")
        if len(cols) >= 4 and cols[0] == str(job_id) and cols[3].isdigit():
            return {"state": cols[1], "reason": cols[2], "restarts": cols[3]}
    return {}


def scheduler_cause(now: dict[str, str], restarts0: str | None) -> dict[str, str]:
    """Why the scheduler ended the job, from its state as its processes ended (`now`) and its restart count when it
    was attached: a time limit (Reason=TimeLimit while it completes, then state TIMEOUT), a requeue (its restart
    count grew — `scontrol requeue`, a preemption that requeues — or it is pending again), a preemption or a node
    failure where the state says it. SLURM 22.05 shows a job as COMPLETING with no reason until its epilogs are done:
    a preemption that cancels reads as the signal it sent."""
    if not now:
        return {}
    words = f"{now['state']}/{now['reason']}"
    if restarts0 is not None and int(now["restarts"]) > int(restarts0) or now["state"].startswith(("PENDING",
                                                                                                   "REQUEUE")):
        return {"cause": "requeued", "scheduler": f"{words}, restarts {now['restarts']}"}
    cause = SCHEDULER_STATES.get(now["state"]) or SCHEDULER_REASONS.get(now["reason"])
    return {"cause": cause, "scheduler": words} if cause else {}


def with_labels(target: Target, job_id: str, scontrol: str) -> Target:
    """The job's labels from squeue (the one beside `scontrol`, where that is a path), and its scheduler's word at
    its end (scheduler_cause; its restart count now, to tell a requeue)."""
    squeue = str(Path(scontrol).with_name("squeue")) if "/" in scontrol else "squeue"
    target.static_labels = slurm_job_labels(job_id, squeue)
    restarts0 = slurm_job_state(job_id, squeue).get("restarts")
    target.scheduler_end = lambda: scheduler_cause(slurm_job_state(job_id, squeue), restarts0)  # type: ignore[method-assign]
    return target


def slurm_target(job_id: str, mountinfo: str = "/proc/self/mountinfo", proc: str = "/proc",
                 scontrol: str = "scontrol", job: str | None = None) -> Target:
    """The SLURM job's cgroup2 group, else its processes; named `job`, else by its id."""
    name = job or str(job_id)
    if not str(job_id).isdigit():
        raise BadInput(f"SLURM job id must be a number, got {job_id!r}")
    mount = find_cgroup2_mount(mountinfo)
    if mount:
        cg = slurm_job_cgroup(job_id, mount)
        if cg:
            return with_labels(with_steps(CgroupTarget(cg, mountinfo=mountinfo, job=name)), job_id, scontrol)
    # New steps are started by slurmstepd, outside the tree: ask scontrol again at most every 5 s.
    last = [time.monotonic()]
    steps: list[str] = []

    def more() -> list[int]:
        if time.monotonic() - last[0] < 5:
            return []
        last[0] = time.monotonic()
        rows = of_the_job(scontrol_listpids_steps(job_id, scontrol), job_id, proc)
        steps[:] = sorted({s for _, s in rows}) or steps
        return [p for p, _ in rows]

    if mount:
        # No job_<id> group: a layout keyed otherwise (Slurm 26.05 names groups by SLUID) is found from where the
        # job's processes are.
        groups = {slurm_group_of(proc, p, mount)
                  for p, _ in of_the_job(scontrol_listpids_steps(job_id, scontrol), job_id, proc)} - {None}
        if len(groups) == 1:
            return with_labels(with_steps(CgroupTarget(groups.pop(), mountinfo=mountinfo, job=name)), job_id,
                               scontrol)
    for _ in range(3):
        # listpids lists every process of the job, also a batch script's short-lived commands, which may exit
        # before we look: keep those still there (else a busy script fails us ~1 time in 5 with "process N does
        # not exist"). The check below can still lose that race, by microseconds; then ask again.
        listed = scontrol_listpids_steps(job_id, scontrol)
        rows = of_the_job(listed, job_id, proc)
        pids = [p for p, _ in rows if Path(proc, str(p)).is_dir()]
        if listed and not rows:
            continue                       # an answer not used (every process on the node): ask again
        if not pids:
            break
        steps[:] = sorted({s for _, s in rows})
        try:
            target = PidTreeTarget(pids, proc=proc, job=name, extra_roots=more)
        except BadInput:
            continue
        target.steps = lambda: list(steps)
        return with_labels(target, job_id, scontrol)
    raise BadInput(f"SLURM job {job_id} does not exist or has no processes on this node")
