# SPDX-License-Identifier: Apache-2.0
"""Unit tier: naming a process's user addresses (jobprobe/kernel/symbols.py) from its maps read while it ran — also
once it has ended, from the same file here, only where the file is the one its maps named (device and inode)."""
import os

from jobprobe.kernel.symbols import UserSymbols


def libc_text_mapping() -> tuple[bytes, int, int]:
    """This process's first executable mapping of libc: its maps line, start address and file offset."""
    with open("/proc/self/maps", "rb") as f:
        line = next(ln for ln in f if b"libc.so" in ln and b"r-xp" in ln)
    lo = int(line.split(b"-")[0], 16)
    return line, lo, int(line.split()[2], 16)


def test_a_gone_processs_addresses_are_named_from_the_same_file_only():
    line, lo, off = libc_text_mapping()
    ip = lo + 0x1000
    live = UserSymbols(line, "/proc/self/root").name(ip)
    gone = UserSymbols(line, "/proc/4194303/root").name(ip)          # no such process: its root is gone
    parts = line.split()
    other = b" ".join([*parts[:4], str(int(parts[4]) + 1).encode(), parts[5]])    # another file at that path
    stale = UserSymbols(other, "/proc/4194303/root").name(ip)
    print(live, gone, stale)
    assert "(libc.so" in live and not live.startswith("libc.so")     # a function of libc, with its file
    assert gone == live
    assert stale == f"{os.path.basename(parts[5].decode())}+{ip - lo + off:#x}"   # not named from a stranger
