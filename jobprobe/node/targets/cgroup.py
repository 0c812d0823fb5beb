# SPDX-License-Identifier: Apache-2.0
"""`CgroupTarget`: a cgroup2 group and all its descendants (SLURM steps, container sub-groups); membership by
cgroup2 id. Its files are read through kept fds, once per agent tick.
"""
from __future__ import annotations

import os
from pathlib import Path

from jobprobe.contract import tickmemo
from jobprobe.contract.target import Target
from jobprobe.core.errors import BadInput, TargetGone
from jobprobe.kernel import procfs
from jobprobe.kernel.host import find_cgroup2_mount


class CgroupTarget(Target):
    kind = "cgroup"

    def __init__(self, path: str, mountinfo: str = "/proc/self/mountinfo", job: str | None = None):
        mount = find_cgroup2_mount(mountinfo)
        if mount is None:
            raise BadInput("no cgroup2 hierarchy is mounted on this host (see /proc/self/mountinfo)")
        p = Path(path)
        if not p.is_absolute() or not str(p).startswith(mount.rstrip("/") + "/") and str(p) != mount:
            p = Path(mount, str(path).lstrip("/"))
        # resolved, then held inside the mount: `..` or a link could name any directory with a cgroup.procs file
        # (issue 48: --cgroup ../../x attached a directory outside the hierarchy)
        root, p = os.path.realpath(mount), Path(os.path.realpath(p))
        if str(p) != root and not str(p).startswith(root.rstrip("/") + "/"):
            raise BadInput(f"cgroup {path} is outside the cgroup2 hierarchy at {mount} (it resolves to {p})")
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
        return tickmemo.get(("dirs", self), self._dirs_now)

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
        return list(tickmemo.get(("pids", self), self._pids_now))   # once per agent tick

    def _pids_now(self) -> list[int]:
        pids: list[int] = []
        for d in self.dirs():
            pids.extend(int(x) for x in (self.files.read(f"{d}/cgroup.procs") or "").split())
        self.files.sweep()
        return pids

    def quiet(self) -> bool:
        if not tickmemo.active():
            return False
        return tickmemo.get(("quiet", self), self._quiet_now)

    def _quiet_now(self) -> bool:
        # cpu.stat usage_usec (also without the cpu controller) covers the descendants; it moves with any run of a
        # task of the group that reaches a microsecond, and a shorter one is counted by the next tick that reads.
        usage = (self.cpu_stat() or {}).get("usage_usec")
        prev, self._usage = self._usage, usage
        return usage is not None and usage == prev

    def cpu_stat(self) -> dict[str, int] | None:
        # once per agent tick: the cgroup probe's CPU figures and quiet() read the same snapshot
        return tickmemo.get(("cpu.stat", self),
                            lambda: procfs.read_kv(f"{self.cgroup_path}/cpu.stat", self.files.read))

    def refresh(self) -> None:
        if not self.dirs():      # the walk (once per agent tick) finds not even the job's own group
            raise TargetGone(f"cgroup {self.cgroup_path} was removed")

    def close(self) -> None:
        self.files.close()
