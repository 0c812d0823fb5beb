"""--out FILE: a msgpack frame stream, append-safe, rotated by size.

Each frame goes out in one write() on an O_APPEND descriptor, so two writers never interleave inside a frame and a
crash leaves at most the last frame cut short (`jobprobe read` says so and keeps the rest). When the file passes
--out-max-mb it is renamed FILE.1 (FILE.1 → FILE.2 …, `keep` files kept) and the new file starts with the hello
frame again, so every file decodes on its own.

Frames hold other users' command lines and stacks (shared SLURM nodes), so every file is 0600 and every directory
made for them 0700, whatever the umask. `job_filename` (jobprobe/core/names.py) maps a job to its file's name injectively: two jobs never
share a file (`a/b` and `a_b` are two files).
"""
from __future__ import annotations

import os
import stat

from jobprobe.core.names import job_filename

FILE_MODE = 0o600
DIR_MODE = 0o700
def private_dir(path: str) -> None:
    """Make directory `path` and any missing parent, each 0700 whatever the umask. A directory that exists already
    is left as it is: `--out` may name a shared one (`/tmp`) that is not ours to close."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        private_dir(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return                      # made by another writer at the same moment: theirs, as it is
    os.chmod(path, DIR_MODE)        # mkdir's mode passes through the umask: it can only narrow, but say it exactly


def job_path(out_dir: str, job: str) -> str:
    """The frame file of `job` under `out_dir` (`--out DIR`), the directory made 0700 if missing."""
    private_dir(out_dir)
    return os.path.join(out_dir, f"{job_filename(job)}.mpk")


class FileSink:
    def __init__(self, path: str, max_mb: float | None = None, keep: int = 5):
        self.path = path
        self.max_bytes = int(max_mb * (1 << 20)) if max_mb else None
        self.keep = keep
        self.written = 0
        self._hello: bytes | None = None
        self._fd = self._open()

    def _open(self) -> int:
        """The file opened for appending, created 0600 — never briefly wider, whatever the umask — and narrowed to
        0600 if it existed (written by an older version, or by hand). Only a regular file of ours is narrowed:
        `--out /dev/null` as root must not change /dev/null."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o7077:
                os.fchmod(fd, FILE_MODE)
            self._size = st.st_size
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _rotate(self) -> None:
        os.close(self._fd)
        for i in range(self.keep - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._fd = self._open()
        if self._hello is not None:
            self._write(self._hello)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # O_APPEND makes each write atomic in position; loop only on a short write
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)
        self.written += len(data)

    def write(self, frame: dict, data: bytes) -> None:
        if frame.get("kind") == "hello":
            self._hello = data
        elif self.max_bytes and self._size + len(data) > self.max_bytes and self._size > 0:
            self._rotate()
        self._write(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"FileSink({self.path!r})"
