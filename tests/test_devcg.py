# SPDX-License-Identifier: Apache-2.0
"""The cgroup2 device rule: device programs read back from the kernel and run by jobprobe/kernel/devcg.py's interpreter,
checked against the kernel's own verdict (opening device nodes from inside the group), (the gpu probe's
`devices` rule on a real group with such a program attached: tests/test_gpu.py)."""
from __future__ import annotations

import ctypes as ct
import errno
import os
import subprocess
import sys

import pytest

from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel.devcg import (
    ACC_READ,
    ACC_WRITE,
    DEV_BLOCK,
    DEV_CHAR,
    DeviceRules,
    Undecidable,
    allows,
    device_ctx,
    effective_programs,
    program_insns,
    run,
)
from tests.devcg_progs import CALL, EXIT, JA, LDXW, allow_list, attach_device_program, insn, odd_expected, odd_program


# ---- unit tier: the interpreter on its own -----------------------------------------------------------------------
def test_prog_info_layout():
    """struct bpf_prog_info (include/uapi/linux/bpf.h): the instruction lengths and pointers sit before the name."""
    from jobprobe.kernel.bpf import ProgInfo
    offsets = {name: getattr(ProgInfo, name).offset for name, _ in ProgInfo._fields_}
    assert (offsets["xlated_prog_len"], offsets["xlated_prog_insns"], offsets["name"]) == (20, 32, 64)
    assert (offsets["run_time_ns"], offsets["recursion_misses"], ct.sizeof(ProgInfo)) == (192, 208, 216)


def test_allow_list_decisions():
    prog = allow_list([(DEV_CHAR, 195, 1, ACC_READ | ACC_WRITE), (DEV_CHAR, 195, 255, 7), (DEV_CHAR, 1, None, 7)])
    assert allows([prog], 195, 1) and allows([prog], 195, 255) and allows([prog], 1, 77)
    assert not allows([prog], 195, 0) and not allows([prog], 195, 2) and not allows([prog], 7, 1)
    assert not allows([prog], 195, 1, access=1)                     # mknod was not granted
    assert not allows([prog], 195, 1, dev_type=DEV_BLOCK)
    assert allows([prog, allow_list([(DEV_CHAR, None, None, 7)])], 195, 1)
    assert not allows([prog, allow_list([(DEV_CHAR, 195, 0, 7)])], 195, 1)   # every program must allow


def test_odd_program_decisions():
    prog = odd_program()
    for dev_type in (DEV_CHAR, DEV_BLOCK):
        for major in (195, 7):
            for minor in range(6):
                for access in (ACC_READ, ACC_WRITE, ACC_READ | ACC_WRITE):
                    assert (run(prog, device_ctx(major, minor, access, dev_type)) == 1) == \
                        odd_expected(dev_type, major, minor, access), (dev_type, major, minor, access)


def test_what_it_cannot_model_is_undecidable():
    ctx = device_ctx(195, 0)
    with pytest.raises(Undecidable, match="call"):
        run(b"".join([insn(CALL, imm=5), insn(EXIT)]), ctx)        # bpf_ktime_get_ns
    with pytest.raises(Undecidable, match="pseudo"):
        run(b"".join([insn(0x18, 1, src=1, imm=3), insn(0), insn(EXIT)]), ctx)   # a map fd
    with pytest.raises(Undecidable, match="outside"):
        run(b"".join([insn(LDXW, 0, 1, 64), insn(EXIT)]), ctx)     # past the 12-byte context
    with pytest.raises(Undecidable, match="too many steps"):
        run(b"".join([insn(JA, off=-1)]), ctx)
    rules = DeviceRules()
    rules.insns[1] = b"".join([insn(CALL, imm=5), insn(EXIT)])
    assert rules._decide((1,), 195, (0, 1)) is None               # the group is "not telling", not guessed


# ---- kernel tier: real programs on real groups, the kernel's own verdict ----------------------------------------
OPENER = """
import os, sys
sys.stdin.readline()
for line in sys.stdin:
    path, mode = line.split()
    try:
        os.close(os.open(path, {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}[mode]))
        print("opened")
    except OSError as e:
        print(e.errno)
"""
MODES = {"r": ACC_READ, "w": ACC_WRITE, "rw": ACC_READ | ACC_WRITE}


def kernel_verdicts(cg, nodes: dict[tuple[int, int, int], str], attach) -> dict[tuple, bool]:
    """Open every node in every mode from a process inside `cg`, after `attach()`: allowed (the open reached the
    absent driver: ENXIO/ENODEV) or denied (EPERM, the device controller)."""
    proc = cg.spawn([sys.executable, "-c", OPENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fds = attach()
    try:
        asks = [(key, mode) for key in nodes for mode in MODES]
        out, _ = proc.communicate("go\n" + "".join(f"{nodes[k]} {m}\n" for k, m in asks), timeout=60)
    finally:
        _bpf.close_all(fds)
    verdicts = {}
    for (key, mode), got in zip(asks, out.split(), strict=True):
        assert got in ("opened", str(errno.ENXIO), str(errno.ENODEV), str(errno.EPERM)), (key, mode, got)
        verdicts[key + (MODES[mode],)] = got != str(errno.EPERM)
    return verdicts


@pytest.fixture
def nodes(tmp_path):
    made = {}
    for dev_type, major in ((DEV_CHAR, 195), (DEV_CHAR, 7), (DEV_BLOCK, 7)):
        for minor in range(6):
            path = tmp_path / f"{'c' if dev_type == DEV_CHAR else 'b'}{major}_{minor}"
            os.mknod(path, 0o666 | (0o020000 if dev_type == DEV_CHAR else 0o060000), os.makedev(major, minor))
            made[(dev_type, major, minor)] = str(path)
    return made


@pytest.mark.kernel
@pytest.mark.parametrize("shape", ["runc", "odd"])
def test_interpreter_agrees_with_the_kernel(make_cgroup, nodes, shape):
    prog = allow_list([(DEV_CHAR, 195, 1, ACC_READ), (DEV_CHAR, 195, 3, ACC_READ | ACC_WRITE), (DEV_BLOCK, 7, 2, 7)]) \
        if shape == "runc" else odd_program()
    cg = make_cgroup()
    seen: list[bytes] = []

    def attach():
        fds = attach_device_program(prog, str(cg.path))
        ids = effective_programs(str(cg.path))
        assert len(ids) == 1
        seen.append(program_insns(ids[0]))     # what the kernel holds, read back
        return fds

    verdicts = kernel_verdicts(cg, nodes, attach)
    mine = {key: allows([seen[0]], key[1], key[2], access=key[3], dev_type=key[0]) for key in verdicts}
    allowed = sorted(k for k, v in verdicts.items() if v)
    print(f"{shape}: the kernel allowed {len(allowed)} of {len(verdicts)} opens: {allowed}")
    assert 0 < len(allowed) < len(verdicts)
    assert mine == verdicts
    assert effective_programs(str(cg.path)) == []      # closing the link detached it


@pytest.mark.kernel
def test_effective_programs_include_the_ancestors(make_cgroup):
    cg = make_cgroup()
    child = cg.path / "step_0"
    child.mkdir()
    try:
        outer = attach_device_program(allow_list([(DEV_CHAR, 195, None, 7), (DEV_CHAR, 1, None, 7)]), str(cg.path))
        inner = attach_device_program(allow_list([(DEV_CHAR, 195, 2, 6), (DEV_CHAR, 1, None, 7)]), str(child))
        try:
            assert len(effective_programs(str(child))) == 2 and len(effective_programs(str(cg.path))) == 1
            rules = DeviceRules()
            assert rules.allowed_minors(str(child), 195, {0, 1, 2, 3}) == {2}
            assert rules.allowed_minors(str(cg.path), 195, {0, 1, 2, 3}) is None    # 195:* — no GPU restriction
            assert rules.allowed_minors(str(child), 7, {0}) == set()
        finally:
            _bpf.close_all(inner + outer)
        assert DeviceRules().allowed_minors(str(child), 195, {0, 1}) is None       # no program: not restricted
    finally:
        child.rmdir()
