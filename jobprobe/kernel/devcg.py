# SPDX-License-Identifier: Apache-2.0
"""Which device files a cgroup2 group lets its processes open, read back from the kernel.

cgroup v2 has no devices.list. Access to device files is decided by BPF_PROG_TYPE_CGROUP_DEVICE programs attached
to the group or its ancestors (runc and crun, systemd's DeviceAllow=, SLURM's ConstrainDevices on v2 hosts). For
each open or mknod the kernel runs every effective program on (device type and access, major, minor) and allows
it only if all of them return 1.

Here those programs are read back (BPF_PROG_QUERY for the group's effective list, their instructions as the
kernel holds them) and run in user space by a small interpreter of what such generated programs are made of:
ALU and jump instructions, 64-bit immediates, loads of the 12-byte context and the stack. A program that uses
anything else (helper calls, maps, atomics) cannot be decided here: `allowed` returns None for it, and callers
treat the group as not telling, rather than guess. The interpreter is checked against the kernel's own verdict
(opening device nodes from inside a group) in tests/test_devcg.py.

Needs root (CAP_SYS_ADMIN for PROG_GET_FD_BY_ID and the instructions); without it every group reads as not telling.
"""
from __future__ import annotations

import ctypes as ct
import errno
import os
import struct
from collections.abc import Iterable

from jobprobe.kernel.bpf import ProgInfo, obj_info, prog_fd_by_id, sys_bpf

PROG_QUERY = 16
CGROUP_DEVICE = 6              # enum bpf_attach_type BPF_CGROUP_DEVICE
QUERY_EFFECTIVE = 1            # BPF_F_QUERY_EFFECTIVE: the programs that run for this group, ancestors' too
DEV_BLOCK, DEV_CHAR = 1, 2     # BPF_DEVCG_DEV_*
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4   # BPF_DEVCG_ACC_*

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
CTX_BASE = 1 << 48             # where the interpreter places the context and the stack (tagged addresses)
STACK_TOP = 2 << 48
STACK_SIZE = 512
MAX_STEPS = 1 << 16            # programs are loop-free in practice; a bound keeps a strange one from spinning


class QueryAttr(ct.Structure):
    """union bpf_attr .query, up to prog_cnt."""
    _fields_ = [("target_fd", ct.c_uint32), ("attach_type", ct.c_uint32), ("query_flags", ct.c_uint32),
                ("attach_flags", ct.c_uint32), ("prog_ids", ct.c_uint64), ("prog_cnt", ct.c_uint32),
                ("pad", ct.c_uint32)]


class Undecidable(Exception):
    """The program does something the interpreter does not model."""


def effective_programs(cgroup_dir: str) -> list[int]:
    """IDs of the device programs that run for processes of `cgroup_dir` (its own and its ancestors')."""
    dfd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        cap = 16
        while True:
            ids = (ct.c_uint32 * cap)()
            attr = QueryAttr(target_fd=dfd, attach_type=CGROUP_DEVICE, query_flags=QUERY_EFFECTIVE,
                             prog_ids=ct.addressof(ids), prog_cnt=cap)
            try:
                sys_bpf(PROG_QUERY, attr)
            except OSError as e:
                if e.errno == errno.ENOSPC and cap < 4096:
                    cap *= 4
                    continue
                raise
            return list(ids[:attr.prog_cnt])
    finally:
        os.close(dfd)


def program_insns(prog_id: int) -> bytes:
    """The instructions of program `prog_id` as the kernel holds them (after its rewrites)."""
    fd = prog_fd_by_id(prog_id)
    try:
        size = obj_info(fd, ProgInfo()).xlated_prog_len
        buf = (ct.c_uint8 * max(size, 8))()
        info = obj_info(fd, ProgInfo(xlated_prog_len=size, xlated_prog_insns=ct.addressof(buf)))
        if not size or not info.xlated_prog_insns:     # the kernel withholds them (kptr_restrict, no CAP_SYSLOG)
            raise OSError(errno.EPERM, "program instructions not readable")
        return bytes(buf[:size])
    finally:
        os.close(fd)


def signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


SIZES = {0x00: 4, 0x08: 2, 0x10: 1, 0x18: 8}    # BPF_W, BPF_H, BPF_B, BPF_DW


def run(insns: bytes, ctx: bytes) -> int:
    """Run a socket-free, helper-free BPF program on `ctx` (r1 points to it); its return value (r0, 32 bits)."""
    prog = [struct.unpack_from("<BBhi", insns, i) for i in range(0, len(insns) - len(insns) % 8, 8)]
    regs = [0] * 11
    regs[1], regs[10] = CTX_BASE, STACK_TOP
    stack = bytearray(STACK_SIZE)

    def where(address: int, size: int) -> tuple[bytearray | bytes, int]:
        if CTX_BASE <= address and address + size <= CTX_BASE + len(ctx):
            return ctx, address - CTX_BASE
        if STACK_TOP - STACK_SIZE <= address and address + size <= STACK_TOP:
            return stack, address - (STACK_TOP - STACK_SIZE)
        raise Undecidable(f"memory access outside the context and the stack at {address:#x}")

    def load(address: int, size: int) -> int:
        mem, at = where(address, size)
        return int.from_bytes(mem[at:at + size], "little")

    def store(address: int, size: int, value: int) -> None:
        mem, at = where(address, size)
        if mem is ctx:
            raise Undecidable("store into the context")
        stack[at:at + size] = (value & ((1 << 8 * size) - 1)).to_bytes(size, "little")

    pc = steps = 0
    while True:
        steps += 1
        if not 0 <= pc < len(prog) or steps > MAX_STEPS:
            raise Undecidable(f"ran off the program at {pc}" if steps <= MAX_STEPS else "too many steps")
        code, rr, off, imm = prog[pc]
        dst, src, cls = rr & 0xF, rr >> 4, code & 7
        if cls in (4, 7):                                       # BPF_ALU, BPF_ALU64
            bits = 64 if cls == 7 else 32
            mask = (1 << bits) - 1
            op = code & 0xF0
            if off or op == 0xD0:                               # signed div/mod, movsx, byte swaps
                raise Undecidable(f"ALU op {code:#x} off {off}")
            a = regs[dst] & mask
            b = (regs[src] if code & 8 else imm) & mask
            sh = b & (bits - 1)
            r = {0x00: lambda: a + b, 0x10: lambda: a - b, 0x20: lambda: a * b,
                 0x30: lambda: a // b if b else 0, 0x40: lambda: a | b, 0x50: lambda: a & b,
                 0x60: lambda: a << sh, 0x70: lambda: a >> sh, 0x80: lambda: -a,
                 0x90: lambda: a % b if b else a, 0xA0: lambda: a ^ b, 0xB0: lambda: b,
                 0xC0: lambda: signed(a, bits) >> sh}.get(op)
            if r is None:
                raise Undecidable(f"ALU op {code:#x}")
            regs[dst] = r() & mask
            pc += 1
        elif cls == 1:                                          # BPF_LDX
            if code & 0xE0 != 0x60:
                raise Undecidable(f"load mode {code:#x}")
            regs[dst] = load(regs[src] + off, SIZES[code & 0x18])
            pc += 1
        elif cls in (2, 3):                                     # BPF_ST, BPF_STX
            if code & 0xE0 != 0x60:
                raise Undecidable(f"store mode {code:#x} (atomics)")
            store(regs[dst] + off, SIZES[code & 0x18], imm if cls == 2 else regs[src])
            pc += 1
        elif cls == 0:                                          # BPF_LD: only a plain 64-bit immediate
            if code != 0x18 or src != 0 or pc + 1 >= len(prog):
                raise Undecidable(f"load {code:#x} src {src} (a map or other pseudo immediate)")
            regs[dst] = (imm & M32) | (prog[pc + 1][3] & M32) << 32
            pc += 2
        else:                                                   # BPF_JMP, BPF_JMP32
            op = code & 0xF0
            if op == 0x90 and cls == 5:                         # exit
                return regs[0] & M32
            if op == 0x80 or op == 0x90:
                raise Undecidable("helper or function call")
            if op == 0x00:                                      # ja (gotol in JMP32)
                pc += 1 + (off if cls == 5 else imm)
                continue
            bits = 64 if cls == 5 else 32
            mask = (1 << bits) - 1
            a = regs[dst] & mask
            b = (regs[src] if code & 8 else imm) & mask
            sa, sb = signed(a, bits), signed(b, bits)
            cond = {0x10: a == b, 0x20: a > b, 0x30: a >= b, 0x40: bool(a & b), 0x50: a != b, 0x60: sa > sb,
                    0x70: sa >= sb, 0xA0: a < b, 0xB0: a <= b, 0xC0: sa < sb, 0xD0: sa <= sb}.get(op)
            if cond is None:
                raise Undecidable(f"jump op {code:#x}")
            pc += 1 + (off if cond else 0)


def device_ctx(major: int, minor: int, access: int = ACC_READ | ACC_WRITE, dev_type: int = DEV_CHAR) -> bytes:
    """struct bpf_cgroup_dev_ctx: access_type (access << 16 | type), major, minor."""
    return struct.pack("<III", access << 16 | dev_type, major, minor)


def allows(programs: Iterable[bytes], major: int, minor: int, access: int = ACC_READ | ACC_WRITE,
           dev_type: int = DEV_CHAR) -> bool:
    """Whether every program allows the access (the kernel's rule); raises Undecidable."""
    ctx = device_ctx(major, minor, access, dev_type)
    return all(run(p, ctx) != 0 for p in programs)


class DeviceRules:
    """Reads groups' device programs and remembers each program's instructions (a loaded program never changes;
    IDs are not reused while it lives)."""

    def __init__(self) -> None:
        self.insns: dict[int, bytes | None] = {}
        self.verdicts: dict[tuple[tuple[int, ...], int, tuple[int, ...]], set[int] | None] = {}

    def allowed_minors(self, cgroup_dir: str, major: int, minors: Iterable[int]) -> set[int] | None:
        """Which of `minors` (char devices of `major`, opened read-write) the group allows; None when it does not
        restrict that major (no device program, or one that also allows a minor outside `minors`, as
        `c 195:* rw` does) or when it cannot be told (no root, an undecidable program)."""
        try:
            ids = tuple(effective_programs(cgroup_dir))
        except OSError:
            return None
        if not ids:
            return None
        cands = tuple(sorted(minors))
        key = (ids, major, cands)
        if key not in self.verdicts:
            if len(self.verdicts) > 1024:        # groups come and go with jobs: keep only recent ones
                self.verdicts.clear()
            self.verdicts[key] = self._decide(ids, major, cands)
        return self.verdicts[key]

    def _decide(self, ids: tuple[int, ...], major: int, minors: tuple[int, ...]) -> set[int] | None:
        progs = []
        for i in ids:
            if i not in self.insns:
                try:
                    self.insns[i] = program_insns(i)
                except OSError:
                    self.insns[i] = None
            if self.insns[i] is None:
                return None
            progs.append(self.insns[i])
        outside = next(m for m in range(1 << 20) if m not in minors)
        try:
            if allows(progs, major, outside):
                return None
            return {m for m in minors if allows(progs, major, m)}
        except Undecidable:
            return None
