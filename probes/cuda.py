# SPDX-License-Identifier: Apache-2.0
"""cuda — what the job asks of its GPUs through the CUDA driver, the CUDA runtime and NCCL, seen from the CPU side.

Measures, per interval, for the job's threads: kernel launches (and their rate), memory copies by direction (HtoD,
DtoH, DtoD, other) with bytes, time blocked in synchronize calls (sum and log2 µs histogram), and NCCL collectives
by type (calls, bytes = count × datatype size, time in the call). Off by default: it puts a breakpoint in every
process that maps these libraries (see Cost).
Hooks: uprobes/uretprobes from bpf/cuda.c on the exported functions of every mapped library file named
libcuda.so*, libcudart.so*, libnccl.so* (the symbol tables in bpf/cuda.c's header and SYMBOLS below). Each tick the
job's processes' /proc/PID/maps are read; a library file seen for the first time is attached at once, for the whole
node (a uprobe lives on the file: every process mapping it, now or later, hits it; the programs keep only the job's
calls, by job_slot_current()). Attaching needs no bcc: the loader only loads the programs (BPF_PROG_TYPE_KPROBE);
here perf_event_open on the uprobe PMU (type and retprobe bit from sysfs; config1 = path, config2 = file offset from
the library's .dynsym, jobprobe/kernel/elf.py) and PERF_EVENT_IOC_SET_BPF. Return probes are attached before entry
probes,
so that every entry seen has its return seen.
Oldest kernel: 4.18 (common.h); the uprobe PMU 4.17. Needs root, bcc to compile, and the uprobe PMU.
Cost: measured in the 6.18 VM (tests/test_cuda.py::test_cost_per_call: wall time of 20k calls on vs off, and
bpf_stats). The programs: 50-300 ns per run (less for other processes' calls). The traps dominate, and every
process on the node that calls a probed function pays them, in the job or not: when the function's first
instruction is emulated (push %rbp) +0.7-0.9 µs per driver launch or copy (one uprobe), +2.1-2.9 µs per runtime
launch (uprobe + uretprobe + the driver's uprobe beneath); when it must be single-stepped (endbr64 of
-fcf-protection builds, a rip-relative mov) +5.2-6.8 µs and +11.5-12.5 µs. (MACHINE-FACTS expects ~1 µs a trap on
bare metal.) Per tick: one read of /proc/PID/maps per job process (0.2-0.3 ms for a small process, more for a large
PyTorch one), and one per-CPU map lookup.
Limits: calls made before a library is first attached (at most one tick after the first process maps it) are not
seen; statically linked runtimes (libcudart_static) are seen only through the driver; bytes of cudaMemcpyDefault
copies count as "other" (their direction is decided from the pointers inside the runtime).
"""
from __future__ import annotations

import ctypes as ct
import os
import time
from typing import Any

from jobprobe.contract.bpfprobe import BpfProbe
from jobprobe.contract.probe import EVENTS_KEY, Field
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta, log2_percentile
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import bpfload as _bpfload
from jobprobe.kernel import elf as _elf
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node
from jobprobe.kernel.procfs import read_maps
from jobprobe.kernel.uprobe import UprobePmu

NBUCKETS = 27                                   # bpf/cuda.c NBUCKETS
DIRS = ("htod", "dtoh", "dtod", "other")        # bpf/cuda.c memcpy_* index order
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "send", "recv")
NCCL_CALLS = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv")   # COLLECTIVES' order
LIBRARY_PREFIXES = ("libcuda.so", "libcudart.so", "libnccl.so")


def _variants(names: str, suffix: str) -> list[str]:
    return [v for n in names.split() for v in (n, n + suffix)]


# exported function → (entry program, return program or None), bpf/cuda.c. The _ptsz/_ptds variants are the
# per-thread-default-stream entry points cuda.h selects with CUDA_API_PER_THREAD_DEFAULT_STREAM: separate functions.
SYMBOLS: dict[str, tuple[str, str | None]] = {
    **{n: ("drv_launch", None) for n in _variants("cuLaunchKernel cuLaunchKernelEx", "_ptsz")},
    **{n: (f"drv_{d}", None) for d, name in (("htod", "HtoD"), ("dtoh", "DtoH"), ("dtod", "DtoD"))
       for n in _variants(f"cuMemcpy{name}_v2", "_ptds") + _variants(f"cuMemcpy{name}Async_v2", "_ptsz")},
    **{n: ("drv_sync", "drv_ret") for n in ["cuCtxSynchronize", *_variants("cuStreamSynchronize", "_ptsz")]},
    **{n: ("rt_launch", "rt_ret") for n in _variants("cudaLaunchKernel cudaLaunchKernelExC", "_ptsz")},
    **{n: ("rt_memcpy", "rt_ret") for n in ["cudaMemcpy", "cudaMemcpy_ptds", *_variants("cudaMemcpyAsync", "_ptsz")]},
    **{n: ("rt_sync", "rt_ret") for n in ["cudaDeviceSynchronize", *_variants("cudaStreamSynchronize", "_ptsz")]},
    **{f"nccl{c}": (f"nccl_{c.lower()}", "nccl_ret")
       for c in NCCL_CALLS},
}
PROGRAMS = tuple(sorted({p for pair in SYMBOLS.values() for p in pair if p}))
SCALARS = ("launches", "sync_calls", "sync_ns", "nccl_unknown_dtype", "untracked")


class CudaStats(ct.Structure):
    """bpf/cuda.c struct cuda_stats, one per job slot and CPU (the map checks the size at start)."""
    _fields_ = [("launches", ct.c_uint64), ("memcpy_calls", ct.c_uint64 * 4), ("memcpy_bytes", ct.c_uint64 * 4),
                ("sync_calls", ct.c_uint64), ("sync_ns", ct.c_uint64), ("nccl_calls", ct.c_uint64 * 7),
                ("nccl_bytes", ct.c_uint64 * 7), ("nccl_ns", ct.c_uint64 * 7), ("nccl_unknown_dtype", ct.c_uint64),
                ("untracked", ct.c_uint64), ("sync_hist", ct.c_uint64 * NBUCKETS)]


ARRAYS = tuple(n for n, t in CudaStats._fields_ if n not in SCALARS)


def mapped_libraries(maps_text: bytes) -> set[str]:
    """Paths of the CUDA/NCCL library files in one /proc/PID/maps text (deleted files left out)."""
    if b"libcu" not in maps_text and b"libnccl" not in maps_text:   # most processes: no line to parse
        return set()
    out = set()
    for line in maps_text.splitlines():
        parts = line.split(None, 5)    # address perms offset dev inode path
        if len(parts) < 6:
            continue
        path = parts[5].decode("utf-8", "surrogateescape")
        if path.startswith("/") and not path.endswith(" (deleted)") and \
                os.path.basename(path).startswith(LIBRARY_PREFIXES):
            out.add(path)
    return out


def plan_library(functions: dict[str, int]) -> list[tuple[str, int, bool]]:
    """(program, file offset, retprobe) to attach for a library's exported functions: return probes first (an entry
    seen then always has its return), each offset once per kind (aliases such as NCCL's pncclX share an address)."""
    rets, entries, seen = [], [], set()
    for name, off in sorted(functions.items(), key=lambda kv: (kv[1], kv[0])):
        entry, ret = SYMBOLS[name]
        if off in seen:
            continue
        seen.add(off)
        entries.append((entry, off, False))
        if ret:
            rets.append((ret, off, True))
    return rets + entries


def interval(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """This interval's fields from two cumulative readings (SCALARS and ARRAYS of CudaStats, "t" monotonic s,
    "libraries")."""
    d = {k: delta(now[k], before[k]) for k in SCALARS}
    a = {k: [delta(x, y) for x, y in zip(now[k], before[k])] for k in ARRAYS}
    dt = now["t"] - before["t"]
    out: dict[str, Any] = {"kernel_launches": d["launches"],
                           "kernel_launches_per_s": d["launches"] / dt if dt > 0 else None}
    for i, direction in enumerate(DIRS):
        out[f"memcpy_{direction}_calls"] = a["memcpy_calls"][i]
        out[f"memcpy_{direction}_bytes"] = a["memcpy_bytes"][i]
    hist = a["sync_hist"]
    out.update({"sync_calls": d["sync_calls"], "sync_ns": d["sync_ns"], "sync_us_log2": hist,
                "sync_p50_us": log2_percentile(hist, 0.50), "sync_p99_us": log2_percentile(hist, 0.99)})
    for i, c in enumerate(COLLECTIVES):
        out[f"nccl_{c}_calls"] = a["nccl_calls"][i]
        out[f"nccl_{c}_bytes"] = a["nccl_bytes"][i]
        out[f"nccl_{c}_ns"] = a["nccl_ns"][i]
    out["nccl_unknown_dtype_calls"] = d["nccl_unknown_dtype"]
    out["untracked_calls"] = d["untracked"]
    out["libraries_probed"] = now["libraries"]
    return out


def zero_reading(t: float = 0.0) -> dict[str, Any]:
    return {**{k: 0 for k in SCALARS}, **{n: [0] * typ._length_ for n, typ in CudaStats._fields_ if n in ARRAYS},
            "t": t, "libraries": 0}


def _fields() -> dict[str, Field]:
    out = {
        "kernel_launches": Field("int", "count", "kernel launches by the job's threads (cuLaunchKernel[Ex], "
                                 "cudaLaunchKernel, cudaLaunchKernelExC; a runtime launch counted once, not again "
                                 "in the driver beneath it; NCCL's own launches included)"),
        "kernel_launches_per_s": Field("float", "1/s", "kernel_launches over the time between this probe's "
                                                       "two readings (None if 0): a tick reads its probes one "
                                                       "after another, so it can be tens of ms off the frame's "
                                                       "dt on a busy node"),
    }
    what = {"htod": "host to device", "dtoh": "device to host", "dtod": "device to device",
            "other": "host to host or cudaMemcpyDefault (direction decided inside the runtime)"}
    for direction in DIRS:
        out[f"memcpy_{direction}_calls"] = Field("int", "count", f"memory copies {what[direction]} "
                                                 "(cuMemcpy*_v2 and Async forms, cudaMemcpy[Async])")
        out[f"memcpy_{direction}_bytes"] = Field("int", "bytes", f"bytes of the memory copies {what[direction]}, "
                                                 "as requested (ByteCount / count argument)")
    out.update({
        "sync_calls": Field("int", "count", "synchronize calls that returned (cuCtxSynchronize, cuStreamSynchronize, "
                            "cudaDeviceSynchronize, cudaStreamSynchronize)"),
        "sync_ns": Field("int", "ns", "time the job's threads spent blocked inside those synchronize calls"),
        "sync_us_log2": Field("list[int]", "count", f"synchronize time histogram: bucket i counts calls of [2^i, "
                              f"2^(i+1)) µs (bucket 0: [0, 2)), {NBUCKETS} buckets, the last open-ended"),
        "sync_p50_us": Field("float", "us", "median synchronize time (from the histogram; None if no calls)"),
        "sync_p99_us": Field("float", "us", "99th percentile synchronize time (from the histogram; None if no calls)"),
    })
    for c in COLLECTIVES:
        out[f"nccl_{c}_calls"] = Field("int", "count", f"NCCL {c} calls that returned")
        out[f"nccl_{c}_bytes"] = Field("int", "bytes", f"bytes of the NCCL {c} calls: the count argument × the "
                                       "datatype's size (per rank: AllGather's sendcount, ReduceScatter's "
                                       "recvcount); calls of an unknown datatype add nothing")
        out[f"nccl_{c}_ns"] = Field("int", "ns", f"time inside the NCCL {c} calls (enqueueing; the collective "
                                    "itself runs on the GPU afterwards)")
    out["nccl_unknown_dtype_calls"] = Field("int", "count", "NCCL calls whose ncclDataType_t this probe does not "
                                            "know (a newer NCCL's type): counted, their bytes not")
    out["untracked_calls"] = Field("int", "count", "calls of the job not counted because the per-thread call "
                                   "table was full (more threads inside probed calls at once than it holds): the "
                                   "figures above are short by these calls")
    out["libraries_probed"] = Field("int", "count", "library files (libcuda, libcudart, libnccl) with uprobes "
                                    "attached now, node-wide", kind="gauge")
    return out


class CudaEvent(ct.Structure):
    """bpf/cuda.c struct cuda_event: one call of a traced job's thread (deep-trace windows)."""
    _fields_ = [("kind", ct.c_uint32), ("slot", ct.c_uint32), ("tid", ct.c_uint32), ("tgid", ct.c_uint32),
                ("start_ns", ct.c_uint64), ("end_ns", ct.c_uint64), ("bytes", ct.c_uint64), ("op", ct.c_uint16),
                ("sub", ct.c_uint16), ("pad", ct.c_uint32)]


def call_name(op: int, sub: int) -> str:
    """A deep-trace record's call, by bpf/cuda.c's OP_* (a runtime call stands for the driver calls beneath it)."""
    copy = ("HtoD", "DtoH", "DtoD", "other")[sub] if sub < 4 else "?"
    return {1: "cudaLaunchKernel", 2: f"cudaMemcpy {copy}", 3: "cudaSynchronize", 4: "cuLaunchKernel",
            5: f"cuMemcpy {copy}", 6: "cuSynchronize",
            7: "nccl" + (NCCL_CALLS[sub] if sub < len(NCCL_CALLS) else "?")}.get(op, f"op {op}")


class Library:
    """One library file with probes on it: where it was found and the perf event fds that hold them."""

    def __init__(self, path: str, fds: list[int], functions: int, exported: int = 0):
        self.path, self.fds, self.functions, self.exported = path, fds, functions, exported


class CudaProbe(BpfProbe):
    name = "cuda"
    default = False
    needs_root = True
    summary = ("CUDA kernel launches, memory copies by direction, synchronize time and NCCL collectives of the "
               "job's threads (eBPF uprobes on libcuda, libcudart, libnccl)")
    fields = _fields()

    bpf_name = "cuda"
    # One load for every job of the node: one set of uprobes per library file for every job; counts kept per slot.
    map_types = {"calls": (ct.c_uint32, None), "stats": (ct.c_uint32, CudaStats)}

    def __init__(self, host: Host | None = None, node: Node | None = None):
        super().__init__(host, node)
        self.pmu: UprobePmu | None = None
        self.libraries: dict[tuple[int, int], Library] = {}   # files this job maps that are probed
        self._seen: dict[int, set[str]] = {}                  # pid → library paths already looked at
        self._events: list[dict[str, Any]] = []

    # The uprobes of a library file are the load's, not a job's: one set per file for every job of the node (the
    # program counts each call for the slot of the thread that makes it), detached when the load closes.
    @property
    def probed(self) -> dict[tuple[int, int], Library]:
        """(st_dev, st_ino) of a file → its uprobes, for every job of this load."""
        return self.shared.extra.setdefault("libraries", {})

    @property
    def refused(self) -> dict[tuple[int, int], str]:
        """Files not to try again, and why (for every job of this load)."""
        return self.shared.extra.setdefault("refused", {})

    # ---- deep-trace windows: each call with its start and end ------------------------------------------------
    trace_kinds = {3: CudaEvent}

    def trace_events(self, records: list[Any], clock: Any) -> list[dict[str, Any]]:
        """One complete ("X") event per call on its thread's CUDA track (a launch or a driver copy, which has no
        return probe, as an instant: dur 0); bytes for copies and collectives."""
        out = []
        for r in records:
            ev = {"ph": "X", "cat": "cuda" if r.op != 7 else "nccl", "name": call_name(r.op, r.sub), "pid": r.tgid,
                  "tid": clock.cuda_tid(r.tid), **clock.span(r.start_ns, r.end_ns)}
            if r.op in (2, 5, 7):
                ev["args"] = {"bytes": r.bytes}
            out.append(ev)
        return out

    def prepare(self, loaded: Any) -> None:
        self.pmu = UprobePmu(self.host.sys)

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        try:
            UprobePmu(host.sys)
        except ProbeUnavailable as err:
            return str(err)
        return None

    def load(self, target: Target) -> _bpfload.Loaded:
        """The programs are loaded unattached: uprobes are attached here, per library file, as files are found."""
        return _bpfload.load(self.bpf_name, self.base_cflags(), self.all_handlers(), sys_root=self.host.sys,
                         pinned=self.pinned(),
                         uprobes=PROGRAMS)

    def start(self, target: Target) -> None:
        self.pmu = UprobePmu(self.host.sys)
        super().start(target)
        if "libraries" not in self.shared.extra:   # the load's uprobes go with it
            probed = self.probed
            self.shared.closers.append(lambda: [_bpf.close_all(lib.fds) for lib in probed.values()])
        self.scan()   # libraries mapped already are probed before the first tick

    def sample(self) -> dict[str, Any]:
        if self.loaded is None:
            return {}
        self.scan()                # then BpfProbe.sample: membership, the map read, the deltas
        out = super().sample()
        if self._events:
            out[EVENTS_KEY], self._events = self._events, []
        return out

    def stop(self) -> None:
        """Stop counting for the job; the uprobes go with the load (when no job uses it, on a node that does not keep
        its loads; a probe used on its own: now). Idempotent."""
        self.libraries, self._seen, self._events = {}, {}, []
        super().stop()

    def note(self) -> str | None:
        if self.loaded is not None and not self.libraries:
            return "no CUDA/NCCL library mapped by the job yet"
        return None

    def reading(self) -> dict[str, Any]:
        out = self.slot_totals()
        out["t"], out["libraries"] = time.monotonic(), len(self.libraries)
        return out

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return interval(now, before)

    # ---- finding and probing the libraries ----------------------------------------------------------------
    def scan(self) -> None:
        """Probe every CUDA/NCCL library file a job process maps that is not probed yet."""
        if self.target is None or self.loaded is None:
            return
        pids = set(self.target.pids())
        self._seen = {p: s for p, s in self._seen.items() if p in pids}
        for pid in pids:
            text = read_maps(self.host.proc, pid)
            if text is None:
                continue          # exited since the listing
            seen = self._seen.setdefault(pid, set())
            for path in mapped_libraries(text) - seen:
                if self.attach_library(pid, path):
                    seen.add(path)

    def attach_library(self, pid: int, path: str) -> bool:
        """Probe the file `path` as process pid sees it (through /proc/PID/root: a container's own files). True
        when it is settled (probed now or before, or refused for good); False to try again next tick."""
        where = f"{self.host.proc}/{pid}/root{path}"
        try:
            st = os.stat(where)
        except OSError:
            return False          # the process left; another member may map it too
        key = (st.st_dev, st.st_ino)
        if key in self.libraries or key in self.refused:
            return True
        if key in self.probed:                   # probed for another job of the node: counted for this one too
            self.libraries[key] = self.probed[key]
            self._events.append({"event": "cuda_library", "path": path, "functions": self.probed[key].exported})
            return True
        try:
            functions = _elf.dynamic_functions(where, SYMBOLS)
            plan = plan_library(functions)
            fds = self._attach_plan(where, plan)
        except (_elf.ElfError, OSError) as err:
            why = getattr(err, "strerror", None) or str(err)
            self.refused[key] = why
            self._events.append({"event": "cuda_library", "path": path, "functions": 0, "error": why})
            return True
        if not plan:
            self.refused[key] = "exports none of the probed functions"
        else:
            self.libraries[key] = self.probed[key] = Library(path, fds, len(plan), len(functions))
        self._events.append({"event": "cuda_library", "path": path, "functions": len(functions)})
        return True

    def _attach_plan(self, path: str, plan: list[tuple[str, int, bool]]) -> list[int]:
        fds: list[int] = []
        try:
            for prog, offset, ret in plan:
                fds.append(self.pmu.attach(self.loaded.progs[prog], path, offset, ret))
        except OSError:
            _bpf.close_all(fds)   # all of a library or none of it: no half-probed file
            raise
        return fds
