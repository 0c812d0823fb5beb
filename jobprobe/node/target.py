"""What we attach to: a cgroup2 group, a process tree, a SLURM job, a Kubernetes pod, or a command we start ourselves.

A target answers three questions for the probes: which cgroup (if any), which processes now, and is the job still
there. Every file read takes a root so the unit tests run on fixture trees.
"""
from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

from jobprobe.node import tickmemo
from jobprobe.core.errors import BadInput, CommandNotExecutable, CommandNotFound, TargetGone
from jobprobe.kernel.host import find_cgroup2_mount
from jobprobe.kernel import procfs


def read_ppid(proc: str, pid: int) -> int | None:
    """Parent PID, or None if the process is gone or a zombie (it has ended; only its exit status waits to be
    collected)."""
    st = procfs.read_stat(proc, pid)
    return None if st is None or st.state in ("Z", "X") else st.ppid


def list_pids(proc: str) -> list[int]:
    return [int(d) for d in os.listdir(proc) if d.isdigit()]


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

    def close(self) -> None:
        """Release what the target made (a cgroup we created, a child we started). Idempotent."""


class CgroupTarget(Target):
    kind = "cgroup"

    def __init__(self, path: str, mountinfo: str = "/proc/self/mountinfo", job: str | None = None):
        mount = find_cgroup2_mount(mountinfo)
        if mount is None:
            raise BadInput("no cgroup2 hierarchy is mounted on this host (see /proc/self/mountinfo)")
        p = Path(path)
        if not p.is_absolute() or not str(p).startswith(mount.rstrip("/") + "/") and str(p) != mount:
            p = Path(mount, str(path).lstrip("/"))
        if not (p / "cgroup.procs").is_file():
            raise BadInput(f"cgroup {path} does not exist (looked for {p} in the cgroup2 hierarchy at {mount})")
        self.mount = mount
        self.cgroup_path = str(p)
        self.job = job or p.name
        self.files = procfs.OpenFiles()      # each group's cgroup.procs, read every tick
        self._usage: int | None = None       # cpu.stat usage_usec at the last tick that asked quiet()

    def describe(self) -> dict:
        return {"kind": self.kind, "job": self.job, "cgroup": self.cgroup_path}

    def dirs(self) -> list[str]:
        """The job's cgroup and all its descendants (SLURM steps, container sub-groups); walked once per agent tick."""
        return tickmemo.get(("dirs", id(self)), self._dirs_now)

    def _dirs_now(self) -> list[str]:
        # A group without descendants (most jobs) says so in its cgroup.stat, one pread of a kept fd: no walk.
        st = self.files.read(f"{self.cgroup_path}/cgroup.stat")
        if st is not None and "\nnr_descendants 0\n" in "\n" + st:
            return [self.cgroup_path]
        return [root for root, _, _ in os.walk(self.cgroup_path)]   # also [] once the group is removed

    def cgroup_ids(self) -> list[int]:
        """cgroup2 ids as bpf_get_current_cgroup_id() returns them: the directories' inode numbers."""
        ids = []
        for d in self.dirs():
            try:
                ids.append(os.stat(d).st_ino)
            except FileNotFoundError:
                pass
        return ids

    def pids(self) -> list[int]:
        return list(tickmemo.get(("pids", id(self)), self._pids_now))   # once per agent tick

    def _pids_now(self) -> list[int]:
        pids: list[int] = []
        for d in self.dirs():
            pids.extend(int(x) for x in (self.files.read(f"{d}/cgroup.procs") or "").split())
        self.files.sweep()
        return pids

    def quiet(self) -> bool:
        if not tickmemo.active():
            return False
        return tickmemo.get(("quiet", id(self)), self._quiet_now)

    def _quiet_now(self) -> bool:
        # cpu.stat usage_usec (also without the cpu controller) covers the descendants; it moves with any run of a
        # task of the group that reaches a microsecond, and a shorter one is counted by the next tick that reads.
        usage = (self.cpu_stat() or {}).get("usage_usec")
        prev, self._usage = self._usage, usage
        return usage is not None and usage == prev

    def cpu_stat(self) -> dict[str, int] | None:
        # once per agent tick: the cgroup probe's CPU figures and quiet() read the same snapshot
        return tickmemo.get(("cpu.stat", id(self)),
                            lambda: procfs.read_kv(f"{self.cgroup_path}/cpu.stat", self.files.read))

    def refresh(self) -> None:
        if not self.dirs():      # the walk (once per agent tick) finds not even the job's own group
            raise TargetGone(f"cgroup {self.cgroup_path} was removed")

    def close(self) -> None:
        self.files.close()


class PidTreeTarget(Target):
    """A set of root processes and every descendant, including those forked after attach.

    Descendants are found by parent PID; a process stays a member until it exits, even if its parent dies first
    and it is re-parented outside the tree.
    """

    kind = "pids"

    def __init__(self, roots: Iterable[int], proc: str = "/proc", job: str | None = None,
                 extra_roots: Callable[[], Iterable[int]] | None = None):
        self.proc = proc
        self.roots = [int(r) for r in roots]
        missing = [r for r in self.roots if not Path(proc, str(r)).is_dir()]
        if not self.roots or missing:
            raise BadInput(f"process {missing[0] if missing else '(none)'} does not exist")
        self.job = job or f"pid-{self.roots[0]}"
        self._extra_roots = extra_roots
        self._members: set[int] = set(self.roots)
        self._ended: list[int] = []
        self._scan()

    def describe(self) -> dict:
        return {"kind": self.kind, "job": self.job, "roots": self.roots}

    def _scan(self) -> None:
        parent = {p: read_ppid(self.proc, p) for p in list_pids(self.proc)}
        alive = {p for p, pp in parent.items() if pp is not None}
        self._ended = sorted(p for p in self._members if p in parent and parent[p] is None)
        members = self._members & alive
        if self._extra_roots is not None:
            members |= set(self._extra_roots()) & alive
        parent = {p: pp for p, pp in parent.items() if pp is not None and p not in members}
        grew = True
        while grew:  # add children of members until nothing new joins (a fork chain may be deep)
            new = {p for p, pp in parent.items() if pp in members}
            grew = bool(new)
            members |= new
            for p in new:
                del parent[p]
        self._members = members

    def pids(self) -> list[int]:
        return sorted(self._members)

    def ended_pids(self) -> list[int]:
        return self._ended

    def refresh(self) -> None:
        self._scan()
        if not self._members:
            raise TargetGone(f"every process of {self.job} has exited")


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


def cgroup2_path_of(proc: str, pid: int) -> str | None:
    """A process's cgroup2 path ("0::/…" in /proc/PID/cgroup), relative to the cgroup2 mount; None if it is gone."""
    return procfs.cgroup2_path(proc, pid)


def slurm_group_of(proc: str, pid: int, mount: str) -> str | None:
    """The job-level group a SLURM process sits in, read from its own /proc/PID/cgroup: the directory right below
    `slurmstepd.scope` (or `<nodename>_slurmstepd.scope`, multiple-slurmd builds) — `job_<id>`, or the job's SLUID
    where Slurm 26.05+ names groups by it (`…/slurmstepd.scope/s5K1KKYAYG5D00/step_0/…`)."""
    path = cgroup2_path_of(proc, pid)
    parts = Path(path).parts if path else ()
    for i, part in enumerate(parts[:-1]):
        if part.endswith("slurmstepd.scope") and parts[i + 1] != "system":   # `system`: slurmstepd itself
            d = Path(mount, *parts[1:i + 2])
            return str(d) if d.is_dir() else None
    return None


def scontrol_listpids(job_id: str, scontrol: str = "scontrol") -> list[int]:
    return [pid for pid, _ in scontrol_listpids_steps(job_id, scontrol)]


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


def slurm_job_labels(job_id: str, scontrol: str = "scontrol") -> dict[str, str]:
    """The job's names as slurmctld has them (`scontrol -o show job`): what a prolog's environment may lack (array
    ids, account, job name before Slurm 23). {} if scontrol cannot say."""
    try:
        res = subprocess.run([scontrol, "-o", "show", "job", str(job_id)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    line = res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else ""
    if not line.startswith("JobId="):
        return {}
    name = re.search(r" JobName=(.*?) UserId=", line)
    fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
    user = re.match(r"([^()]*)\((\d+)\)", fields.get("UserId", ""))
    out = {"slurm_job_id": fields.get("JobId", ""), "partition": fields.get("Partition", ""),
           "account": fields.get("Account", ""), "job_name": name.group(1) if name else "",
           "array_job_id": fields.get("ArrayJobId", ""), "array_task_id": fields.get("ArrayTaskId", "")}
    if user:
        out["user"], out["uid"] = user.group(1), user.group(2)
    return {k: v for k, v in out.items() if v and v != "(null)"}


SQUEUE_LABELS = ("slurm_job_id", "user", "partition", "account", "job_name", "array_job_id", "array_task_id")


def slurm_running_jobs(node: str, squeue: str = "squeue") -> list[tuple[str, dict[str, str]]]:
    """The jobs running on SLURM node `node`, each with its labels (the names the prolog would have given)."""
    fmt = "%A|%u|%P|%a|%j|%F|%K"
    try:
        out = subprocess.run([squeue, "--noheader", "--nodelist", node, "--states", "RUNNING", "--format", fmt],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BadInput(f"cannot run {squeue}: {err}") from err
    if out.returncode != 0:
        raise BadInput(f"{squeue} failed: {out.stderr.strip()[:200]}")
    jobs = []
    for line in out.stdout.splitlines():
        cols = line.split("|")
        if len(cols) != len(SQUEUE_LABELS) or not cols[0].isdigit():
            continue
        labels = dict(zip(SQUEUE_LABELS, cols))
        if labels["array_task_id"] in ("N/A", ""):      # not an array job
            del labels["array_task_id"], labels["array_job_id"]
        jobs.append((cols[0], {k: v for k, v in labels.items() if v}))
    return jobs


def step_dirs(target: CgroupTarget) -> list[str]:
    """The step ids of a SLURM job's cgroup2 group: its `step_<id>` children (`batch`, `extern`, `0`, …)."""
    top = target.cgroup_path.rstrip("/")
    return sorted(d[len(top) + 6:] for d in target.dirs() if d.startswith(top + "/step_") and "/" not in d[len(top) + 1:])


def with_steps(target: CgroupTarget) -> CgroupTarget:
    target.steps = lambda: step_dirs(target)
    return target


def with_labels(target: Target, job_id: str, scontrol: str) -> Target:
    target.static_labels = slurm_job_labels(job_id, scontrol)
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
        rows = scontrol_listpids_steps(job_id, scontrol)
        steps[:] = sorted({s for _, s in rows})
        return [p for p, _ in rows]

    if mount:
        # No job_<id> group: a layout keyed otherwise (Slurm 26.05 names groups by SLUID) is found from where the
        # job's processes are.
        groups = {slurm_group_of(proc, p, mount) for p in scontrol_listpids(job_id, scontrol)} - {None}
        if len(groups) == 1:
            return with_labels(with_steps(CgroupTarget(groups.pop(), mountinfo=mountinfo, job=name)), job_id,
                               scontrol)
    for _ in range(3):
        # listpids lists every process of the job, also a batch script's short-lived commands, which may exit
        # before we look: keep those still there (else a busy script fails us ~1 time in 5 with "process N does
        # not exist"). The check below can still lose that race, by microseconds; then ask again.
        rows = scontrol_listpids_steps(job_id, scontrol)
        pids = [p for p, _ in rows if Path(proc, str(p)).is_dir()]
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


POD_UID = re.compile(r"[0-9a-f]{8}([-_][0-9a-f]{4}){3}[-_][0-9a-f]{12}")


def k8s_pod_cgroup(uid: str, mount: str, max_depth: int = 8) -> str | None:
    """Where the kubelet put pod `uid`'s group, wherever its root is (kubepods, kubelet.slice/..., a node in a
    container): `pod<uid>` with the cgroupfs driver (kubepods/[burstable|besteffort/]pod<uid>), or
    `kubepods[-burstable|-besteffort]-pod<uid, '_' for '-'>.slice` with the systemd driver. Containers are groups
    below it; the pod's group holds them all."""
    dashed = uid.lower().replace("_", "-")
    names = {f"pod{dashed}", f"pod{dashed.replace('-', '_')}"}

    def is_pod(d: str) -> bool:
        return d in names or (d.endswith(".slice") and d[:-len(".slice")].rsplit("-", 1)[-1] in names)

    base = len(Path(mount).parts)
    for root, subdirs, _ in os.walk(mount):
        hit = next((d for d in subdirs if is_pod(d)), None)
        if hit:
            return str(Path(root, hit))
        # not into other pods' trees (their containers), nor deeper than a kubelet root can sit
        depth = len(Path(root).parts) - base
        subdirs[:] = [] if depth >= max_depth else \
            [d for d in subdirs if not (d.startswith("pod") or "-pod" in d)]
    return None


def k8s_pod_target(uid: str, mountinfo: str = "/proc/self/mountinfo", job: str | None = None) -> CgroupTarget:
    if not POD_UID.fullmatch(uid.lower()):
        raise BadInput(f"not a pod UID: {uid!r} (8-4-4-4-12 hex digits, as "
                       f"`kubectl get pod NAME -o jsonpath='{{.metadata.uid}}'` prints it)")
    mount = find_cgroup2_mount(mountinfo)
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted: pods are found by their cgroup2 group")
    path = k8s_pod_cgroup(uid, mount)
    if path is None:
        raise BadInput(f"pod {uid} has no cgroup2 group on this node (not scheduled here, or already gone)")
    return CgroupTarget(path, mountinfo=mountinfo, job=job or f"pod-{uid.lower().replace('_', '-')}")


def check_runnable(cmd: str, path: str | None = None) -> None:
    """Raise CommandNotFound (127) when `cmd` names no file, CommandNotExecutable (126) when what it names cannot
    be executed: a shell's rules (a name with a slash is a path; else the first match on PATH)."""
    if shutil.which(cmd, path=path) is not None:
        return
    if "/" in cmd:
        candidates = [cmd]
    else:
        dirs = (os.environ.get("PATH", os.defpath) if path is None else path).split(os.pathsep)
        candidates = [os.path.join(d or ".", cmd) for d in dirs]
    for c in candidates:
        if os.path.exists(c):
            why = "is a directory" if os.path.isdir(c) else "permission denied"
            raise CommandNotExecutable(f"cannot run {cmd}: {why}")
    raise CommandNotFound(f"cannot run {cmd}: command not found")


class CommandTarget(CgroupTarget):
    """`-- CMD ARGS…`: a fresh cgroup2 group that we create, CMD started inside it, the group removed at the end."""

    def __init__(self, argv: list[str], mountinfo: str = "/proc/self/mountinfo", job: str | None = None,
                 parent: str = "jobprobe"):
        mount = find_cgroup2_mount(mountinfo)
        if mount is None:
            raise BadInput("no cgroup2 hierarchy is mounted on this host; use --pid instead of -- CMD")
        if not argv:
            raise BadInput("nothing to run after --")
        check_runnable(argv[0])
        name = f"{Path(argv[0]).name}-{os.getpid()}-{int(time.time())}"
        path = Path(mount, parent, name)
        try:
            path.mkdir(parents=True)
        except OSError as err:
            raise BadInput(f"cannot create cgroup {path}: {err.strerror}") from err
        self.argv = argv
        self.proc_handle: subprocess.Popen | None = None
        self._made = path
        super().__init__(str(path), mountinfo=mountinfo, job=job or name)

    def describe(self) -> dict:
        return {**super().describe(), "command": shlex.join(self.argv)}

    def launch(self) -> subprocess.Popen:
        """Start CMD inside the group (the child joins it before exec, so nothing of CMD runs outside)."""
        procs = Path(self.cgroup_path, "cgroup.procs")

        def join() -> None:
            procs.write_text(str(os.getpid()))

        try:
            self.proc_handle = subprocess.Popen(self.argv, preexec_fn=join)
        except OSError as err:
            self.close()
            # ENOENT here is a missing interpreter (#! line) or loader: "not found", as a shell says it
            kind = CommandNotFound if err.errno == errno.ENOENT else CommandNotExecutable
            raise kind(f"cannot run {self.argv[0]}: {err.strerror}") from err
        return self.proc_handle

    def launched_pids(self) -> list[int]:
        return [self.proc_handle.pid] if self.proc_handle is not None else []

    def refresh(self) -> None:
        if self.proc_handle is not None and self.proc_handle.poll() is not None and not self.pids():
            raise TargetGone(f"{self.argv[0]} exited with code {self.proc_handle.returncode}")

    def close(self) -> None:
        if self._made is not None:
            self._remove_group()
        super().close()

    def _remove_group(self) -> None:
        # Processes CMD left behind would keep the group busy: move them to the parent before removing it.
        for pid in self.pids():
            try:
                Path(self._made.parent, "cgroup.procs").write_text(str(pid))
            except OSError:
                pass
        for d in sorted(self.dirs(), key=len, reverse=True):
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)  # a just-exited task may still be leaving the group
        try:
            self._made.parent.rmdir()  # our parent group, if no other jobprobe uses it now
        except OSError:
            pass
        self._made = None
