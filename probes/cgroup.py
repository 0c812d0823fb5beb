"""cgroup — the job's own accounting: CPU time, memory, I/O bytes, read from the kernel's files.

Hooks: cgroup2 cpu.stat, memory.current/memory.peak/memory.stat, io.stat for cgroup targets; /proc/PID/{stat,statm}
and /proc/PID/task/TID/{io,stat} for process-tree targets and for controllers that a hybrid (v1+v2) host keeps on
v1; as root, the kernel's taskstats exit records (jobprobe/kernel/taskstats.py) for what a thread did between its
last read and its exit. Kernel: cgroup2 cpu.stat needs 4.15+, memory.peak 5.19+ (older: the highest value seen).
Cost: a few small file reads per tick (kept open: one pread each), two more per thread of the job where counts come
from /proc (~3 µs each); no root needed for the job's own files.
Nothing is lost at exits: cgroup figures count everything by themselves; /proc CPU time and I/O bytes are read per
thread (a process's own files add the totals of the children it has waited for, which would count a reaped child
twice) and a thread's exit record carries its final counts — also of processes born and gone between two ticks
(found by their parent) and of a PID tree's root, reaped outside the job. Without root (no taskstats) a thread's
I/O since the last tick is lost at its exit, and CPU time is read per process: a child reaped by a member is found
in the parent's cutime/cstime, the root's last interval is lost.
A job attached as it starts (`from_start`: the SLURM prolog) counts from zero, so its first frame holds what it did
before it was attached.
CPU limits: how often and how long the job's group was stopped by its CPU limit (cgroup2 cpu.stat nr_throttled /
throttled_usec and cpu.max; on a hybrid host the v1 cpu group of its processes: cpu.stat, cpu.cfs_quota_us) — a
throttled rank is the classic straggler of a data-parallel job.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Callable

from jobprobe.node import tickmemo
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.core.counters import delta
from jobprobe.node.probe import Field, Probe
from jobprobe.node.target import Target
from jobprobe.kernel import procfs
from jobprobe.kernel.taskstats import ExitFeed, ExitRecord, Subscription

CLK_TCK = procfs.CLK_TCK
PAGE = os.sysconf("SC_PAGE_SIZE")
Reader = Callable[[str], "str | None"]
OPTIONAL_RECHECK_S = 10.0   # a memory or io controller turned on for a group is seen within this


read_kv = procfs.read_kv


def read_int(path: Path, read: Reader = procfs.read_small) -> int | None:
    try:
        return int((read(path) or "").split()[0])
    except (ValueError, IndexError):
        return None


def io_stat_bytes(path: Path, read: Reader = procfs.read_small) -> tuple[int, int] | None:
    """Sum rbytes and wbytes over every device line of a cgroup2 io.stat; None if there is no io.stat."""
    text = read(path)
    if text is None:
        return None
    rd = wr = 0
    for line in text.splitlines():
        for item in line.split()[1:]:
            k, _, v = item.partition("=")
            if k == "rbytes":
                rd += int(v)
            elif k == "wbytes":
                wr += int(v)
    return rd, wr


def proc_counters(proc: str, pid: int, io: bool = True, read: Reader = procfs.read_small,
                  cpu: bool = True) -> dict[str, int] | None:
    """CPU (ns), RSS (bytes) and I/O bytes of one process from /proc; None if it has gone. (The probe reads I/O
    per thread, ThreadAcct, and asks for no `io` here; the process's figure is for the tests' and tools' use. No
    `cpu`: CPU is not read, 0 — the group's cpu.stat has it.)"""
    base = f"{proc}/{pid}"
    st = procfs.read_stat(proc, pid, read) if cpu else None
    statm = (read(f"{base}/statm") or "").split()
    if len(statm) < 3:
        return None
    if st is None and cpu:
        return None
    ns = procfs.NS_PER_TICK
    # statm: size resident shared(RssFile + RssShmem) ...
    out = {"user": st.utime * ns if st else 0, "system": st.stime * ns if st else 0,
           "cuser": st.cutime * ns if st else 0, "csystem": st.cstime * ns if st else 0,
           "rss": int(statm[1]) * PAGE, "rss_file": int(statm[2]) * PAGE, "rd": 0, "wr": 0}
    io = read_kv_colon(f"{base}/io", read) if io else None
    if io:
        out["rd"], out["wr"] = io.get("read_bytes", 0), io.get("write_bytes", 0)
    return out


def read_kv_colon(path: Path, read: Reader = procfs.read_small) -> dict[str, int] | None:
    text = read(path)
    if text is None:
        return None
    return {k: int(v) for k, _, v in (ln.partition(": ") for ln in text.splitlines()) if v.strip().isdigit()}


class PerPid:
    """Per-interval deltas of per-process counters. A process alive at start counts from its value then; one
    that appears later counts from zero (it was born in this interval).

    A process that exits takes with it what it did since the last sample — unless a member reaps it: the parent's
    cutime/cstime then grow by the child's whole total. `child` maps a key to that counterpart; what a parent's
    counterpart grows by, beyond what we had already counted of the children that went away, is the lost tail.
    Only the tail of a process reaped outside the job (the job's root) is lost."""

    def __init__(self, child: dict[str, str] | None = None):
        self.prev: dict[int, dict[str, int]] = {}
        self.primed = False
        self.child = child or {}
        self.pending = dict.fromkeys(self.child, 0)

    def update(self, now: dict[int, dict[str, int]], keys: tuple[str, ...]) -> dict[str, int]:
        out = dict.fromkeys(keys, 0)
        prev, self.prev = self.prev, now
        if not self.primed:
            self.primed = True
            return out
        for pid, vals in now.items():
            before = prev.get(pid)
            for k in keys:
                out[k] += max(0, vals[k] - (before[k] if before else 0))
        gone = prev.keys() - now.keys()
        for k, ck in self.child.items():
            self.pending[k] += sum(prev[p][k] + prev[p][ck] for p in gone)
            grew = sum(max(0, v[ck] - (prev[p][ck] if p in prev else 0)) for p, v in now.items())
            out[k] += max(0, grew - self.pending[k])
            self.pending[k] = max(0, self.pending[k] - grew)
        return out


KEYS = ("rd", "wr", "user", "system")   # what ThreadAcct counts per thread: bytes read, written; CPU ns


def thread_counters(proc: str, pid: int, read: Reader = procfs.read_small,
                    cpu: bool = True) -> dict[int, tuple[int, int, int, int]]:
    """{tid: (read_bytes, write_bytes, user_ns, system_ns)} of each thread of process pid, from
    /proc/PID/task/TID/io and .../stat (the thread's own counters; the process's files add those of its threads that
    have exited, and its io those of the children it has waited for). CPU 0 when `cpu` is off. {} if it has gone."""
    out = {}
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        io = read_kv_colon(f"{proc}/{pid}/task/{tid}/io", read)
        if not io:
            continue
        st = procfs.read_stat(f"{proc}/{pid}/task", tid, read) if cpu else None
        ut, stime = (st.utime * procfs.NS_PER_TICK, st.stime * procfs.NS_PER_TICK) if st else (0, 0)
        out[int(tid)] = (io.get("read_bytes", 0), io.get("write_bytes", 0), ut, stime)
    return out


class ThreadAcct:
    """Per-interval storage I/O bytes and CPU time of the job's threads, exact through their exits.

    Each live thread's own counters are read per tick; when a thread exits, its taskstats exit record holds its final
    counters (bytes; CPU in µs), and what it did since its last read is added. Records of threads never read (born
    and gone between two ticks) count whole when their process is the job's or their parent process is (followed
    down a chain of such short-lived processes) — so the root of a PID tree, reaped outside the job (by slurmstepd,
    a shell), loses nothing either. Without a listener (no root, no taskstats) a thread's counts since the last tick
    are lost at its exit (the probe then takes CPU per process, with what a parent's cutime/cstime says of the
    children it reaped). A baseline (the first update) counts nothing, unless `from_zero`: then every thread counts
    whole (a job attached as it starts).

    Order matters: records are drained before /proc is read. The kernel sends a thread's record from do_exit, before
    the thread leaves /proc, so a thread missing from /proc now has its record in this drain (or it was lost)."""

    def __init__(self, listener: Subscription | None, from_zero: bool = False):
        self.listener = listener
        self.last: dict[int, tuple[int, tuple[int, ...]]] = {}   # tid → (tgid, KEYS values) at its last read
        self.finished: set[int] = set()                          # tids whose exit record was counted (zombies)
        self.claimed: set[int] = set()                           # launched pids whose exit record was counted
        self.uncounted = 0       # threads gone without an exit record: their last interval is missing (counted)
        self.primed = from_zero

    def update(self, proc: str, pids: list[int], read: Reader = procfs.read_small,
               cpu: bool = True, quiet: bool = False, launched: list[int] = ()) -> dict[str, int]:
        """This interval's KEYS summed over the job's threads (CPU 0 when `cpu` is off).

        `quiet`: the caller knows that none of the job's threads ran since the last update (its group's CPU usage
        did not move, its processes are the same): a thread's counters only grow while it runs (I/O bytes are
        charged to the task that submits or dirties), so /proc is not walked and nothing is counted — unless an
        exit record of the job came (then the walk is done as usual). What a thread did in less than the usage
        counter's 1 µs is not lost: it is in the next walk's difference, or in its exit record.

        `launched`: processes the target started itself (Target.launched_pids): their records, and those of their
        descendants, are the job's even if no walk ever saw them (a job born and gone within its first tick). Each
        is claimed once: a pid reused after its reaping is someone else."""
        records = self.listener.drain() if self.listener is not None else []
        out = [0, 0, 0, 0]
        if self.primed:
            mine = self.job_records(records, pids, [p for p in launched if p not in self.claimed])
            if quiet and not mine:
                return dict.fromkeys(KEYS, 0)
            for r in mine:
                _, before = self.last.pop(r.tid, (0, (0, 0, 0, 0)))
                final = (r.read_bytes, r.write_bytes, r.utime_us * 1000, r.stime_us * 1000)
                for i in range(4):
                    out[i] += max(0, final[i] - before[i])
                self.finished.add(r.tid)
        now: dict[int, tuple[int, tuple[int, ...]]] = {}
        listed: set[int] = set()
        for pid in pids:
            for tid, vals in thread_counters(proc, pid, read, cpu).items():
                listed.add(tid)
                if tid in self.finished:
                    continue
                now[tid] = (pid, vals)
                if self.primed:   # a thread not read before was born in this interval
                    before = self.last[tid][1] if tid in self.last else (0, 0, 0, 0)
                    for i in range(4):
                        out[i] += max(0, vals[i] - before[i])
        self.finished &= listed         # a zombie reaped: its tid may come back as someone else
        # threads gone without a record (no listener, or records the kernel dropped): their tail is lost — counted
        self.uncounted += sum(1 for tid in self.last if tid not in listed)
        self.last = now
        self.primed = True
        return dict(zip(KEYS, out))

    def job_records(self, records: list[ExitRecord], pids: list[int],
                    launched: list[int] = ()) -> list[ExitRecord]:
        """The records of the job's threads: read before, or of a job process (or one the target launched), or of
        a process whose parent is one (a fixed point over the records, for a chain of processes that came and went
        between ticks)."""
        procs = set(pids) | {tgid for tgid, _ in self.last.values()} | set(launched)
        out, rest = [], []
        for r in records:
            (out if r.tid in self.last else rest).append(r)
        grew = True
        while grew and rest:
            grew = False
            for r in list(rest):
                if (r.tgid and r.tgid in procs) or r.ppid in procs or r.tid in procs:
                    procs.add(r.tgid or r.tid)
                    if r.tid in launched:
                        self.claimed.add(r.tid)
                    out.append(r)
                    rest.remove(r)
                    grew = True
        return out

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


class Throttle:
    """CPU bandwidth throttling of the job's group(s): what a CPU limit (cpu.max; v1 cpu.cfs_quota_us) did to it.

    cgroup2's cpu.stat carries nr_periods / nr_throttled / throttled_usec when the cpu controller is on for the
    group; else (a hybrid host keeps cpu on v1, or a PID tree) the v1 cpu groups of the job's processes are found
    from /proc/PID/cgroup (again every OPTIONAL_RECHECK_S) and their cpu.stat read (throttled_time in ns). Deltas
    are kept per group, so a group joining or leaving adds no jump; a root group (no limit possible) counts 0."""

    KEYS = ("cpu_periods", "cpu_throttled_periods", "cpu_throttled_ns")

    def __init__(self, files: procfs.OpenFiles, host=None, from_zero: bool = False):
        self.files, self.host, self.from_zero = files, host, from_zero
        self.is_v2 = False
        self.prev: dict[str, tuple[int, int, int]] = {}
        self.acc = [0, 0, 0]
        self.limit: float | None = None
        self.seen = False                     # some cpu.stat read: the fields are real (else absent)
        self.groups: list[tuple[str, str]] = []      # (v1 group, its directory)
        self.found_at = -1e9
        self.mount: tuple[str, str] | None | bool = False     # v1 cpu mount (point, root), looked up once

    def _add(self, key: str, now: tuple[int, int, int], limit: float | None) -> None:
        before = self.prev.get(key)
        if before is None and not self.from_zero:
            before = now                      # a group seen for the first time: its past is not this interval's
        self.prev[key] = now
        for i in range(3):
            self.acc[i] += delta(now[i], before[i]) if before is not None else now[i]
        if limit is not None:
            self.limit = (self.limit or 0.0) + limit
        self.seen = True

    def v2(self, cg: Path, cpu: dict[str, int]) -> None:
        self.is_v2 = True
        self.limit = None
        quota, _, period = (self.files.read(str(cg / "cpu.max")) or "max").partition(" ")
        limit = int(quota) / int(period) if quota.isdigit() and period.strip().isdigit() else None
        self._add("v2", (cpu["nr_periods"], cpu["nr_throttled"], cpu.get("throttled_usec", 0) * 1000), limit)

    def v1(self, pids: list[int]) -> None:
        self.limit = None
        if self.mount is False:
            from jobprobe.kernel.host import find_cgroup_v1_mount
            self.mount = find_cgroup_v1_mount(self.host.mountinfo, "cpu") if self.host else None
        if not self.mount:
            return
        now = time.monotonic()
        if now - self.found_at > OPTIONAL_RECHECK_S or not self.groups:
            self.found_at = now
            found = {procfs.cgroup_v1_path(self.host.proc, p, "cpu") for p in pids[:64]}
            point, root = self.mount

            def where(g: str) -> str:
                rel = g[len(root):] if root != "/" and g.startswith(root) else g
                return str(Path(point) / rel.lstrip("/"))
            self.groups = [(g, where(g)) for g in sorted(g for g in found if g)]
        for g, d in self.groups:
            # jobs whose processes share a v1 group (a hybrid host's session or root group) read it once per tick
            got = tickmemo.get(("v1cpu", d), lambda: self._v1_group(d))
            if got is not None:
                self._add(g, *got)

    def _v1_group(self, d: str) -> tuple[tuple[int, int, int], float | None] | None:
        st = read_kv(f"{d}/cpu.stat", self.files.read)
        if st is None or "nr_periods" not in st:
            return None
        quota = read_int(f"{d}/cpu.cfs_quota_us", self.files.read)
        period = read_int(f"{d}/cpu.cfs_period_us", self.files.read)
        limit = quota / period if quota and quota > 0 and period else None
        return (st["nr_periods"], st["nr_throttled"], st.get("throttled_time", 0)), limit

    def take(self) -> dict:
        if not self.seen:
            return {}
        out = dict(zip(self.KEYS, self.acc))
        if self.limit is not None:
            out["cpu_limit_cores"] = round(self.limit, 4)
        self.acc = [0, 0, 0]
        return out


class CgroupProbe(Probe):
    name = "cgroup"
    default = True
    summary = "the job's own accounting: CPU time, memory, I/O bytes (cgroup2 files, /proc)"
    fields = {
        "cpu_user_ns": Field("int", "ns", "CPU time in user mode this interval"),
        "cpu_system_ns": Field("int", "ns", "CPU time in kernel mode this interval"),
        "mem_bytes": Field("int", "bytes", "memory now: memory.current, else the sum of the processes' RSS"),
        "mem_peak_bytes": Field("int", "bytes", "highest memory so far: memory.peak, else the highest mem_bytes seen"),
        "mem_anon_bytes": Field("int", "bytes", "of mem_bytes, anonymous memory (heap, stacks; what swap or the OOM "
                                "killer would take): memory.stat anon, else the processes' RssAnon"),
        "mem_file_bytes": Field("int", "bytes", "of mem_bytes, file pages: the page cache charged to the job "
                                "(memory.stat file), else the processes' mapped file pages; shared memory (tmpfs, "
                                "MAP_SHARED anonymous) counts here in both"),
        "io_read_bytes": Field("int", "bytes", "bytes read from storage this interval (io.stat rbytes, else the "
                               "job's threads' /proc/PID/task/TID/io and, as root, their exit records)"),
        "io_write_bytes": Field("int", "bytes", "bytes written to storage this interval (io.stat wbytes, else the "
                                "job's threads' /proc/PID/task/TID/io and, as root, their exit records)"),
        "nprocs": Field("int", "count", "processes in the job now"),
        "exits_uncounted": Field("int", "count", "threads of the job that exited this interval without an exit "
                                 "record (not root: no taskstats; or records the kernel dropped in a burst), where "
                                 "CPU or I/O come from /proc: what each did since the last tick is missing from "
                                 "those figures. 0 where the group's own files count everything"),
        "cpu_periods": Field("int", "count", "CFS bandwidth periods in which the job's group ran with a CPU limit "
                             "this interval (cpu.stat nr_periods; 0 without a limit)"),
        "cpu_throttled_periods": Field("int", "count", "of those, periods in which the group used up its limit and "
                                       "was stopped (nr_throttled)"),
        "cpu_throttled_ns": Field("int", "ns", "time the group spent stopped by its CPU limit this interval "
                                  "(throttled_usec; v1: throttled_time)"),
        "cpu_limit_cores": Field("float", "cores", "the group's CPU limit now (cpu.max, v1 cpu.cfs_quota_us / "
                                 "cfs_period_us); absent without a limit"),
    }

    def __init__(self, host=None):
        super().__init__(host)
        self.target: Target | None = None
        self.cg: Path | None = None
        self.cgf: dict[str, str] = {}
        self.prev: dict[str, int] = {}
        self.perpid = PerPid({"user": "cuser", "system": "csystem"})
        self.threadacct: ThreadAcct | None = None
        self.members: list[int] = []      # the processes read last time (with pids that ended)
        self.from_zero = False
        self.peak = 0
        self._uncounted = 0               # ThreadAcct.uncounted at the last sample
        self.files = procfs.OpenFiles()   # the files read every tick, kept open
        self.throttle = Throttle(self.files)

    def start(self, target: Target) -> None:
        self.target = target
        self.cg = Path(target.cgroup_path) if target.cgroup_path else None
        self.cgf = {n: str(self.cg / n) for n in ("memory.current", "memory.stat", "memory.peak",
                                                  "io.stat")} if self.cg is not None else {}
        if self.cg is not None and target.cpu_stat() is None:
            raise ProbeUnavailable(f"cannot read {self.cg / 'cpu.stat'}")
        self.perpid = PerPid({"user": "cuser", "system": "csystem"})
        self.threadacct = None
        self.members = []
        self.peak = 0
        self._uncounted = 0
        self.throttle = Throttle(self.files, self.host, from_zero=bool(getattr(target, "from_start", False)))
        # A job attached as it starts (a scheduler's prolog) counts from zero: its first frame holds everything it
        # did before it, up to the processes' and the group's own totals. Else the first frame reports its interval.
        self.from_zero = bool(getattr(target, "from_start", False))
        if self.from_zero:
            self.perpid.primed = True
            self.prev = dict.fromkeys(KEYS, 0)
        else:
            self.prev = self._read()  # baseline

    def _read(self) -> dict[str, int]:
        proc, read = self.host.proc, self.files.read
        optional = functools.partial(self.files.read, recheck=OPTIONAL_RECHECK_S)   # controllers that may be off
        need_proc = self.cg is None
        cur: dict[str, int] = {}
        if self.cg is not None:
            cpu = self.target.cpu_stat()    # (read once a tick: Target.quiet() looks at it too)
            if cpu is None:
                raise TargetGone(f"cgroup {self.cg} was removed")
            cur["user"] = cpu.get("user_usec", 0) * 1000
            cur["system"] = cpu.get("system_usec", 0) * 1000
            cur["usage"] = cpu.get("usage_usec", -1)
            if "nr_periods" in cpu:      # the cpu controller is on cgroup2 for this group
                self.throttle.v2(self.cg, cpu)
            mem = read_int(self.cgf["memory.current"], optional)
            if mem is not None:  # the memory controller is on cgroup2 here
                cur["mem"] = mem
                stat = read_kv(self.cgf["memory.stat"], optional) or {}
                cur["anon"], cur["file"] = stat.get("anon", 0), stat.get("file", 0)
                peak = read_int(self.cgf["memory.peak"], optional)
                if peak is not None:
                    cur["peak"] = peak
            io = io_stat_bytes(self.cgf["io.stat"], optional)
            if io is not None:
                cur["rd"], cur["wr"] = io
            need_proc = mem is None or io is None
        pids = self.target.pids()
        cur["nprocs"] = len(pids)
        if not self.throttle.is_v2:      # a hybrid host's v1 cpu controller, or a PID tree's groups
            self.throttle.v1(pids)
        if need_proc:  # PID-tree target, or controllers a hybrid host keeps on cgroup v1
            members = pids + self.target.ended_pids()
            acct = self.thread_acct()
            per_cpu = "user" not in cur and acct.listener is None   # no exit records: per process, with cutime
            per = {}
            if per_cpu or "mem" not in cur:   # /proc/PID/stat only for per_cpu; statm for RSS
                per = {p: c for p in members
                       if (c := proc_counters(proc, p, io=False, read=read, cpu=per_cpu)) is not None}
            # No thread of the group ran since the last read (usage unchanged) and its processes are the same: the
            # threads' /proc counters cannot have moved (ThreadAcct.update).
            quiet = cur.get("usage", -1) >= 0 and cur["usage"] == self.prev.get("usage") and members == self.members
            self.members = members
            d = acct.update(proc, members, read, cpu="user" not in cur and acct.listener is not None, quiet=quiet,
                            launched=self.target.launched_pids())
            if per_cpu:
                d.update(self.perpid.update(per, ("user", "system")))
            if "mem" not in cur:
                cur["mem"] = sum(c["rss"] for c in per.values())
                cur["file"] = sum(c["rss_file"] for c in per.values())
                cur["anon"] = cur["mem"] - cur["file"]
            for k in KEYS:
                if k not in cur:
                    cur[f"d_{k}"] = d[k]  # already a delta
        return cur

    def thread_acct(self) -> ThreadAcct:
        """Made at the first read that needs it: the exit-record listener only where counts come from /proc."""
        if self.threadacct is None:
            try:
                listener = ExitFeed.subscribe() if self.host.is_root else None
            except ProbeUnavailable:
                listener = None   # a thread's counts since the last tick are lost at its exit (see ThreadAcct)
            self.threadacct = ThreadAcct(listener, from_zero=self.from_zero)
        return self.threadacct

    def sample(self) -> dict:
        cur = self._read()
        self.files.sweep()
        prev, self.prev = self.prev, cur

        def d(k: str) -> int:
            if f"d_{k}" in cur:
                return cur[f"d_{k}"]
            return delta(cur[k], prev.get(k, cur[k]))

        self.peak = max(self.peak, cur.get("peak", 0), cur["mem"])
        uncounted = self.threadacct.uncounted if self.threadacct is not None else 0
        uncounted, self._uncounted = uncounted - self._uncounted, uncounted
        return {"cpu_user_ns": d("user"), "cpu_system_ns": d("system"), "mem_bytes": cur["mem"],
                "mem_peak_bytes": self.peak, "mem_anon_bytes": cur["anon"], "mem_file_bytes": cur["file"],
                "io_read_bytes": d("rd"), "io_write_bytes": d("wr"),
                "nprocs": cur["nprocs"], "exits_uncounted": uncounted, **self.throttle.take()}

    def stop(self) -> None:
        self.target = None
        self.files.close()
        if self.threadacct is not None:
            self.threadacct.close()
            self.threadacct = None
