"""--out FILE: a msgpack frame stream, append-safe, rotated by size.

Each frame goes out in one write() on an O_APPEND descriptor, so two writers never interleave inside a frame and a
crash leaves at most the last frame cut short (`jobprobe read` says so and keeps the rest). When the file passes
--out-max-mb it is renamed FILE.1 (FILE.1 → FILE.2 …, `keep` files kept) and the new file starts with the hello
frame again, so every file decodes on its own.
"""
from __future__ import annotations

import os


class FileExporter:
    def __init__(self, path: str, max_mb: float | None = None, keep: int = 5):
        self.path = path
        self.max_bytes = int(max_mb * (1 << 20)) if max_mb else None
        self.keep = keep
        self.written = 0
        self._hello: bytes | None = None
        self._fd = self._open()

    def _open(self) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(fd).st_size
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
        return f"FileExporter({self.path!r})"
