# SPDX-License-Identifier: Apache-2.0
"""Drive tests/fake_cuda/cudaprog (a TEST FAKE workload, see its header) from a test, line by line."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


class Prog:
    """tests/fake_cuda/cudaprog driven line by line (see its header for the commands)."""

    def __init__(self, libdir: Path, spawn=subprocess.Popen):
        env = {**os.environ, "LD_LIBRARY_PATH": str(libdir)}
        self.proc = spawn([str(libdir / "cudaprog")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=env)
        self.pid = self.proc.pid

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def reply(self) -> str:
        out = self.proc.stdout.readline()
        assert out, f"cudaprog exited with {self.proc.poll()}"
        return out.strip()

    def cmd(self, line: str) -> str:
        self.send(line)
        return self.reply()

    def run(self, phase: str, n: int) -> dict:
        return json.loads(self.cmd(f"run {phase} {n}"))

    def probed(self) -> tuple[int, int]:
        got, _, total = self.cmd("probed").partition(" of ")
        return int(got), int(total)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def file_offsets_from_the_linker(prog: Prog, names: list[str]) -> dict[str, tuple[str, int]]:
    """name → (library path, file offset), from where the dynamic linker put each function (dlsym) and the kernel's
    own map of the process (an address in a file mapping is at map offset + (address - map start))."""
    maps = []
    for line in Path(f"/proc/{prog.pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append((lo, hi, int(parts[2], 16), parts[5]))
    out = {}
    for name in names:
        addr = int(prog.cmd(f"addr {name}"), 16)
        lo, _, off, path = next(m for m in maps if m[0] <= addr < m[1])
        out[name] = (path, off + addr - lo)
    return out
