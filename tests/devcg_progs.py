# SPDX-License-Identifier: Apache-2.0
"""Device programs for the tests: a small assembler of the instruction shapes container runtimes (runc, crun) and
systemd generate for cgroup2 device control, and a loader that attaches one to a real group."""
from __future__ import annotations

import ctypes as ct
import os
import struct

from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel.devcg import ACC_WRITE, DEV_CHAR

PROG_LOAD = 5
PROG_CGROUP_DEVICE = 15
CGROUP_DEVICE = 6


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, src << 4 | dst, off, imm)


LDXW, LDXDW, STXDW = 0x61, 0x79, 0x7B
AND32_K, RSH32_K, MOV32_X, MOV32_K, MOV64_K, RSH64_K = 0x54, 0x74, 0xBC, 0xB4, 0xB7, 0x77
JNE_K, JNE_X, JMP32_JGT_K, JSET_K, JA, CALL, EXIT = 0x55, 0x5D, 0x26, 0x45, 0x05, 0x85, 0x95

PRELUDE = [insn(LDXW, 2, 1, 0), insn(AND32_K, 2, imm=0xFFFF),     # r2 = type
           insn(LDXW, 3, 1, 0), insn(RSH32_K, 3, imm=16),          # r3 = access
           insn(LDXW, 4, 1, 4), insn(LDXW, 5, 1, 8)]               # r4 = major, r5 = minor


def allow_list(rules: list[tuple[int, int | None, int | None, int]]) -> bytes:
    """(type, major or None for any, minor or None, access bits) allow rules, else deny — as runc writes them."""
    out = list(PRELUDE)
    for dev_type, major, minor, access in rules:
        block = [insn(JNE_K, 2, imm=dev_type)]
        if access != 7:
            block += [insn(MOV32_X, 1, 3), insn(AND32_K, 1, imm=access), insn(JNE_X, 1, 3)]
        if major is not None:
            block.append(insn(JNE_K, 4, imm=major))
        if minor is not None:
            block.append(insn(JNE_K, 5, imm=minor))
        block += [insn(MOV32_K, 0, imm=1), insn(EXIT)]
        n = len(block)   # every jump leaves the block: to the instruction after its exit
        out += [b if struct.unpack_from("<B", b)[0] not in (JNE_K, JNE_X) else
                b[:2] + struct.pack("<h", n - 1 - i) + b[4:] for i, b in enumerate(block)]
    return b"".join(out + [insn(MOV32_K, 0, imm=0), insn(EXIT)])


def ld_imm64(dst: int, value: int) -> list[bytes]:
    return [insn(0x18, dst, imm=struct.unpack("<i", struct.pack("<I", value & 0xFFFFFFFF))[0]),
            insn(0, imm=struct.unpack("<i", struct.pack("<I", value >> 32))[0])]


def odd_program() -> bytes:
    """Char devices of major 195 with minor <= 3 only, minor 0 read-only: through the stack, a 64-bit immediate,
    JMP32 and JSET, which the allow lists do not use."""
    return b"".join(PRELUDE + [
        insn(STXDW, 10, 4, -8), insn(LDXDW, 6, 10, -8),            # 6, 7: r6 = major, through the stack
        *ld_imm64(7, 195 << 32), insn(RSH64_K, 7, imm=32),         # 8, 9, 10: r7 = 195
        insn(JNE_X, 6, 7, 6),                                      # 11: major != 195 -> 18 (deny)
        insn(JNE_K, 2, off=5, imm=DEV_CHAR),                       # 12: not a char device -> 18
        insn(JMP32_JGT_K, 5, off=4, imm=3),                        # 13: minor > 3 -> 18
        insn(JNE_K, 5, off=1, imm=0),                              # 14: minor != 0 -> 16 (allow)
        insn(JSET_K, 3, off=2, imm=ACC_WRITE),                     # 15: minor 0 and a write -> 18
        insn(MOV64_K, 0, imm=1), insn(EXIT),                       # 16, 17
        insn(MOV64_K, 0, imm=0), insn(EXIT)])                      # 18, 19


def odd_expected(dev_type: int, major: int, minor: int, access: int) -> bool:
    return dev_type == DEV_CHAR and major == 195 and minor <= 3 and not (minor == 0 and access & ACC_WRITE)


class LoadAttr(ct.Structure):
    _fields_ = [("prog_type", ct.c_uint32), ("insn_cnt", ct.c_uint32), ("insns", ct.c_uint64),
                ("license", ct.c_uint64), ("log_level", ct.c_uint32), ("log_size", ct.c_uint32),
                ("log_buf", ct.c_uint64)]


def attach_device_program(prog: bytes, cgroup_dir: str) -> list[int]:
    """Load `prog` as a cgroup device program and link it to the group; the fds to close to detach it."""
    buf = ct.create_string_buffer(prog, len(prog))
    lic = ct.create_string_buffer(b"GPL")
    log = ct.create_string_buffer(65536)
    try:
        pfd = _bpf.sys_bpf(PROG_LOAD, LoadAttr(prog_type=PROG_CGROUP_DEVICE, insn_cnt=len(prog) // 8,
                                               insns=ct.addressof(buf), license=ct.addressof(lic), log_level=1,
                                               log_size=len(log), log_buf=ct.addressof(log)))
    except OSError as e:
        raise AssertionError(f"verifier: {_bpf.trim_log(log.value.decode())}") from e
    dfd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        lfd = _bpf.sys_bpf(_bpf.LINK_CREATE, _bpf.LinkCreateAttr(prog_fd=pfd, target_fd=dfd,
                                                                 attach_type=CGROUP_DEVICE))
    finally:
        os.close(dfd)
    return [lfd, pfd]
