# SPDX-License-Identifier: Apache-2.0
"""`PidTreeTarget`: a set of root processes and every descendant, found by parent PID in /proc; membership by tgid."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from jobprobe.contract.target import Target
from jobprobe.core.errors import BadInput, TargetGone
from jobprobe.kernel.procfs import list_pids, read_ppid


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
