# SPDX-License-Identifier: Apache-2.0
"""Workloads for the memory probe's tests, run as separate processes.

Each one that counts faults does its work between two handshakes, so that a test can sample probes exactly around
it: it prints "ready MINFLT MAJFLT" (its own getrusage), waits for a line on stdin, works, prints
"done MINFLT MAJFLT", waits for a line again and exits.

    anon PAGES ROUNDS   ROUNDS times: map PAGES anonymous pages (no THP), write one byte to each, unmap
                        (one minor fault per page)
    filemap PATH        map PATH read-only with MADV_RANDOM (no readahead, no fault-around) and read one byte
                        per page: one major fault per page not in the page cache
    readfile PATH       read() PATH in 1 MiB chunks (page cache: in a small memory cgroup, memcg reclaim)
    hog MIB             allocate and touch 1 MiB at a time up to MIB, then sleep: in a small memory cgroup, the
                        OOM killer ends it
    compact             write 1 to /proc/sys/vm/compact_memory (compacts every populated zone in this process)
    mkfile PATH MIB     write a file of MIB MiB, fsync it and drop it from the page cache (posix_fadvise)

Imported by tests/test_memory.py for the other side: memwork() (argv), spawn() (joins cgroups before exec),
window() (the handshakes around probe samples), and small readers of the kernel's own counts.
"""
import mmap
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

PAGE = mmap.PAGESIZE


def faults() -> str:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return f"{ru.ru_minflt} {ru.ru_majflt}"


def handshake(word: str) -> None:
    print(word, faults(), flush=True)
    sys.stdin.readline()


def anon(pages: int, rounds: int) -> None:
    for _ in range(rounds):
        m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_NOHUGEPAGE)   # one fault per 4 KiB page, not one per 2 MiB
        for off in range(0, pages * PAGE, PAGE):
            m[off] = 1
        m.close()


def filemap(path: str) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        m.madvise(mmap.MADV_RANDOM)
        total = 0
        for off in range(0, size, PAGE):
            total += m[off]
        m.close()


def readfile(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


def hog(mib: int) -> None:
    keep = []
    for _ in range(mib):
        keep.append(b"\x01" * (1 << 20))
    time.sleep(60)


def mkfile(path: str, mib: int) -> None:
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def compact() -> None:
    with open("/proc/sys/vm/compact_memory", "w") as f:
        f.write("1\n")


# ---- the tests' side ------------------------------------------------------------------------------------------
def memwork(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def spawn(argv: list[str], procs_files: list[Path] = ()) -> subprocess.Popen:
    """A workload that joins each cgroup (v1 memory, cgroup2 job group) before exec."""
    def join():
        for f in procs_files:
            f.write_text(str(os.getpid()))
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=join)


def said(proc: subprocess.Popen, word: str) -> tuple[int, int]:
    line = proc.stdout.readline().split()
    assert line and line[0] == word, f"workload said {line!r}, not {word}"
    return int(line[1]), int(line[2])


def go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def window(procs: list[subprocess.Popen], probes: list, before=None) -> tuple[list[tuple[int, int]], list[dict]]:
    """Samples every probe right before the workloads work and right after; returns each workload's own
    (minflt, majflt) over its work and each probe's sample of the window."""
    ru0 = [said(p, "ready") for p in procs]
    for pr in probes:
        pr.sample()
    if before:
        before()
    for p in procs:
        go(p)
    ru1 = [said(p, "done") for p in procs]
    samples = [pr.sample() for pr in probes]
    for p in procs:
        go(p)
        assert p.wait(timeout=120) == 0
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(ru0, ru1)], samples


def memcg_v1_root() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, opts = right.split(" ")[:3]
        if fstype == "cgroup" and "memory" in opts.split(","):
            return Path(left.split(" ")[4])
    return None


class MemcgV1:
    """v1 memory cgroups made for one test, each with a limit; remove() kills what is left in them."""

    def __init__(self, root: Path, prefix: str):
        self.root, self.prefix, self.made = root, re.sub(r"[^\w.-]", "-", prefix), []

    def make(self, limit_mib: int, memsw: bool = False) -> Path:
        """With memsw, the memory+swap limit too, so that a host with swap also hits it instead of swapping (then
        both failcnt files stay 0 on 6.18)."""
        d = self.root / f"{self.prefix}-{len(self.made)}"
        d.mkdir()
        self.made.append(d)
        (d / "memory.limit_in_bytes").write_text(str(limit_mib << 20))
        if memsw and (d / "memory.memsw.limit_in_bytes").exists():
            (d / "memory.memsw.limit_in_bytes").write_text(str(limit_mib << 20))
        return d

    def remove(self) -> None:
        for d in self.made:
            for _ in range(200):
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), 9)
                    except ProcessLookupError:
                        pass
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def failcnt(memcg: Path) -> int:
    files = [memcg / f for f in ("memory.failcnt", "memory.memsw.failcnt")]
    return sum(int(f.read_text()) for f in files if f.exists())


def populated_zones() -> int:
    return sum(int(m) > 0 for m in re.findall(r"^\s+present\s+(\d+)", Path("/proc/zoneinfo").read_text(), re.M))





if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "mkfile":
        mkfile(args[0], int(args[1]))
        sys.exit(0)
    work = {"anon": lambda: anon(int(args[0]), int(args[1])), "filemap": lambda: filemap(args[0]),
            "readfile": lambda: readfile(args[0]), "hog": lambda: hog(int(args[0])), "compact": compact}
    if what not in work:
        sys.exit(f"unknown workload {what}")
    handshake("ready")
    work[what]()
    handshake("done")
