# SPDX-License-Identifier: Apache-2.0
"""bpf_loader — the short-lived process that holds bcc and LLVM so that the agent never does.

Run by jobprobe.kernel.bpfload.load() as `python -m jobprobe.kernel.bpf_loader FD` (FD: its end of an AF_UNIX
SOCK_SEQPACKET pair).
Reads one JSON request on stdin: {"text": C source, "cflags": [...], "tracepoints": [["cat:event", "function"]…],
"cgroups": [["function", "/cgroup2/dir", "cgroup_skb/egress"]…], "uprobes": ["function"…], "pinned": {"map": FD…},
"pin_dir": "/tmp/jobprobe-pins-XXXX", "cache": {"dir": ..., "name": ...} or null}; with "cache", once loaded it
writes the module's record there (jobprobe/kernel/bpfcache.py: a next load needs no compile); with "pinned" (maps
the agent already holds, passed as inherited fds: the
node's membership maps), it first moves to a mount namespace of its own, mounts a bpffs on "pin_dir" there, pins each
fd under its name and compiles with -DJOB_PIN_DIR="<pin_dir>", so that the module's BPF_TABLE_PINNED declarations
(bpf/common.h) open those very maps; the namespace, the mount and the pins vanish with this process, and nothing
stays in the kernel but what the agent holds by fd. The empty directory itself is the agent's, made before this
process starts and removed after it exits (jobprobe.kernel.bpfload.pin_dir), so that no way of ending here leaves it
behind. Then it compiles with bcc,
attaches each function to its tracepoint in the given order ("raw:cat:event": as a raw tracepoint program), by name
(not bcc's auto-attached TRACEPOINT_PROBE: when
one of several programs fails, bcc 0.26's constructor raises with the earlier ones attached and no object left to
detach them), then loads each cgroup function as its hook's program type (one function per program type: bcc caches
by name) and links it to its directory (BPF_LINK_CREATE, jobprobe.kernel.bpf.attach_cgroup), loads each uprobes
function as
a kprobe-type program (what uprobes run) without attaching it (the agent attaches it per library file, later), and
replies with ONE message: JSON metadata plus, as SCM_RIGHTS, the fds of every program, every attachment (perf_event,
bpf_link) and every map. Any failure replies {"error": ...} with no fds; bcc's compiler and verifier logs go to
stderr, which the agent reads from a file.
Hooks: whatever the request names. Oldest kernel: that of the program loaded. Cost: ~135 MiB of RSS (bcc, LLVM)
  and ~0.4-0.6 s (sched.c in a 6.18 VM), for the lifetime of this process only.

It always leaves with os._exit, skipping bcc's atexit cleanup: that cleanup issues PERF_EVENT_IOC_DISABLE on the
very perf events the agent now holds (the same open files) and tears LLVM down for nothing. Tracepoint programs
survive the disable (checked on 6.18: a tracepoint runs its BPF programs whether or not the perf event is enabled),
but nothing here should depend on that for other attach types.
"""
from __future__ import annotations

import ctypes as ct
import json
import os
import socket
import sys
from typing import Any

from jobprobe.core.libc import LIBC


def describe_maps(lib: Any, module: int) -> list[dict[str, Any]]:
    """Every map bcc created for the module, from libbcc's table registry (ids 0..n-1). bcc's Python wrapper
    declares only some of these functions, so their signatures are set here."""
    sigs = {"bpf_num_tables": (ct.c_size_t, [ct.c_void_p]),
            "bpf_table_name": (ct.c_char_p, [ct.c_void_p, ct.c_size_t]),
            "bpf_table_fd_id": (ct.c_int, [ct.c_void_p, ct.c_size_t]),
            "bpf_table_type_id": (ct.c_int, [ct.c_void_p, ct.c_size_t]),
            "bpf_table_key_size_id": (ct.c_size_t, [ct.c_void_p, ct.c_size_t]),
            "bpf_table_leaf_size_id": (ct.c_size_t, [ct.c_void_p, ct.c_size_t]),
            "bpf_table_max_entries_id": (ct.c_size_t, [ct.c_void_p, ct.c_size_t])}
    for fn, (res, args) in sigs.items():
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    out = []
    for i in range(lib.bpf_num_tables(module)):
        fd = lib.bpf_table_fd_id(module, i)
        if fd < 0:                  # a table declared but not created (extern/shared from another module)
            continue
        out.append({"name": lib.bpf_table_name(module, i).decode(), "sys_fd": fd,
                    "type": lib.bpf_table_type_id(module, i), "key_size": lib.bpf_table_key_size_id(module, i),
                    "value_size": lib.bpf_table_leaf_size_id(module, i),
                    "max_entries": lib.bpf_table_max_entries_id(module, i)})
    return out


CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18


def pin_shared(pinned: dict[str, int], where: str) -> None:
    """Pin the inherited map fds in a bpffs mounted on the empty directory `where` in this process's own mount
    namespace."""
    from jobprobe.kernel.bpf import obj_pin
    libc = LIBC

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ct.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Private propagation first, so that the bpffs mounted below is never seen in the host's namespace.
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    check(libc.mount(b"bpf", where.encode(), b"bpf", 0, None), f"mount bpffs on {where}")
    for name, fd in pinned.items():
        obj_pin(fd, f"{where}/{name}")


_btf = None   # the running kernel's BTF, read at its first use


def vmlinux() -> Any:
    from pathlib import Path

    from jobprobe.kernel.btf import Btf
    global _btf
    if _btf is None:
        _btf = Btf(Path("/sys/kernel/btf/vmlinux").read_bytes())
    return _btf


def btf_trace_id(tp: str) -> int:
    """The vmlinux BTF id of a tracepoint's btf_trace_<event> typedef, what a BTF tracepoint program names."""
    event = tp.rsplit(":", 1)[1]
    btf = vmlinux()
    tid = btf.find(btf.TYPEDEF, f"btf_trace_{event}")
    if tid is None:
        raise Exception(f"no btf_trace_{event} in this kernel's BTF")
    return tid


def btf_flag(flag: str) -> str:
    """-DNAME=@btf:struct.member:size becomes -DNAME=offset, from the running kernel's BTF (its size checked):
    offsets a module reads directly, found here so that the agent never reads the BTF itself. With @btf?: a
    member the kernel does not have (a config option off) becomes -1, for the module to do without."""
    if "=@btf:" not in flag and "=@btf?:" not in flag:
        return flag
    optional = "=@btf?:" in flag
    define, ref = flag.split("=@btf?:" if optional else "=@btf:", 1)
    where, size = ref.rsplit(":", 1)
    struct_name, path = where.split(".", 1)
    try:
        off, got = vmlinux().offset(struct_name, path)
    except (KeyError, IndexError) as err:
        if optional:
            return f"{define}=-1"
        raise Exception(f"the kernel's BTF has no {err}") from None
    if got != int(size):
        raise Exception(f"{where} is {got} bytes in the kernel's BTF, not {size}")
    return f"{define}={off}"


def load(req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    from bcc import BPF
    from bcc.libbcc import lib

    from jobprobe.kernel.bpf import BTF, CGROUP_HOOKS, RAW, attach_btf_tracepoint, attach_cgroup, load_btf_tracepoint

    cflags = [btf_flag(f) for f in req["cflags"]]
    if req.get("pinned"):
        if not req.get("pin_dir"):
            raise Exception("maps to pin but no pin_dir to pin them in")
        pin_shared(req["pinned"], req["pin_dir"])
        cflags.append(f'-DJOB_PIN_DIR="{req["pin_dir"]}"')
    # Compiles and creates the maps; loads no program yet (none has an auto-attach name).
    b = BPF(text=req["text"].encode(), cflags=cflags)
    fds: list[int] = []
    progs: dict[str, int] = {}
    links = []
    btf_progs: dict[str, int] = {}
    for tp, fn in req["tracepoints"]:
        if tp.startswith(BTF):
            # bcc compiles it (maps made, their fds in the code) but cannot load this type: load it here
            if fn not in btf_progs:
                btf_progs[fn] = load_btf_tracepoint(b.dump_func(fn.encode()), fn, btf_trace_id(tp))
            prog_fd = btf_progs[fn]
            fd = attach_btf_tracepoint(prog_fd)
        else:
            if tp.startswith(RAW):
                event = tp.rsplit(":", 1)[1].encode()       # a raw tracepoint is named by its event alone
                b.attach_raw_tracepoint(tp=event, fn_name=fn.encode())
                fd = b.raw_tracepoint_fds[event]
            else:
                b.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
                fd = b.tracepoint_fds[tp.encode()]
            prog_fd = b.funcs[fn.encode()].fd
        if fn not in progs:
            progs[fn] = len(fds)
            fds.append(prog_fd)
        links.append({"tracepoint": tp, "prog": fn, "fd": len(fds)})
        fds.append(fd)
    for fn, path, hook in req.get("cgroups", ()):
        prog_type, attach_type = CGROUP_HOOKS[hook]
        # The expected attach type is given at load: the kernel then checks it against the link's, and an egress
        # program may use egress-only return codes.
        f = b.load_func(fn.encode(), prog_type, attach_type=attach_type)
        if fn not in progs:
            progs[fn] = len(fds)
            fds.append(f.fd)
        if not path:
            continue              # loaded only: the agent links it to each job's group itself (attach_cgroup)
        # A link fd, unlike bcc's attach_func (PROG_ATTACH), detaches when the last holder closes it.
        links.append({"tracepoint": f"{hook}:{path}", "prog": fn, "fd": len(fds)})
        try:
            fds.append(attach_cgroup(f.fd, path, hook))
        except OSError as err:   # no LINK_CREATE for cgroups before 5.7 (EINVAL), a group gone (ENOENT)
            raise Exception(f"cannot link {fn} to {hook} of {path}: {err}") from err
    for fn in req.get("uprobes", ()):
        if fn not in progs:
            progs[fn] = len(fds)
            fds.append(b.load_func(fn.encode(), BPF.KPROBE).fd)
    maps = describe_maps(lib, b.module)
    for m in maps:
        m["fd"] = len(fds)
        fds.append(m.pop("sys_fd"))
    meta = {"progs": [{"name": n, "fd": i} for n, i in progs.items()], "links": links, "maps": maps,
            "nfds": len(fds)}
    if req.get("cache"):
        from pathlib import Path

        from jobprobe.kernel import bpfcache
        try:
            bpfcache.write(Path(req["cache"]["dir"]), req["cache"]["name"], record(b, lib, req, progs, fds, maps))
        except Exception as err:    # the load stands; only the next start compiles again
            print(f"bpf_loader: no record written: {type(err).__name__}: {err}", file=sys.stderr)
    return meta, fds


def record(b: Any, lib: Any, req: dict[str, Any], progs: dict[str, int], fds: list[int],
           maps: list[dict[str, Any]]) -> Any:
    """What a later load needs to load this module again without compiling it (jobprobe/kernel/bpfcache.py): each
    program's instructions as bcc gave them to the kernel, each map as the kernel holds it (its BTF types too), the
    module's own BTF. Raises where the module holds something a record cannot (maps typed by two BTFs)."""
    from jobprobe.kernel import bpfcache
    from jobprobe.kernel.bpf import BTF, CGROUP_HOOKS, TRACE_RAW_TP, btf_bytes, map_info, prog_info
    attach = {fn: (TRACE_RAW_TP, btf_trace_id(tp)) for tp, fn in req["tracepoints"] if tp.startswith(BTF)}
    attach.update({fn: (CGROUP_HOOKS[hook][1], 0) for fn, _, hook in req.get("cgroups", ())})
    out = {}
    for fn, i in progs.items():
        kind, btf_id = attach.get(fn, (0, 0))
        out[fn] = bpfcache.Prog(prog_info(fds[i]).type, kind, btf_id, bytes(b.dump_func(fn.encode())))
    shared = set(req.get("pinned") or ())
    defs, btf_ids = [], set()
    for m in maps:
        info = map_info(fds[m["fd"]])
        typed = m["name"] not in shared and info.btf_id
        if typed:
            btf_ids.add(info.btf_id)
        defs.append(bpfcache.MapDef(m["name"], info.type, info.key_size, info.value_size, info.max_entries,
                                    info.map_flags, fds[m["fd"]], m["name"] in shared,
                                    info.btf_key_type_id if typed else 0, info.btf_value_type_id if typed else 0))
    if len(btf_ids) > 1:
        raise ValueError(f"maps typed by {len(btf_ids)} BTFs")
    lic = lib.bpf_module_license(b.module)
    return bpfcache.Record(lic.decode() if lic else "GPL", int(lib.bpf_module_kern_version(b.module)), out,
                           tuple(defs), btf_bytes(btf_ids.pop()) if btf_ids else b"")


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[1]))
    try:
        meta, fds = load(json.loads(sys.stdin.read()))
    except Exception as err:  # bcc raises bare Exception for compile, verifier and attach errors
        why = str(err) if type(err) is Exception else f"{type(err).__name__}: {err}"
        sock.send(json.dumps({"error": why, "nfds": 0}).encode())
        sys.stderr.flush()
        os._exit(1)
    if len(fds) > 253:  # SCM_MAX_FD; no probe comes near it
        sock.send(json.dumps({"error": f"{len(fds)} fds are more than one message can carry", "nfds": 0}).encode())
        os._exit(1)
    socket.send_fds(sock, [json.dumps(meta).encode()], fds)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    try:
        main(sys.argv)
    except BaseException as err:  # a broken socket, a bad request: say it on stderr, never run bcc's atexit
        print(f"_bpf_loader: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(2)
