# SPDX-License-Identifier: Apache-2.0
"""`CommandTarget`: `-- CMD ARGS…`, a fresh cgroup2 group that we create with CMD started inside it and remove at
the end; `check_runnable`, a shell's answer to "can CMD be run" (127 / 126) before anything is made.
"""
from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from jobprobe.core.errors import BadInput, CommandNotExecutable, CommandNotFound, TargetGone
from jobprobe.kernel.host import find_cgroup2_mount
from jobprobe.node.targets.cgroup import CgroupTarget


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

    def exit_status(self) -> dict[str, int]:
        """Asked once the job ended (its group empty): its child has exited. A wait, not poll(): `jobprobe run`'s
        waiter thread is in wait() on it, and poll() answers None while another thread waits (a crashed job read
        "ended", no code, in its test)."""
        if self.proc_handle is None:
            return {}
        try:
            code = self.proc_handle.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return {}
        return {"signal": -code} if code < 0 else {"exit_code": code}

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
