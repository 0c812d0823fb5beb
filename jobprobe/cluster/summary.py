# SPDX-License-Identifier: Apache-2.0
"""`jobprobe summary`: one page a person reads in 30 seconds — where a job's wall time went, and why.

    jobprobe summary FILE… [--format text|json]                 # frame files (the agents' --out)
    jobprobe summary --store PATH --job ID [--format text|json]  # the controller's store: every node of the job

Each node's samples are split into buckets (jobprobe/core/timeuse.py, docs/TIMEUSE.md); the job's buckets are the
nodes' shares of their own wall time, averaged, times the job's wall time (its first interval's start to its last
interval's end over all nodes). Beside them: the steady pace each node kept, the straggler episodes the controller
named (with their cause) and the job's size.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Iterable

from jobprobe.cluster import report
from jobprobe.core import efficiency
from jobprobe.core import ends as job_ends
from jobprobe.core.timeuse import BUCKETS, STARVED_BY, decompose, num, usable

STARVED_WORDS = {"own_threads": "its own threads, beyond its CPUs", "cpu_limit": "its CPU limit (throttled)",
                 "neighbours": "other work on its CPUs (neighbours)", "memory": "memory stalls"}
WORDS = {"startup": "startup", "computing": "computing", "waiting_for_input": "waiting for input",
         "waiting_for_peers": "waiting for peers", "starved": "starved or throttled", "checkpointing": "checkpointing",
         "gpu_idle": "GPU idle", "lost": "lost to failures", "teardown": "teardown (its exit)",
         "other": "other (not attributed)"}


def frames_of_store(path: Any, job: str) -> list[dict]:
    from jobprobe.cluster.store import Store
    st = Store(path, readonly=True)
    try:
        return job_frames(st, job)
    finally:
        st.close()


def job_frames(store: Any, job: str) -> list[dict]:
    """A job's samples (raw and compacted) and events, every node's, from an open store, in time order."""
    _, rows = store.sql("SELECT body FROM frames WHERE job = ? AND kind = 'event' ORDER BY t", (job,))
    out = store.samples_of(job) + [json.loads(b) for (b,) in rows]
    return sorted(out, key=lambda f: f["t"])


END_AFTER = 3           # intervals with no sample of a job from any of its nodes, they alive: the job has ended
KEEP = 1000             # summaries kept for the controller's metrics (the newest)
MIN_SAMPLES = 3         # a job's samples (from all its nodes) before its end is summarized: one that never ran has none


class JobEnds:
    """The controller's view of when a job ends: every node that sent its samples is alive (still sending other
    frames, heartbeats included) or lost (the job ended there with it: `node_lost`), and none sent one of it for
    END_AFTER of its intervals. Each end is said once; a job
    whose samples come again ends again later (its summary then covers its whole run)."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, float]] = {}    # job → node → when its newest sample arrived
        self.samples: dict[str, int] = {}               # job → samples seen (up to MIN_SAMPLES)
        self.open: set[str] = set()                     # jobs with samples since their last end
        self.done: dict[str, dict[str, Any]] = {}       # job → its newest summary, for metrics

    def saw(self, frames: list[dict], now: float) -> None:
        for f in frames:
            if f.get("kind") == "sample":
                self.seen.setdefault(f["job"], {})[f["node"]] = now
                self.open.add(f["job"])
                self.samples[f["job"]] = min(MIN_SAMPLES, self.samples.get(f["job"], 0) + 1)

    def ended(self, now: float, alive: Any, interval: Any) -> list[str]:
        """Jobs that ended since the last call: `alive(node)` says a node is heard from, `interval(node)` its tick.
        A job with fewer than MIN_SAMPLES samples ended too: the caller summarizes only the others."""
        out = []
        for job in list(self.open):
            nodes = self.seen.get(job, {})
            if nodes and all(alive(n) and now - t > END_AFTER * interval(n) for n, t in nodes.items()):
                self.open.discard(job)
                out.append(job)
        return out

    def keep(self, job: str, summary: dict[str, Any]) -> None:
        self.done.pop(job, None)
        self.done[job] = summary
        while len(self.done) > KEEP:
            self.done.pop(next(iter(self.done)))

    def forget(self, live: set[str]) -> None:
        """Jobs no node reports any more (the controller's own hour): their tracks go, their summaries stay."""
        for job in [j for j in self.seen if j not in live]:
            del self.seen[job]
            self.samples.pop(job, None)
            self.open.discard(job)


class Episodes:
    """What report.straggler_periods reads of a job: its events in time order, and the end of its run."""

    def __init__(self, events: list[dict], end: float):
        self.events, self.span = events, (0.0, end)


def summarize(frames: Iterable[dict], name: str = "", thresholds: dict[str, float] | None = None) -> dict[str, Any]:
    """The summary of one job's frames (every node's): see the module docstring; `per_node` holds each node's own,
    `notes` the efficiency notes (jobprobe/core/efficiency.py; `thresholds` from a rules file, else its defaults)."""
    th = thresholds or dict(efficiency.DEFAULTS)
    frames = [f for f in frames if isinstance(f, dict)]
    by_node, nodes, periods = split(frames)
    ends = [num(f, "t") for fs in by_node.values() for f in fs]
    name = name or next((str(f.get("job")) for f in frames if f.get("job") is not None), "")
    peers = to_peers(nodes, periods) if len(nodes) > 1 else {}
    starts = [num(f, "t") - (num(f, "dt") or 0.0) for fs in by_node.values() for f in fs]
    wall = (max(ends) - min(starts)) if ends else 0.0
    shares = dict.fromkeys(BUCKETS, 0.0)
    starved = dict.fromkeys(STARVED_BY, 0.0)
    for d in nodes.values():
        for b in BUCKETS:       # a node whose intervals hold no time (dt 0): not attributed
            shares[b] += (d["buckets"][b] / d["wall_s"] if d["wall_s"] > 0 else float(b == "other")) / len(nodes)
        for p in STARVED_BY:
            starved[p] += (d.get("starved_by", {}).get(p, 0.0) / d["wall_s"] if d["wall_s"] > 0 else 0.0) / len(nodes)
    episodes = [{"node": p["node"], "start": p["start"], "end": p["end"], "s": round(p["end"] - p["start"], 1),
                 "reason": p["reason"], "waited_by": p["waited_by"]} for p in periods]
    labels = next((f["labels"] for f in reversed(frames) if isinstance(f.get("labels"), dict)), {})
    return {"job": name, "labels": labels, "nodes": len(nodes), "start": min(starts) if starts else None,
            "end": max(ends) if ends else None, "wall_s": round(wall, 3), "ended": how_it_ended(by_node),
            "goodput": round(shares["computing"], 4),
            "buckets": {b: round(shares[b] * wall, 3) for b in BUCKETS},
            "starved_by": {p: round(starved[p] * wall, 3) for p in STARVED_BY},
            "stragglers": episodes, "waited_for": {n: round(v, 3) for n, v in sorted(peers.items())},
            "notes": [f"node {n}: {line}" for n, d in nodes.items()
                      for line in efficiency.notes(d.get("used", {}), d.get("granted", {}), th)],
            "restarts": max((d.get("restarts", 0) for d in nodes.values()), default=0),
            "disruptions": max((d.get("disruptions", 0) for d in nodes.values()), default=0),
            "ideal_pace": ideal_pace(nodes),
            "per_node": {n: {"wall_s": round(d["wall_s"], 3), "goodput": round(d["goodput"], 4),
                             "pace": d["pace"], "buckets": {b: round(v, 3) for b, v in d["buckets"].items()},
                             "starved_by": {p: round(v, 3) for p, v in d.get("starved_by", {}).items()},
                             **({"gpu": {k: round(v, 2) for k, v in d["gpu"].items()}} if "gpu" in d else {}),
                             "used": {k: round(v, 3) for k, v in d.get("used", {}).items()},
                             "granted": {k: round(v, 3) for k, v in d.get("granted", {}).items()}}
                         for n, d in nodes.items()}}


def ideal_pace(nodes: dict[str, dict]) -> dict[str, Any] | None:
    """The job's ideal pace: its nodes' steady paces (docs/TIMEUSE.md) — what it runs at when nothing holds it
    back; `per_second`, their mean, in `of` (cpu_cores, lead_cpu_cores, gpu_busy). None where no node has one."""
    paces = [d["pace"] for d in nodes.values() if (d.get("pace") or {}).get("steady")]
    if not paces:
        return None
    return {"of": paces[0]["of"], "per_second": round(sum(p["steady"] for p in paces) / len(paces), 4)}


def how_it_ended(by_node: dict[str, list[dict]]) -> dict[str, Any] | None:
    """How the job ended, from its nodes' last samples' `end` (docs/FRAMES.md): the first node that ended badly
    (an exit code other than 0, a signal), else the last to end; None where no node's frames say it ended (still
    running, let go by a detach, or an agent of before `end`)."""
    ends = []
    for node, fs in by_node.items():
        last = max(fs, key=lambda f: num(f, "t") or 0.0) if fs else None
        if last is not None and isinstance(last.get("end"), dict):
            ends.append((num(last, "t") or 0.0, node, last["end"]))
    if not ends:
        return None
    bad = sorted((e for e in ends if job_ends.failed(e[2])), key=lambda e: (e[0], e[1]))
    t, node, end = bad[0] if bad else max(ends, key=lambda e: (e[0], e[1]))
    return {"node": node, "t": t, "how": job_ends.how(end), "cause": job_ends.cause_of(end), "ok": not bad,
            "why": str(end.get("why", ""))[:200],
            **{k: end[k] for k in ("exit_code", "signal", "oom_kills") if isinstance(end.get(k), int)},
            **({"scheduler": end["scheduler"][:200]} if isinstance(end.get("scheduler"), str) else {})}


def lost_nodes(by_node: dict[str, list[dict]], events: list[dict]) -> None:
    """A node the controller lost (`node_lost`, not followed by its `node_back`) whose last frame of the job has no
    `end`: the job ended there with its node — its last frame (a copy) says so, as an agent's would
    (core/ends.py)."""
    lost: dict[str, dict] = {}
    for e in events:             # in time order: the last word on each node
        if e.get("event") in ("node_lost", "node_back"):
            lost[str(e.get("node", "?"))] = e
    for node, e in lost.items():
        fs = by_node.get(node)
        if e.get("event") != "node_lost" or not fs:
            continue
        i = max(range(len(fs)), key=lambda k: num(fs[k], "t") or 0.0)
        if "end" not in fs[i]:
            fs[i] = {**fs[i], "end": {"why": f"node {node} lost: silent {e.get('silent_s', '?')} s",
                                      "cause": "node_lost"}}


def split(frames: list[dict]) -> tuple[dict[str, list[dict]], dict[str, dict], list[dict]]:
    """A job's frames (dicts) by node: each node's samples, its decomposition interval by interval (before
    to_peers) and the straggler episodes the controller named."""
    by_node: dict[str, list[dict]] = defaultdict(list)
    hellos: dict[str, list[dict]] = defaultdict(list)     # each run's hello: a job started again (decompose)
    for f in frames:
        if usable(f):
            by_node[str(f.get("node", "?"))].append(f)
        elif f.get("kind") == "hello":
            hellos[str(f.get("node", "?"))].append(f)
    events = sorted((f for f in frames if f.get("kind") == "event" and num(f, "t") is not None),
                    key=lambda e: num(e, "t"))
    lost_nodes(by_node, events)
    nodes = {n: decompose(hellos[n] + fs, intervals=True) for n, fs in sorted(by_node.items())}
    ends = [num(f, "t") for fs in by_node.values() for f in fs]
    periods = [{**p, "node": str(p["node"]), "reason": str(p["reason"]),
                "waited_by": [str(w) for w in p["waited_by"]] if isinstance(p["waited_by"], list) else []}
               for p in report.straggler_periods(Episodes(events, max(ends) if ends else 0.0))]
    return by_node, nodes, periods


def to_peers(nodes: dict[str, dict], periods: list[dict]) -> dict[str, float]:
    """While the controller had a node named as the job's straggler, the other nodes' waits (waiting_for_input and
    other: a rank blocked on its peers' sockets reads as a wait on input from its own frames) above their usual level
    were waits for it: moved, in each interval inside the episode, to waiting_for_peers (from the two in proportion)
    — as much of them as the progress the job lost there: each waiting node's computing's shortfall from its usual
    level, of which their median bounds each one (ranks in step make the same steps; a rank that waits for its peers
    also waits less for a CPU: that time is no progress lost; it stays `other`). A node's
    usual level of each is the median per second over its intervals outside every episode, after its startup; its
    usual waits go with its work (a wait per step: for its data, for its GPU), so what it waits anyway for the work
    it did in the interval is not the straggler's doing. Returns the seconds moved per straggler."""
    def inside(i: dict, p: dict) -> bool:
        return p["start"] <= i["t"] - i["dt"] / 2 <= p["end"]

    def waits(i: dict) -> float:
        return i["buckets"].get("waiting_for_input", 0.0) + i["buckets"].get("other", 0.0)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else 0.0
    moved: dict[str, float] = {}
    levels = {}                   # each node's usual waits and computing per second
    for n, d in nodes.items():
        calm = [i for i in d.get("intervals", ()) if i["dt"] > 0 and not i["buckets"].get("startup")
                and not any(inside(i, p) for p in periods)]
        levels[n] = (median([waits(i) / i["dt"] for i in calm]),
                     median([i["buckets"].get("computing", 0.0) / i["dt"] for i in calm]))
    for p in periods:
        plan = []
        for n, d in nodes.items():
            if p["node"] == n:
                continue
            usual, computes = levels[n]
            ins = [i for i in d.get("intervals", ()) if inside(i, p) and i["dt"] > 0]
            # each interval's share of its usual work done, its waits above those that go with it, its progress lost
            done = [i["buckets"].get("computing", 0.0) / computes if computes > 0 else 1.0 for i in ins]
            above = [waits(i) - usual * min(1.0, r) * i["dt"] for i, r in zip(ins, done)]
            lost = [i["dt"] * (1 - r) if computes > 0 else a for i, r, a in zip(ins, done, above)]
            plan.append((ins, above, lost))
        # ranks in step make the same steps: the job lost one progress, which each waiting node's own figure
        # estimates (its CPU per step moves while it waits, each its own way): their median bounds each one
        losts = sorted(sum(lost) for _, _, lost in plan)
        job_lost = (losts[(len(losts) - 1) // 2] + losts[len(losts) // 2]) / 2 if losts else 0.0
        for ins, above, lost in plan:
            # over the episode (an interval in step has its figures a little above or below usual: summed, that
            # evens out; taken interval by interval, only its ups would count)
            fits = [max(0.0, min(a, x)) for a, x in zip(above, lost)]
            room = sum(fits)           # none: no interval both waited more and lost progress — nothing moves
            share = min(max(0.0, min(sum(above), job_lost)), room) / room if room > 0 else 0.0
            for i, a, f in zip(ins, above, fits):
                if a <= 0:
                    continue
                take, b, have = share * f, i["buckets"], waits(i)
                for k in ("waiting_for_input", "other"):
                    if k in b:
                        b[k] *= 1 - a / have
                b["other"] = b.get("other", 0.0) + a - take
                if take > 0:
                    b["waiting_for_peers"] = b.get("waiting_for_peers", 0.0) + take
                    moved[p["node"]] = moved.get(p["node"], 0.0) + take
    for d in nodes.values():      # the node's totals again from its intervals
        if d.get("intervals"):
            for bucket in BUCKETS:
                d["buckets"][bucket] = sum(i["buckets"].get(bucket, 0.0) for i in d["intervals"])
    return moved


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def text(s: dict[str, Any]) -> str:
    """The summary as a person reads it."""
    if not s["nodes"]:
        return f"job {s['job']}: no samples\n"
    again = s.get("restarts") or 0
    lines = [f"job {s['job']} on {s['nodes']} node{'s' if s['nodes'] != 1 else ''}: {_hms(s['wall_s'])} wall "
             f"({s['wall_s']:.1f} s), goodput {100 * s['goodput']:.0f}%"
             + (f"; started again {again} time{'s' if again != 1 else ''}" if again else "")
             + (f"; ended: {s['ended']['how']}" + ("" if s["ended"]["ok"] else
                                                 f" on {s['ended']['node']} — its work since its last checkpoint "
                                                 f"lost ({s['buckets']['lost']:.1f} s)") if s.get("ended") else ""),
             "", "where the time went:"]
    wall = s["wall_s"] or 1.0
    for b, v in sorted(s["buckets"].items(), key=lambda kv: -kv[1]):
        if v > 0 or b in ("computing", "other"):
            lines.append(f"  {WORDS[b]:<24} {_hms(v):>8}  {100 * v / wall:5.1f}%")
        if b == "starved" and v > 0 and s.get("starved_by"):
            lines += [f"    {STARVED_WORDS[p]:<38} {100 * x / v:3.0f}%" for p, x in
                      sorted(s["starved_by"].items(), key=lambda kv: -kv[1]) if x >= 0.005 * v]
    lines.append("")
    for n, d in s["per_node"].items():
        pace = d["pace"]
        what = {"gpu_busy": "GPUs busy", "lead_cpu_cores": "CPU cores (its helpers apart)"}.get(pace["of"], "CPU cores")
        steady = f"{pace['steady']:.2f} {what}" if pace["steady"] else f"no {what} figure"
        gpu = d.get("gpu", {})
        ofu = (f", OFU {gpu['ofu_pct']:.0f}%" if "ofu_pct" in gpu else "") + \
            (f", SM active {gpu['gpm_sm_active_pct']:.0f}%" if "gpm_sm_active_pct" in gpu else "")
        lines.append(f"node {n}: goodput {100 * d['goodput']:.0f}%, steady pace {steady}{ofu}")
    if s["notes"]:
        lines += ["", "efficiency:"] + [f"  {line}" for line in s["notes"]]
    if s["stragglers"]:
        lines.append("")
        for p in s["stragglers"]:
            by = f"; {', '.join(map(str, p['waited_by']))} waited for it" if p["waited_by"] else ""
            lines.append(f"straggler: node {p['node']} for {p['s']:.0f} s: {p['reason']}{by}")
        for n, v in s["waited_for"].items():
            lines.append(f"the other nodes waited {v:.1f} node-seconds for node {n}")
    else:
        lines.append("no straggler named")
    return "\n".join(lines) + "\n"


def html_table(s: dict[str, Any]) -> str:
    """The summary at the top of the report: goodput and the buckets, largest first (every name escaped)."""
    import html
    if not s["nodes"]:
        return ""
    wall = s["wall_s"] or 1.0
    rows = "".join(f"<tr><td>{html.escape(WORDS[b])}</td><td>{v:.1f} s</td><td>{100 * v / wall:.1f}%</td></tr>"
                   for b, v in sorted(s["buckets"].items(), key=lambda kv: -kv[1]) if v > 0)
    return (f'<section id="summary"><h2>Where the time went</h2><p>{s["wall_s"]:.0f} s of wall time, goodput '
            f'<b>{100 * s["goodput"]:.0f}%</b> (docs/TIMEUSE.md)</p><table><tr><th>bucket</th><th>time</th>'
            f'<th>share</th></tr>{rows}</table></section>')
