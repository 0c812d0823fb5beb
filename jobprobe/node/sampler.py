# SPDX-License-Identifier: Apache-2.0
"""The tick loop: start probes on a target, sample them every interval on the monotonic clock (no drift),
build one frame per tick and hand it to the exporters. A probe that fails is stopped and reported; the rest go on."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError
from typing import Callable, Iterable

from jobprobe import __version__
from jobprobe.contract.probe import EVENTS_KEY, STACKS_KEY, Probe, schema_of
from jobprobe.contract.target import Target
from jobprobe.core import ends
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.kernel.host import Host

log = logging.getLogger("jobprobe.node.sampler")


NO_TRACE_DIR = "no trace directory (--trace-dir / trace_dir)"


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1][:300] if text else type(err).__name__


class Sampler:
    def __init__(self, target: Target, probes: Iterable[Probe], sinks: Iterable, interval: float = 1.0,
                 host: Host | None = None, clock: Callable[[], float] = time.monotonic, run: str | None = None,
                 rules: list | None = None, trace_dir: str | None = None, window_probes: Iterable[Probe] = (),
                 trace_every: float | None = None):
        """window_probes: probes (not started) that deep-trace windows run for their length only, where this job
        does not run them already and they were not switched off for it. trace_every: a window every S seconds
        of the run, as requested ones are (no duty cap; one at a time)."""
        self.target = target
        self.probes = {p.name: p for p in probes}
        self.sinks = list(sinks)
        self.interval = float(interval)
        self.host = host or Host()
        self.clock = clock
        self.builder = FrameBuilder(self.host.node, target.job, run)
        self.status: dict[str, str] = {}
        self.running: dict[str, Probe] = {}
        self.stop_event = threading.Event()
        self.end_reason: str | None = None
        self.oom_kills = 0                     # counted over the job's life, for its `end`
        self._last = 0.0
        self._read_at: dict[str, float] = {}     # each probe's last sample() call (the clock)
        self.trace_dir = trace_dir
        self.tracer = None          # deep-trace windows (jobprobe/node/tracewin.py): made at the first one
        self.window_probes = list(window_probes)
        self.trace_every = trace_every
        self._next_scheduled = clock() + trace_every if trace_every else None
        self._window_only: list[str] = []
        self._window_deep: list | None = None    # the open window's recording probes (the tracer's list)
        self._window_starting: dict[str, tuple[Probe, Future]] = {}   # window-only probes being compiled
        self._traced_since: dict[str, int] = {}  # a recording probe's CLOCK_MONOTONIC ns when its recording began
        self.ruleset = None
        if rules:
            from jobprobe.node.rules import RuleSet
            self.ruleset = RuleSet(rules, schema_of(self.probes.values()), target.job)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def _start_one(self, name: str, probe: Probe) -> str | None:
        """Start one probe: None, or why it is not running."""
        why = probe.check(self.host)
        if why is None:
            try:
                probe.start(self.target)
                # its baseline is read in start(): its first sample's counters cover from here (an eBPF probe
                # beside it compiling for 0.6 s made a burner's first interval read 1.67 cores in a 1 s tick)
                self._read_at[name] = self.clock()
            except ProbeUnavailable as err:
                why = _reason(err)
            except Exception as err:  # a probe bug must not take the agent down
                log.exception("probe %s failed to start", name)
                why = f"failed to start: {_reason(err)}"
        return why

    def start(self) -> dict:
        # The target's members as of now, not as of its making: a PID tree scanned before the agent got ready (a
        # membership load compiling, seconds under load) would miss the children forked since, and a probe whose
        # baseline did not see them counts them from zero at the first tick — their CPU before the baseline too.
        try:
            self.target.refresh()
        except TargetGone:
            pass                     # said at the first tick, with the job's last frame
        # Probes start side by side: an eBPF probe spends its start waiting for its loader to compile (a process
        # of its own), so N of them take about as long as the slowest, not the sum (on N cores).
        with ThreadPoolExecutor(max_workers=max(1, len(self.probes)), thread_name_prefix="start") as pool:
            whys = dict(zip(self.probes, pool.map(self._start_one, self.probes, self.probes.values())))
        for name, probe in self.probes.items():
            if whys[name] is None:
                self.running[name] = probe
                self._note(name, probe)
            else:
                self.status[name] = f"unavailable: {whys[name]}"
        self._last = self.clock()
        self.builder.labels = self._labels()
        hello = self.builder.hello(kernel=self.host.kernel, version=__version__, interval=self.interval,
                                   target=self.target.describe(), from_start=self.target.from_start,
                                   probes=dict(self.status),
                                   schema=schema_of(self.running.values()))
        self._emit(hello)
        return hello

    def open_trace(self, reason: str, evidence: dict | None = None, duration: float | None = None,
                   force_budget: bool = False) -> dict:
        """A deep-trace window for this job (a rule's action, or a request): its state, or why it was refused."""
        if not self.trace_dir:
            return {"ok": False, "state": "refused", "why": NO_TRACE_DIR}
        if self.tracer is None:
            from jobprobe.devices import pyproc
            from jobprobe.node import tracewin
            proc = self.host.proc
            self.tracer = tracewin.Tracer(self.target.job, self.trace_dir, self.target.pids,
                                          lambda p: pyproc.role(proc, p), lambda p: pyproc.is_python(proc, p),
                                          pyproc.py_spy(), deep_begin=self._deep_begin, deep_end=self._deep_end)
        return self.tracer.open(reason, evidence, duration or 25.0, force_budget=force_budget)

    def trace_refusal(self, duration: float, at: float | None = None, force_budget: bool = False) -> str | None:
        """Why a window asked for now, or for `at` (UNIX s ahead), would be refused — as far as it is known now —
        or None: a scheduled request is answered when it is made."""
        if not self.trace_dir:
            return NO_TRACE_DIR
        return None if self.tracer is None else self.tracer.may_open(duration, at, force_budget)

    def _deep_begin(self) -> list[Probe]:
        """A window's first tick: every running probe with a deep mode records event by event; the window-only
        probes start for this job in threads of their own (their compile takes seconds, longer on a loaded host:
        the agent's tick, every job's, never waits for it) and record from the end of their start; they join the
        window's probes and frames at the first tick after it (_window_join). Returns the recording probes (a list
        the joining ones are added to)."""
        deep = [p for p in self.running.values() if getattr(p, "deep", False)]
        for p in deep:
            p.trace_on(True)
            self._traced_since[p.name] = time.monotonic_ns()
        self._window_deep = deep
        for probe in self.window_probes:
            name = probe.name
            if name not in self.running and name not in self._window_starting and self.status.get(name) != "off":
                done: Future = Future()
                threading.Thread(target=self._window_start, args=(probe, done), name=f"window-{name}",
                                 daemon=True).start()
                self._window_starting[name] = (probe, done)
        return deep

    def _window_start(self, probe: Probe, done: Future) -> None:
        """(its own thread) Start a window-only probe and its deep mode; it is this thread's alone until joined."""
        why = self._start_one(probe.name, probe)
        if why is None and getattr(probe, "deep", False):
            try:
                probe.trace_on(True)
                self._traced_since[probe.name] = time.monotonic_ns()
            except Exception as err:
                log.exception("probe %s: deep mode not started", probe.name)
                self._stop_quietly(probe)
                why = f"deep mode not started: {_reason(err)}"
        done.set_result(why)

    def _window_join(self) -> None:
        """(the tick) The window-only probes whose start has ended: into the open window's probes and the frames,
        or stopped if the window ended first (or their start failed: said in the log, not in the frames)."""
        for name, (probe, done) in list(self._window_starting.items()):
            if not done.done():
                continue
            del self._window_starting[name]
            why = done.result()
            if why is not None:
                log.info("job %s: %s not in the trace window: %s", self.target.job, name, why)
            elif self._window_deep is None or name in self.running:
                self._stop_quietly(probe)
            else:
                self.probes[name] = self.running[name] = probe
                self._note(name, probe)
                self._window_only.append(name)
                if getattr(probe, "deep", False):
                    self._window_deep.append(probe)

    def _stop_quietly(self, probe: Probe) -> None:
        try:
            probe.stop()
        except Exception:
            log.exception("probe %s failed to stop", probe.name)

    def _deep_end(self, probes: list[Probe]) -> list[tuple[Probe, list, int, int | None]]:
        """The window's end: each probe's records [(probe, records, dropped, recording since: monotonic ns)], deep
        mode off, the window-only probes stopped (and out of the frames again)."""
        self._window_deep = None      # a window-only probe still starting is stopped when its start ends
        # One end for every probe: all stop recording, then each one's records are taken (taking them one probe
        # after another while the others still recorded gave a busy host's trace tens of ms of sched records past
        # the syscalls' end — sleeps outside any recorded call)
        failed = None
        for p in probes:
            try:
                p.trace_on(False)
            except Exception as err:       # (the others still stop; it is raised once all are taken)
                failed = failed or err
        out = [(p, *p.trace_take(), self._traced_since.get(p.name)) for p in probes]
        if failed is not None:
            raise failed
        for name in self._window_only:
            self._stop_probe(name)
            self.probes.pop(name, None)
            self.status.pop(name, None)
        self._window_only = []
        return out

    def stop(self) -> None:
        # Teardown order: a trace window cut short and announced; probes (release kernel objects), then sinks
        # (flush what was built).
        if self.tracer is not None:
            for body in self.tracer.close():
                self._emit(self.builder.trace(time.time(), **body))
        for name in list(self.running):
            self._stop_probe(name)
        for probe, done in self._window_starting.values():   # a window's probe still compiling: let go at its end
            try:
                if done.result(timeout=120) is None:
                    self._stop_quietly(probe)
            except TimeoutError:
                log.error("probe %s: its start for a trace window did not end", probe.name)
        self._window_starting.clear()
        for exp in self.sinks:
            try:
                exp.close()
            except Exception:
                log.exception("sink %s failed to close", exp)

    def enable(self, probe: Probe) -> str:
        """Start one more probe for this job while it runs (a per-job toggle); its status, said in the next
        frame. A probe already running stays as it is."""
        if probe.name in self.running:
            return self.status[probe.name]
        self.probes[probe.name] = probe
        why = self._start_one(probe.name, probe)
        if why is None:
            self.running[probe.name] = probe
            self._note(probe.name, probe)
        else:
            self.status[probe.name] = f"unavailable: {why}"
        return self.status[probe.name]

    def disable(self, name: str) -> None:
        """Stop one probe for this job only (the others, and other jobs, go on); frames then say "off"."""
        self._stop_probe(name)
        self.probes.pop(name, None)
        self.status[name] = "off"

    def _note(self, name: str, probe: Probe) -> None:
        """status "ok", or "ok: <what it waits for>" while a running probe has nothing to count yet."""
        if type(probe).note is Probe.note:   # a probe that never waits: "ok" for as long as it runs
            self.status[name] = "ok"
            return
        try:
            note = probe.note()
        except Exception:   # a probe's note is a courtesy: a bug in it must not fail the probe
            log.exception("probe %s: note() failed", name)
            note = None
        self.status[name] = f"ok: {note}" if note else "ok"

    def _stop_probe(self, name: str) -> None:
        probe = self.running.pop(name, None)
        self._read_at.pop(name, None)
        if probe is not None:
            self._stop_quietly(probe)

    # ---- one tick ----------------------------------------------------------------------------------------
    def _labels(self) -> dict[str, str]:
        try:
            return self.target.labels()
        except Exception:   # the scheduler's names are a courtesy: a failure to read them must not cost a frame
            log.exception("labels of %s", self.target.job)
            return self.builder.labels

    def tick(self, end: dict | None = None) -> dict:
        """One sample frame (and its events, stacks, traces); `end`: the job ended, this is its last frame, and
        `end` its record as the agent knows it (core/ends.record), to which the OOM kills counted over the job's
        life are added (core/ends.with_oom)."""
        self.builder.labels = self._labels()
        now = self.clock()
        dt, self._last = now - self._last, now
        t = time.time()
        values = {}
        events: list[dict] = []
        stacks: list[dict] = []
        if self._window_starting:
            self._window_join()
        reads = {}
        for name, probe in list(self.running.items()):
            try:
                # its counters' own interval, from its last read to this one: a probe read late in a tick (the
                # tick's thread preempted, the probes before it slow) covers more than the tick's dt
                at = self.clock()
                values[name] = probe.sample()
                if name in self._read_at:
                    reads[name] = round(at - self._read_at[name], 6)
                self._read_at[name] = at
                self._note(name, probe)
                # Things that happened once (an OOM kill, a GPU XID error) travel as event frames of their own.
                for ev in values[name].pop(EVENTS_KEY, None) or ():
                    events.append({"probe": name, **ev})
                # Folded stacks (pystacks) travel as `stacks` frames, one per process, beside the sample.
                for st in values[name].pop(STACKS_KEY, None) or ():
                    stacks.append({"probe": name, **st})
            except TargetGone as err:  # the job vanished under this probe: nothing more to read, not a failure
                self.end_reason = self.end_reason or str(err)
            except Exception as err:
                log.warning("probe %s failed: %s", name, err)
                self.status[name] = f"failed: {_reason(err)}"
                self._stop_probe(name)
        # OOM kills: the group's own counter (cgroup) and the kernel's choice of victims (memory) count the same
        # kills; the larger of the two each tick
        self.oom_kills += max((values.get(p) or {}).get("oom_kills") or 0 for p in ("cgroup", "memory"))
        if end is not None:
            end = ends.with_oom(end, self.oom_kills)
        frame = self.builder.sample(t, dt, values, dict(self.status), reads, end)
        self._emit(frame)
        if self.ruleset is not None:           # rules over the job's recent frames: fired and ended as events
            for ev in self.ruleset.feed(frame):
                log.warning("job %s: rule %s %s %s", self.target.job, ev["rule"],
                            "fired:" if ev["event"] == "rule" else "ended", ev.get("evidence"))
                events.append(ev)
                if ev["event"] == "rule" and ev.get("action") == "trace":
                    r = self.open_trace(f"rule {ev['rule']}", ev.get("evidence"), ev.get("trace_s"))
                    ev["trace"] = r.get("path") or r.get("why")
        if self._next_scheduled is not None and now >= self._next_scheduled:
            self._next_scheduled = now + self.trace_every
            r = self.open_trace("schedule", {"every_s": self.trace_every}, None, force_budget=True)
            log.info("job %s: scheduled trace window: %s", self.target.job, r.get("path") or r.get("why"))
        traces = self.tracer.feed(frame) if self.tracer is not None else []
        for ev in events:
            self._emit(self.builder.event(ev.pop("t", t), ev.pop("event"), **ev))
        for st in stacks:
            self._emit(self.builder.stacks(t, dt, **st))
        for body in traces:
            self._emit(self.builder.trace(t, **body))
        return frame

    def _emit(self, frame: dict) -> None:
        data = encode(frame)
        for exp in self.sinks:
            try:
                exp.write(frame, data)
            except Exception as err:  # a full disk or a closed pipe loses that sink, not the others
                log.error("sink %s failed: %s", exp, err)

    # ---- the loop ----------------------------------------------------------------------------------------
    def run(self, duration: float | None = None) -> str:
        """Tick until stopped, the job ends, or `duration` seconds pass. Returns why it ended."""
        def step() -> str | None:
            try:
                self.target.refresh()
            except TargetGone as err:
                self.end_reason = str(err)
            self.tick()  # the last, partial interval too: nothing collected is lost
            return self.end_reason
        return run_ticks(step, self.interval, self.clock, self.stop_event, duration, self._last)


def run_ticks(step: Callable[[], str | None], interval: float, clock: Callable[[], float], stop: threading.Event,
              duration: float | None = None, t0: float | None = None) -> str:
    """Call step() at t0 + k·interval on the monotonic clock (no drift) until it returns why it is done, `stop` is
    set, or `duration` s pass; the tick at the end of a partial interval is taken too. Ticks overrun (a stalled
    host) are skipped, not fired back to back. Returns why it ended."""
    t0 = clock() if t0 is None else t0
    k = 1
    while True:
        deadline = t0 + k * interval
        if duration is not None:
            deadline = min(deadline, t0 + duration)
        stop.wait(max(0.0, deadline - clock()))
        done = step()
        if stop.is_set() or done:
            return done or "stopped"
        if duration is not None and clock() - t0 >= duration - 1e-6:
            return "duration reached"
        k = max(k + 1, int((clock() - t0) / interval) + 1)
