# SPDX-License-Identifier: Apache-2.0
"""Typed errors. Everything deep inside raises one of these; only the CLI turns them into exit codes."""


class JobprobeError(Exception):
    """Base of every error jobprobe raises on purpose."""


class BadInput(JobprobeError):
    """The user asked for something that does not exist or cannot be (CLI exit code 2)."""
    exit_code = 2


class CommandNotFound(BadInput):
    """`-- CMD` names no file: exit 127, as a shell, env, timeout and nohup say it."""
    exit_code = 127


class CommandNotExecutable(BadInput):
    """`-- CMD` names a file that cannot be executed (no x bit, a directory, not a binary): exit 126."""
    exit_code = 126


class TargetGone(JobprobeError):
    """The job we were attached to has ended: its cgroup was removed, or its last process exited."""


class ProbeUnavailable(JobprobeError):
    """A probe cannot run on this host or for this target. The message is the reason shown to the user."""


class ProbeFailed(JobprobeError):
    """A probe that was running has failed; it is stopped and reported, the others go on."""


class UnsafeFile(BadInput):
    """A file or directory the agent would write is not safely its own — a symbolic link, a FIFO, another user's
    file, a directory others may write (jobprobe/core/safefile.py): refused, one line naming the path and why."""
