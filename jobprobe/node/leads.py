# SPDX-License-Identifier: Apache-2.0
"""`Leads`: how a job's lead processes ended, for targets that did not start them (a cgroup, a SLURM job, a pod, a
process tree): the kernel's exit records (taskstats, jobprobe/kernel/taskstats.py) of the processes that lead the
job — those whose parent was not the job's when the agent first saw them (a batch script under slurmstepd, a
container's entry point, the command a prolog's group was made for). Their wait status is what their parent's
wait() got; a job whose leads all exited 0 ended well.

Cost per tick: a set difference of the job's processes with the last tick's; one /proc/PID/stat read per new process;
the exit records that came since the last tick, filtered by thread-group leader. Without root or taskstats, no
status: the end says `exited`.
"""
from __future__ import annotations

from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel.procfs import read_ppid
from jobprobe.kernel.taskstats import ExitFeed, Subscription

MAX_LEADS = 4096       # a job that keeps making processes whose parent left it still holds a bounded set


class Leads:
    def __init__(self, proc: str = "/proc", root: bool = True):
        self.proc = proc
        self.sub: Subscription | None = None
        if root:
            try:
                self.sub = ExitFeed.subscribe()
            except ProbeUnavailable:
                self.sub = None
        self.seen: frozenset[int] = frozenset()
        self.leads: set[int] = set()
        # the job's status from its leads' ends as they come: the first bad one, else the last (bounded, however
        # many leads a long job has)
        self.first_bad: dict[str, int] | None = None
        self.last: dict[str, int] | None = None

    def update(self, pids: list[int]) -> None:
        """The job's processes now (once per tick): new ones whose parent is not the job's are leads; the exit
        records since the last call give the leads' ends."""
        now = frozenset(pids)
        if now != self.seen:
            for pid in now - self.seen:
                if len(self.leads) < MAX_LEADS and read_ppid(self.proc, pid) not in now:
                    self.leads.add(pid)
        if self.sub is not None:
            for rec in self.sub.drain():
                pid = rec.tgid or rec.tid
                if rec.tid == pid and pid in self.leads:
                    self.leads.discard(pid)
                    self.last = rec.ended()
                    if self.first_bad is None and (self.last.get("signal") or self.last.get("exit_code")):
                        self.first_bad = self.last
        self.leads &= now      # a lead gone without a record (dropped in a burst): its end is not known
        self.seen = now

    def status(self) -> dict[str, int]:
        """How the job's leads ended: the first that ended badly, else the last; {} before any did."""
        return dict(self.first_bad or self.last or {})

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
            self.sub = None
