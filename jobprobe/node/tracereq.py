# SPDX-License-Identifier: Apache-2.0
"""Deep-trace requests to the node agent (TraceRequests, a part the Agent holds): a person's on the control socket
(trace: not held to the cooldown and the duty cap), the controller's over NATS (remote, on jobprobe.ctl.node.<node>:
held to the whole trace budget); each opens a window now, or at a UNIX time up to an hour ahead — the common start of
a job's windows on all its nodes. Windows asked for later wait in a table (at most one per job, Scheduled), opened on
time by one thread for all of them.

Its interface to the agent is what it is given — the node's name, and `held(name)`: the attached job `name` under
its lock (a context manager; BadInput when no such job is attached) — and its methods: trace, remote, cancel.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from jobprobe.core.errors import BadInput

log = logging.getLogger("jobprobe.node.agent")


@dataclass(frozen=True)
class Scheduled:
    """A trace window asked for a later time: due on the monotonic clock (a step of the wall clock moves no window),
    `at` the UNIX time asked for."""
    due: float
    at: float
    duration: float
    force_budget: bool


class TraceRequests:
    """The agent's trace requests and its table of scheduled windows."""

    def __init__(self, node: str, held: Callable[[str], ContextManager[Any]]):
        self.node, self.held = node, held
        # Trace windows asked for a later time: at most one per job, opened by one thread for all of them (started
        # with the first, gone when none is left) — a flood of requests makes no threads.
        self.scheduled: dict[str, Scheduled] = {}
        self.scheduled_cv = threading.Condition()
        self.scheduler: threading.Thread | None = None

    def cancel(self) -> None:
        """Scheduled windows go with the agent (their thread ends)."""
        with self.scheduled_cv:
            self.scheduled.clear()
            self.scheduled_cv.notify()

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
        if at is not None and at - now > 0.01:
            with self.held(name) as job:
                why = job.sampler.trace_refusal(float(duration), at, force_budget)
            if why is not None:
                return {"job": name, "ok": False, "state": "refused", "why": why}
            return self._schedule(name, Scheduled(time.monotonic() + (at - now), at, float(duration), force_budget))
        with self.held(name) as job:
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
            with self.held(name) as job:
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
            out = {"ok": True, "node": self.node,
                   **self._trace(str(req.get("job")), req.get("duration", 25.0), req.get("at"), force_budget=False)}
        except (BadInput, ValueError) as err:
            out = {"ok": False, "node": self.node, "error": str(err)}
        return json.dumps(out).encode()
