# SPDX-License-Identifier: Apache-2.0
"""cgroup — the job's own accounting: CPU time, memory, I/O bytes, read from the kernel's files.

Hooks: cgroup2 cpu.stat, memory.current/memory.peak/memory.stat, io.stat for cgroup targets (a hybrid host's v1
memory group where it holds the job's processes alone: memory.usage_in_bytes, limit_in_bytes, max_usage_in_bytes,
memory.stat); /proc/PID/{stat,statm}
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
Helpers: the job's processes that another of them forked without a program of their own (their command line is
their parent's: DataLoader workers), their number and CPU time (/proc/PID/stat of the helpers only, each process's
command line read once) — the rest of the job's CPU is its lead processes', the pace of a CPU job's time use.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from jobprobe.contract import tickmemo
from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.kernel import procfs
from jobprobe.kernel.taskstats import ExitFeed
from jobprobe.kernel.threadacct import KEYS, Helpers, PerPid, Reader, ThreadAcct, proc_counters

EXITED_TICKS = 3            # ticks a process's exit event is kept for its exit record to be claimed
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


def v1_groups(proc: str, mount: tuple[str, str], controller: str, pids: list[int]) -> list[tuple[str, str]]:
    """[(v1 group, its directory)] of `controller` holding the job's processes (the first 64 looked at), sorted."""
    found = {procfs.cgroup_v1_path(proc, p, controller) for p in pids[:64]}
    point, root = mount

    def where(g: str) -> str:
        rel = g[len(root):] if root != "/" and g.startswith(root) else g
        return str(Path(point) / rel.lstrip("/"))
    return [(g, where(g)) for g in sorted(g for g in found if g)]


class V1Memory:
    """A hybrid host's v1 memory group of the job (cgroup2 has no memory controller there): its usage, limit, peak
    and anonymous / page-cache split (memory.usage_in_bytes, limit_in_bytes, max_usage_in_bytes, memory.stat
    total_rss / total_cache) — used only where the job's processes are in one group that holds nothing else (a
    SLURM job's or a pod's own group; not a session or root group shared with other work, whose figures are not
    the job's: then the processes' RSS is summed instead, as for a PID tree). Looked up again every
    OPTIONAL_RECHECK_S."""

    def __init__(self, files: procfs.OpenFiles, host=None):
        self.files, self.host = files, host
        self.dir: str | None = None
        self.found_at = -1e9
        self.mount: tuple[str, str] | None | bool = False

    def read(self, pids: list[int]) -> dict[str, int] | None:
        if self.mount is False:
            from jobprobe.kernel.host import find_cgroup_v1_mount
            self.mount = find_cgroup_v1_mount(self.host.mountinfo, "memory") if self.host else None
        if not self.mount or not pids:
            return None
        now = time.monotonic()
        if now - self.found_at > OPTIONAL_RECHECK_S:
            self.found_at = now
            groups = v1_groups(self.host.proc, self.mount, "memory", pids)
            self.dir = None
            if len(groups) == 1 and groups[0][0] != "/":
                held = self.files.read(f"{groups[0][1]}/cgroup.procs", recheck=OPTIONAL_RECHECK_S) or ""
                if {int(x) for x in held.split()} <= set(pids):
                    self.dir = groups[0][1]
        if self.dir is None:
            return None
        usage = read_int(f"{self.dir}/memory.usage_in_bytes", self.files.read)
        stat = read_kv(f"{self.dir}/memory.stat", self.files.read)
        if usage is None or stat is None:
            self.dir, self.found_at = None, -1e9
            return None
        out = {"mem": usage, "anon": stat.get("total_rss", 0),
               "file": stat.get("total_cache", 0)}
        peak = read_int(f"{self.dir}/memory.max_usage_in_bytes", self.files.read)
        if peak is not None:
            out["peak"] = peak
        limit = read_int(f"{self.dir}/memory.limit_in_bytes", self.files.read)
        if limit is not None and limit < 1 << 62:       # (no limit reads as PAGE_COUNTER_MAX pages: ~2^63)
            out["memlim"] = limit
        return out

    def oom_kills(self) -> int | None:
        """The group's OOM kills so far (memory.oom_control oom_kill, kernel 4.13+); also read once its last process
        is gone (an OOM kill empties it): the group found before stays."""
        if self.dir is None:
            return None
        return (read_kv(f"{self.dir}/memory.oom_control", self.files.read) or {}).get("oom_kill")


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
            self.groups = v1_groups(self.host.proc, self.mount, "cpu", pids)
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


def count_cpus(text: str | None) -> int | None:
    """CPUs in a kernel CPU list ("0-3,8,10-11" → 7); None for nothing, or text that is not one."""
    if not text or not text.strip():
        return None
    n = 0
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            return None
        n += int(hi) - int(lo) + 1 if hi else 1
    return n


class CgroupProbe(Probe):
    name = "cgroup"
    default = True
    summary = "the job's own accounting: CPU time, memory, I/O bytes (cgroup2 files, /proc)"
    fields = {
        "cpu_user_ns": Field("int", "ns", "CPU time in user mode this interval"),
        "cpu_system_ns": Field("int", "ns", "CPU time in kernel mode this interval"),
        "mem_bytes": Field("int", "bytes", "memory now: memory.current (a hybrid host: the job's own "
                           "v1 memory group's memory.usage_in_bytes), else the sum of the processes' RSS"),
        "mem_peak_bytes": Field("int", "bytes", "highest memory so far: memory.peak (v1: "
                                "max_usage_in_bytes), else the highest mem_bytes seen"),
        "mem_anon_bytes": Field("int", "bytes", "of mem_bytes, anonymous memory (heap, stacks; what swap or the OOM "
                                "killer would take): memory.stat anon (v1: total_rss), else the processes' RssAnon"),
        "mem_file_bytes": Field("int", "bytes", "of mem_bytes, file pages: the page cache charged to the job "
                                "(memory.stat file; v1: total_cache), else the processes' mapped file pages; shared "
                                "memory (tmpfs, MAP_SHARED anonymous) counts here in both"),
        "io_read_bytes": Field("int", "bytes", "bytes read from storage this interval (io.stat rbytes, else the "
                               "job's threads' /proc/PID/task/TID/io and, as root, their exit records)"),
        "io_write_bytes": Field("int", "bytes", "bytes written to storage this interval (io.stat wbytes, else the "
                                "job's threads' /proc/PID/task/TID/io and, as root, their exit records)"),
        "nprocs": Field("int", "count", "processes in the job now"),
        "helper_nprocs": Field("int", "count", "of those, helpers: forked by another of the job's processes "
                               "without a program of their own (a DataLoader worker; docs/TIMEUSE.md)",
                               kind="gauge"),
        "helper_cpu_user_ns": Field("int", "ns", "of cpu_user_ns, the helpers' (their /proc/PID/stat utime)"),
        "helper_cpu_system_ns": Field("int", "ns", "of cpu_system_ns, the helpers' (/proc/PID/stat stime)"),
        "exits_uncounted": Field("int", "count", "threads of the job that exited this interval without an exit "
                                 "record (not root: no taskstats; or records the kernel dropped in a burst), and "
                                 "processes whose exit note the node's membership table lost (a burst of exits "
                                 "past its size), where CPU or I/O come from /proc: what each did since the last "
                                 "tick may be missing from those figures. 0 where the group's own files count "
                                 "everything"),
        "cpu_periods": Field("int", "count", "CFS bandwidth periods in which the job's group ran with a CPU limit "
                             "this interval (cpu.stat nr_periods; 0 without a limit)"),
        "cpu_throttled_periods": Field("int", "count", "of those, periods in which the group used up its limit and "
                                       "was stopped (nr_throttled)"),
        "cpu_throttled_ns": Field("int", "ns", "time the group spent stopped by its CPU limit this interval "
                                  "(throttled_usec; v1: throttled_time)"),
        "cpu_limit_cores": Field("float", "cores", "the group's CPU limit now (cpu.max, v1 cpu.cfs_quota_us / "
                                 "cfs_period_us); absent without a limit"),
        "cpus_allowed": Field("int", "count", "CPUs the group may run on now (cgroup2 cpuset.cpus.effective); absent "
                              "where the cpuset controller is not on for it", kind="gauge"),
        "cpus_online": Field("int", "count", "CPUs online on the node now: the most the group can use where no limit "
                             "or cpuset says less", kind="gauge"),
        "oom_kills": Field("int", "count", "processes of the job's group the OOM killer took this interval "
                           "(memory.events oom_kill; a hybrid host: the job's own v1 group's memory.oom_control); "
                           "absent where no memory controller counts for the group"),
        "mem_limit_bytes": Field("int", "bytes", "the group's memory limit now (cgroup2 memory.max; a hybrid "
                                 "host: the job's own v1 group's memory.limit_in_bytes); absent without a limit"),
    }

    @classmethod
    def build(cls, host, node=None, sinks=None):
        return cls(host, node=node)

    def __init__(self, host=None, node=None):
        super().__init__(host)
        self.node = node                  # the node's membership: whose an exit record is (orphans), where it runs
        self.recent: list[set[int]] = []  # the job's processes that exited, the last EXITED_TICKS drains
        self.notes_lost = 0               # exit notes the membership table lost (counted in exits_uncounted)
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
        self.v1mem = V1Memory(self.files)
        self.helpers = Helpers(self.host.proc, self.files.read)

    def start(self, target: Target) -> None:
        self.target = target
        self.cg = Path(target.cgroup_path) if target.cgroup_path else None
        self.cgf = {n: str(self.cg / n) for n in ("memory.current", "memory.stat", "memory.peak", "memory.max",
                                                  "memory.events", "cpuset.cpus.effective",
                                                  "io.stat")} if self.cg is not None else {}
        if self.cg is not None and target.cpu_stat() is None:
            raise ProbeUnavailable(f"cannot read {self.cg / 'cpu.stat'}")
        self.perpid = PerPid({"user": "cuser", "system": "csystem"})
        self.threadacct = None
        self.members = []
        self.peak = 0
        self._uncounted = 0
        self.throttle = Throttle(self.files, self.host, from_zero=bool(getattr(target, "from_start", False)))
        self.v1mem = V1Memory(self.files, self.host)
        self.helpers = Helpers(self.host.proc, self.files.read)
        # A job attached as it starts (a scheduler's prolog) counts from zero: its first frame holds everything it
        # did before it, up to the processes' and the group's own totals. Else the first frame reports its interval.
        self.from_zero = bool(getattr(target, "from_start", False))
        if self.from_zero:
            self.perpid.primed = True
            self.prev = dict.fromkeys(KEYS + ("ooms",), 0)
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
                limit = read_int(self.cgf["memory.max"], optional)     # "max": no limit
                if limit is not None:
                    cur["memlim"] = limit
                ooms = (read_kv(self.cgf["memory.events"], optional) or {}).get("oom_kill")
                if ooms is not None:
                    cur["ooms"] = ooms
            cpus = count_cpus(optional(self.cgf["cpuset.cpus.effective"]))
            if cpus:
                cur["cpus"] = cpus
            io = io_stat_bytes(self.cgf["io.stat"], optional)
            if io is not None:
                cur["rd"], cur["wr"] = io
            need_proc = mem is None or io is None
        pids = self.target.pids()
        cur["nprocs"] = len(pids)
        cur["helpers"] = self.helpers.update(pids + self.target.ended_pids())
        if self.cg is not None and "mem" not in cur and (v1 := self.v1mem.read(pids)) is not None:
            cur.update(v1)            # a hybrid host's v1 memory group, the job's own
            need_proc = io is None
        if self.cg is not None and "ooms" not in cur and (ooms := self.v1mem.oom_kills()) is not None:
            cur["ooms"] = ooms
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
                            launched=self.target.launched_pids(), exited=self.exited())
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

    def exited(self) -> set[int]:
        """The tgids of the job's processes that exited in the last EXITED_TICKS ticks (an exit record may be drained
        a tick before or after its process's exit event), from the node's membership — drained once per agent tick
        for every job."""
        # the job's slot in the node's membership where its eBPF probes put it (asked each tick: a slot is let go
        # with the job's last eBPF probe, and may be another job's after); the cgroup probe loads no program itself
        slot = self.node.slot_of(self.target) if self.node is not None and self.target is not None else None
        if slot is None:
            self.recent = []
            return set()
        now = tickmemo.get("job_exited", self.node.exited) if tickmemo.active() else self.node.exited()
        mine, lost = now.get(slot, (set(), 0))
        self.notes_lost += lost           # processes whose exit note the table lost: their records may be missed
        self.recent = (self.recent + [mine])[-EXITED_TICKS:]
        return set().union(*self.recent)

    def sample(self) -> dict:
        cur = self._read()
        self.files.sweep()
        prev, self.prev = self.prev, cur

        def d(k: str) -> int:
            if f"d_{k}" in cur:
                return cur[f"d_{k}"]
            return delta(cur[k], prev.get(k, cur[k]))

        self.peak = max(self.peak, cur.get("peak", 0), cur["mem"])
        uncounted = (self.threadacct.uncounted if self.threadacct is not None else 0) + self.notes_lost
        uncounted, self._uncounted = uncounted - self._uncounted, uncounted
        return {"cpu_user_ns": d("user"), "cpu_system_ns": d("system"), "mem_bytes": cur["mem"],
                "mem_peak_bytes": self.peak, "mem_anon_bytes": cur["anon"], "mem_file_bytes": cur["file"],
                "io_read_bytes": d("rd"), "io_write_bytes": d("wr"),
                "nprocs": cur["nprocs"], "helper_nprocs": cur["helpers"][0], "helper_cpu_user_ns": cur["helpers"][1],
                "helper_cpu_system_ns": cur["helpers"][2], "exits_uncounted": uncounted, **self.throttle.take(),
                **({"mem_limit_bytes": cur["memlim"]} if "memlim" in cur else {}),
                **({"oom_kills": d("ooms")} if "ooms" in cur else {}),
                **({"cpus_allowed": cur["cpus"]} if "cpus" in cur else {}),
                "cpus_online": tickmemo.get("cpus_online", self._online_cpus)}

    def _online_cpus(self) -> int:
        """The node's online CPUs now (once per agent tick for all its jobs; a CPU taken offline leaves them)."""
        try:
            return len(self.host.online_cpus()) or os.cpu_count() or 1
        except (OSError, ValueError):
            return os.cpu_count() or 1

    def stop(self) -> None:
        self.target = None
        self.files.close()
        if self.threadacct is not None:
            self.threadacct.close()
            self.threadacct = None
