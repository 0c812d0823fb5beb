# SPDX-License-Identifier: Apache-2.0
"""The node agent: a job table, one tick for all jobs, one set of kernel programs for the node.

Each attached job has a slot in the node's membership maps (jobprobe/kernel/membership.py) and a Sampler of its own (its
probes, its frames, its sinks), but the eBPF probes of every job share one load of their programs (BpfProbe with a
node). A tick samples every job at once and sends one frame per job. Jobs arrive and leave at run time:
attach(spec), detach(job), probes(job, "+x,-y"); a job whose processes have all exited is detached by itself after
its last frame. `jobprobe run` is this agent with one job; `jobprobe agent` adds the control socket
(jobprobe/node/control.py) and the state file from which a restarted agent attaches the jobs still running.
With a NATS sink, the agent sends the node's `heartbeat` each tick, with or without jobs (every controller reads them:
liveness does not depend on jobs, nor on which partition a job's frames go to), and one marked `stopping` when it
stops cleanly, after its jobs' last frames.

Nothing of a dead agent stays in the kernel: every program, link and map is held by the agent's file descriptors (the
loaders pin maps only inside a mount namespace that dies with them), so SIGKILL releases everything.

This module holds the Agent — the job table (attach, pending jobs, detach, the end of a job), per-job probe toggles,
status, preload and the tick — and Job. The parts it holds, each made with what it needs and holding no reference
back to it: the node's sinks, each job's and the heartbeat (NodeSinks, jobprobe/node/nodesinks.py), trace requests
and scheduled windows (TraceRequests, jobprobe/node/tracereq.py: given the node's name and `held(name)`, the job
under its lock), the state file and the jobs adopted at start (jobprobe/node/adopt.py: given `attach`). What a job
to attach is: jobprobe/node/jobspec.py; the agent's
settings: jobprobe/node/config.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from jobprobe.contract import tickmemo
from jobprobe.contract.target import Target
from jobprobe.core import ends
from jobprobe.core.errors import BadInput, TargetGone
from jobprobe.core.frame import new_run_id
from jobprobe.core.libc import trim_heap
from jobprobe.exporters.queued import sink_stats
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node
from jobprobe.node import adopt
from jobprobe.node.config import Config
from jobprobe.node.jobspec import JobSpec, spec_key, waitable
from jobprobe.node.leads import Leads
from jobprobe.node.nodesinks import NodeSinks
from jobprobe.node.registry import all_probes, parse_probes
from jobprobe.node.sampler import Sampler, run_ticks
from jobprobe.node.tracereq import TraceRequests

log = logging.getLogger("jobprobe.node.agent")

RECENT = 256     # jobs that ended, remembered (with why) for status and for an epilog's detach that comes after
TRIM_EVERY = 60  # ticks between two trim_heap() with no change of jobs (what a tick frees piecemeal)
END_WHY = 200    # characters of why a job ended that its last frame carries (a path in it is the longest part)


class Job:
    """One attached job: its target, its probes' sampler and sinks."""

    def __init__(self, name: str, spec: JobSpec | None, target: Target, sampler: Sampler, sinks: list,
                 leads: Leads | None = None):
        self.name, self.spec, self.target, self.sampler, self.sinks = name, spec, target, sampler, sinks
        self.leads = leads          # how its lead processes ended (a target that did not start them)
        self.removed = False        # its group was removed under it
        self.attached_at = time.time()
        self.ended: str | None = None
        self.had_procs = False      # a group attached before its processes start is not "ended" while empty
        # Held by whoever uses the job's sampler — the tick, a detach's last frame, a probe toggle, a trace request —
        # so that two threads never sample one job at once (each would count the same interval). A job's lock is
        # taken alone or before the agent's lock (a job that ends in its tick leaves the table), never inside it.
        self.lock = threading.RLock()
        self.released = False       # its probes and sinks are let go: nothing may sample it any more
        self.leaving = ""           # why it is being let go: its last frame and sinks are being finished


class Agent:
    """The job table and the tick. Thread-safe: the control socket calls attach/detach/probes/status from its own
    thread while run() ticks."""

    def __init__(self, config: Config | None = None, host: Host | None = None,
                 sinks_for: Callable[[str], list] | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = config or Config()
        self.host = host or Host()
        if self.cfg.node:
            self.host = dataclasses.replace(self.host, node=self.cfg.node)
        self.traces = TraceRequests(self.host.node, self._held_by_name)   # deep-trace requests, scheduled windows
        self.node_sinks = NodeSinks(self.cfg, self.host, self.traces.remote)   # NATS, Prometheus, files, heartbeat
        if self.cfg.trace_every is not None and not self.cfg.trace_every >= 1:
            raise BadInput(f"trace_every must be 1 s or more, got {self.cfg.trace_every!r}")
        self.rules = None
        if self.cfg.rules:
            from jobprobe.node.rules import load as load_rules
            self.rules = load_rules(self.cfg.rules)    # an error in the file: BadInput now, with its line
        self.node = Node(self.host, keep_loads=True)
        self.registry = all_probes()
        self.run_id = new_run_id()
        self._trim = False          # the job table changed: the heap is given back at the next tick (trim_heap)
        self.jobs: dict[str, Job] = {}
        self.starting: set[str] = set()
        self.pending: dict[str, tuple[JobSpec, float, str]] = {}   # job → (spec, deadline, why it waits)
        self.recent: list[dict[str, Any]] = []                      # the last jobs that ended or were given up
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.ready = threading.Event()    # cleared by the daemon while it loads its programs and restores its jobs
        self.ready.set()
        self.clock = clock
        self.sinks_for = sinks_for or self.node_sinks.for_job
        self.persist = False     # write cfg.state on every change (the daemon; not `jobprobe run`)
        self.state_file = adopt.StateFile(self.cfg.state)
        self._t0 = clock()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)

    @property
    def nats(self):
        """The node's NATS sink (None without --send)."""
        return self.node_sinks.nats

    @property
    def prom(self):
        """The node's Prometheus endpoint (None without --prometheus)."""
        return self.node_sinks.prom

    # ---- the state file, and the jobs taken on at start (jobprobe/node/adopt.py) ---------------------------------
    def _save(self) -> None:
        """The job table into the state file (the daemon: persist), on every change of it."""
        if self.persist:
            self.state_file.save([j.spec for j in self.jobs.values() if j.spec is not None and not j.leaving] +
                                 [s for s, _, _ in self.pending.values()])

    def restore(self) -> list[dict[str, Any]]:
        """Attach again the jobs a previous agent had (its state file), those still running."""
        out = adopt.restore(self.state_file.load(), lambda spec: self.attach(spec, wait=0))
        self._save()
        return out

    def adopt_slurm(self, node: str | None = None) -> list[dict[str, Any]]:
        """Attach the SLURM jobs running on this node whose prolog found no agent."""
        def known(job: str) -> bool:
            with self.lock:
                return job in self.jobs or job in self.pending
        return adopt.adopt_slurm(node or self.cfg.slurm_node or self.host.node.split(".")[0], known,
                                 lambda spec: self.attach(spec, wait=0))

    # ---- the job table ------------------------------------------------------------------------------------
    def attach(self, spec: JobSpec, wait: float | None = None, defer: bool = False) -> dict[str, Any]:
        """Attach the job now, or — when its processes do not exist yet (a prolog runs before them) — keep trying
        each tick for up to `wait` s (cfg.attach_wait). `defer`: do not try now, leave it to the next tick (a
        prolog's request returns at once, whatever resolving the job costs). Returns what happened, for the caller
        to show."""
        names = parse_probes(spec.probes or self.cfg.probes, self.registry)   # an unknown probe: BadInput now
        try:
            if defer and waitable(spec):
                raise BadInput("to be attached on the next tick")
            target = spec.target()
        except BadInput as err:
            wait = self.cfg.attach_wait if wait is None else wait
            if wait <= 0 or not waitable(spec):
                raise
            key = spec.job or spec_key(spec)
            with self.lock:
                if key in self.jobs:
                    return {"job": key, "state": "already attached",
                            "note": "attached once; the second request changed nothing"}
                if key in self.pending:        # as the first request's answer said it, with the time left
                    _, deadline, why = self.pending[key]
                    return {"job": key, "state": "pending", "waiting_s": round(max(0.0, deadline - self.clock()), 1),
                            "why": why, "note": "asked for once; the second request changed nothing"}
                self.pending[key] = (spec, self.clock() + wait, str(err))
                self._save()
            return {"job": key, "state": "pending", "waiting_s": wait, "why": str(err)}
        return self.attach_target(target, names, spec)

    def attach_target(self, target: Target, names: list[str], spec: JobSpec | None = None,
                      sinks: list | None = None) -> dict[str, Any]:
        with self.lock:
            if target.job in self.jobs or target.job in self.starting:
                target.close()
                return {"job": target.job, "state": "already attached",
                        "note": "attached once; the second request changed nothing"}
            self.starting.add(target.job)
        try:
            sinks = self.sinks_for(target.job) if sinks is None else sinks
            probes = [self.registry[n].build(self.host, self.node, lambda: sink_stats(sinks)) for n in names]
            # Probes with a deep mode the job does not run: deep-trace windows run them for their length only.
            extra = [cls.build(self.host, self.node, None) for n, cls in self.registry.items()
                     if n not in names and getattr(cls, "trace_kinds", None)]
            sampler = Sampler(target, probes, sinks, self.cfg.interval, self.host, clock=self.clock,
                              rules=self.rules, trace_dir=self.cfg.trace_dir, run=self.run_id, window_probes=extra,
                              trace_every=self.cfg.trace_every)
            job = Job(target.job, spec, target, sampler, sinks,
                      None if target.launched_pids() else Leads(self.host.proc, self.host.is_root))
            try:
                hello = sampler.start()      # outside the lock: the other jobs' ticks go on meanwhile
            except BaseException:
                sampler.stop()
                target.close()
                raise
            with self.lock:
                self.jobs[job.name] = job
                self.pending.pop(job.name, None)
                self._save()
                self._trim = True
        finally:
            with self.lock:
                self.starting.discard(target.job)
        log.info("attached %s (%s): %s", job.name, target.describe(), hello["probes"])
        return {"job": job.name, "state": "attached", "probes": hello["probes"], "target": target.describe()}

    def detach(self, name: str, why: str = "detached", told: dict[str, Any] | None = None) -> dict[str, Any]:
        """A last frame (what happened since the last tick), then the job's probes and sinks are released. `told`:
        how the job ended as its scheduler says it (a pod's status: k8s.pod_end), for its last frame's `end` — the
        scheduler's word over the kernel's, whose leads in a pod include its sandbox."""
        with self.lock:
            if name in self.pending:
                del self.pending[name]
                self._save()
                return {"job": name, "state": "detached (was pending)"}
            job = self.jobs.get(name)
            # it ended by itself, or is being let go (an epilog comes after the job's last process)
            ended = job.leaving if job is not None else \
                next((r["why"] for r in reversed(self.recent) if r["job"] == name), None)
            if ended:
                return {"job": name, "state": "already ended", "why": ended, **self.node_sinks.file_of(name)}
            if job is None:
                raise BadInput(f"no job {name!r} is attached (attached: {', '.join(self.jobs) or 'none'})")
            self._drop(job, why)      # out of the table first: later ticks do not sample it
        with job.lock:                # a tick that took it before waits here, then finds it released
            try:
                # an epilog's detach comes after the job's last process: its last frame says how the job ended
                end = self._check_end(job)
                if told is not None:
                    end = ends.record(((end or {}).get("why") or why)[:END_WHY], told.get("status") or {},
                                      bool(end and end.get("cause") == "group_removed"), False, scheduler=told)
                job.sampler.tick(end)
            except Exception:
                log.exception("last frame of %s", name)
            self._release(job)
        self._remember(name, why, job)
        log.info("detached %s: %s", name, why)
        return {"job": name, "state": "detached", "why": why, **self.node_sinks.file_of(name)}

    def _find(self, name: str) -> Job:
        """The attached job `name` (BadInput if none)."""
        with self.lock:
            job = self.jobs.get(name)
            if job is None:
                raise BadInput(f"no job {name!r} is attached (attached: {', '.join(self.jobs) or 'none'})")
        return job

    def trace(self, name: str, duration: float = 25.0, at: float | None = None) -> dict[str, Any]:
        """A person's deep-trace request on the control socket (TraceRequests.trace)."""
        return self.traces.trace(name, duration, at)

    def remote(self, data: bytes) -> bytes:
        """A request from the controller over NATS (TraceRequests.remote)."""
        return self.traces.remote(data)

    @contextlib.contextmanager
    def _held_by_name(self, name: str) -> Iterator[Job]:
        """The attached job `name` under its lock (BadInput if there is none, or it was released meanwhile)."""
        with self._held(self._find(name)) as job:
            yield job

    @contextlib.contextmanager
    def _held(self, job: Job) -> Iterator[Job]:
        """`job` under its lock, for sampling it or changing its probes; BadInput if it was released meanwhile. Taken
        outside the agent's lock: a job's lock comes first."""
        with job.lock:
            if job.released:
                raise BadInput(f"no job {job.name!r} is attached")
            yield job

    def set_probes(self, name: str, spec: str) -> dict[str, Any]:
        """'+x,-y' for one job: start x, stop y, for that job only."""
        edits = [s.strip() for s in spec.split(",") if s.strip()]
        bad = [e for e in edits if e[0] not in "+-" or e[1:] not in self.registry]
        if not edits or bad:
            what = bad[0] if bad else spec
            raise BadInput(f"bad probe toggle {what!r}: give +name or -name, names from: {', '.join(self.registry)}")
        job = self._find(name)
        with self._held(job):
            for e in edits:
                if e[0] == "+":
                    job.sampler.enable(self.registry[e[1:]].build(self.host, self.node,
                                                                  lambda: sink_stats(job.sinks)))
                else:
                    job.sampler.disable(e[1:])
            status = dict(job.sampler.status)
        with self.lock:
            if job.spec is not None and self.jobs.get(name) is job:   # a restart attaches it with what it has now
                job.spec.probes = ",".join(n for n, st in status.items() if st != "off")
                self._save()
        return {"job": name, "probes": status}

    def status(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        wall = max(1e-9, self.clock() - self._t0)
        cpu = (ru.ru_utime + ru.ru_stime) - (self._ru0.ru_utime + self._ru0.ru_stime)
        with self.lock:
            jobs = [{"job": j.name, "target": j.target.describe(), "probes": dict(j.sampler.status),
                     **({"note": j.spec.note} if j.spec is not None and j.spec.note else {}),
                     **({"leaving": j.leaving} if j.leaving else {}),
                     "slot": self.node.slot_of(j.target), "attached_at": j.attached_at,
                     "frames": j.sampler.builder.seq, "sinks": sink_stats(j.sinks)} for j in self.jobs.values()]
            pending = [{"job": k, "waiting_s": round(max(0.0, d - self.clock()), 1), "why": w}
                       for k, (_, d, w) in self.pending.items()]
            loads = {str(k[0].name if isinstance(k[0], type) else k[0]): v.refs for k, v in self.node.loads.items()}
        return {"node": self.host.node, "run": self.run_id, "interval": self.cfg.interval, "jobs": jobs,
                "pending": pending, "recent": list(self.recent),
                "agent": {"pid": os.getpid(), "cpu_cores": round(cpu / wall, 5), "uptime_s": round(wall, 1),
                          "rss_bytes": rss_bytes(self.host.proc), "program_loads": loads}}

    def preload(self) -> dict[str, str]:
        """Load the node's programs before any job: the membership handlers and every default probe's shared
        programs, so that an attach compiles nothing (a per-job probe — one whose programs are per job — still
        loads at attach)."""
        self.node.start()
        done = {}
        for name in parse_probes(self.cfg.probes, self.registry):
            probe = self.registry[name].build(self.host, self.node, None)
            if probe.check(self.host) is not None or not hasattr(probe, "preload"):
                continue
            try:
                probe.preload()
                done[name] = "loaded"
            except Exception as err:   # it will say so again, per job, at attach
                done[name] = f"not loaded: {err}"
        return done

    # ---- the tick ---------------------------------------------------------------------------------------
    def tick(self) -> None:
        """One frame per job; jobs that ended get their last frame and go; pending jobs are tried again."""
        with self.lock:
            jobs = list(self.jobs.values())
        tickmemo.begin()
        try:
            with self.node_sinks.file_writer.hold():   # the files' thread wakes once, after every job's frame
                self._tick_jobs(jobs)
        finally:
            tickmemo.end()
        self._retry_pending()
        self.node_sinks.heartbeat(len(self.jobs))

    def _tick_jobs(self, jobs: list[Job]) -> None:
        for job in jobs:
            with job.lock:
                if not job.released and not job.leaving:
                    self._tick_job(job)

    def _tick_job(self, job: Job) -> None:
        end = self._check_end(job)
        try:
            job.sampler.tick(end)
        except Exception:
            log.exception("tick of %s", job.name)
        if job.ended or job.sampler.end_reason:
            self._end(job, job.ended or job.sampler.end_reason or "ended")

    def _check_end(self, job: Job) -> dict | None:
        """Whether the job has ended (job.ended says why), and then its last frame's end: why, its cause, and how
        its lead process(es) ended where that is known (Sampler.tick adds the OOM kills)."""
        try:
            job.target.refresh()
            pids = job.target.pids()
            if job.leads is not None:
                job.leads.update(pids)
            if job.target.kind == "cgroup":
                has = bool(pids)
                if job.had_procs and not has:
                    job.ended = f"every process of {job.name} has exited"
                elif not job.had_procs and not has and time.time() - job.attached_at > self.cfg.attach_wait:
                    # empty since it was attached (a group whose processes exited while no agent watched, restored
                    # from the state file; a group nothing ever ran in): no process will come to end it
                    job.ended = f"no process in {job.name} for the {self.cfg.attach_wait:g} s since it was attached"
                job.had_procs |= has
        except TargetGone as err:
            # the group gone under it (not `run -- CMD`'s child exiting: its group is there until the job lets go)
            path = job.target.cgroup_path
            job.ended, job.removed = str(err), bool(path) and not os.path.isdir(path)
            if job.leads is not None:
                job.leads.update([])       # the records of its last processes
        if not job.ended:
            return None
        status = job.target.exit_status() or (job.leads.status() if job.leads is not None else {})
        try:
            scheduler = job.target.scheduler_end()
        except Exception:      # the scheduler's word is a help, never a reason to lose the last frame
            log.exception("the scheduler's end of %s", job.name)
            scheduler = {}
        return ends.record(job.ended[:END_WHY], status, job.removed,
                           never_ran=not job.had_procs and job.target.kind == "cgroup", scheduler=scheduler)

    def _end(self, job: Job, why: str) -> None:
        """A job that ended by itself, after its last frame."""
        if self._drop(job, why):
            self._release(job)
            self._remember(job.name, why, job)
            log.info("job %s ended: %s", job.name, why)

    def _drop(self, job: Job, why: str) -> bool:
        """`job` leaving (out of the state file; later ticks and requests leave it alone); False if it was not in
        the table or is leaving already. It stays in the table (status: `jobs`) until _remember: a job is shown
        ended (`recent`) only once its last frame is written and its sinks closed."""
        with self.lock:
            if self.jobs.get(job.name) is not job or job.leaving:
                return False
            job.leaving = why
            self._save()
            return True

    @staticmethod
    def _release(job: Job) -> None:
        """The job's probes (its slot's state in every module) and sinks, then what its target made."""
        with job.lock:
            job.released = True
            job.sampler.stop()
            job.target.close()
            if job.leads is not None:
                job.leads.close()

    def _retry_pending(self) -> None:
        with self.lock:
            pending = list(self.pending.items())
        for key, (spec, deadline, _) in pending:
            try:
                self.attach_target(spec.target(), parse_probes(spec.probes or self.cfg.probes, self.registry), spec)
                with self.lock:
                    self.pending.pop(key, None)
            except BadInput as err:
                if self.clock() >= deadline:
                    with self.lock:
                        self.pending.pop(key, None)
                        self._save()
                    self._remember(key, f"gave up waiting for its processes: {err}")
                    log.warning("job %s: gave up waiting for its processes: %s", key, err)
                else:
                    with self.lock:
                        if key in self.pending:
                            self.pending[key] = (spec, deadline, str(err))

    def _remember(self, name: str, why: str, job: Job | None = None) -> None:
        """`name` ended (status: `recent`), and `job`, let go, out of the table — in one step."""
        with self.lock:
            if job is not None and self.jobs.get(name) is job:
                del self.jobs[name]
            self.recent.append({"job": name, "why": why, "t": time.time()})
            del self.recent[:-RECENT]
            self._trim = True

    def run(self, until: Callable[[], bool] = lambda: False, duration: float | None = None) -> str:
        """Tick on the monotonic clock (no drift; overrun ticks are skipped, not fired back to back) until
        stopped, `until()` says so, or `duration` s pass."""
        ticks = 0

        def step() -> str | None:
            nonlocal ticks
            self.tick()
            ticks += 1
            if ticks % TRIM_EVERY == 1 or self._trim:     # the first tick (the start's peak), after each change
                self._trim = False
                trim_heap()
            return "done" if until() else None
        return run_ticks(step, self.cfg.interval, self.clock, self.stop_event, duration)

    def close(self) -> None:
        """Every job gets its last frame and is released (kept in the state file: a restart attaches them again),
        then the node's programs and maps."""
        with self.lock:
            names = list(self.jobs)
            persist, self.persist = self.persist, False   # stopping the agent is not detaching its jobs
        self.traces.cancel()              # scheduled windows go with the agent (their thread ends)
        for name in names:
            try:
                self.detach(name, "agent stopped")
            except BadInput:
                pass
        self.node_sinks.heartbeat(len(names), stopping=True)   # after the jobs' last frames: a stop, not a loss
        self.node.close()
        self.node_sinks.close()
        self.persist = persist


def rss_bytes(proc: str = "/proc") -> int:
    try:
        for line in Path(proc, "self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
