"""_bpf — the one way an eBPF probe loads programs and reads maps, without bcc or LLVM in the agent.

What: load() starts a short-lived loader (jobprobe/kernel/bpf_loader.py, same interpreter) that compiles bpf/<name>.c with
  bcc, loads its programs, attaches them to tracepoints (and, when asked, to cgroup2 directories through BPF links)
  and sends back, over a socketpair (SCM_RIGHTS), the fds of every program, every attachment (a perf_event fd per
  tracepoint, a bpf_link fd per cgroup hook) and every map, then exits. Holding those fds keeps everything
  attached; closing them (Loaded.close) detaches. Maps are then read and written with plain bpf(2) syscalls through
  ctypes (Map): lookup / update / delete, iteration, per-CPU values, batch lookups.
Hooks: none of its own; bpf(2) commands MAP_*_ELEM, MAP_GET_NEXT_KEY, MAP_LOOKUP_BATCH, OBJ_GET_INFO_BY_FD,
  ENABLE_STATS, LINK_CREATE; SCM_RIGHTS on an AF_UNIX socketpair.
Oldest kernel: 4.12 (GET_NEXT_KEY with no key for the first one). Batch lookups need 5.6 (hash maps) / 5.7 (arrays)
  and fall back to one lookup per key; run_time_ns/run_cnt need 5.1, ENABLE_STATS 5.8 (else the sysctl); cgroup
  hooks through LINK_CREATE 5.7 (a link detaches when its last fd closes, so no exit path can leave one attached).
Cost: the agent never maps libbcc/LLVM (jobprobe run: 19 MB RSS instead of 141 MB); a load costs one
  interpreter start plus the compile (~0.4-0.6 s in a 6.18 VM), once per probe start. A map read is one syscall
  per element, or per batch of up to 1024 (per key on kernels without batch ops).
"""
from __future__ import annotations

import array
import contextlib
import ctypes as ct
import errno
import json
import mmap
import operator
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from jobprobe import bpf
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel.host import parse_cpu_list

NR_BPF = {"x86_64": 321, "aarch64": 280}   # asm/unistd.h; bpf(2) has no libc wrapper

# include/uapi/linux/bpf.h: enum bpf_cmd, enum bpf_map_type, update flags
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_GET_NEXT_ID, PROG_GET_FD_BY_ID = 11, 13
OBJ_PIN = 6
PROG_LOAD, RAW_TRACEPOINT_OPEN = 5, 17
PROG_TRACING, TRACE_RAW_TP = 26, 23     # enum bpf_prog_type, enum bpf_attach_type
OBJ_GET_INFO_BY_FD = 15
MAP_LOOKUP_BATCH = 24
LINK_CREATE = 28
ENABLE_STATS = 32
STATS_RUN_TIME = 0
ANY, NOEXIST, EXIST = 0, 1, 2
PERCPU_TYPES = {5, 6, 10, 21}   # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH, PERCPU_CGROUP_STORAGE
ENOTSUPP = 524                  # the kernel-internal errno that batch ops return for unsupported map types
BATCH = 1024                    # elements per batch call
MAX_FDS = 253                   # SCM_MAX_FD: the most fds one message may carry
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
    """struct bpf_map_info up to its name (the kernel's own view of a map, to check what a loader said)."""
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("key_size", ct.c_uint32), ("value_size", ct.c_uint32),
                ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32), ("name", ct.c_char * 16)]


_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


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


def addr(buf: Any) -> int:
    return ct.addressof(buf) if buf is not None else 0


def possible_cpus(sys_root: str = "/sys") -> int:
    """How many CPUs a per-CPU map holds a value for: the kernel copies one per possible CPU (not online)."""
    return len(parse_cpu_list(Path(sys_root, "devices/system/cpu/possible").read_text()))


def percpu_stride(value_size: int) -> int:
    """Each CPU's value in a per-CPU map buffer is padded to 8 bytes (kernel: round_up(value_size, 8))."""
    return (value_size + 7) & ~7


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
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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


def load_btf_tracepoint(insns: bytes, name: str, btf_id: int) -> int:
    """Load compiled instructions (map fds already in them, as bcc leaves them) as a BTF tracepoint program for
    the vmlinux BTF type `btf_id` (the tracepoint's btf_trace_<event> typedef); returns its fd. A refusal raises
    OSError with the verifier's last lines."""
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(b"GPL")
    attr = ProgLoadAttr(prog_type=PROG_TRACING, insn_cnt=len(insns) // 8, insns=ct.addressof(code),
                        license=ct.addressof(lic), prog_name=name[:15].encode(), expected_attach_type=TRACE_RAW_TP,
                        attach_btf_id=btf_id)
    try:
        return sys_bpf(PROG_LOAD, attr)
    except OSError as err:   # again with the verifier's log (kept off above: writing it doubles the load's time)
        log = ct.create_string_buffer(1 << 22)
        attr.log_level, attr.log_size, attr.log_buf = 1, len(log), ct.addressof(log)
        with contextlib.suppress(OSError):
            sys_bpf(PROG_LOAD, attr)
        raise OSError(err.errno, f"{name}: {err.strerror}: {trim_log(log.value.decode(errors='replace'))}") from None


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


MAP_RINGBUF = 27
RINGBUF_BUSY, RINGBUF_DISCARD, RINGBUF_HDR = 1 << 31, 1 << 30, 8   # include/uapi/linux/bpf.h BPF_RINGBUF_*


class MapCreateAttr(ct.Structure):
    _fields_ = [("map_type", ct.c_uint32), ("key_size", ct.c_uint32), ("value_size", ct.c_uint32),
                ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32)]


def ringbuf_supported() -> bool:
    """Can this kernel make a BPF ring buffer (Linux 5.8)? Asked by making one of one page and closing it."""
    try:
        fd = sys_bpf(MAP_CREATE, MapCreateAttr(map_type=MAP_RINGBUF, max_entries=mmap.PAGESIZE))
    except OSError:
        return False
    os.close(fd)
    return True


class RingBuffer:
    """The user-space side of a BPF ring buffer map (BPF_MAP_TYPE_RINGBUF), read without libbpf: its consumer page
    mapped read-write, its producer page and data area read-only (the kernel maps the data twice in a row, so a
    record that wraps reads as one piece). drain() returns the records committed so far and frees their space.
    One reader at a time (the caller's lock)."""

    def __init__(self, fd: int, size: int):
        if size <= 0 or size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power of two")
        page = mmap.PAGESIZE
        self.size, self.page = size, page
        self.cons = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)

    def drain(self) -> list[bytes]:
        out = []
        cons = struct.unpack_from("<Q", self.cons, 0)[0]
        prod = struct.unpack_from("<Q", self.prod, 0)[0]
        while cons < prod:
            at = self.page + (cons & (self.size - 1))
            head = struct.unpack_from("<I", self.prod, at)[0]
            if head & RINGBUF_BUSY:
                break                       # reserved, not yet committed: the rest waits for the next drain
            length = head & ~(RINGBUF_BUSY | RINGBUF_DISCARD)
            if not head & RINGBUF_DISCARD:
                out.append(self.prod[at + RINGBUF_HDR:at + RINGBUF_HDR + length])
            cons += (length + RINGBUF_HDR + 7) & ~7
            struct.pack_into("<Q", self.cons, 0, cons)
        return out

    def close(self) -> None:
        self.cons.close()
        self.prod.close()


class Map:
    """One BPF map, by fd. Keys and values are bytes unless typed() gave ctypes types: then ints (simple types)
    or ctypes structs go in and come out. Per-CPU maps take and give a list with one value per possible CPU."""

    def __init__(self, fd: int, name: str, type: int, key_size: int, value_size: int, max_entries: int,
                 ncpus: int = 1):
        self.fd, self.name, self.type = fd, name, type
        self.key_size, self.value_size, self.max_entries = key_size, value_size, max_entries
        self.percpu = type in PERCPU_TYPES
        self.ncpus = ncpus if self.percpu else 1
        self.stride = percpu_stride(value_size) if self.percpu else value_size
        self.key_type: Any = None    # ctypes types, from typed()
        self.value_type: Any = None
        self._batch_ok = True        # until the kernel says this map (or kernel) has no batch lookup
        self._sums: dict[int, tuple[bytes, list[int]]] = {}   # sums_at's last answer per index, with its bytes

    def typed(self, key: Any = None, value: Any = None) -> Map:
        """Set the ctypes key/value types, checking their sizes against the kernel's: a layout mismatch between
        Python and C is caught at start, not read as garbage."""
        for what, t, size in (("key", key, self.key_size), ("value", value, self.value_size)):
            if t is not None and ct.sizeof(t) != size:
                raise ValueError(f"map {self.name}: {what} type {t.__name__} is {ct.sizeof(t)} bytes, the map's "
                                 f"{what} is {size}")
        self.key_type, self.value_type = key, value
        return self

    # -- conversions
    def _raw(self, obj: Any, t: Any, size: int) -> bytes:
        if isinstance(obj, (bytes, bytearray, ct.Structure, ct.Union, ct.Array, ct._SimpleCData)):
            raw = bytes(obj)
        elif t is not None:
            raw = bytes(t(obj))
        else:
            raise TypeError(f"map {self.name}: give bytes or a ctypes object, or call typed() first")
        if len(raw) != size:
            raise ValueError(f"map {self.name}: {len(raw)} bytes given, {size} expected")
        return raw

    def _decode(self, raw: bytes, t: Any) -> Any:
        if t is None:
            return raw
        obj = t.from_buffer_copy(raw)
        return obj.value if isinstance(obj, ct._SimpleCData) else obj

    def _key_buf(self, key: Any) -> Any:
        return ct.create_string_buffer(self._raw(key, self.key_type, self.key_size), self.key_size)

    def _values(self, buf: Any, offset: int = 0) -> Any:
        """One element's value from a buffer: the value, or a list of per-CPU values."""
        raw = bytes(buf[offset:offset + self.stride * self.ncpus])
        if not self.percpu:
            return self._decode(raw, self.value_type)
        return [self._decode(raw[i * self.stride:i * self.stride + self.value_size], self.value_type)
                for i in range(self.ncpus)]

    # -- element operations
    def lookup(self, key: Any) -> Any:
        """The value (list of per-CPU values for a per-CPU map), or None when the key is absent."""
        raw = self._lookup_raw(key)
        return None if raw is None else self._values(raw)

    def _lookup_raw(self, key: Any) -> bytes | None:
        """One element's value as the kernel copies it (every CPU's, padded to stride), or None when absent."""
        kb, vb = self._key_buf(key), ct.create_string_buffer(self.stride * self.ncpus)
        try:
            sys_bpf(MAP_LOOKUP_ELEM, ElemAttr(map_fd=self.fd, key=addr(kb), value=addr(vb)))
        except FileNotFoundError:
            return None
        return vb.raw

    def _column_sums(self, raw: bytes) -> list[int]:
        """One element's per-CPU values of u64 fields, summed over CPUs as flat columns."""
        words, per, n = array.array("Q", raw), self.stride // 8, self.value_size // 8
        if self.ncpus <= 4:         # a few CPUs: pairwise adds in C are quickest (2 CPUs: 5 µs vs 11 for 80 fields)
            acc = words[0:n].tolist()
            for c in range(1, self.ncpus):
                acc = list(map(operator.add, acc, words[c * per:c * per + n]))
            return acc
        return [sum(col) for col in zip(*(words[c * per:c * per + n] for c in range(self.ncpus)))]

    def lookup_sums(self, key: Any) -> list[int] | None:
        """A per-CPU value made of u64 fields, summed over CPUs as flat u64 columns (no ctypes decode: the
        agent reads one such value per job and probe every tick); None when the key is absent."""
        raw = self._lookup_raw(key)
        return None if raw is None else self._column_sums(raw)

    def array_raw(self) -> bytes:
        """An array map's every value, raw, in key order (0 … max_entries-1; per-CPU maps: each key's CPUs in turn):
        batch lookups where the kernel has them (5.6), else a lookup per key. For sums_at()."""
        size = self.stride * self.ncpus
        raw = self._batch_or_none(lambda: b"".join(vals[:n * size] for _, vals, n in self._batches()))
        if raw is not None and len(raw) == self.max_entries * size:
            return raw
        out = []
        for i in range(self.max_entries):
            raw = self._lookup_raw(i)
            if raw is None:
                raise FileNotFoundError(errno.ENOENT, f"map {self.name}: no element {i}")
            out.append(raw)
        return b"".join(out)

    def sums_at(self, raw: bytes, index: int) -> list[int]:
        """lookup_sums() of key `index` from array_raw()'s bytes. An element whose bytes are those of the last
        call for that index (an idle job's slot) is not summed again: one compare instead of ncpus × fields adds."""
        size = self.stride * self.ncpus
        chunk = raw[index * size:(index + 1) * size]
        last = self._sums.get(index)
        if last is not None and last[0] == chunk:
            return list(last[1])
        sums = self._column_sums(chunk)
        self._sums[index] = (chunk, sums)
        return list(sums)

    def update(self, key: Any, value: Any, flags: int = ANY) -> None:
        if self.percpu and not isinstance(value, (bytes, bytearray)):
            if len(value) != self.ncpus:
                raise ValueError(f"map {self.name}: {len(value)} per-CPU values given, {self.ncpus} CPUs")
            pad = bytes(self.stride - self.value_size)
            raw = b"".join(self._raw(v, self.value_type, self.value_size) + pad for v in value)
        else:
            raw = self._raw(value, self.value_type, self.stride * self.ncpus)
        kb, vb = self._key_buf(key), ct.create_string_buffer(raw, len(raw))
        sys_bpf(MAP_UPDATE_ELEM, ElemAttr(map_fd=self.fd, key=addr(kb), value=addr(vb), flags=flags))

    def delete(self, key: Any) -> bool:
        """False when the key was not there (arrays cannot delete: EINVAL is raised)."""
        kb = self._key_buf(key)
        try:
            sys_bpf(MAP_DELETE_ELEM, ElemAttr(map_fd=self.fd, key=addr(kb)))
        except FileNotFoundError:
            return False
        return True

    def __contains__(self, key: Any) -> bool:
        return self.lookup(key) is not None

    def keys(self) -> list[Any]:
        """Every key, by GET_NEXT_KEY. A list, not a generator: deleting the current key while walking a hash map
        restarts the walk from the first bucket."""
        out, prev = [], None
        nxt = ct.create_string_buffer(self.key_size)
        while True:
            try:
                sys_bpf(MAP_GET_NEXT_KEY, ElemAttr(map_fd=self.fd, key=addr(prev), value=addr(nxt)))
            except FileNotFoundError:
                return out
            out.append(self._decode(nxt.raw, self.key_type))
            prev, nxt = nxt, ct.create_string_buffer(self.key_size)
            if len(out) > self.max_entries:   # a map churning faster than we walk it: stop, never loop forever
                return out

    def items(self) -> list[tuple[Any, Any]]:
        """Every (key, value): batch lookups where the kernel has them, else one lookup per key."""
        got = self._batch_or_none(self._items_batch)
        if got is not None:
            return got
        out = []
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:            # deleted between the walk and the lookup
                out.append((k, v))
        return out

    def _batch_or_none(self, fn: Any) -> Any:
        """fn() (batch lookups), or None where the kernel has none for this map: kernel < 5.6, or a map type
        without batch ops — asked once, then not again."""
        if not self._batch_ok:
            return None
        try:
            return fn()
        except OSError as err:
            if err.errno not in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            self._batch_ok = False
            return None

    def _items_batch(self) -> list[tuple[Any, Any]]:
        out = []
        for keys, vals, n in self._batches():
            for i in range(n):
                key = self._decode(keys[i * self.key_size:(i + 1) * self.key_size], self.key_type)
                out.append((key, self._values(vals, i * self.stride * self.ncpus)))
        return out

    def _batches(self) -> Iterator[tuple[bytes, bytes, int]]:
        """The map in MAP_LOOKUP_BATCH chunks: (keys, values, how many came back) each."""
        count = min(BATCH, max(self.max_entries, 1))
        # The batch token is a bucket index (u32) for hash maps and a key for the others.
        token_in, token_out = (ct.create_string_buffer(max(self.key_size, 8)) for _ in range(2))
        first = True
        while True:
            keys = ct.create_string_buffer(count * self.key_size)
            vals = ct.create_string_buffer(count * self.stride * self.ncpus)
            attr = BatchAttr(in_batch=0 if first else addr(token_in), out_batch=addr(token_out), keys=addr(keys),
                             values=addr(vals), count=count, map_fd=self.fd)
            done = False
            try:
                sys_bpf(MAP_LOOKUP_BATCH, attr)
            except FileNotFoundError:
                done = True              # the last chunk: attr.count still says how many came back
            except OSError as err:
                if err.errno == errno.ENOSPC and count < self.max_entries:
                    count *= 2           # a hash bucket longer than count: retry with room for it
                    continue
                raise
            yield keys.raw, vals.raw, attr.count
            if done:
                return
            ct.memmove(token_in, token_out, len(token_out))
            first = False


@dataclass
class ProgStats:
    run_time_ns: int
    run_cnt: int
    recursion_misses: int = 0


class Loaded:
    """What one load() gave: fds of programs, attachments and maps. Holding them keeps the programs attached.
    links: (what, program, fd): what is a tracepoint "category:event", or "HOOK:CGROUP_DIR" for a cgroup link."""

    def __init__(self, name: str, progs: dict[str, int], links: list[tuple[str, str, int]], maps: dict[str, Map],
                 loader_pid: int = 0):
        self.name, self.progs, self.links, self.maps = name, progs, links, maps
        self.loader_pid = loader_pid

    def fds(self) -> list[int]:
        return [fd for _, _, fd in self.links] + list(self.progs.values()) + [m.fd for m in self.maps.values()]

    def close(self) -> None:
        """Close every fd, attachments first so that no event runs a half-torn-down program. Idempotent; maps are
        marked closed (fd -1) so that a stale Map cannot reach an unrelated file that reused the number."""
        fds = [fd for fd in self.fds() if fd >= 0]
        self.links, self.progs = [], {}
        for m in self.maps.values():
            m.fd = -1
        close_all(fds)

    def prog_stats(self) -> dict[str, ProgStats]:
        """Cumulative run time and run count of each program (counted only while stats are enabled)."""
        infos = {name: prog_info(fd) for name, fd in self.progs.items()}
        return {name: ProgStats(i.run_time_ns, i.run_cnt, i.recursion_misses) for name, i in infos.items()}

    def __enter__(self) -> Loaded:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The loader's one reply: JSON and the fds attached to it (close-on-exec from the moment they arrive). Raises
    OSError if the loader sent nothing or its fds were cut short, closing whatever did arrive."""
    # Not socket.recv_fds: Python 3.11's ignores its flags argument, so the fds would arrive without close-on-exec
    # and leak into any process another thread forks meanwhile.
    msg, anc, flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4),
                                      socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
    got = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got.frombytes(data[:len(data) - len(data) % got.itemsize])
    fds = list(got)
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise OSError(errno.EMSGSIZE, "loader reply truncated")
        if not msg:
            raise OSError(errno.EPIPE, "loader exited without a reply")
        meta = json.loads(msg)
        if len(fds) != meta.get("nfds", 0):
            raise OSError(errno.EBADMSG, f"loader sent {len(fds)} fds, said {meta.get('nfds')}")
    except (OSError, ValueError):
        close_all(fds)
        raise
    return meta, fds


def build(name: str, meta: dict[str, Any], fds: list[int], ncpus: int, loader_pid: int) -> Loaded:
    progs = {p["name"]: fds[p["fd"]] for p in meta["progs"]}
    links = [(ln["tracepoint"], ln["prog"], fds[ln["fd"]]) for ln in meta["links"]]
    maps = {m["name"]: Map(fds[m["fd"]], m["name"], m["type"], m["key_size"], m["value_size"], m["max_entries"],
                           ncpus) for m in meta["maps"]}
    return Loaded(name, progs, links, maps, loader_pid)


def load(name: str, cflags: Sequence[str], tracepoints: Sequence[tuple[str, str]], text: str | None = None,
         timeout: float = 120.0, sys_root: str = "/sys",
         cgroups: Sequence[tuple[str, str, str]] = (), uprobes: Sequence[str] = (),
         pinned: dict[str, int] | None = None) -> Loaded:
    """Compile bpf/<name>.c (or `text`), attach each (tracepoint "category:event" or "raw:category:event", function)
    in order, then each (function, cgroup2 directory, hook in CGROUP_HOOKS) through a BPF link, load each function
    of `uprobes` as a
    BPF_PROG_TYPE_KPROBE program WITHOUT attaching it (the caller attaches it to uprobes through perf_event_open,
    probes/cuda.py: which files to probe is only known later), and return the fds. Raises
    ProbeUnavailable with the compiler's or verifier's last lines; then no fd is left open here and nothing stays
    attached (the loader's own fds die with it). `pinned`: maps the caller holds ({name: fd}: the node's membership
    maps) that the module declares with BPF_TABLE_PINNED; the loader inherits the fds and pins them where only it
    can see them (pin_dir)."""
    text = bpf.source(name) if text is None else text
    for _, _, hook in cgroups:
        if hook not in CGROUP_HOOKS:
            raise ValueError(f"unknown cgroup hook {hook!r}; known: {', '.join(CGROUP_HOOKS)}")
    with pin_dir(bool(pinned)) as where:
        request = json.dumps({"text": text, "cflags": list(cflags), "tracepoints": [list(t) for t in tracepoints],
                              "cgroups": [list(c) for c in cgroups], "uprobes": list(uprobes),
                              "pinned": dict(pinned or {}), "pin_dir": where})
        meta, fds, pid, why = run_loader(name, request, timeout, tuple((pinned or {}).values()))
    what = f"cannot load bpf/{name}.c"
    if "error" in meta:
        close_all(fds)
        raise ProbeUnavailable(f"{what}: {meta['error']}" + (f": {why}" if why else ""))
    try:
        return build(name, meta, fds, possible_cpus(sys_root), pid)
    except (KeyError, IndexError, OSError, ValueError) as err:
        close_all(fds)
        raise ProbeUnavailable(f"{what}: bad loader reply: {err}") from err


@contextlib.contextmanager
def pin_dir(wanted: bool) -> Iterator[str | None]:
    """A fresh empty directory (mkdtemp: 0700, a name nobody can guess) for the loader to mount its private bpffs on
    and pin the shared maps in, removed once the loader has exited — however it ended (an error, a timeout, a
    kill). It is made and removed here, not in the loader: a loader killed mid-compile cleans up nothing, and a load
    per probe start would leave one directory in the temp directory each time. The mount lived in the loader's own
    mount namespace only, so the directory is empty again on this side. None when nothing is pinned."""
    if not wanted:
        yield None
        return
    where = tempfile.mkdtemp(prefix="jobprobe-pins-")
    try:
        yield where
    finally:
        with contextlib.suppress(OSError):   # a directory left over must not fail a load that worked
            os.rmdir(where)


def run_loader(name: str, request: str, timeout: float,
               inherited: tuple[int, ...]) -> tuple[dict[str, Any], list[int], int, str]:
    """Run the loader on `request` (it inherits the fds `inherited`) and wait for it to exit; returns its reply's
    metadata, the fds it sent, its pid and the last lines of its log."""
    what = f"cannot load bpf/{name}.c"
    root = str(Path(__file__).resolve().parents[2])   # the checkout: `-m jobprobe.kernel.bpf_loader` imports from any cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # The loader's log goes to a file, not a pipe: a verifier log can be megabytes and would block a full pipe.
    with ours, tempfile.TemporaryFile() as log:
        try:
            with theirs:
                proc = subprocess.Popen([sys.executable, "-m", "jobprobe.kernel.bpf_loader", str(theirs.fileno())],
                                        stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                        pass_fds=(theirs.fileno(), *inherited))
            try:
                proc.communicate(request.encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                with contextlib.suppress(OSError, ValueError):
                    close_all(receive(ours)[1])   # a reply sent just before the kill
                raise ProbeUnavailable(f"{what}: the loader took more than {timeout:.0f} s") from None
        except OSError as err:
            raise ProbeUnavailable(f"{what}: cannot start the loader: {err}") from err
        log.seek(0)
        why = trim_log(log.read().decode(errors="replace"))
        try:
            meta, fds = receive(ours)
        except (OSError, ValueError) as err:
            raise ProbeUnavailable(f"{what}: loader exit {proc.returncode}: {err}"
                                   + (f": {why}" if why else "")) from err
    return meta, fds, proc.pid, why
