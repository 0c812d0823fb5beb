# SPDX-License-Identifier: Apache-2.0
"""bpfcache — compiled BPF modules kept between loads: a probe's next start on the same kernel needs neither bcc,
nor LLVM, nor a loader process.

What: once the loader (jobprobe/kernel/bpf_loader.py) has compiled and loaded a module, it writes a record of what
  the kernel was given: each program's instructions (map fds in them, as bcc leaves them), its type, expected attach
  type and BTF id, the module's license and kernel version, and each map's attributes with the fd number the
  instructions name it by. jobprobe.kernel.bpfload.load() looks for the record first; with one it makes the maps,
  puts their fds into the instructions, loads the programs and attaches them in this process. The kernel's verifier
  checks those programs as it checks any.
Key: sha256 of the source, the cflags, the hooks asked for, the names of the maps the caller holds, the number of
  possible CPUs, this format's version and the kernel (release, version string, sha256 of its BTF): another kernel
  or source is another record.
Where: /var/cache/jobprobe/bpf, or JOBPROBE_BPF_CACHE (a directory, or "off"). A record is trusted only where the
  directory and the file belong to this process's user, no one else may write either, and it passes every check of
  read(); otherwise, or when the kernel refuses it, it is not used (one log line) and the module is compiled again
  and its record written anew. At most MAX_RECORDS records; the oldest go first.
Cost: a load from a record is the kernel's own verification of the programs (sched.c: ~0.3 s of system time, as in
  a compile) and ~5 ms besides; compiled, a loader adds ~0.6-1.0 s of CPU (interpreter, bcc, LLVM). `jobprobe run`
  as a whole: scripts/bpf_load_cost.py, docs/PERFORMANCE.md. Oldest kernel: that of the programs.
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from jobprobe.core.digest import sha256

FORMAT = 1
DEFAULT_DIR = "/var/cache/jobprobe/bpf"
MAX_RECORDS = 256
MAX_INSNS = 1_000_000          # the kernel's own limit per program
MAX_BYTES = 64 << 20           # a record larger than this is not read
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
LD_IMM64 = 0x18                # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
PSEUDO_MAP_FD = 1              # src_reg of an ld_imm64 whose imm is a map fd

log = logging.getLogger(__name__)


class Rejected(ValueError):
    """A record that must not be used, and why."""


@dataclass(frozen=True)
class Prog:
    type: int
    attach: int                # expected attach type (0: none)
    btf_id: int                # attach BTF id (0: none)
    insns: bytes


@dataclass(frozen=True)
class MapDef:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    old_fd: int                # the number the instructions name it by
    pinned: bool               # one of the caller's own maps (not made here)
    btf_key: int               # its key's and value's types in the record's BTF (0: none; task storage needs them)
    btf_value: int


@dataclass(frozen=True)
class Record:
    license: str
    kern_version: int
    progs: dict[str, Prog]
    maps: tuple[MapDef, ...]
    btf: bytes                 # the module's BTF, as the kernel was given it (b"": none)


def directory() -> Path | None:
    """The cache directory, or None when caching is off."""
    where = os.environ.get("JOBPROBE_BPF_CACHE", DEFAULT_DIR)
    return None if where in ("", "off") else Path(where)


_kernel: str | None = None


def kernel_identity(sys_root: str = "/sys", proc: str = "/proc") -> str:
    """The running kernel: release, version string, sha256 of its BTF, possible CPUs (read once per process)."""
    global _kernel
    if _kernel is None:
        parts = []
        for p in (f"{proc}/sys/kernel/osrelease", f"{proc}/sys/kernel/version",
                  f"{sys_root}/devices/system/cpu/possible"):
            with contextlib.suppress(OSError):
                parts.append(Path(p).read_text().strip())
        with contextlib.suppress(OSError):
            parts.append(sha256(Path(sys_root, "kernel/btf/vmlinux").read_bytes()).hexdigest())
        _kernel = "\n".join(parts)
    return _kernel


def key(text: str, cflags: Sequence[str], tracepoints: Sequence[tuple[str, str]],
        cgroups: Sequence[tuple[str, str, str]], uprobes: Sequence[str], pinned: Sequence[str]) -> str:
    """A module's record name: what decides the instructions and how each program is loaded (not where a cgroup
    program is linked: that is done anew at each load)."""
    what = {"format": FORMAT, "kernel": kernel_identity(), "text": text, "cflags": list(cflags),
            "tracepoints": [list(t) for t in tracepoints], "cgroups": [[fn, hook] for fn, _, hook in cgroups],
            "uprobes": list(uprobes), "pinned": sorted(pinned)}
    return sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def trusted_dir(d: Path) -> bool:
    """The directory exists, is a directory (not a link) of this user that nobody else may write."""
    try:
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _int(x: Any, what: str, lo: int = 0, hi: int = 0xFFFFFFFF) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise Rejected(f"{what}: {x!r} is not an integer in [{lo}, {hi}]")
    return x


def parse(data: bytes) -> Record:
    """A record from its bytes, every field checked; raises Rejected."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise Rejected(f"not JSON: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise Rejected("not a record of this format")
    lic = doc.get("license")
    if not isinstance(lic, str) or not 0 < len(lic) <= 128 or not lic.isprintable():
        raise Rejected("bad license")
    progs, maps = doc.get("progs"), doc.get("maps")
    if not isinstance(progs, dict) or not progs or not isinstance(maps, list):
        raise Rejected("no programs or no map list")
    try:
        btf = base64.b64decode(doc.get("btf", ""), validate=True)
    except (ValueError, TypeError):
        raise Rejected("BTF not base64") from None
    if len(btf) > MAX_BYTES // 2:
        raise Rejected(f"{len(btf)} bytes of BTF")
    out: dict[str, Prog] = {}
    for name, p in progs.items():
        if not NAME.match(name) or not isinstance(p, dict):
            raise Rejected(f"bad program {name!r}")
        try:
            insns = base64.b64decode(p.get("insns", ""), validate=True)
        except (ValueError, TypeError):
            raise Rejected(f"{name}: instructions not base64") from None
        if not insns or len(insns) % 8 or len(insns) > 8 * MAX_INSNS:
            raise Rejected(f"{name}: {len(insns)} bytes of instructions")
        out[name] = Prog(_int(p.get("type"), f"{name} type", 1, 64), _int(p.get("attach", 0), f"{name} attach", 0, 64),
                         _int(p.get("btf_id", 0), f"{name} btf_id"), insns)
    defs = []
    for m in maps:
        if not isinstance(m, dict) or not isinstance(m.get("name"), str) or not NAME.match(m["name"]):
            raise Rejected(f"bad map {m!r:.80}")
        n = m["name"]
        defs.append(MapDef(n, _int(m.get("type"), f"{n} type", 1, 64), _int(m.get("key_size"), f"{n} key_size"),
                           _int(m.get("value_size"), f"{n} value_size"),
                           _int(m.get("max_entries"), f"{n} max_entries"), _int(m.get("flags", 0), f"{n} flags"),
                           _int(m.get("old_fd"), f"{n} old_fd", 0, 1 << 20), m.get("pinned") is True,
                           _int(m.get("btf_key", 0), f"{n} btf_key"), _int(m.get("btf_value", 0), f"{n} btf_value")))
    if any(d.btf_key or d.btf_value for d in defs) and not btf:
        raise Rejected("map types named in a BTF the record does not hold")
    if len({d.old_fd for d in defs}) != len(defs) or len({d.name for d in defs}) != len(defs):
        raise Rejected("two maps share a name or a number")
    rec = Record(lic, _int(doc.get("kern_version", 0), "kern_version"), out, tuple(defs), btf)
    for name, p in out.items():
        relocate(p.insns, {d.old_fd: 0 for d in defs}, name)      # every map an instruction names is in the record
    return rec


def relocate(insns: bytes, fds: dict[int, int], name: str = "") -> bytes:
    """The instructions with each map fd (an ld_imm64 with src_reg BPF_PSEUDO_MAP_FD) replaced through `fds`.
    Raises Rejected on an fd not in `fds`, on any other kind of ld_imm64 (map values, BTF ids, functions: bcc's
    modules have none) and on an ld_imm64 cut in half."""
    out = bytearray(insns)
    i, n = 0, len(insns) // 8
    while i < n:
        code, regs, _off, imm = struct.unpack_from("<BBhi", out, 8 * i)
        if code == LD_IMM64:
            if i + 1 >= n:
                raise Rejected(f"{name}: an ld_imm64 cut short at instruction {i}")
            src = regs >> 4
            if src == PSEUDO_MAP_FD:
                if imm not in fds:
                    raise Rejected(f"{name}: instruction {i} names map fd {imm}, not in the record")
                struct.pack_into("<i", out, 8 * i + 4, fds[imm])
            elif src != 0:
                raise Rejected(f"{name}: instruction {i} is an ld_imm64 of kind {src}")
            i += 2
            continue
        i += 1
    return bytes(out)


def read(path: Path) -> Record | None:
    """The record at `path`, or None when there is none; raises Rejected when one is there but must not be used."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise Rejected(f"cannot open: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise Rejected("not a regular file of this user that only it may write")
        if st.st_size > MAX_BYTES:
            raise Rejected(f"{st.st_size} bytes")
        return parse(f.read(MAX_BYTES + 1))


def dump(rec: Record) -> bytes:
    return json.dumps({"format": FORMAT, "license": rec.license, "kern_version": rec.kern_version,
                       "btf": base64.b64encode(rec.btf).decode(),
                       "progs": {n: {"type": p.type, "attach": p.attach, "btf_id": p.btf_id,
                                     "insns": base64.b64encode(p.insns).decode()} for n, p in rec.progs.items()},
                       "maps": [{"name": m.name, "type": m.type, "key_size": m.key_size, "value_size": m.value_size,
                                 "max_entries": m.max_entries, "flags": m.flags, "old_fd": m.old_fd,
                                 "pinned": m.pinned, "btf_key": m.btf_key, "btf_value": m.btf_value}
                                for m in rec.maps]}).encode()


def write(d: Path, name: str, rec: Record) -> None:
    """Store `rec` as d/name (made 0700 if missing; written whole then renamed: a reader sees all of it or none),
    then keep the newest MAX_RECORDS. Raises OSError; a directory that is not trusted is left alone."""
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not trusted_dir(d):
        raise OSError(f"{d} is not a directory of this user that only it may write")
    tmp = d / f".{name}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(dump(rec))
        os.replace(tmp, d / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    def age(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:         # another writer's eviction took it meanwhile
            return 0.0
    records = sorted((p for p in d.iterdir() if not p.name.startswith(".")), key=age)
    for old in records[:-MAX_RECORDS]:
        with contextlib.suppress(OSError):
            old.unlink()


PERF_TYPE_TRACEPOINT, PERF_SAMPLE_RAW = 2, 1 << 10


def open_tracepoint(sys_root: str, tp: str, prog_fd: int) -> int:
    """A classic tracepoint "category:event" running prog_fd, attached as bcc attaches one; closing the fd detaches
    it."""
    from jobprobe.kernel import perf as _perf
    from jobprobe.kernel.tracefs import event_dir
    cat, event = tp.split(":", 1)
    d = event_dir(sys_root, cat, event)
    if d is None:
        raise OSError(f"no tracepoint {tp}")
    attr = _perf.PerfEventAttr()
    attr.type, attr.size, attr.config = PERF_TYPE_TRACEPOINT, ctypes.sizeof(attr), int((d / "id").read_text())
    attr.sample_period, attr.wakeup_events, attr.sample_type = 1, 1, PERF_SAMPLE_RAW
    return _perf.open_bpf_event(attr, prog_fd)


def instantiate(rec: Record, tracepoints: Sequence[tuple[str, str]], cgroups: Sequence[tuple[str, str, str]],
                uprobes: Sequence[str], pinned: dict[str, int], sys_root: str = "/sys") -> tuple[dict[str, Any],
                                                                                               list[int]]:
    """Make the record's maps, load the programs asked for and attach them as bpf_loader.load does: the same
    metadata and fds as its reply (the caller's pinned maps dup'd). Raises Rejected (the record does not fit the
    request) or OSError (the kernel refused); then every fd made here is closed."""
    from jobprobe.kernel import bpf as _bpf
    fds: list[int] = []
    try:
        wanted = [fn for _, fn in tracepoints] + [fn for fn, _, _ in cgroups] + list(uprobes)
        missing = [fn for fn in wanted if fn not in rec.progs]
        if missing:
            raise Rejected(f"no program {missing[0]!r} in the record")
        if {m.name for m in rec.maps if m.pinned} != set(pinned):
            raise Rejected("the record's shared maps are not the ones given")
        btf_fd = _bpf.btf_load(rec.btf) if rec.btf else 0      # the maps hold it; closed once they are made
        try:                      # the maps first: fds[i] is rec.maps[i]
            for m in rec.maps:
                fds.append(os.dup(pinned[m.name]) if m.pinned else   # (the caller keeps its own fd)
                           _bpf.map_create(m.type, m.key_size, m.value_size, m.max_entries, m.flags, m.name,
                                           btf_fd if m.btf_key or m.btf_value else 0, m.btf_key, m.btf_value))
        finally:
            if btf_fd:
                os.close(btf_fd)
        new_fd = {m.old_fd: fd for m, fd in zip(rec.maps, fds)}
        maps = [{"name": m.name, "type": m.type, "key_size": m.key_size, "value_size": m.value_size,
                 "max_entries": m.max_entries, "fd": i} for i, m in enumerate(rec.maps)]
        progs: dict[str, int] = {}

        def prog(fn: str) -> int:
            if fn not in progs:
                p = rec.progs[fn]
                fd = _bpf.prog_load(relocate(p.insns, new_fd, fn), p.type, fn, rec.license, rec.kern_version,
                                    p.attach, p.btf_id)
                fds.append(fd)
                progs[fn] = len(fds) - 1
            return fds[progs[fn]]
        links = []
        for tp, fn in tracepoints:
            pfd = prog(fn)
            if tp.startswith(_bpf.BTF):
                fd = _bpf.attach_btf_tracepoint(pfd)
            elif tp.startswith(_bpf.RAW):
                fd = _bpf.open_raw_tracepoint(tp.rsplit(":", 1)[1], pfd)
            else:
                fd = open_tracepoint(sys_root, tp, pfd)
            fds.append(fd)
            links.append({"tracepoint": tp, "prog": fn, "fd": len(fds) - 1})
        for fn, path, hook in cgroups:
            pfd = prog(fn)
            if path:
                fds.append(_bpf.attach_cgroup(pfd, path, hook))
                links.append({"tracepoint": f"{hook}:{path}", "prog": fn, "fd": len(fds) - 1})
        for fn in uprobes:
            prog(fn)
    except BaseException:
        _bpf.close_all(fds)
        raise
    meta = {"progs": [{"name": n, "fd": i} for n, i in progs.items()], "links": links, "maps": maps,
            "nfds": len(fds)}
    return meta, fds
