# SPDX-License-Identifier: Apache-2.0
"""--out FILE: a msgpack frame stream, append-safe, rotated by size.

Each frame goes out in one write() on an O_APPEND descriptor, so two writers never interleave inside a frame and a
crash leaves at most the last frame cut short (`jobprobe read` says so and keeps the rest). When the file passes
--out-max-mb it is renamed FILE.1 (FILE.1 → FILE.2 …, `keep` files kept) and the new file starts with the hello
frame again, so every file decodes on its own.

Frames hold other users' command lines and stacks (shared SLURM nodes), so every file is 0600 and every directory
made for them 0700, whatever the umask. `job_filename` (jobprobe/core/names.py) maps a job to its file's name
injectively: two jobs never
share a file (`a/b` and `a_b` are two files). `--out` may be a shared directory (/tmp): every file is opened through
jobprobe/core/safefile.py, so a link, a FIFO or another user's file planted at its name is refused, never written.
"""
from __future__ import annotations

import os

from jobprobe.core.names import job_filename
from jobprobe.core.safefile import Dir, write_all


def job_path(out_dir: str, job: str) -> str:
    """The frame file of `job` under `out_dir` (`--out DIR`), the directory checked (safefile's shared rule) and
    made 0700 if missing."""
    Dir(out_dir, shared=True).close()
    return os.path.join(out_dir, f"{job_filename(job)}.mpk")


class FileSink:
    def __init__(self, path: str, max_mb: float | None = None, keep: int = 5):
        self.path = path
        self.max_bytes = int(max_mb * (1 << 20)) if max_mb else None
        self.keep = keep
        self.written = 0
        self._hello: bytes | None = None
        self.dir = Dir(os.path.dirname(path), shared=True)   # held: rotation renames inside the directory checked
        self.name = os.path.basename(path)
        try:
            self._fd = self._open()
        except BaseException:
            self.dir.close()
            raise

    def _open(self) -> int:
        """The file opened for appending: made 0600 — never briefly wider, whatever the umask — or, if it exists, a
        regular file of ours with one link (written by an earlier run), narrowed to 0600; else UnsafeFile."""
        fd = self.dir.open(self.name, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(fd).st_size
        return fd

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        for i in range(self.keep - 1, 0, -1):
            src = f"{self.name}.{i}"
            if self.dir.exists(src):
                self.dir.replace(src, f"{self.name}.{i + 1}")
        self.dir.replace(self.name, f"{self.name}.1")
        self._fd = self._open()
        if self._hello is not None:
            self._write(self._hello)

    def _write(self, data: bytes) -> None:
        write_all(self._fd, data)  # O_APPEND makes each write atomic in position; it loops only on a short write
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
        self.dir.close()

    def __repr__(self) -> str:
        return f"FileSink({self.path!r})"
