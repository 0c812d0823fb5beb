# SPDX-License-Identifier: Apache-2.0
"""Per-process and per-thread accounting of a set of processes from /proc, exact through exits where the kernel's
taskstats exit records (jobprobe/kernel/taskstats.py) can be had: CPU time, RSS and storage I/O bytes of one process
(proc_counters), of each of its threads (thread_counters), their per-interval deltas per process with what a parent's
cutime/cstime says of the children it reaped (PerPid), and per thread with each exited thread's final counts from its
exit record (ThreadAcct). The caller names the processes (pids); nothing here knows of jobs or targets.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from jobprobe.kernel import procfs
from jobprobe.kernel.taskstats import ExitRecord, Subscription

CLK_TCK = procfs.CLK_TCK
PAGE = os.sysconf("SC_PAGE_SIZE")
Reader = Callable[[str], "str | None"]


def proc_counters(proc: str, pid: int, io: bool = True, read: Reader = procfs.read_small,
                  cpu: bool = True) -> dict[str, int] | None:
    """CPU (ns), RSS (bytes) and I/O bytes of one process from /proc; None if it has gone. (The cgroup probe reads
    I/O per thread, ThreadAcct, and asks for no `io` here; the process's figure is for the tests' and tools' use. No
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


HOLD_UPDATES = 2         # an exit record no job process claims is held this many updates (its parent's may come next)
HOLD_MAX = 8192          # ... at most this many (every exit on the host comes through the one socket)
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
    counters (bytes; CPU: ExitRecord.cpu_ns, its exact time on CPU), and what it did since its last read is added.
    Records of threads never read (born and gone between two ticks) count whole when their process is the job's or
    their parent process is (followed down a chain of such short-lived processes) — so the root of a PID tree, reaped
    outside the job (by slurmstepd, a shell), loses nothing either. Without a listener (no root, no taskstats) a
    thread's counts since the last tick
    are lost at its exit (the cgroup probe then takes CPU per process, with what a parent's cutime/cstime says of the
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
        self.held: list[tuple[ExitRecord, int]] = []   # records no job process claimed yet, with the update they came
        self.updates = 0

    def update(self, proc: str, pids: list[int], read: Reader = procfs.read_small,
               cpu: bool = True, quiet: bool = False, launched: list[int] = (),
               exited: set[int] = frozenset()) -> dict[str, int]:
        """This interval's KEYS summed over the job's threads (CPU 0 when `cpu` is off).

        `quiet`: the caller knows that none of the job's threads ran since the last update (its group's CPU usage
        did not move, its processes are the same): a thread's counters only grow while it runs (I/O bytes are
        charged to the task that submits or dirties), so /proc is not walked and nothing is counted — unless an
        exit record of the job came (then the walk is done as usual). What a thread did in less than the usage
        counter's 1 µs is not lost: it is in the next walk's difference, or in its exit record.

        `launched`: processes the caller started itself (a target's launched_pids): their records, and those of their
        descendants, are the job's even if no walk ever saw them (a job born and gone within its first tick). Each
        is claimed once: a pid reused after its reaping is someone else.

        `exited`: processes the node's membership saw exit as the job's (by its group): their records are the job's
        whoever their parent was at exit — one that left the job's tree first (double-forked, its shell gone) and
        lived less than a tick is no process's child here."""
        self.updates += 1
        records = self.listener.drain() if self.listener is not None else []
        out = [0, 0, 0, 0]
        now: dict[int, tuple[int, tuple[int, ...]]] = {}
        if self.primed:
            mine = self.job_records(records, pids, [p for p in launched if p not in self.claimed], exited=exited)
            if quiet and not mine:
                return dict.fromkeys(KEYS, 0)
            self._count(mine, now, out)
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
        gone = [tid for tid in self.last if tid not in listed and tid not in self.finished]
        if gone and self.primed and self.listener is not None:
            # threads that exited between the drain above and their read: their records were sent before they
            # left /proc, so they are in the socket now (on a busy host that gap held a SLURM task's whole tail)
            late = self.job_records(self.listener.drain(), pids, [p for p in launched if p not in self.claimed],
                                    now, exited)
            self._count(late, now, out)
        self.finished &= listed         # a zombie reaped: its tid may come back as someone else
        # threads gone without a record (no listener, or records the kernel dropped): their tail is lost — counted
        self.uncounted += sum(1 for tid in self.last if tid not in listed)
        self.last = now
        self.primed = True
        return dict(zip(KEYS, out))

    def _count(self, records: list[ExitRecord], now: dict[int, tuple[int, tuple[int, ...]]], out: list[int]) -> None:
        """Add each record's final counts less the thread's last read (this walk's, else the last tick's)."""
        for r in records:
            _, before = now.pop(r.tid, None) or self.last.pop(r.tid, (0, (0, 0, 0, 0)))
            final = (r.read_bytes, r.write_bytes, *r.cpu_ns())
            for i in range(4):
                out[i] += max(0, final[i] - before[i])
            self.finished.add(r.tid)

    def job_records(self, records: list[ExitRecord], pids: list[int], launched: list[int] = (),
                    now: dict[int, tuple[int, tuple[int, ...]]] | None = None,
                    exited: set[int] = frozenset()) -> list[ExitRecord]:
        """The records of the job's threads: read before (or in this walk: `now`), or of a job process (or one the
        target launched), or of a process whose parent is one (a fixed point over the records, for a chain of
        processes that came and went between ticks). A record none of them claims is held for HOLD_UPDATES
        updates: a grandchild that exits just before its parent (which reaps it, then exits) may be drained an
        update before the parent's record that makes it the job's."""
        known = self.last if now is None else {**self.last, **now}
        procs = set(pids) | {tgid for tgid, _ in known.values()} | set(launched) | set(exited)
        out, rest = [], []
        for r, n in self.held + [(r, self.updates) for r in records]:
            if r.tid in known:
                out.append(r)
            else:
                rest.append((r, n))
        grew = True
        while grew and rest:
            grew = False
            for item in list(rest):
                r = item[0]
                if (r.tgid and r.tgid in procs) or r.ppid in procs or r.tid in procs:
                    procs.add(r.tgid or r.tid)
                    if r.tid in launched:
                        self.claimed.add(r.tid)
                    out.append(r)
                    rest.remove(item)
                    grew = True
        self.held = [(r, n) for r, n in rest if self.updates - n < HOLD_UPDATES][-HOLD_MAX:]
        return out

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


class Helpers:
    """Which of a set of processes are helpers, and their CPU per interval. A helper was forked by another process
    of the set and did not start a program of its own: its command line is its parent's, the parent in the set (a
    PyTorch DataLoader worker, a pool under multiprocessing's default fork method). The others are the lead
    processes: a launcher, the programs it started (torchrun's ranks, `mp.spawn`'s — started anew, with their own
    command line), the ranks' own work. A process is judged once it is SETTLE_S old (a fork about to exec is no
    helper), and again where its PID is used anew. A helper that appears after the first update counts from zero;
    one that exits takes what it did since the last update with it (its parent's cutime has it, with the rest).
    Not told apart: helpers started by multiprocessing's spawn or forkserver methods (their command line is their
    own), which count as lead processes."""

    SETTLE_S = 1.0

    def __init__(self, proc: str, read: Reader = procfs.read_small):
        self.proc, self.read = proc, read
        self.judged: dict[int, tuple[int, bool]] = {}    # pid → (its start time, a helper)
        self.prev: dict[int, tuple[int, int]] = {}       # helper pid → (utime, stime) ticks at the last update
        self.first: set[int] | None = None               # the processes of the first update (counted from then)

    def _judge(self, pid: int, st: procfs.Stat, members: set[int]) -> bool:
        if st.ppid not in members:
            return False
        cmd = procfs.read_cmdline(self.proc, pid)
        return bool(cmd) and procfs.read_cmdline(self.proc, st.ppid) == cmd

    def update(self, pids: list[int]) -> tuple[int, int, int]:
        """(helpers now, their user ns, their system ns this interval) among `pids` (the set's processes now and
        those ended but not reaped)."""
        members = set(pids)
        first = self.first is None
        if first:
            self.first = members
        for pid in [p for p in self.judged if p not in members]:
            del self.judged[pid]
        now_ticks = None
        cur: dict[int, tuple[int, int]] = {}
        for pid in pids:
            known = self.judged.get(pid)
            if known is not None and not known[1]:
                continue          # a lead process: nothing to read
            st = procfs.read_stat(self.proc, pid, self.read)
            if st is None:
                continue
            if known is None or known[0] != st.starttime:
                if now_ticks is None:
                    now_ticks = uptime_ticks(self.proc)
                if now_ticks - st.starttime < self.SETTLE_S * CLK_TCK:
                    continue      # too young to tell
                self.judged[pid] = (st.starttime, self._judge(pid, st, members))
                if not self.judged[pid][1]:
                    continue
                self.prev.pop(pid, None)
                if first or (known is None and pid in self.first):
                    self.prev[pid] = (st.utime, st.stime)    # there before the first update: counted from now
            cur[pid] = (st.utime, st.stime)
        user = system = 0
        for pid, (u, s) in cur.items():
            pu, ps = self.prev.get(pid, (0, 0))
            user, system = user + max(0, u - pu), system + max(0, s - ps)
        self.prev = cur
        return len(cur), user * procfs.NS_PER_TICK, system * procfs.NS_PER_TICK


def uptime_ticks(proc: str) -> float:
    """Clock ticks since boot (/proc/uptime), the unit of a process's start time."""
    text = procfs.read_small(f"{proc}/uptime") or "0"
    return float(text.split()[0]) * CLK_TCK
