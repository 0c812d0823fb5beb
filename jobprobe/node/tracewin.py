# SPDX-License-Identifier: Apache-2.0
"""Deep-trace windows: for a short while, one job is traced in detail, and the result is one Chrome / Perfetto
trace file (Trace Event Format JSON, gzipped) a person opens in ui.perfetto.dev.

A window opens when a rule with `action = "trace"` fires (jobprobe/node/rules.py), or on request (`jobprobe trace --job
ID [--duration S]`). For its duration, for that job only:
- every Python process of the job is sampled at TRACE_HZ by `py-spy record --format chrometrace --nonblocking`
  (a recorder per process, idle threads included: where a thread waits is the point): one timeline per process
  and thread;
- the job's probes that have a deep mode record event by event (jobprobe/contract/bpfprobe.py: trace_on /
  trace_take), and
  those given for windows only (`syscalls`, `cuda`: off by default for their cost) run for the window's length:
  each off-CPU period of 100 µs or more with its reason and its kernel and user stacks (sched), each syscall of
  100 µs or more (syscalls), each CUDA / NCCL call with its start and end (cuda) — on two tracks per thread beside
  its Python samples: "kernel" (syscalls, and the off-CPU periods inside them) and "CUDA";
- the job's frames of the window go in as counter tracks (CPU cores; time waiting for a CPU; off-CPU time by
  reason; network), so the Python timeline sits beside what the kernel saw;
- the rule's evidence is an instant event at the window's start.
Tracks: a thread's Python samples are on (pid, its OS thread id) — py-spy names threads by pthread id, mapped here
with a `py-spy dump` per process at the window's start and end — its kernel events on (pid, KERNEL_TID + tid), its CUDA
calls on (pid, CUDA_TID + tid), each track named.
Then the file is written under the trace directory and announced in a `trace` frame with its path.

Budget: at most one window at a time per job; none within `cooldown` s of the last one's end; and none while the
time already traced exceeds `duty` (30%) of the job's run so far — a rule that holds all the time traces about 30%
of the run (at most one window more), not all of it. The controller's requests (jobprobe/node/agent.py: Agent.remote)
are held to all of it like a rule; a person's request on the node's root-only control socket, and the agent's own
`trace_every`, skip the cooldown and the duty cap (`force_budget`), never the one window at a time. A refused
request says why.

Files: the trace directory is made (or set) 0700 and every trace is written 0600 — a trace holds the job's command
lines, stacks and function names, which other users of a shared node must not read; a directory another user owns
or may write is refused (jobprobe/core/safefile.py), the window with it.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from jobprobe.core.errors import UnsafeFile
from jobprobe.core.names import job_filename
from jobprobe.core.safefile import Dir

log = logging.getLogger("jobprobe.trace")

DURATION_S = 25.0
COOLDOWN_S = 60.0
DUTY = 0.30
TRACE_HZ = 50
OFFCPU = ("preempt", "io", "lock", "sleep", "wait")
KERNEL_TID, CUDA_TID = 10_000_000, 20_000_000          # above any pid_max (4 Mi): a thread's other tracks


class TraceClock:
    """Where a kernel time (CLOCK_MONOTONIC ns, bpf_ktime_get_ns) and a thread's tracks go in one window."""

    def __init__(self, mono0_ns: int):
        self.mono0_ns = mono0_ns

    def us(self, ns: int) -> float:
        return round((ns - self.mono0_ns) / 1e3, 3)

    def span(self, start_ns: int, end_ns: int) -> dict[str, float]:
        """ts and dur (µs) of an interval, its part before the window's start cut off."""
        start_ns = max(start_ns, self.mono0_ns)
        return {"ts": self.us(start_ns), "dur": round(max(0, end_ns - start_ns) / 1e3, 3)}

    @staticmethod
    def kernel_tid(tid: int) -> int:
        return KERNEL_TID + tid

    @staticmethod
    def cuda_tid(tid: int) -> int:
        return CUDA_TID + tid


def thread_names(events: list[dict]) -> list[dict]:
    """Names and order for every (pid, tid) track of the events: 'thread N: Python|kernel|CUDA', a thread's
    tracks side by side."""
    out = []
    for pid, tid in sorted({(e["pid"], e["tid"]) for e in events if "pid" in e and "tid" in e and e["pid"]}):
        if tid >= 1 << 32:                   # a pthread id py-spy gave and no dump could map
            base, k, name = tid, 0, f"Python thread {tid:#x}"
        else:
            k = 2 if tid >= CUDA_TID else 1 if tid >= KERNEL_TID else 0
            base = tid - (0, KERNEL_TID, CUDA_TID)[k]
            name = f"thread {base}: " + ("Python", "kernel: syscalls, off-CPU", "CUDA / NCCL calls")[k]
        order = (base * 3 + k) % (1 << 31)
        out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": order}}]
    return out


def os_thread_ids(py_spy: str, pid: int) -> dict[int, int]:
    """py-spy's thread ids (pthread_t) → OS thread ids of one Python process, from one `py-spy dump`."""
    try:
        r = subprocess.run([py_spy, "dump", "--pid", str(pid), "--nonblocking", "--json"], capture_output=True,
                           text=True, timeout=20)
        threads = json.loads(r.stdout) if r.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return {}
    return {t["thread_id"]: t["os_thread_id"] for t in threads if isinstance(t, dict)
            and isinstance(t.get("thread_id"), int) and isinstance(t.get("os_thread_id"), int)}


def counters(frame: dict) -> dict[str, dict[str, float]]:
    """A sample frame's figures as counter tracks: {track: {series: value}}."""
    p, dt = frame.get("probes") or {}, float(frame.get("dt") or 1.0) or 1.0
    out: dict[str, dict[str, float]] = {}
    cg, sc, net = p.get("cgroup") or {}, p.get("sched") or {}, p.get("net") or {}
    if isinstance(cg, dict) and "cpu_user_ns" in cg:
        out["CPU cores"] = {"user": cg["cpu_user_ns"] / 1e9 / dt, "system": cg.get("cpu_system_ns", 0) / 1e9 / dt}
    if isinstance(sc, dict) and "runq_lat_ns" in sc:
        out["waiting for a CPU (s/s)"] = {"runq": sc["runq_lat_ns"] / 1e9 / dt}
        out["off-CPU by reason (s/s)"] = {r: sc.get(f"offcpu_{r}_ns", 0) / 1e9 / dt for r in OFFCPU}
    if isinstance(net, dict) and "tcp_tx_bytes" in net:
        out["network (MiB/s)"] = {"tx": net["tcp_tx_bytes"] / 2 ** 20 / dt,
                                  "rx": net.get("tcp_rx_bytes", 0) / 2 ** 20 / dt}
    return out


class Window:
    def __init__(self, job: str, reason: str, evidence: dict, duration: float, pids: list[int], out_dir: str,
                 py_spy: str | None, clock: Callable[[], float] = time.time):
        self.job, self.reason, self.evidence, self.duration = job, reason, evidence, duration
        self.clock = clock
        self.t0 = clock()
        self.kclock = TraceClock(time.monotonic_ns())
        self.py_spy = py_spy
        self.deep: list | None = None      # the probes recording event by event (None: not begun yet)
        # (probe, its records, records it could not keep, CLOCK_MONOTONIC ns its recording began or None)
        self.taken: list[tuple[Any, list, int, int | None]] = []
        self.deep_span: list[float] = []   # µs on the window's timeline: event-by-event recording on, off
        self.frames: list[dict] = []
        self.out_dir = Path(out_dir)
        self.recorders: list[tuple[int, subprocess.Popen, Path]] = []
        Dir(str(self.out_dir)).close()     # checked (ours alone, else UnsafeFile), made or narrowed to 0700
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.t0))
        # injective: two jobs never share a name
        self.path = self.out_dir / f"{job_filename(job)}-{stamp}.trace.json.gz"
        for pid in pids if py_spy else ():
            tmp = self.out_dir / f".{job_filename(job)}-{pid}-{os.getpid()}.pyspy.json"
            proc = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--format", "chrometrace", "--rate",
                                     str(TRACE_HZ), "--duration", str(max(1, int(round(duration)))), "--nonblocking",
                                     "--idle", "--output", str(tmp)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self.recorders.append((pid, proc, tmp))
        # py-spy's thread ids → OS ones, asked now (the processes may be gone by the end: a job that ends cuts
        # the window short) and again at the end for threads started meanwhile
        self.tid_maps: dict[int, dict[int, int]] = {}
        self._mapper = threading.Thread(target=self._map_threads, args=([pid for pid, _, _ in self.recorders],),
                                        daemon=True, name="trace-tids")
        self._mapper.start()

    def _map_threads(self, pids: list[int]) -> None:
        for pid in pids:
            self.tid_maps.setdefault(pid, {}).update(os_thread_ids(self.py_spy, pid))

    @property
    def done(self) -> bool:
        return self.clock() >= self.t0 + self.duration

    def finish(self, roles: dict[int, str]) -> dict[str, Any]:
        """Wait for the recorders, merge, write the file. Returns the `trace` frame's body."""
        with Dir(str(self.out_dir)) as d:     # checked again: a window lasts long enough for a directory to change
            return self._written(d, roles)

    def _written(self, d: Dir, roles: dict[int, str]) -> dict[str, Any]:
        events: list[dict] = []
        said = []
        for pid, proc, tmp in self.recorders:
            try:
                _, err = proc.communicate(timeout=self.duration + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            try:
                raw = json.loads(d.read(tmp.name) or b"")
            except (OSError, ValueError):
                said.append(f"pid {pid}: {(err or b'').decode(errors='replace').strip().splitlines()[:1]}")
                continue
            finally:
                d.unlink(tmp.name)
            raw = raw.get("traceEvents", []) if isinstance(raw, dict) else raw
            for e in raw:                  # py-spy's ts are µs since its start: the window's start here
                if isinstance(e, dict) and isinstance(e.get("ts"), (int, float)):
                    events.append(e)
        events = balanced(events, self.duration * 1e6)
        if events and self.py_spy:                   # py-spy's pthread ids → OS thread ids
            self._mapper.join(timeout=30)
            for pid in {e["pid"] for e in events if "pid" in e}:
                ids = {**self.tid_maps.get(pid, {}), **os_thread_ids(self.py_spy, pid)}
                for e in events:
                    if e.get("pid") == pid and e.get("tid") in ids:
                        e["tid"] = ids[e["tid"]]
        counts: dict[str, int] = {}
        spans: dict[str, list[float]] = {}     # each probe's own recording span: a window-only one's from its start
        for probe, records, dropped, since_ns in self.taken:
            if len(self.deep_span) == 2:
                on, off = self.deep_span
                spans[probe.name] = [max(on, self.kclock.us(since_ns)) if since_ns else on, off]
            try:
                deep = probe.trace_events(records, self.kclock)
            except Exception as err:           # one probe's records must not cost the window
                log.exception("trace events of %s", probe.name)
                said.append(f"{probe.name}: {err}")
                continue
            events += deep
            counts[probe.name] = len(deep)
            if dropped:
                said.append(f"{probe.name}: {dropped} events not kept (over the window's limit, or refused by the "
                                f"kernel's ring)")
        pids = sorted({e["pid"] for e in events if "pid" in e})
        meta = [{"ph": "M", "name": "process_name", "pid": p, "tid": 0,
                 "args": {"name": f"{roles.get(p, 'python')} (pid {p})"}} for p in pids]
        meta.append({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": f"job {self.job}"}})
        marks = [{"ph": "i", "s": "g", "name": f"window opened: {self.reason}", "pid": 0, "tid": 0, "ts": 0,
                  "args": {"reason": self.reason, "evidence": self.evidence}}]
        tracks = []
        for fr in self.frames:
            ts = max(0.0, (float(fr["t"]) - self.t0) * 1e6)
            for name, series in counters(fr).items():
                tracks.append({"ph": "C", "name": name, "pid": 0, "tid": 0, "ts": ts,
                               "args": {k: round(v, 6) for k, v in series.items()}})
        meta += thread_names(events)
        doc = {"traceEvents": meta + marks + tracks + events, "displayTimeUnit": "ms",
               "otherData": {"job": self.job, "reason": self.reason, "start_unix_s": self.t0,
                             "duration_s": self.duration, "tool": "jobprobe",
                             "monotonic_ns_at_0": self.kclock.mono0_ns, "kernel_events_us": self.deep_span,
                             "kernel_events_us_by_probe": spans}}
        tmp = self.path.with_suffix(".tmp").name
        with os.fdopen(d.open(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as raw, gzip.open(raw, "wt") as f:
            json.dump(doc, f)
        d.replace(tmp, self.path.name)
        body = {"path": str(self.path), "reason": self.reason, "start": self.t0, "duration_s": self.duration,
                "processes": pids, "events": len(events), "kernel_events": counts, "evidence": self.evidence}
        if not self.recorders:
            said.insert(0, "no Python process to sample")
        if said:
            body["note"] = "; ".join(said)[:300]
        return body


def balanced(events: list[dict], end_ts: float) -> list[dict]:
    """py-spy's events in time order, every begin with its end: an end with no open begin is dropped, begins still
    open at the end are closed at `end_ts` (a window cuts the program mid-call), so every viewer draws them."""
    events = sorted(events, key=lambda e: e["ts"])      # stable: at a tie py-spy's E stays before its B
    out, stacks = [], {}
    for e in events:
        if e.get("ph") not in ("B", "E"):
            out.append(e)
            continue
        st = stacks.setdefault((e.get("pid"), e.get("tid")), [])
        if e["ph"] == "B":
            st.append(e)
            out.append(e)
        elif e.get("name") in [b.get("name") for b in st]:
            while st:
                b = st.pop()
                out.append({**b, "ph": "E", "ts": e["ts"]})
                if b.get("name") == e.get("name"):
                    break
    for st in stacks.values():
        last = max(end_ts, max((b["ts"] for b in st), default=0))
        out += [{**b, "ph": "E", "ts": last} for b in reversed(st)]
    return out


class Tracer:
    """One job's trace windows: the budget (one at a time, cooldown, duty cap), the open window, its end."""

    def __init__(self, job: str, out_dir: str, pids: Callable[[], list[int]], roles: Callable[[int], str],
                 is_python: Callable[[int], bool], py_spy: str | None, cooldown: float = COOLDOWN_S,
                 duty: float = DUTY, clock: Callable[[], float] = time.time,
                 deep_begin: Callable[[], list] = list, deep_end: Callable[[list], list] = lambda probes: []):
        """deep_begin: (the sampler's thread, at the first tick of a window) start the window's probes and their
        deep mode, returning those probes; deep_end(probes): their records [(probe, records, dropped, since_ns)], the
        window-only probes stopped."""
        self.job, self.out_dir, self.pids, self.roles, self.is_python = job, out_dir, pids, roles, is_python
        self.deep_begin, self.deep_end = deep_begin, deep_end
        self.py_spy, self.cooldown, self.duty, self.clock = py_spy, cooldown, duty, clock
        self.started = clock()
        self.traced_s = 0.0
        self.last_end = -1e18
        self.window: Window | None = None
        self.finishing: list[threading.Thread] = []
        self.ready: list[dict] = []           # `trace` frame bodies to send with the next tick
        self.lock = threading.Lock()

    def may_open(self, duration: float, at: float | None = None, force_budget: bool = False) -> str | None:
        """Why a window cannot open now, or None. With `at` (a time ahead, on this tracer's clock: UNIX s in the
        agent): why it surely cannot open then, whatever happens meanwhile — another window opened meanwhile only
        adds to what is traced — so that a scheduled request is refused when it is made, not silently when due.
        `force_budget`: only the one window at a time holds."""
        now = self.clock()
        when = now if at is None else max(now, at)
        last_end, w = self.last_end, self.window
        if w is not None:
            if at is None:
                return "a window is open already"
            if when < w.t0 + w.duration:
                return f"a window is open already (until {w.t0 + w.duration - now:.0f} s from now)"
            last_end = max(last_end, w.t0 + w.duration)     # it ends then at the earliest
        if force_budget:
            return None
        then = "" if at is None else " at the time asked"
        if when - last_end < self.cooldown:
            return f"cooling down ({self.cooldown - (when - last_end):.0f} s left{then})"
        run = when - self.started
        if self.traced_s > self.duty * run:     # the share so far: the run's traced share stays ≈ duty (+ a window)
            return (f"the duty cap: {self.traced_s:.0f} s of {run:.0f} s traced already{then} "
                    f"(at most {self.duty:.0%})")
        return None

    def open(self, reason: str, evidence: dict | None = None, duration: float = DURATION_S,
             force_budget: bool = False) -> dict[str, Any]:
        why = self.may_open(duration, force_budget=force_budget)
        if why is not None:
            return {"ok": False, "state": "refused", "why": why}
        pids = [p for p in self.pids() if self.is_python(p)]    # a recorder per process (py-spy's --subprocesses
        # takes a forked child's thread for its parent's: the same pthread id on both sides of the fork)
        try:
            self.window = Window(self.job, reason, evidence or {}, duration, pids, self.out_dir, self.py_spy,
                                 clock=self.clock)
        except UnsafeFile as err:             # a trace directory another user could turn: said, in one line
            return {"ok": False, "state": "refused", "why": str(err)}
        self.traced_s += duration
        log.warning("job %s: trace window open for %.0f s (%s): %s", self.job, duration, reason, self.window.path)
        return {"ok": True, "state": "tracing", "path": str(self.window.path), "duration_s": duration}

    def feed(self, frame: dict) -> list[dict]:
        """Each sample frame: kept for the open window; a window past its end is finished in a thread. Returns
        the `trace` frame bodies ready to send."""
        w = self.window
        if w is not None and frame.get("kind") == "sample":
            if w.deep is None:
                w.deep = self._begin()
                w.deep_span = [w.kclock.us(time.monotonic_ns())]
            w.frames.append(frame)
            if w.done:
                self.window, self.last_end = None, self.clock()
                w.deep_span.append(w.kclock.us(time.monotonic_ns()))
                w.taken = self._end(w.deep)
                roles = {p: self.roles(p) for p in {pid for pid, _, _ in w.recorders}}
                t = threading.Thread(target=self._finish, args=(w, roles), name=f"trace-{self.job}", daemon=True)
                t.start()
                self.finishing.append(t)
        with self.lock:
            out, self.ready = self.ready, []
        return out

    def _begin(self) -> list:
        try:
            return self.deep_begin()
        except Exception:                     # the Python samples and counters still make a window
            log.exception("job %s: deep trace not started", self.job)
            return []

    def _end(self, probes: list | None) -> list:
        try:
            return self.deep_end(probes or [])
        except Exception:
            log.exception("job %s: deep trace not taken", self.job)
            return []

    def _finish(self, w: Window, roles: dict[int, str]) -> None:
        try:
            body = w.finish(roles)
        except Exception as err:              # a full disk: said, and the next window may do better
            log.error("job %s: trace %s not written: %s", self.job, w.path, err)
            body = {"path": None, "reason": w.reason, "start": w.t0, "duration_s": w.duration, "error": str(err)}
        with self.lock:
            self.ready.append(body)

    def close(self, timeout: float = 30.0) -> list[dict]:
        """At the job's end: an open window is cut short and written; returns what is ready."""
        w = self.window
        if w is not None:
            self.window = None
            if w.deep is not None:
                w.deep_span.append(w.kclock.us(time.monotonic_ns()))
            w.taken = self._end(w.deep)
            for _, proc, _ in w.recorders:
                if proc.poll() is None:
                    proc.send_signal(2)            # py-spy writes what it has on SIGINT
            self._finish(w, {pid: self.roles(pid) for pid, _, _ in w.recorders})
        for t in self.finishing:
            t.join(timeout=timeout)
        with self.lock:
            out, self.ready = self.ready, []
        return out
