# SPDX-License-Identifier: Apache-2.0
"""Names for instruction addresses: the kernel's (/proc/kallsyms) and a process's (its /proc/PID/maps and the
.dynsym of each mapped file), for the stacks of deep-trace windows.

What: KernelSymbols reads /proc/kallsyms once (text symbols, sorted) and names an address "function+0xOFF";
  UserSymbols takes a process's maps text (read while it lived) and names an address "function+0xOFF (file)" from
  the exported functions of the file mapped there (jobprobe/kernel/elf.py), or "file+0xOFF" where the file exports
  nothing before it. The file is read under the process's root (/proc/PID/root: a container's own files); once the
  process has ended, at the same path here only if it is the file the maps named (same device and inode). A name
  is the nearest symbol at or below: a static function shows as the exported one before it, with its offset (no
  .symtab is read: production binaries are stripped).
Hooks: none; file reads. Oldest kernel: any (kallsyms addresses need root under kptr_restrict). Cost: kallsyms
  parse ~0.2-0.4 s and ~10 MB while a window's stacks are named (built per window, then dropped); one .dynsym read
  per mapped file named.
"""
from __future__ import annotations

import bisect
import os
from array import array

from jobprobe.kernel import elf as _elf


class KernelSymbols:
    def __init__(self, proc: str = "/proc"):
        rows = []
        try:
            with open(f"{proc}/kallsyms", "rb") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 3 and parts[1] in (b"t", b"T", b"w", b"W"):
                        addr = int(parts[0], 16)
                        if addr:
                            rows.append((addr, parts[2].decode(errors="replace")))
        except OSError:
            pass
        rows.sort()
        self.addrs = array("Q", (a for a, _ in rows))
        self.names = [n for _, n in rows]

    def name(self, ip: int) -> str:
        i = bisect.bisect_right(self.addrs, ip) - 1
        if i < 0:
            return hex(ip)
        return f"{self.names[i]}+{ip - self.addrs[i]:#x}"


class UserSymbols:
    """One process's addresses, from its maps text (as read from /proc/PID/maps) and files under `root`
    (/proc/PID/root: a container's own files)."""

    _cache: dict[str, tuple[array, list[str]]] = {}

    def __init__(self, maps_text: bytes, root: str = ""):
        self.root = root
        self.maps: list[tuple[int, int, int, str]] = []      # start, end, file offset, path (executable only)
        self.ids: dict[str, tuple[int, int, int]] = {}          # path → (major, minor, inode) as the maps say
        for line in maps_text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or b"x" not in parts[1]:
                continue
            lo, _, hi = parts[0].partition(b"-")
            path = parts[5].decode("utf-8", "surrogateescape")
            self.maps.append((int(lo, 16), int(hi, 16), int(parts[2], 16), path))
            major, _, minor = parts[3].partition(b":")
            if parts[4].isdigit() and minor:
                self.ids[path] = (int(major, 16), int(minor, 16), int(parts[4]))
        self.maps.sort()
        self.starts = [m[0] for m in self.maps]
        self.files: dict[str, tuple[array, list[str]]] = {}

    def _file(self, path: str) -> str:
        """Where to read the file mapped at `path`: under the process's root; where that is gone (the process
        ended), the same path here if it is the same file (the device and inode the maps give)."""
        if not self.root or os.path.exists(self.root):
            return self.root + path
        try:
            st = os.stat(path)
        except OSError:
            return self.root + path
        same = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) == self.ids.get(path)
        return path if same else self.root + path

    def _functions(self, path: str) -> tuple[array, list[str]]:
        if path not in self.files:
            try:
                funcs = sorted((off, name) for name, off in _elf.dynamic_functions(self._file(path)).items())
            except _elf.ElfError:
                funcs = []
            self.files[path] = (array("Q", (o for o, _ in funcs)), [n for _, n in funcs])
        return self.files[path]

    def name(self, ip: int) -> str:
        i = bisect.bisect_right(self.starts, ip) - 1
        if i < 0 or ip >= self.maps[i][1]:
            return hex(ip)
        start, _, pgoff, path = self.maps[i]
        off = ip - start + pgoff
        base = os.path.basename(path) or path
        if not path.startswith("/"):
            return f"{base}+{off:#x}"                 # [vdso], anonymous JIT code
        offs, names = self._functions(path)
        j = bisect.bisect_right(offs, off) - 1
        if j < 0:
            return f"{base}+{off:#x}"
        return f"{names[j]}+{off - offs[j]:#x} ({base})"
