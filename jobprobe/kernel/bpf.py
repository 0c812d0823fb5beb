# SPDX-License-Identifier: Apache-2.0
"""bpf — bpf(2) itself, through ctypes (the syscall has no libc wrapper): the one way the agent talks to the kernel's
eBPF objects without bcc or LLVM.

What: sys_bpf and the union bpf_attr parts of each command the agent issues; the kernel's own view of a program or
  map (prog_info: run time, run count, recursion misses; map_info: its layout); pinning; the hook names a probe
  attaches to (tracepoints, "raw:" and "btf:" ones, cgroup hooks); the attachments made without bcc (BTF
  tracepoints, cgroup links: the loader makes them, jobprobe/kernel/bpf_loader.py); and stats_enabled. Maps are
  read and written in jobprobe.kernel.bpfmap; programs are compiled, loaded and attached through
  jobprobe.kernel.bpfload.
Hooks: none of its own; bpf(2) commands OBJ_GET_INFO_BY_FD, PROG_GET_FD_BY_ID, OBJ_PIN, PROG_LOAD,
  RAW_TRACEPOINT_OPEN, LINK_CREATE, ENABLE_STATS (and the map commands, for jobprobe.kernel.bpfmap).
Oldest kernel: 4.12. run_time_ns/run_cnt need 5.1, ENABLE_STATS 5.8 (else the sysctl); cgroup hooks through
  LINK_CREATE 5.7 (a link detaches when its last fd closes, so no exit path can leave one attached).
Cost: one syscall per call.
"""
from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

from jobprobe.core.libc import LIBC

NR_BPF = {"x86_64": 321, "aarch64": 280}   # asm/unistd.h; bpf(2) has no libc wrapper
CLOSE_ALONE, CLOSE_THREADS = 4, 32          # close_all: up to this many fds one by one; beyond, this many threads

# include/uapi/linux/bpf.h: enum bpf_cmd, enum bpf_map_type, update flags
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_GET_NEXT_ID, PROG_GET_FD_BY_ID = 11, 13
OBJ_PIN = 6
PROG_LOAD, RAW_TRACEPOINT_OPEN = 5, 17
PROG_TRACING, TRACE_RAW_TP = 26, 23     # enum bpf_prog_type, enum bpf_attach_type
OBJ_GET_INFO_BY_FD = 15
BTF_LOAD, BTF_GET_FD_BY_ID = 18, 19
MAP_LOOKUP_BATCH = 24
LINK_CREATE = 28
ENABLE_STATS = 32
STATS_RUN_TIME = 0
ANY, NOEXIST, EXIST = 0, 1, 2
# A tracepoint named "raw:category:event" is attached as BPF_PROG_TYPE_RAW_TRACEPOINT (Linux 4.17): the program gets
# the tracepoint's C arguments (struct bpf_raw_tracepoint_args), not its format record. What matters here: the kernel
# guards raw programs against recursion per program, while a classic tracepoint program is skipped (and counted in
# the program's recursion_misses) whenever ANY classic tracepoint or kprobe program is running on that CPU, as when
# a softirq interrupts one. Hooks that fire in softirq (TCP retransmits, closes) need raw to see every event.
RAW = "raw:"
# "btf:category:event": a BTF tracepoint program (tp_btf: BPF_PROG_TYPE_TRACING, BPF_TRACE_RAW_TP; Linux 5.5 with
# vmlinux BTF): the raw tracepoint's arguments, typed by the kernel's BTF, so that task pointers can be passed to
# helpers that take a task (task storage) and read directly. Run by the kernel like a raw one (same guard), held
# by a link.
BTF = "btf:"


def linked(tp: str) -> bool:
    """Whether a hook is attached through a BPF link (raw and BTF tracepoints) rather than a perf event."""
    return tp.startswith((RAW, BTF))


def event_of(tp: str) -> str:
    """'category:event' of a hook name, whatever its kind."""
    return tp.removeprefix(RAW).removeprefix(BTF)


# cgroup hooks by libbpf's section names: (enum bpf_prog_type, enum bpf_attach_type)
PROG_CGROUP_SKB = 8
CGROUP_HOOKS = {"cgroup_skb/ingress": (PROG_CGROUP_SKB, 0), "cgroup_skb/egress": (PROG_CGROUP_SKB, 1)}


class ElemAttr(ct.Structure):
    """union bpf_attr for MAP_*_ELEM and MAP_GET_NEXT_KEY (value and next_key share offset 16)."""
    _fields_ = [("map_fd", ct.c_uint32), ("pad", ct.c_uint32), ("key", ct.c_uint64), ("value", ct.c_uint64),
                ("flags", ct.c_uint64)]


class BatchAttr(ct.Structure):
    """union bpf_attr .batch, for MAP_LOOKUP_BATCH."""
    _fields_ = [("in_batch", ct.c_uint64), ("out_batch", ct.c_uint64), ("keys", ct.c_uint64),
                ("values", ct.c_uint64), ("count", ct.c_uint32), ("map_fd", ct.c_uint32),
                ("elem_flags", ct.c_uint64), ("flags", ct.c_uint64)]


class LinkCreateAttr(ct.Structure):
    """union bpf_attr .link_create, the part a cgroup attachment uses (the kernel zero-fills the rest)."""
    _fields_ = [("prog_fd", ct.c_uint32), ("target_fd", ct.c_uint32), ("attach_type", ct.c_uint32),
                ("flags", ct.c_uint32)]


class IdAttr(ct.Structure):
    """union bpf_attr for PROG_GET_NEXT_ID / PROG_GET_FD_BY_ID."""
    _fields_ = [("id", ct.c_uint32), ("next_id", ct.c_uint32), ("open_flags", ct.c_uint32)]


class PinAttr(ct.Structure):
    """union bpf_attr for OBJ_PIN."""
    _fields_ = [("pathname", ct.c_uint64), ("bpf_fd", ct.c_uint32), ("file_flags", ct.c_uint32)]


def obj_pin(fd: int, path: str) -> None:
    """Pin a map or program at `path` in a mounted bpffs."""
    buf = ct.create_string_buffer(path.encode())
    sys_bpf(OBJ_PIN, PinAttr(pathname=ct.addressof(buf), bpf_fd=fd))


class InfoAttr(ct.Structure):
    """union bpf_attr .info, for OBJ_GET_INFO_BY_FD."""
    _fields_ = [("bpf_fd", ct.c_uint32), ("info_len", ct.c_uint32), ("info", ct.c_uint64)]


class ProgInfo(ct.Structure):
    """struct bpf_prog_info up to recursion_misses (216 bytes). The kernel copies min(its size, ours) and leaves the
    rest zero, so on kernels before 5.1 run_time_ns/run_cnt read 0, before 5.12 recursion_misses (runs the kernel
    skipped because another BPF program was running on that CPU) reads 0."""
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("tag", ct.c_uint8 * 8),
                ("jited_prog_len", ct.c_uint32), ("xlated_prog_len", ct.c_uint32),
                ("jited_prog_insns", ct.c_uint64), ("xlated_prog_insns", ct.c_uint64),
                ("skip1", ct.c_uint8 * 24),       # load_time, created_by_uid, nr_map_ids, map_ids
                ("name", ct.c_char * 16),
                ("skip2", ct.c_uint8 * 112),      # ifindex .. prog_tags
                ("run_time_ns", ct.c_uint64), ("run_cnt", ct.c_uint64), ("recursion_misses", ct.c_uint64)]


class MapInfo(ct.Structure):
    """struct bpf_map_info up to its BTF types (the kernel's own view of a map: what a loader made, what a record of
    it holds). Before 4.18 the BTF fields read 0."""
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("key_size", ct.c_uint32), ("value_size", ct.c_uint32),
                ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32), ("name", ct.c_char * 16),
                ("ifindex", ct.c_uint32), ("btf_vmlinux_value_type_id", ct.c_uint32), ("netns_dev", ct.c_uint64),
                ("netns_ino", ct.c_uint64), ("btf_id", ct.c_uint32), ("btf_key_type_id", ct.c_uint32),
                ("btf_value_type_id", ct.c_uint32)]


class MapCreateAttr(ct.Structure):
    """union bpf_attr for MAP_CREATE, up to btf_value_type_id (the fields past map_flags zero unless set)."""
    _fields_ = [("map_type", ct.c_uint32), ("key_size", ct.c_uint32), ("value_size", ct.c_uint32),
                ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32), ("inner_map_fd", ct.c_uint32),
                ("numa_node", ct.c_uint32), ("map_name", ct.c_char * 16), ("map_ifindex", ct.c_uint32),
                ("btf_fd", ct.c_uint32), ("btf_key_type_id", ct.c_uint32), ("btf_value_type_id", ct.c_uint32)]


class BtfInfo(ct.Structure):
    """struct bpf_btf_info up to its id."""
    _fields_ = [("btf", ct.c_uint64), ("btf_size", ct.c_uint32), ("id", ct.c_uint32)]


class BtfLoadAttr(ct.Structure):
    """union bpf_attr for BTF_LOAD."""
    _fields_ = [("btf", ct.c_uint64), ("btf_log_buf", ct.c_uint64), ("btf_size", ct.c_uint32),
                ("btf_log_size", ct.c_uint32), ("btf_log_level", ct.c_uint32)]


_libc = LIBC


def sys_bpf(cmd: int, attr: ct.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr); raises OSError like os.* functions do. The kernel zero-fills the rest of the
    union, so each command passes only the part it uses."""
    nr = NR_BPF.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf syscall number unknown on {platform.machine()}")
    ret = _libc.syscall(ct.c_long(nr), ct.c_int(cmd), ct.byref(attr), ct.c_uint(ct.sizeof(attr)))
    if ret < 0:
        err = ct.get_errno()
        raise OSError(err, os.strerror(err))
    return ret



def trim_log(text: str, lines: int = 6) -> str:
    """The last non-empty lines of a compiler or verifier log: the reason is at the end, the rest is noise."""
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])


def obj_info(fd: int, info: Any) -> Any:
    sys_bpf(OBJ_GET_INFO_BY_FD, InfoAttr(bpf_fd=fd, info_len=ct.sizeof(info), info=ct.addressof(info)))
    return info


def prog_info(fd: int) -> ProgInfo:
    return obj_info(fd, ProgInfo())


def prog_fd_by_id(prog_id: int) -> int:
    """An fd for a loaded program, by its id (root: CAP_SYS_ADMIN); the caller closes it."""
    return sys_bpf(PROG_GET_FD_BY_ID, IdAttr(id=prog_id))


def map_info(fd: int) -> MapInfo:
    return obj_info(fd, MapInfo())


def close_all(fds: Sequence[int]) -> None:
    """Close every fd (one already closed is no error). Many are closed from several threads: the close of a perf
    event that runs a program (a uprobe, a classic tracepoint) waits on the kernel, ~19 ms a uprobe here, mostly
    under a lock the closes share — together the cuda probe's 268 uprobes of a library close in 3.9 s, not 5.1."""
    fds = list(fds)

    def close(fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)
    if len(fds) <= CLOSE_ALONE:
        for fd in fds:
            close(fd)
        return
    with ThreadPoolExecutor(max_workers=min(CLOSE_THREADS, len(fds)), thread_name_prefix="close") as pool:
        list(pool.map(close, fds))


class ProgLoadAttr(ct.Structure):
    """union bpf_attr for BPF_PROG_LOAD, up to attach_btf_id (include/uapi/linux/bpf.h)."""
    _fields_ = [("prog_type", ct.c_uint32), ("insn_cnt", ct.c_uint32), ("insns", ct.c_uint64),
                ("license", ct.c_uint64), ("log_level", ct.c_uint32), ("log_size", ct.c_uint32),
                ("log_buf", ct.c_uint64), ("kern_version", ct.c_uint32), ("prog_flags", ct.c_uint32),
                ("prog_name", ct.c_char * 16), ("prog_ifindex", ct.c_uint32), ("expected_attach_type", ct.c_uint32),
                ("prog_btf_fd", ct.c_uint32), ("func_info_rec_size", ct.c_uint32), ("func_info", ct.c_uint64),
                ("func_info_cnt", ct.c_uint32), ("line_info_rec_size", ct.c_uint32), ("line_info", ct.c_uint64),
                ("line_info_cnt", ct.c_uint32), ("attach_btf_id", ct.c_uint32)]


class RawTpOpenAttr(ct.Structure):
    _fields_ = [("name", ct.c_uint64), ("prog_fd", ct.c_uint32)]


def obj_name(name: str) -> bytes:
    """A program's or map's name as the kernel takes it: at most 15 characters of [A-Za-z0-9_.]."""
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name)[:15].encode()


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0, name: str = "",
               btf_fd: int = 0, btf_key: int = 0, btf_value: int = 0) -> int:
    """A new map (typed by the BTF `btf_fd` where given: task storage needs it); returns its fd."""
    return sys_bpf(MAP_CREATE, MapCreateAttr(map_type=map_type, key_size=key_size, value_size=value_size,
                                             max_entries=max_entries, map_flags=flags, map_name=obj_name(name),
                                             btf_fd=btf_fd, btf_key_type_id=btf_key, btf_value_type_id=btf_value))


def prog_load(insns: bytes, prog_type: int, name: str, license: str = "GPL", kern_version: int = 0,
              attach_type: int = 0, attach_btf_id: int = 0) -> int:
    """Load compiled instructions (map fds already in them, as bcc leaves them); returns the program's fd. A
    refusal raises OSError with the verifier's last lines."""
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license.encode())
    attr = ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ct.addressof(code),
                        license=ct.addressof(lic), kern_version=kern_version, prog_name=obj_name(name),
                        expected_attach_type=attach_type, attach_btf_id=attach_btf_id)
    try:
        return sys_bpf(PROG_LOAD, attr)
    except OSError as err:   # again with the verifier's log (kept off above: writing it doubles the load's time)
        log = ct.create_string_buffer(1 << 22)
        attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ct.addressof(log)
        with contextlib.suppress(OSError):
            sys_bpf(PROG_LOAD, attr)
        raise OSError(err.errno, f"{name}: {err.strerror}: {trim_log(log.value.decode(errors='replace'))}") from None


def load_btf_tracepoint(insns: bytes, name: str, btf_id: int) -> int:
    """Load compiled instructions as a BTF tracepoint program for the vmlinux BTF type `btf_id` (the tracepoint's
    btf_trace_<event> typedef); returns its fd."""
    return prog_load(insns, PROG_TRACING, name, attach_type=TRACE_RAW_TP, attach_btf_id=btf_id)


def open_raw_tracepoint(event: str, prog_fd: int) -> int:
    """Attach a raw tracepoint program to the tracepoint `event` (its name alone); returns the fd that holds it."""
    name = ct.create_string_buffer(event.encode())
    return sys_bpf(RAW_TRACEPOINT_OPEN, RawTpOpenAttr(name=ct.addressof(name), prog_fd=prog_fd))


def btf_bytes(btf_id: int) -> bytes:
    """The raw BTF the kernel holds as object `btf_id`: what was loaded."""
    fd = sys_bpf(BTF_GET_FD_BY_ID, IdAttr(id=btf_id))
    try:
        size = obj_info(fd, BtfInfo()).btf_size
        buf = ct.create_string_buffer(size)
        info = obj_info(fd, BtfInfo(btf=ct.addressof(buf), btf_size=size))
        return buf.raw[:info.btf_size]
    finally:
        os.close(fd)


def btf_load(data: bytes) -> int:
    """Load raw BTF; returns its fd."""
    buf = ct.create_string_buffer(data, len(data))
    return sys_bpf(BTF_LOAD, BtfLoadAttr(btf=ct.addressof(buf), btf_size=len(data)))


def attach_btf_tracepoint(prog_fd: int) -> int:
    """Attach a loaded BTF tracepoint program to its tracepoint (named by the program's BTF id); returns the link
    fd, whose close detaches it."""
    return sys_bpf(RAW_TRACEPOINT_OPEN, RawTpOpenAttr(name=0, prog_fd=prog_fd))


def attach_cgroup(prog_fd: int, cgroup_dir: str, hook: str) -> int:
    """Attach a loaded program to a cgroup2 directory (and so to its descendants) with a BPF link; returns the link
    fd, whose close detaches it. A link, unlike PROG_ATTACH, is always multi-attach: other users' programs on the
    same group are left alone, and several jobs' groups can hold the same program."""
    _, attach_type = CGROUP_HOOKS[hook]
    dfd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return sys_bpf(LINK_CREATE, LinkCreateAttr(prog_fd=prog_fd, target_fd=dfd, attach_type=attach_type))
    finally:
        os.close(dfd)


@contextlib.contextmanager
def stats_enabled(proc: str = "/proc") -> Iterator[None]:
    """Count run_time_ns/run_cnt of every BPF program while inside (two clock reads per run, so it is off by
    default). BPF_ENABLE_STATS holds it on through an fd, so a crash cannot leave it on; kernels before 5.8 get the
    sysctl, restored on the way out."""
    try:
        fd = sys_bpf(ENABLE_STATS, ct.c_uint32(STATS_RUN_TIME))
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            yield
        finally:
            os.close(fd)
        return
    knob = Path(proc, "sys/kernel/bpf_stats_enabled")
    old = knob.read_text().strip()
    knob.write_text("1")
    try:
        yield
    finally:
        knob.write_text(old)
