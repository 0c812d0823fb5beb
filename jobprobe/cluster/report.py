# SPDX-License-Identifier: Apache-2.0
"""`jobprobe report`: one self-contained HTML page a person opens after a slow job.

    jobprobe report FILE… -o report.html                 # frame files (the agents' --out, `jobprobe run --out`)
    jobprobe report --store PATH --job ID -o report.html  # the controller's store: every node of the job

At the top a verdict in words (the stragglers named and for how much of the run, what the others did meanwhile,
the job's size and the collector's own cost), then per-node timelines — CPU, memory, GPU, I/O, network, time
waiting for a CPU, time asleep waiting — with the events on them (straggler periods shaded, lost nodes and other
events marked), off-CPU time by reason per node, and the collector's cost. Plots are matplotlib SVG, inline: the
page needs no network and no script. Long runs are averaged into at most MAX_POINTS points per line, so a page of
an hour of 8 nodes stays small (docs/PERFORMANCE.md).

Every name on the page comes from frames — node and job names a node chose — so none is ever markup: HTML-escaped in
the page, and in the plots drawn as it is, never as mathtext or TeX (a node `n$\frac{1}{0}$1` is a label, not a
formula that fails to parse).
"""
from __future__ import annotations

import html
import io
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from jobprobe.core.numbers import is_number

MAX_POINTS = 600
OFFCPU = ("preempt", "io", "lock", "sleep", "wait")
# Text in the plots is literal: `$…$` is not mathtext, nothing goes through LaTeX (whatever a matplotlibrc says).
PLAIN_TEXT = {"text.usetex": False, "text.parse_math": False}


class Series:
    """One node's samples, as parallel lists (time, dt, figures)."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.v: dict[str, list[float | None]] = defaultdict(list)
        self.began = math.inf        # when its earliest interval began (its t less its dt): the wall time's start

    def add(self, t: float, dt: float, probes: dict[str, Any]) -> None:
        dt = dt or 1.0
        self.t.append(t)
        self.began = min(self.began, t - dt)
        cg = _d(probes.get("cgroup"))
        sc = _d(probes.get("sched"))
        net = _d(probes.get("net"))
        gpu = _d(probes.get("gpu"))
        me = _d(probes.get("self"))
        row: dict[str, float | None] = {
            "cpu": _sum(cg, "cpu_user_ns", "cpu_system_ns", scale=1e-9 / dt),
            "throttled": _sum(cg, "cpu_throttled_ns", scale=1e-9 / dt),
            "mem": _sum(cg, "mem_bytes", scale=1 / 2 ** 30),
            "io": _sum(cg, "io_read_bytes", "io_write_bytes", scale=1 / 2 ** 20 / dt),
            "net": _sum(net, "tcp_tx_bytes", "tcp_rx_bytes", "udp_tx_bytes", "udp_rx_bytes", scale=1 / 2 ** 20 / dt),
            "runq": _sum(sc, "runq_lat_ns", scale=1e-9 / dt),
            "waiting": _sum(sc, "offcpu_lock_ns", "offcpu_wait_ns", scale=1e-9 / dt),
            "self_cpu": me.get("cpu_cores") if isinstance(me.get("cpu_cores"), (int, float)) else None,
            "self_rss": _sum(me, "rss_bytes", scale=1 / 2 ** 20),
        }
        gpus = gpu.get("gpus") if isinstance(gpu.get("gpus"), list) else []
        util = [u for g in gpus if (u := _sum(_d(g), "util_gpu_pct")) is not None]
        row["gpu"] = sum(util) / len(util) if util else None
        for r in OFFCPU:
            row[f"off_{r}"] = _sum(sc, f"offcpu_{r}_ns", scale=1e-9)
        for k, x in row.items():
            self.v[k].append(x)
        for k in self.v:
            if k not in row:
                self.v[k].append(None)


def _d(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _sum(d: dict, *keys: str, scale: float = 1.0) -> float | None:
    vals = [d[k] for k in keys if is_number(d.get(k))]
    return sum(vals) * scale if vals else None


class Job:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self.nodes: dict[str, Series] = defaultdict(Series)
        self.events: list[dict] = []
        self.what = ""      # what ran: its command (`jobprobe run -- CMD`) or its owner labels, for the title

    def take(self, frames: Iterable[dict]) -> None:
        for fr in frames:
            if not isinstance(fr, dict):
                continue
            if not self.name:
                self.name = str(fr.get("job", ""))
            t, dt = fr.get("t"), fr.get("dt") or 1.0
            if not all(is_number(x) for x in (t, dt)):
                continue      # a frame from a file is hostile until checked: no time, no place on the page
            target, labels = fr.get("target"), fr.get("labels")
            if fr.get("kind") == "hello" and not self.what and isinstance(target, dict) and \
                    isinstance(target.get("command"), str):
                self.what = target["command"][:160]
            elif not self.what and isinstance(labels, dict) and labels:
                self.what = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if isinstance(v, str))[:160]
            if fr.get("kind") == "sample" and isinstance(fr.get("probes"), dict):
                self.nodes[str(fr.get("node", "?"))].add(float(t), float(dt), fr["probes"])
            elif fr.get("kind") == "event":
                self.events.append(fr)

    def sort(self) -> None:
        for s in self.nodes.values():
            order = sorted(range(len(s.t)), key=s.t.__getitem__)
            s.t = [s.t[i] for i in order]
            for k in s.v:
                s.v[k] = [s.v[k][i] for i in order]
        self.events.sort(key=lambda e: float(e.get("t", 0)))

    @property
    def wall_s(self) -> float:
        """From its earliest interval's start to its last frame: the wall time `summary` says (the span of the
        frames' own times leaves the first interval out: a header of 35 s over a table of 36 s)."""
        began = min((s.began for s in self.nodes.values()), default=0.0)
        return max(0.0, self.span[1] - began) if self.nodes else 0.0

    @property
    def span(self) -> tuple[float, float]:
        ts = [t for s in self.nodes.values() for t in (s.t[:1] + s.t[-1:])]
        return (min(ts), max(ts)) if ts else (0.0, 0.0)


def frames_of_files(paths: list[str]) -> list[dict]:
    """Every frame of the files, in their order (a file's last frame cut short is left out by the reader)."""
    from jobprobe.core.frame import StreamReader
    out: list[dict] = []
    for p in paths:
        with open(p, "rb") as f:
            out.extend(fr for fr in StreamReader(f) if isinstance(fr, dict))
    return out


def from_files(paths: list[str]) -> Job:
    job = Job()
    job.take(frames_of_files(paths))
    job.sort()
    return job


# ---- the verdict --------------------------------------------------------------------------------------------
def straggler_periods(job: Job, opened: str = "straggler", closed: str = "straggler_end") -> list[dict]:
    """(node, start, end, reason, evidence, causes, waited_by) of each straggler named (or, with opened="imbalance",
    each imbalance), its end the matching end event (or the end of the run)."""
    out: list[dict] = []
    open_: dict[str, dict] = {}
    for e in job.events:
        node = e.get("straggler", e.get("node"))
        if not isinstance(node, str):
            continue                   # a frame from a file is hostile until checked: a node is a name
        if e.get("event") == opened:
            since = e.get("since")
            start = float(since) if is_number(since) else float(e["t"])
            open_[node] = {"node": node, "start": start, "end": None,
                           "reason": e.get("reason", ""), "evidence": e.get("evidence", {}),
                           "causes": e.get("causes", []), "waited_by": e.get("waited_by", [])}
        elif e.get("event") == closed:
            if node in open_:
                p = open_.pop(node)
                p["end"] = float(e.get("t"))
                out.append(p)
    end = job.span[1]
    for p in open_.values():
        p["end"] = end
        out.append(p)
    return sorted(out, key=lambda p: p["start"])


CAUSE_WORDS = {"cpu_throttled": "throttled by its CPU limit", "runq": "short of CPU (run queue)",
               "memory_pressure": "stalled on memory", "io_pressure": "stalled on I/O",
               "memory_reclaim": "reclaiming memory", "nic_queue": "held back by a slow link (its interface's queue)",
               "net_rtt": "on a slow path", "net_retransmits": "losing packets", "gpu_util": "with a less busy GPU",
               "gpu_clock": "with slower GPU clocks", "gpu_throttled": "with its GPU throttled",
               "nic_rail": "with a slow network rail", "rdma_port": "with an RDMA port down or failing"}


def _waiters(ps: list[dict]) -> str:
    who = sorted({str(n) for p in ps if isinstance(p.get("waited_by"), (list, tuple)) for n in p["waited_by"]})
    return f"; {html.escape(', '.join(who))} waited for it" if who else ""


def verdict(job: Job) -> str:
    t0, t1 = job.span
    run = max(job.wall_s, 1e-9)
    nodes = sorted(job.nodes)
    parts = []
    periods = straggler_periods(job)
    if periods:
        by_node: dict[str, list[dict]] = defaultdict(list)
        for p in periods:
            by_node[p["node"]].append(p)
        for node, ps in by_node.items():
            secs = sum(p["end"] - p["start"] for p in ps)
            causes = sorted({c for p in ps for c in p["causes"]})
            said = ", ".join(CAUSE_WORDS.get(c, c) for c in causes)
            waited = [p["evidence"].get("peers_wait_s_per_s", 0) - p["evidence"].get("wait_s_per_s", 0) for p in ps]
            extra = (f"; meanwhile the other nodes' threads waited {max(waited):.2f} s per second more than its own"
                     if waited and max(waited) > 0.05 else "")
            parts.append(f"<b>{html.escape(node)}</b> was the straggler for {secs:.0f} s "
                         f"({secs / run:.0%} of the run), {html.escape(said)}{_waiters(ps)}{extra}.")
    more_work = straggler_periods(job, "imbalance", "imbalance_end")
    by_node = defaultdict(list)
    for p in more_work:
        by_node[p["node"]].append(p)
    for node, ps in by_node.items():
        secs = sum(p["end"] - p["start"] for p in ps)
        parts.append(f"<b>{html.escape(node)}</b> had more work than its peers for {secs:.0f} s "
                     f"({secs / run:.0%} of the run): the job's own imbalance, not its node{_waiters(ps)}.")
    if not periods and not more_work and len(nodes) > 1:
        parts.append("No straggler: the nodes kept in step the whole run.")
    lost = [e for e in job.events if e.get("event") == "node_lost" and float(e.get("t", 0)) < t1]  # not the end
    if lost:
        parts.append(f"{len({e.get('node') for e in lost})} node(s) went silent at some point "
                     f"({', '.join(sorted({html.escape(str(e.get('node'))) for e in lost}))}).")
    cpu = [x for s in job.nodes.values() for x in s.v.get("cpu", []) if x is not None]
    mem = [x for s in job.nodes.values() for x in s.v.get("mem", []) if x is not None]
    me = [x for s in job.nodes.values() for x in s.v.get("self_cpu", []) if x is not None]
    gpu = [x for s in job.nodes.values() for x in s.v.get("gpu", []) if x is not None]
    size = (f"{html.escape(job.name)} ran {run:.0f} s on {len(nodes)} node(s)"
            + (f", {sum(cpu) / len(cpu):.2f} CPU cores per node on average" if cpu else "")
            + (f", memory up to {max(mem):.2f} GiB on a node" if mem else "")
            + (f", GPUs {sum(gpu) / len(gpu):.0f}% busy on average" if gpu else "") + ".")
    cost = f" The collector itself used {sum(me) / len(me):.4f} cores per job and node." if me else ""
    return " ".join(parts + [size + cost])


# ---- plots ----------------------------------------------------------------------------------------------
PANELS = [("cpu", "CPU cores used"), ("throttled", "share of time throttled by the CPU limit"),
          ("mem", "memory (GiB)"), ("gpu", "GPU utilization (%)"), ("io", "storage I/O (MiB/s)"),
          ("net", "network (MiB/s, both ways)"), ("runq", "waiting for a CPU (s per s, all threads)"),
          ("waiting", "asleep waiting: futex + socket/poll (s per s, all threads)")]


def _downsample(t: list[float], v: list[float | None]) -> tuple[list[float], list[float]]:
    pts = [(a, b) for a, b in zip(t, v) if b is not None]
    if len(pts) <= MAX_POINTS:
        return [a for a, _ in pts], [b for _, b in pts]
    step = len(pts) / MAX_POINTS
    xs, ys = [], []
    for i in range(MAX_POINTS):
        chunk = pts[int(i * step):int((i + 1) * step)] or pts[-1:]
        xs.append(sum(a for a, _ in chunk) / len(chunk))
        ys.append(sum(b for _, b in chunk) / len(chunk))
    return xs, ys


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def timelines(job: Job) -> list[tuple[str, str]]:
    """The plots, as (title, SVG). Drawn with PLAIN_TEXT: node names become legend entries and tick labels, and
    matplotlib makes (and lays out) those texts when it draws, inside savefig — so the setting holds for the whole
    drawing, not only for the texts made here."""
    import matplotlib
    matplotlib.use("Agg")
    with matplotlib.rc_context(PLAIN_TEXT):
        return _timelines(job)


def _timelines(job: Job) -> list[tuple[str, str]]:
    import matplotlib.pyplot as plt
    t0, _ = job.span
    periods = straggler_periods(job)
    marks = [e for e in job.events if e.get("event") not in ("straggler", "straggler_end")]   # imbalance: a mark
    out = []
    for key, title in PANELS:
        if not any(x is not None for s in job.nodes.values() for x in s.v.get(key, [])):
            continue
        fig, ax = plt.subplots(figsize=(10, 2.4))
        colour, lines = {}, []
        for node in sorted(job.nodes):
            s = job.nodes[node]
            xs, ys = _downsample(s.t, s.v.get(key, []))
            (line,) = ax.plot([x - t0 for x in xs], ys, linewidth=1.2)
            colour[node] = line.get_color()
            lines.append(line)
        for p in periods:       # shaded in the straggler's own colour
            ax.axvspan(p["start"] - t0, p["end"] - t0, color=colour.get(p["node"], "tab:red"), alpha=0.13)
        for e in marks:
            ax.axvline(float(e.get("t", t0)) - t0, color="tab:gray", linestyle=":", linewidth=1)
        ax.set_ylim(bottom=0)       # every panel's figure is a quantity from zero: its axis starts there
        ax.set_xlabel("seconds since the first frame", fontsize=8)
        ax.grid(alpha=0.3)
        # handles and labels given: a node named `_x` is still listed (a label of ours starting with `_` is not)
        ax.legend(lines, sorted(job.nodes), fontsize=7, loc="upper right", ncol=min(4, len(job.nodes)))
        out.append((title, _svg(fig)))
    # off-CPU time by reason, per node, over the run
    if any(s.v.get("off_lock") for s in job.nodes.values()):
        fig, ax = plt.subplots(figsize=(10, 0.6 + 0.45 * len(job.nodes)))
        names = sorted(job.nodes)
        left = [0.0] * len(names)
        for r in OFFCPU:
            vals = [sum(x for x in job.nodes[n].v.get(f"off_{r}", []) if x is not None) for n in names]
            ax.barh(names, vals, left=left, label=r)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_title("off-CPU time by reason over the run (s, all threads)", loc="left", fontsize=10)
        ax.legend(fontsize=7, ncol=5, loc="lower right")
        out.append(("off-CPU by reason", _svg(fig)))
    if any(x is not None for s in job.nodes.values() for x in s.v.get("self_cpu", [])):
        fig, ax = plt.subplots(figsize=(10, 2.0))
        lines = []
        for node in sorted(job.nodes):
            s = job.nodes[node]
            xs, ys = _downsample(s.t, s.v.get("self_cpu", []))
            lines += ax.plot([x - t0 for x in xs], ys, linewidth=1)
        ax.set_title("the collector's own CPU (cores, per job)", loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(lines, sorted(job.nodes), fontsize=7, loc="upper right")
        out.append(("collector cost", _svg(fig)))
    return out


def cost_html(c: dict | None) -> str:
    """The job's cost block (jobprobe/cluster/cost.py summary) as a small table, or nothing."""
    if not c:
        return ""
    cur = html.escape(c.get("currency", ""))
    money = (lambda x: f"{x:,.2f} {cur}") if "cost" in c else (lambda x: "")       # noqa: E731
    head = (f"<p class='cost' id='cost'><b>Cost: {money(c['cost'])}</b> ({money(c['cost_per_hour'])} per hour of run;"
            f" nodes {money(c['node_cost'])}, energy {money(c['energy_cost'])})</p>") if "cost" in c else ""
    waste = c["idle_gpu_cost"] + c["waiting_gpu_cost"] + c["revoked_cost"] if "cost" in c else None
    rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{o['node_hours']:.3f}</td><td>{o['gpu_hours']:.3f}</td>"
                   f"<td>{o['energy_kwh']:.4f}</td><td>{html.escape(str(o.get('price', '')))}</td>"
                   f"<td>{money(o['cost']) if 'cost' in o else ''}</td></tr>" for n, o in c["nodes"].items())
    return (f"<h2>Cost</h2>{head}<p>{c['node_hours']:.3f} node-hours, {c['gpu_hours']:.3f} GPU-hours, "
            f"{c['energy_kwh']:.4f} kWh. Wasted: {c['idle_gpu_hours']:.3f} GPU-hours idle, "
            f"{c['waiting_gpu_hours']:.3f} waiting on the host, {c['revoked_node_hours']:.3f} node-hours lost to "
            f"revocations{' — ' + money(waste) if waste is not None else ''}.</p>"
            f"<table><tr><th>node</th><th>node-h</th><th>GPU-h</th><th>kWh</th><th>price</th><th>cost</th></tr>"
            f"{rows}</table>")


def render(job: Job, cost: dict | None = None, top: str = "") -> str:
    """The page; `top` (HTML) opens it: the job's summary (jobprobe/cluster/summary.py html())."""
    if not job.nodes:
        from jobprobe.core.errors import BadInput
        raise BadInput(f"no sample frames{' of job ' + job.name if job.name else ''} to report on")
    t0, t1 = job.span
    rows = "".join(
        f"<tr><td>{html.escape(_utc(float(e.get('t', 0)), '%H:%M:%S'))}</td>"
        f"<td>{html.escape(str(e.get('node', '')))}</td><td>{html.escape(str(e.get('event', '')))}</td>"
        f"<td>{html.escape(str(e.get('reason') or {k: v for k, v in e.items() if k in ('silent_s', 'why')}))}</td></tr>"
        for e in job.events)
    plots = "".join(f'<section><h3>{html.escape(title)}</h3>{svg}</section>' for title, svg in timelines(job))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(job.what or job.name)} — jobprobe report</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
.verdict {{ font-size: 1.1em; background: #f5f7fa; border-left: 4px solid #c33; padding: 0.8em 1em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }} td, th {{ border-bottom: 1px solid #ddd; padding: 3px 8px;
text-align: left; vertical-align: top; }} svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>{html.escape(job.what or job.name)}</h1>
{f'<p class="meta">job {html.escape(job.name)}</p>' if job.what else ''}
<p class="meta">{len(job.nodes)} node(s): {html.escape(", ".join(sorted(job.nodes)))} ·
{_utc(t0, "%Y-%m-%d %H:%M:%S")} – {_utc(t1, "%H:%M:%S")} UTC
({job.wall_s:.0f} s)</p>
{top}
{cost_html(cost)}
<p class="verdict" id="verdict">{verdict(job)}</p>
<h2>Timelines</h2>
<p>Shaded, in its line's colour: a node named the straggler, from the first moment its cause held to when it was
cleared. Dotted: other events (a node lost or back, rules, …).</p>
{plots}
<h2>Events</h2>
<table><tr><th>time (UTC)</th><th>node</th><th>event</th><th>what</th></tr>\
{rows or '<tr><td colspan=4>none</td></tr>'}</table>
</body></html>
"""


def _utc(t: float, fmt: str) -> str:
    """A UNIX time as UTC text; one no calendar holds (a hostile file's) as the number it is."""
    try:
        return time.strftime(fmt, time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return f"t={t:g}"


def write(job: Job, out: str, cost: dict | None = None, top: str = "") -> int:
    text = render(job, cost, top)
    Path(out).write_text(text)
    return len(text.encode())
