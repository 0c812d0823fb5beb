"""The node agent: a job table, one tick for all jobs, one set of kernel programs for the node.

Each attached job has a slot in the node's membership maps (jobprobe/kernel/membership.py) and a Sampler of its own (its
probes, its frames, its sinks), but the eBPF probes of every job share one load of their programs (BpfProbe with a
node). A tick samples every job at once and sends one frame per job. Jobs arrive and leave at run time:
attach(spec), detach(job), probes(job, "+x,-y"); a job whose processes have all exited is detached by itself after
its last frame. `jobprobe run` is this agent with one job; `jobprobe agent` adds the control socket
(jobprobe/node/control.py) and the state file from which a restarted agent attaches the jobs still running.
With a NATS sink, an agent with no job attached sends the node's `heartbeat` each tick (the controller's liveness
does not depend on jobs), and one marked `stopping` when it stops cleanly, after its jobs' last frames.

Nothing of a dead agent stays in the kernel: every program, link and map is held by the agent's file descriptors (the
loaders pin maps only inside a mount namespace that dies with them), so SIGKILL releases everything.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import resource
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from jobprobe.exporters.file import FileExporter, job_path
from jobprobe.exporters.queued import QueuedSink, SinkWorker, sink_stats
from jobprobe.exporters.stdout import StdoutExporter
from jobprobe.node import tickmemo
from jobprobe.core.errors import BadInput, TargetGone
from jobprobe.core.frame import NODE_JOB, FrameBuilder, new_run_id
from jobprobe.kernel.host import Host
from jobprobe.node.probe import Probe
from jobprobe.node.registry import all_probes, parse_probes
from jobprobe.node.sampler import Sampler, run_ticks
from jobprobe.node.target import Target
from jobprobe.kernel.membership import Node

log = logging.getLogger("jobprobe.node.agent")


@dataclass
class JobSpec:
    """What a scheduler or a person asked to attach (also what the state file keeps)."""
    cgroup: str | None = None
    pid: int | None = None
    slurm_job: str | None = None
    k8s_pod: str | None = None
    job: str | None = None
    probes: str | None = None
    labels: dict[str, str] | None = None   # the scheduler's names for the job (user, partition, …): in its frames
    from_start: bool = False               # attached as it starts (a prolog): count what it did before the attach
    note: str | None = None                # what the one who asked wants said in status (a refused probe)

    def target(self) -> Target:
        from jobprobe.node.target import CgroupTarget, PidTreeTarget, k8s_pod_target, slurm_target
        given = [x for x in (self.cgroup, self.pid, self.slurm_job, self.k8s_pod) if x is not None]
        if len(given) != 1:
            raise BadInput("give exactly one of --cgroup PATH, --pid PID, --slurm-job ID, --k8s-pod UID")
        if self.cgroup is not None:
            target: Target = CgroupTarget(self.cgroup, job=self.job)
        elif self.pid is not None:
            target = PidTreeTarget([int(self.pid)], job=self.job)
        elif self.slurm_job is not None:
            target = slurm_target(str(self.slurm_job), job=self.job)
        else:
            target = k8s_pod_target(str(self.k8s_pod), job=self.job)
        target.from_start = self.from_start
        target.static_labels = {**target.static_labels, **(self.labels or {})}   # the scheduler's, then ours
        return target

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        known = {f: d[f] for f in cls.__dataclass_fields__ if d.get(f) is not None}
        if "pid" in known:
            try:
                known["pid"] = int(known["pid"])
            except (TypeError, ValueError):
                raise BadInput(f"pid must be a number, got {known['pid']!r}") from None
        labels = known.get("labels")
        if labels is not None and (not isinstance(labels, dict) or len(labels) > 32 or not all(
                isinstance(k, str) and isinstance(v, (str, int)) and len(k) <= 64 and len(str(v)) <= 256
                for k, v in labels.items())):
            raise BadInput("labels must be a map of at most 32 names (≤ 64 characters) to strings (≤ 256)")
        if labels is not None:
            known["labels"] = {k: str(v) for k, v in labels.items()}
        if not isinstance(known.get("from_start", False), bool):
            raise BadInput(f"from_start must be true or false, got {known['from_start']!r}")
        return cls(**known)


@dataclass
class Config:
    """The agent's settings: /etc/jobprobe/agent.toml, every key also a flag (flags win)."""
    interval: float = 1.0
    probes: str | None = None           # the default --probes spec of attached jobs
    out: str | None = None              # a directory: each job's frames to OUT/<job>.mpk
    out_max_mb: float | None = None
    stdout: str | None = None           # "human" | "json": every job's frames on stdout too
    socket: str = "/run/jobprobe/agent.sock"
    state: str = "/run/jobprobe/jobs.json"
    attach_wait: float = 30.0           # s to wait for a job's processes to appear (the prolog case)
    queue: int = 1024                   # frames each sink may hold before it drops the oldest
    slurm: bool = False                 # a SLURM node: at start, attach the running jobs the prolog could not
    slurm_node: str | None = None       # this node's SLURM name (default: the short host name)
    k8s: str | None = None              # the kubelet's URL (https://<node>:10250): probe the pods annotated for it
    k8s_every: float = 5.0              # s between two looks at the kubelet's pod list
    k8s_token_file: str | None = None   # a bearer token for the kubelet (the service account's)
    k8s_ca: str | None = None           # the CA that signed the kubelet's certificate
    k8s_insecure: bool = False          # do not check the peer's certificate (refused with a token)
    k8s_node: str | None = None         # this node's Kubernetes name: its pods from the API server's list
    nats: str | None = None             # nats://HOST:PORT[,…]: every job's frames to the controller's JetStream
    spool: str = "/var/lib/jobprobe/spool"   # frames waiting for the NATS server's ack, on disk
    spool_max_mb: float = 256.0         # past this the oldest unacked frames go (counted, logged)
    nats_creds: str | None = None       # this node's NATS credentials: .creds (JWT + nkey), .nk seed, or user:password
    nats_ca: str | None = None          # TLS: the CA of the NATS servers' certificates
    nats_insecure_plaintext: bool = False   # allow a password or token in clear to a server that is not loopback
    node: str | None = None             # this node's name in frames (default: the short host name)
    prometheus: str | None = None       # HOST:PORT: serve every job's metrics at /metrics
    rules: str | None = None            # a rules file, or "default": `rule` events over each job's frames
    trace_dir: str = "/var/lib/jobprobe/traces"   # deep-trace windows' files (rules' `trace` action, `trace`)
    trace_every: float | None = None    # a deep-trace window every S s of each job's run (as a request)
    prometheus_max_jobs: int = 256      # jobs exposed at most (the rest counted: bounded cardinality)

    @classmethod
    def load(cls, path: str | None, overrides: dict[str, Any]) -> Config:
        data: dict[str, Any] = {}
        if path:
            import tomllib
            try:
                with open(path, "rb") as f:
                    data = tomllib.load(f)
            except FileNotFoundError:
                if path != DEFAULT_CONFIG:
                    raise BadInput(f"config {path} does not exist") from None
            except (OSError, tomllib.TOMLDecodeError) as err:
                raise BadInput(f"config {path}: {err}") from err
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise BadInput(f"config {path}: unknown key {sorted(unknown)[0]!r}; known: "
                           f"{', '.join(cls.__dataclass_fields__)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**data)
        if cfg.interval <= 0:
            raise BadInput(f"interval must be positive, got {cfg.interval}")
        return cfg


DEFAULT_CONFIG = "/etc/jobprobe/agent.toml"
RECENT = 256     # jobs that ended, remembered (with why) for status and for an epilog's detach that comes after


def make_probe(cls: type[Probe], host: Host, node: Node | None, sinks: Callable[[], dict] | None) -> Probe:
    """An instance of a probe for one job, given what its constructor takes (the node, the sinks' counters)."""
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())   # **kw, handed on to BpfProbe
    kw: dict[str, Any] = {}
    if "node" in params or takes_any:
        kw["node"] = node
    if "sinks" in params and sinks is not None:
        kw["sinks"] = sinks
    return cls(host, **kw)


class Job:
    """One attached job: its target, its probes' sampler and sinks."""

    def __init__(self, name: str, spec: JobSpec | None, target: Target, sampler: Sampler, sinks: list):
        self.name, self.spec, self.target, self.sampler, self.sinks = name, spec, target, sampler, sinks
        self.attached_at = time.time()
        self.ended: str | None = None
        self.had_procs = False      # a group attached before its processes start is not "ended" while empty
        # Held by whoever uses the job's sampler — the tick, a detach's last frame, a probe toggle, a trace request —
        # so that two threads never sample one job at once (each would count the same interval). A job's lock is
        # taken alone or before the agent's lock (a job that ends in its tick leaves the table), never inside it.
        self.lock = threading.RLock()
        self.released = False       # its probes and sinks are let go: nothing may sample it any more


@dataclass(frozen=True)
class Scheduled:
    """A trace window asked for a later time: due on the monotonic clock (a step of the wall clock moves no window),
    `at` the UNIX time asked for."""
    due: float
    at: float
    duration: float
    force_budget: bool


class Agent:
    """The job table and the tick. Thread-safe: the control socket calls attach/detach/probes/status from its own
    thread while run() ticks."""

    def __init__(self, config: Config | None = None, host: Host | None = None,
                 sinks_for: Callable[[str], list] | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = config or Config()
        self.host = host or Host()
        if self.cfg.node:
            self.host = dataclasses.replace(self.host, node=self.cfg.node)
        self.nats = None
        if self.cfg.nats:
            from jobprobe.exporters.nats import NatsSink
            from jobprobe.core.wire import control_subject
            try:
                self.nats = NatsSink(self.cfg.nats, self.cfg.spool, int(self.cfg.spool_max_mb * (1 << 20)),
                                     creds=self.cfg.nats_creds, tls_ca=self.cfg.nats_ca, node=self.host.node,
                                     allow_plaintext_password=self.cfg.nats_insecure_plaintext)
            except (OSError, ValueError) as err:     # credentials unreadable or malformed, a password in clear
                raise BadInput(f"nats: {err}") from None
            self.nats.serve(control_subject(self.host.node), self.remote)   # the controller's cluster-wide traces
        self.prom = None
        if self.cfg.prometheus:
            from jobprobe.exporters.prometheus import PromSink
            self.prom = PromSink(self.cfg.prometheus, self.cfg.prometheus_max_jobs)
        if self.cfg.trace_every is not None and not self.cfg.trace_every >= 1:
            raise BadInput(f"trace_every must be 1 s or more, got {self.cfg.trace_every!r}")
        self.rules = None
        if self.cfg.rules:
            from jobprobe.node.rules import load as load_rules
            self.rules = load_rules(self.cfg.rules)    # an error in the file: BadInput now, with its line
        self.node = Node(self.host, keep_loads=True)
        self.registry = all_probes()
        self.run_id = new_run_id()
        # the node's heartbeats: a run id of their own (a job may be named "node": its frames' keys stay apart)
        self.beat = FrameBuilder(self.host.node, NODE_JOB) if self.nats is not None else None
        self.jobs: dict[str, Job] = {}
        self.starting: set[str] = set()
        self.pending: dict[str, tuple[JobSpec, float, str]] = {}   # job → (spec, deadline, why it waits)
        self.recent: list[dict[str, Any]] = []                      # the last jobs that ended or were given up
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.ready = threading.Event()    # cleared by the daemon while it loads its programs and restores its jobs
        self.ready.set()
        self.clock = clock
        self.sinks_for = sinks_for or self._default_sinks
        self.persist = False     # write cfg.state on every change (the daemon; not `jobprobe run`)
        self._t0 = clock()
        self._ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self.file_writer = SinkWorker("files")   # one thread writes every job's --out file
        # Trace windows asked for a later time: at most one per job, opened by one thread for all of them (started
        # with the first, gone when none is left) — a flood of requests makes no threads.
        self.scheduled: dict[str, Scheduled] = {}
        self.scheduled_cv = threading.Condition()
        self.scheduler: threading.Thread | None = None

    # ---- sinks --------------------------------------------------------------------------------------------
    def _default_sinks(self, job: str) -> list:
        out: list = []
        if self.cfg.out:
            try:
                path = job_path(self.cfg.out, job)       # one file per job (an injective name), 0700 directory
                out.append(QueuedSink(FileExporter(path, self.cfg.out_max_mb), f"file:{path}", self.cfg.queue,
                                      self.file_writer))
            except ValueError as err:
                raise BadInput(f"job {job!r}: {err}") from None
            except OSError as err:
                raise BadInput(f"cannot write {self.cfg.out} for job {job!r}: {err.strerror}") from err
        if self.cfg.stdout:
            out.append(QueuedSink(StdoutExporter(self.cfg.stdout), "stdout", self.cfg.queue))
        if self.nats is not None:
            out.append(self.nats.for_job(job))   # appends to the node's spool: no queue of its own needed
        if self.prom is not None:
            out.append(self.prom.for_job(job))   # updates a few totals under a lock: no queue needed
        return out

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
                if key in self.jobs or key in self.pending:
                    return {"job": key, "state": "already attached" if key in self.jobs else "pending",
                            "note": "attached once; the second request changed nothing"}
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
            probes = [make_probe(self.registry[n], self.host, self.node, lambda: sink_stats(sinks)) for n in names]
            # Probes with a deep mode the job does not run: deep-trace windows run them for their length only.
            extra = [make_probe(cls, self.host, self.node, None) for n, cls in self.registry.items()
                     if n not in names and getattr(cls, "trace_kinds", None)]
            sampler = Sampler(target, probes, sinks, self.cfg.interval, self.host, clock=self.clock,
                              rules=self.rules, trace_dir=self.cfg.trace_dir, run=self.run_id, window_probes=extra,
                              trace_every=self.cfg.trace_every)
            job = Job(target.job, spec, target, sampler, sinks)
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
        finally:
            with self.lock:
                self.starting.discard(target.job)
        log.info("attached %s (%s): %s", job.name, target.describe(), hello["probes"])
        return {"job": job.name, "state": "attached", "probes": hello["probes"], "target": target.describe()}

    def detach(self, name: str, why: str = "detached") -> dict[str, Any]:
        """A last frame (what happened since the last tick), then the job's probes and sinks are released."""
        with self.lock:
            if name in self.pending:
                del self.pending[name]
                self._save()
                return {"job": name, "state": "detached (was pending)"}
            job = self.jobs.get(name)
            if job is None:
                ended = next((r for r in reversed(self.recent) if r["job"] == name), None)
                if ended is not None:   # it ended by itself (an epilog comes after the job's last process)
                    return {"job": name, "state": "already ended", "why": ended["why"]}
                raise BadInput(f"no job {name!r} is attached (attached: {', '.join(self.jobs) or 'none'})")
            self._drop(job, why)      # out of the table first: later ticks do not sample it
        with job.lock:                # a tick that took it before waits here, then finds it released
            try:
                job.sampler.tick()
            except Exception:
                log.exception("last frame of %s", name)
            self._release(job)
        log.info("detached %s: %s", name, why)
        return {"job": name, "state": "detached", "why": why}

    def trace(self, name: str, duration: float = 25.0, at: float | None = None) -> dict[str, Any]:
        """A person's request on the control socket (root only, on this node): a deep-trace window for one job, not
        held to the cooldown and the duty cap — whoever may ask here may trace the job anyway — but to one window at
        a time, and to one scheduled window per job. `at` (UNIX s, up to an hour ahead): opened then. The
        controller's requests come through remote(), under the whole budget."""
        return self._trace(name, duration, at, force_budget=True)

    def _trace(self, name: str, duration: float, at: float | None, force_budget: bool) -> dict[str, Any]:
        """A window now, or one scheduled for `at` — the common start of a window on every node of a job. A
        request the budget refuses (now, or surely at `at`) is answered {"ok": false, "state": "refused", "why"}."""
        if not isinstance(duration, (int, float)) or not 1 <= duration <= 600:
            raise BadInput(f"duration must be 1 to 600 s, got {duration!r}")
        now = time.time()
        if at is not None and (not isinstance(at, (int, float)) or not now - 60 <= at <= now + 3600):
            raise BadInput(f"at must be a UNIX time within the next hour, got {at!r} (now {now:.1f})")
        job = self._find(name)
        if at is not None and at - now > 0.01:
            with self._held(job):
                why = job.sampler.trace_refusal(float(duration), at, force_budget)
            if why is not None:
                return {"job": name, "ok": False, "state": "refused", "why": why}
            return self._schedule(name, Scheduled(time.monotonic() + (at - now), at, float(duration), force_budget))
        with self._held(job):
            return {"job": name, **job.sampler.open_trace("request", {}, float(duration), force_budget=force_budget)}

    def _schedule(self, name: str, s: Scheduled) -> dict[str, Any]:
        """Into the table of scheduled windows — refused if the job has one there already: a second request neither
        replaces the first (the nodes of a job would disagree on their common start) nor waits beside it."""
        with self.scheduled_cv:
            had = self.scheduled.get(name)
            if had is not None:
                return {"job": name, "ok": False, "state": "refused",
                        "why": f"a window is scheduled already for this job (at {had.at:.3f}, {had.duration:g} s); "
                               "one at a time"}
            self.scheduled[name] = s
            if self.scheduler is None:
                self.scheduler = threading.Thread(target=self._run_scheduled, name="trace-scheduler", daemon=True)
                self.scheduler.start()
            self.scheduled_cv.notify()
        return {"job": name, "ok": True, "state": "scheduled", "at": s.at, "in_s": round(s.due - time.monotonic(), 3),
                "duration_s": s.duration}

    def _find(self, name: str) -> Job:
        """The attached job `name` (BadInput if none)."""
        with self.lock:
            job = self.jobs.get(name)
            if job is None:
                raise BadInput(f"no job {name!r} is attached (attached: {', '.join(self.jobs) or 'none'})")
        return job

    @contextlib.contextmanager
    def _held(self, job: Job) -> Iterator[Job]:
        """`job` under its lock, for sampling it or changing its probes; BadInput if it was released meanwhile. Taken
        outside the agent's lock: a job's lock comes first."""
        with job.lock:
            if job.released:
                raise BadInput(f"no job {job.name!r} is attached")
            yield job

    def _run_scheduled(self) -> None:
        """The one thread of scheduled windows: each opened when due, on the monotonic clock to the millisecond —
        `at` is the common start of a job's windows on all its nodes, which a tick (up to `interval` late) would
        blur. It ends when the table is empty; the next scheduled request starts it again."""
        while True:
            with self.scheduled_cv:
                while True:
                    now = time.monotonic()
                    due = {k: s for k, s in self.scheduled.items() if s.due <= now}
                    if due or not self.scheduled:
                        break
                    self.scheduled_cv.wait(min(s.due for s in self.scheduled.values()) - now)
                for k in due:
                    del self.scheduled[k]
                if not due:
                    self.scheduler = None
                    return
            for name, s in sorted(due.items(), key=lambda kv: kv[1].due):
                self._open_at(name, s.duration, s.at, s.force_budget)

    def _open_at(self, name: str, duration: float, at: float, force_budget: bool) -> None:
        """A scheduled window, due now: under the budget as it stands now (its answer went out when it was asked for;
        this one is logged)."""
        try:
            with self._held(self._find(name)) as job:
                r = job.sampler.open_trace("request", {"at": at}, duration, force_budget=force_budget)
        except BadInput:
            r = {"state": "refused", "why": "the job is gone"}
        except Exception:                     # one job's window must not stop the others' scheduled ones
            log.exception("job %s: scheduled trace window", name)
            return
        log.warning("job %s: trace window due at %.3f (%+.3f s): %s", name, at, time.time() - at,
                    r.get("path") or r.get("why"))

    def remote(self, data: bytes) -> bytes:
        """A request from the controller over NATS (jobprobe.ctl.node.<node>): {"cmd": "trace", "job", "duration",
        "at"}. Answered with the same JSON as the control socket's; bad input is said, never raised. Held to the
        whole budget, like a rule's window — the cooldown, the duty cap, one window at a time, one scheduled window
        per job: whoever can publish on the control subject must not be able to trace a job back to back (nor make
        a thread per request: a scheduled window waits in the table)."""
        try:
            req = json.loads(data)
            if not isinstance(req, dict) or req.get("cmd") != "trace":
                raise BadInput(f"unknown request {str(req)[:80]!r}: only trace")
            out = {"ok": True, "node": self.host.node,
                   **self._trace(str(req.get("job")), req.get("duration", 25.0), req.get("at"), force_budget=False)}
        except (BadInput, ValueError) as err:
            out = {"ok": False, "node": self.host.node, "error": str(err)}
        return json.dumps(out).encode()

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
                    job.sampler.enable(make_probe(self.registry[e[1:]], self.host, self.node,
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
            probe = make_probe(self.registry[name], self.host, self.node, None)
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
            with self.file_writer.hold():      # the files' thread wakes once, after every job's frame
                self._tick_jobs(jobs)
        finally:
            tickmemo.end()
        self._retry_pending()
        self._heartbeat()

    def _tick_jobs(self, jobs: list[Job]) -> None:
        for job in jobs:
            with job.lock:
                if not job.released:
                    self._tick_job(job)

    def _tick_job(self, job: Job) -> None:
        try:
            job.target.refresh()
            if job.target.kind == "cgroup":
                has = bool(job.target.pids())
                if job.had_procs and not has:
                    job.ended = f"every process of {job.name} has exited"
                elif not job.had_procs and not has and time.time() - job.attached_at > self.cfg.attach_wait:
                    # empty since it was attached (a group whose processes exited while no agent watched, restored
                    # from the state file; a group nothing ever ran in): no process will come to end it
                    job.ended = f"no process in {job.name} for the {self.cfg.attach_wait:g} s since it was attached"
                job.had_procs |= has
        except TargetGone as err:
            job.ended = str(err)
        try:
            job.sampler.tick()
        except Exception:
            log.exception("tick of %s", job.name)
        if job.ended or job.sampler.end_reason:
            self._end(job, job.ended or job.sampler.end_reason or "ended")

    def _heartbeat(self, stopping: bool = False, jobs: int = 0) -> None:
        """The node's liveness to the controller, while no job is attached (a job's frames show it alive
        otherwise): a heartbeat frame each tick; `stopping`, once, at a clean stop (then no more)."""
        with self.lock:
            if self.beat is None or (self.jobs and not stopping):
                return
            beat = self.beat.heartbeat(time.time(), self.cfg.interval, jobs, stopping)
            if stopping:
                self.beat = None
        try:
            self.nats.heartbeat(beat)
        except Exception as err:     # the spool's disk: the next tick tries again
            log.warning("heartbeat: %s: %s", type(err).__name__, err)

    def _end(self, job: Job, why: str) -> None:
        """A job that ended by itself, after its last frame."""
        if self._drop(job, why):
            self._release(job)
            log.info("job %s ended: %s", job.name, why)

    def _drop(self, job: Job, why: str) -> bool:
        """Out of the job table (and the state file), remembered with why; False if it was not there."""
        with self.lock:
            if self.jobs.get(job.name) is not job:
                return False
            del self.jobs[job.name]
            self._save()
            self._remember(job.name, why)
            return True

    @staticmethod
    def _release(job: Job) -> None:
        """The job's probes (its slot's state in every module) and sinks, then what its target made."""
        with job.lock:
            job.released = True
            job.sampler.stop()
            job.target.close()

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

    def _remember(self, name: str, why: str) -> None:
        with self.lock:
            self.recent.append({"job": name, "why": why, "t": time.time()})
            del self.recent[:-RECENT]

    def run(self, until: Callable[[], bool] = lambda: False, duration: float | None = None) -> str:
        """Tick on the monotonic clock (no drift; overrun ticks are skipped, not fired back to back) until
        stopped, `until()` says so, or `duration` s pass."""
        def step() -> str | None:
            self.tick()
            return "done" if until() else None
        return run_ticks(step, self.cfg.interval, self.clock, self.stop_event, duration)

    def close(self) -> None:
        """Every job gets its last frame and is released (kept in the state file: a restart attaches them again),
        then the node's programs and maps."""
        with self.lock:
            names = list(self.jobs)
            persist, self.persist = self.persist, False   # stopping the agent is not detaching its jobs
        with self.scheduled_cv:           # scheduled windows go with the agent (their thread ends)
            self.scheduled.clear()
            self.scheduled_cv.notify()
        for name in names:
            try:
                self.detach(name, "agent stopped")
            except BadInput:
                pass
        self._heartbeat(stopping=True, jobs=len(names))   # after the jobs' last frames: a stop, not a loss
        self.node.close()
        if self.nats is not None:
            self.nats.close()
        if self.prom is not None:
            self.prom.close()
        self.persist = persist

    # ---- state across restarts ----------------------------------------------------------------------------
    def _save(self) -> None:
        if not self.persist:
            return
        specs = [asdict(j.spec) for j in self.jobs.values() if j.spec is not None]
        specs += [asdict(s) for s, _, _ in self.pending.values()]
        path = Path(self.cfg.state)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"jobs": specs}))
            os.replace(tmp, path)
        except OSError as err:
            log.error("cannot write %s: %s", path, err)

    def restore(self) -> list[dict[str, Any]]:
        """Attach again the jobs a previous agent had (its state file), those still running; the others go."""
        try:
            specs = json.loads(Path(self.cfg.state).read_text()).get("jobs", [])
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.error("cannot read %s: %s; starting with no jobs", self.cfg.state, err)
            return []
        out = []
        for d in specs:
            try:
                spec = JobSpec.from_dict(d)
                spec.from_start = False    # the agent before this one reported the job's start already
                out.append(self.attach(spec, wait=0))
            except BadInput as err:
                log.warning("not attached again: %s: %s", d, err)
                out.append({"job": d.get("job"), "state": "gone", "why": str(err)})
        self._save()
        return out


    def adopt_slurm(self, node: str | None = None) -> list[dict[str, Any]]:
        """Attach the SLURM jobs running on this node that no one asked for: those whose prolog found no agent
        (down, restarting). They count from now (their hello says so): their start was missed."""
        from jobprobe.node.target import slurm_running_jobs
        try:
            running = slurm_running_jobs(node or self.cfg.slurm_node or self.host.node.split(".")[0])
        except BadInput as err:
            log.warning("cannot list this node's SLURM jobs: %s", err)
            return []
        out = []
        for job_id, labels in running:
            with self.lock:
                if job_id in self.jobs or job_id in self.pending:
                    continue
            try:
                out.append(self.attach(JobSpec(slurm_job=job_id, job=job_id, labels=labels), wait=0))
            except BadInput as err:
                out.append({"job": job_id, "state": "not attached", "why": str(err)})
        return out


def waitable(spec: JobSpec) -> bool:
    """Targets whose processes may appear after the attach (a SLURM prolog runs before them; a pod's cgroup is
    made when its containers start). A --pid or --cgroup that does not exist is a mistake, said at once."""
    return spec.slurm_job is not None or spec.k8s_pod is not None


def spec_key(spec: JobSpec) -> str:
    if spec.slurm_job is not None:
        return str(spec.slurm_job)
    if spec.k8s_pod is not None:
        return f"pod-{str(spec.k8s_pod).lower().replace('_', '-')}"
    return f"pid-{spec.pid}" if spec.pid is not None else str(spec.cgroup)


def rss_bytes(proc: str = "/proc") -> int:
    try:
        for line in Path(proc, "self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
