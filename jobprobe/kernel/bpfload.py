# SPDX-License-Identifier: Apache-2.0
"""bpfload — the one way an eBPF probe loads programs, without bcc or LLVM in the agent.

What: load() starts a short-lived loader (jobprobe/kernel/bpf_loader.py, same interpreter) that compiles
  bpf/<name>.c with bcc, loads its programs, attaches them to tracepoints (and, when asked, to cgroup2 directories
  through BPF links) and sends back, over a socketpair (SCM_RIGHTS), the fds of every program, every attachment
  (a perf_event fd per tracepoint, a bpf_link fd per cgroup hook) and every map, then exits. Holding those fds
  keeps everything attached; closing them (Loaded.close) detaches. The maps come back as jobprobe.kernel.bpfmap.Map.
Hooks: none of its own; SCM_RIGHTS on an AF_UNIX socketpair.
  A module loaded before on this kernel comes from its record instead (jobprobe/kernel/bpfcache.py): no loader.
Cost: the agent never maps libbcc/LLVM (jobprobe run: 19 MB RSS instead of 141 MB); a compiled load costs one
  interpreter start plus the compile (~0.6-1.0 s of CPU for sched.c in a 6.18 VM); from a record, only what the
  kernel's verifier takes (sched.c ~0.3 s, paid in a compile too) and ~5 ms (scripts/bpf_load_cost.py).
"""
from __future__ import annotations

import array
import contextlib
import errno
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from jobprobe import bpf
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import bpfcache
from jobprobe.kernel.bpf import CGROUP_HOOKS, close_all, prog_info, trim_log
from jobprobe.kernel.bpfmap import Map, possible_cpus

MAX_FDS = 253                   # SCM_MAX_FD: the most fds one message may carry
log = logging.getLogger("jobprobe.kernel.bpfload")


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
    cache = bpfcache.directory()
    key = bpfcache.key(text, cflags, tracepoints, cgroups, uprobes, list(pinned or {})) if cache else ""
    if cache and bpfcache.trusted_dir(cache):
        got = from_record(name, cache / key, tracepoints, cgroups, uprobes, pinned or {}, sys_root)
        if got is not None:
            return got
    with pin_dir(bool(pinned)) as where:
        request = json.dumps({"text": text, "cflags": list(cflags), "tracepoints": [list(t) for t in tracepoints],
                              "cgroups": [list(c) for c in cgroups], "uprobes": list(uprobes),
                              "pinned": dict(pinned or {}), "pin_dir": where,
                              "cache": {"dir": str(cache), "name": key} if cache else None})
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


def from_record(name: str, path: Path, tracepoints: Sequence[tuple[str, str]], cgroups: Sequence[tuple[str, str, str]],
                uprobes: Sequence[str], pinned: dict[str, int], sys_root: str) -> Loaded | None:
    """The module loaded from its record at `path` (jobprobe/kernel/bpfcache.py), with no loader; None when there is
    no record, or one that must not be used or that the kernel refused (said in one line: the caller compiles)."""
    try:
        rec = bpfcache.read(path)
        if rec is None:
            return None
        meta, fds = bpfcache.instantiate(rec, tracepoints, cgroups, uprobes, pinned, sys_root)
    except (ValueError, OSError) as err:           # bpfcache.Rejected is a ValueError
        log.warning("bpf/%s.c: its compiled record %s not used (%s): compiling it again", name, path.name[:12], err)
        return None
    try:
        return build(name, meta, fds, possible_cpus(sys_root), 0)
    except (KeyError, IndexError, OSError, ValueError) as err:
        close_all(fds)
        raise ProbeUnavailable(f"cannot load bpf/{name}.c from its record: {err}") from err


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
    # the checkout: `-m jobprobe.kernel.bpf_loader` imports from any cwd
    root = str(Path(__file__).resolve().parents[2])
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
