# SPDX-License-Identifier: Apache-2.0
"""The nodes that hold their jobs back, over days: `jobprobe nodes --store PATH [--since 7d]` and the controller's
`node_suspect` event (jobprobe_node_suspect in /metrics).

A node named the straggler of one job is that job's finding; named in job after job, it is the operator's: drain it.
Each node's record over a window comes from the store's events: the `straggler` events that named it (its job, its
causes, when), their `straggler_end` (how long each episode lasted) and the jobs' `summary` (`waited_for`: the
node-seconds the other nodes of the job waited for it). A node named in at least `min_jobs` distinct jobs within
the window is a suspect; the controller says so once per window, as a `node_suspect` event under the job that made
it one. A controller of a partition (by job) sees its partition's jobs; `jobprobe nodes` over every partition's
store sees them all.
"""
from __future__ import annotations

import collections
import json
import time
from typing import Any

SUSPECT_JOBS = 3                 # distinct jobs that named a node within the window: a suspect
SUSPECT_WINDOW_S = 7 * 86400.0


def records(store: Any, since_s: float, now: float | None = None, node: str | None = None) -> dict[str, dict]:
    """Each node's record over the last `since_s` (of one node, when given): {episodes, jobs (sorted), seconds
    (the episodes' length, where ended), lost_s (node-seconds its peers waited for it, from the jobs' summaries),
    causes ({cause: episodes}), last (UNIX s of its newest naming)}. Only nodes named at least once."""
    now = time.time() if now is None else now
    out: dict[str, dict] = {}
    # a straggler's events are stored under the node they name (Controller.node_event): only that node's are read
    q, args = "SELECT job, t, event, body FROM events WHERE event IN ('straggler', 'straggler_end') AND t >= ?", \
        [now - since_s]
    if node is not None:
        q, args = q + " AND node = ?", args + [node]
    for job, t, event, body in store.sql(q + " ORDER BY t", tuple(args))[1]:
        try:
            b = json.loads(body)
        except (TypeError, ValueError):
            continue
        named = b.get("straggler") if isinstance(b, dict) else None
        if not isinstance(named, str) or (node is not None and named != node):
            continue
        r = out.setdefault(named, {"episodes": 0, "jobs": set(), "seconds": 0.0, "lost_s": 0.0,
                                   "causes": collections.Counter(), "last": 0.0})
        if event == "straggler":
            r["episodes"] += 1
            r["jobs"].add(job)
            r["last"] = max(r["last"], float(t))
            causes = b.get("causes")
            for c in causes if isinstance(causes, list) else []:
                if isinstance(c, str):
                    r["causes"][c[:40]] += 1
            if not causes:
                r["causes"]["unknown"] += 1
        elif isinstance(b.get("duration_s"), (int, float)):
            r["seconds"] += float(b["duration_s"])
    # the jobs' summaries: only their waited_for, the newest of each job (a summary is the job's whole account)
    waited_for: dict[str, Any] = {}
    for job, waited in store.sql("SELECT job, json_extract(body, '$.waited_for') FROM events WHERE event = "
                                 "'summary' AND t >= ? ORDER BY t", (now - since_s,))[1]:
        waited_for[job] = waited
    for job, text in waited_for.items():
        try:
            waited = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            continue
        for named, lost in (waited.items() if isinstance(waited, dict) else ()):
            if named in out and job in out[named]["jobs"] and isinstance(lost, (int, float)):
                out[named]["lost_s"] += float(lost)
    for r in out.values():
        r["jobs"] = sorted(r["jobs"])
        r["causes"] = dict(r["causes"].most_common())
        r["seconds"], r["lost_s"] = round(r["seconds"], 1), round(r["lost_s"], 1)
    return out


def rows(store: Any, since_s: float, now: float | None = None, min_jobs: int = SUSPECT_JOBS) -> list[dict]:
    """`jobprobe nodes`: one row per node named in the window, the most time lost to it first; `suspect` where it
    was named in at least `min_jobs` distinct jobs."""
    out = [{"node": n, **r, "suspect": len(r["jobs"]) >= min_jobs} for n, r in records(store, since_s, now).items()]
    return sorted(out, key=lambda r: (-r["lost_s"], -r["seconds"], -len(r["jobs"]), r["node"]))


def text(rs: list[dict]) -> str:
    if not rs:
        return "no node was named a straggler in the window\n"
    lines = [f"{'node':<24} {'jobs':>4} {'episodes':>8} {'episode s':>9} {'others lost':>11}  {'last named':<19} "
             "causes"]
    for r in rs:
        last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["last"])) if r["last"] else "-"
        causes = ",".join(f"{c}×{n}" for c, n in r["causes"].items()) or "-"
        lines.append(f"{r['node'][:24]:<24} {len(r['jobs']):>4} {r['episodes']:>8} {r['seconds']:>8.0f}s "
                     f"{r['lost_s']:>10.0f}s  {last:<19} {causes}" + ("  SUSPECT" if r["suspect"] else ""))
    n = sum(r["suspect"] for r in rs)
    lines.append(f"{len(rs)} node{'s' if len(rs) != 1 else ''} named, {n} suspect")
    return "\n".join(lines) + "\n"


def as_json(rs: list[dict]) -> str:
    return json.dumps(rs, indent=1)


class Suspects:
    """The controller's side: at each `straggler` event, the named node's record over the window (the store's events
    and this one); a node named in `min_jobs` distinct jobs gets one `node_suspect` per window."""

    def __init__(self, store: Any, min_jobs: int = SUSPECT_JOBS, window_s: float = SUSPECT_WINDOW_S):
        self.store, self.min_jobs, self.window_s = store, min_jobs, window_s
        self.flagged: dict[str, float] = {}      # node → when it was said a suspect

    def check(self, node: str, job: str, now: float) -> dict[str, Any] | None:
        """The `node_suspect` event's body for `node`, just named in `job`, when it becomes one; else None."""
        if self.min_jobs <= 0 or now - self.flagged.get(node, -float("inf")) < self.window_s:
            return None
        self.flagged.pop(node, None)           # said before, a window ago: said again if it still is one
        r = records(self.store, self.window_s, now, node).get(node) or {"episodes": 0, "jobs": [], "seconds": 0.0,
                                                                       "lost_s": 0.0, "causes": {}, "last": now}
        jobs = sorted(set(r["jobs"]) | {job})
        if len(jobs) < self.min_jobs:
            return None
        self.flagged[node] = now
        return {"suspect": node, "jobs": jobs[-50:], "jobs_n": len(jobs), "episodes": r["episodes"] + 1,
                "seconds": r["seconds"], "lost_s": r["lost_s"], "causes": r["causes"],
                "window_s": self.window_s, "reason": f"{node} was named the straggler of {len(jobs)} jobs in "
                f"{self.window_s / 86400:g} d (others lost {r['lost_s']:.0f} node-s to it): drain it and look"}

    def open(self, now: float) -> list[str]:
        """The nodes said suspects within the window (/metrics: read from its own thread, so nothing changes here)."""
        return sorted(n for n, t in list(self.flagged.items()) if now - t < self.window_s)
