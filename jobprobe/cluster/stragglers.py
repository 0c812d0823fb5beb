"""Stragglers: in a job spanning nodes, the node the others wait for — named, with why.

In a data-parallel job every rank waits at each collective for the slowest, so one throttled, crowded or badly
connected node sets the pace of all. The controller sees every node's frames of the same job on the same clock;
per job, every `every` seconds, it compares the nodes over the last `window` seconds:

- **causes** — a figure in which one node is far from all its peers: CPU throttled by its group's limit, threads
  waiting for a CPU (run-queue time), the queue in front of its network interface holding or dropping packets (a
  link slower than what it sends: the `nic` probe), TCP round-trip time or retransmits, GPU utilization, SM clock
  or throttle reasons — over the window and over its newest slice. (TCP round-trip time is a property of a path
  both ways: in a ring, the nodes on both sides of a slow link see it alike, so it names a node only when one
  node alone has it);
- **the signature of being waited for** — the others' threads spend more time asleep waiting (futex and socket
  waits: `sched.offcpu_lock_ns + offcpu_wait_ns`) than the node does. It is reported as evidence ("the others
  waited 0.41 s/s more"), not required: a rank that is slow for a reason we can name is named.

A node is named (`straggler` event, its node's name, the causes and the figures beside the peers' median) after
its cause holds in `open_after` consecutive comparisons (3: 20 s of overlapping windows), and cleared (`straggler_end`) after `close_after` without
it (at the lower `clear` bounds): hysteresis and a minimum duration, so one noisy window names nobody. A job whose
nodes all look alike has no event. Figures absent from a node's frames (no sched probe, no GPU) are simply not
compared.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 10.0
EVERY_S = 5.0
OPEN_AFTER = 3            # comparisons in a row: 20 s of 10 s windows 5 s apart, so a burst under 5 s names nobody
CLOSE_AFTER = 2
KEEP_S = 60.0             # frames kept per node (a little more than a window, for late nodes)

# clock-event reasons that are throttling, not idling or an application's own clock choice (NVML bits)
GPU_THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80 | 0x100     # SW power, HW slowdown, SW/HW thermal, power brake


def figures(probes: dict) -> dict[str, float]:
    """What one sample frame says, per figure (absent when its probe did not report it)."""
    out: dict[str, float] = {}
    cg = probes.get("cgroup") or {}
    if "cpu_user_ns" in cg:
        out["cpu_ns"] = cg.get("cpu_user_ns", 0) + cg.get("cpu_system_ns", 0)
    if "cpu_throttled_ns" in cg:
        out["throttled_ns"] = cg["cpu_throttled_ns"]
    if "cpu_limit_cores" in cg:
        out["limit"] = cg["cpu_limit_cores"]
    sc = probes.get("sched") or {}
    if "runq_lat_ns" in sc:
        out["runq_ns"] = sc["runq_lat_ns"]
    if "offcpu_lock_ns" in sc:
        out["wait_ns"] = sc.get("offcpu_lock_ns", 0) + sc.get("offcpu_wait_ns", 0)
    net = probes.get("net") or {}
    if "tcp_tx_bytes" in net:
        out["tx_bytes"] = net.get("tcp_tx_bytes", 0) + net.get("udp_tx_bytes", 0)
        out["rx_bytes"] = net.get("tcp_rx_bytes", 0) + net.get("udp_rx_bytes", 0)
        out["retrans"] = net.get("tcp_retransmits", 0)
        if net.get("tcp_srtt_us") is not None and net.get("tcp_tx_packets"):
            out["rtt_w"] = net["tcp_srtt_us"] * net["tcp_tx_packets"]    # averaged over the window by segments
            out["rtt_n"] = net["tcp_tx_packets"]
    nics = [n for n in (probes.get("nic") or {}).get("nics") or () if isinstance(n, dict)]
    if nics:
        out["nic_held"] = sum(n.get("qdisc_overlimits", 0) + n.get("qdisc_drops", 0) for n in nics)
        out["nic_drops"] = sum(n.get("qdisc_drops", 0) + n.get("tx_dropped", 0) for n in nics)
    nic = probes.get("nic") or {}
    if "rails_slow" in nic:                   # a frame in which one of its rails carried under half the median
        out["rail_dt"] = 1.0
        out["rail_slow"] = float(nic["rails_slow"] > 0)
    rd = probes.get("rdma") or {}
    if "ports_fatal" in rd:
        out["rdma_dt"] = 1.0
        out["rdma_fatal"] = float(rd["ports_fatal"] > 0)
    gpus = [g for g in (probes.get("gpu") or {}).get("gpus") or () if isinstance(g, dict) and "util_gpu_pct" in g]
    if gpus:
        out["gpu_dt"] = 1.0
        out["gpu_util"] = statistics.fmean(g["util_gpu_pct"] for g in gpus)
        out["gpu_clock"] = statistics.fmean(g.get("sm_clock_mhz", 0) for g in gpus)
        out["gpu_throttled"] = float(any(int(g.get("clock_event_reasons", 0)) & GPU_THROTTLE_BITS for g in gpus))
    return out


@dataclass
class Window:
    """A node's figures summed over a window: rates per second of wall time."""
    wall_s: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    limit: float | None = None

    def rate(self, k: str) -> float | None:
        return self.sums[k] / self.wall_s if k in self.sums and self.wall_s > 0 else None

    def rtt(self) -> float | None:
        n = self.sums.get("rtt_n")
        return self.sums["rtt_w"] / n if n else None

    def gpu(self, k: str) -> float | None:
        return self.share(k, "gpu_dt")

    def share(self, k: str, per: str) -> float | None:
        """A figure averaged over the frames that carry it (`per` counts them)."""
        n = self.sums.get(per)
        return self.sums[k] / n if n else None


@dataclass
class Cause:
    name: str
    value: float
    peers: float
    text: str


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# each compared figure, from a window (None: the node does not report it)
GET = {
    "throttled": lambda w: (w.rate("throttled_ns") or 0) / 1e9 if "throttled_ns" in w.sums else None,
    "runq": lambda w: (w.rate("runq_ns") or 0) / 1e9 if "runq_ns" in w.sums else None,
    "retrans": lambda w: w.rate("retrans"),
    "nic_held": lambda w: w.rate("nic_held"),
    "rtt": lambda w: w.rtt(),
    "gpu_util": lambda w: w.gpu("gpu_util"),
    "gpu_clock": lambda w: w.gpu("gpu_clock"),
    "gpu_throttled": lambda w: w.gpu("gpu_throttled"),
    "rail_slow": lambda w: w.share("rail_slow", "rail_dt"),
    "rdma_fatal": lambda w: w.share("rdma_fatal", "rdma_dt"),
}


class Others:
    """Every node's value of every figure, sorted once per comparison: a node's peers' median and maximum (all
    but itself) in O(log n), so a comparison of an n-node job costs O(n log n), not O(n²)."""

    def __init__(self, wins: list[Window]):
        self.sorted = {k: sorted(v for w in wins if (v := g(w)) is not None) for k, g in GET.items()}

    def stats(self, k: str, mine: float | None) -> tuple[float, float, int]:
        """(median, max, count) of figure k over the other nodes: `mine` taken out once."""
        s = self.sorted[k]
        i = bisect.bisect_left(s, mine) if mine is not None else len(s)
        skip = i < len(s) and s[i] == mine
        n = len(s) - skip

        def at(j: int) -> float:
            return s[j + 1] if skip and j >= i else s[j]
        if n == 0:
            return 0.0, 0.0, 0
        med = at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
        return med, at(n - 1), n


def causes(me: Window, peers: "list[Window] | Others", clearing: bool = False) -> list[Cause]:
    """The figures in which `me` is far from all its peers (a list of their windows, or an Others made from
    every node's, `me` included). `clearing`: the lower bounds an open straggler must fall under to be cleared
    (hysteresis)."""
    others = peers if isinstance(peers, Others) else Others([me, *peers])
    f = 0.5 if clearing else 1.0
    out: list[Cause] = []
    v = {k: g(me) for k, g in GET.items()}

    thr = v["throttled"]
    if thr is not None:
        m, top, _ = others.stats("throttled", thr)
        if thr >= 0.10 * f and thr >= top + 0.10 * f:
            lim = f" (limit {me.limit:g} cores)" if me.limit else ""
            out.append(Cause("cpu_throttled", round(thr, 3), round(m, 3),
                             f"CPU throttled {thr:.0%} of the time by its cgroup's CPU limit{lim}; peers {m:.0%}"))
    rq = v["runq"]
    if rq is not None:
        m, _, _ = others.stats("runq", rq)
        if rq >= 0.25 * f and rq >= 3 * m + 0.15 * f:
            out.append(Cause("runq", round(rq, 3), round(m, 3),
                             f"threads waited {rq:.2f} s per s for a CPU (run queue); peers {m:.2f}"))
    rt = v["retrans"]
    if rt is not None:
        m, _, _ = others.stats("retrans", rt)
        if rt >= 5 * f and rt >= 5 * m + 5 * f:
            out.append(Cause("net_retransmits", round(rt, 1), round(m, 1),
                             f"network: {rt:.0f} TCP retransmits/s (a slow or lossy link); peers {m:.0f}/s"))
    held = v["nic_held"]
    if held is not None:
        m, _, n = others.stats("nic_held", held)
        if n and held >= 50 * f and held >= 10 * m + 50 * f:
            drops = me.rate("nic_drops") or 0
            out.append(Cause("nic_queue", round(held, 1), round(m, 1),
                             f"network: the queue in front of its interface held packets back or dropped them "
                             f"{held:.0f} times/s ({drops:.0f} drops/s) — a link slower than what it sends; peers "
                             f"{m:.0f}/s"))
    rtt = v["rtt"]
    if rtt is not None:
        m, _, n = others.stats("rtt", rtt)
        if n and rtt >= 1000 * f and rtt >= 4 * m + 500 * f:
            out.append(Cause("net_rtt", round(rtt), round(m),
                             f"network: its TCP round trips take {rtt / 1000:.1f} ms (a queue on a slow link); "
                             f"peers {m / 1000:.2f} ms"))
    gu = v["gpu_util"]
    if gu is not None:
        m, _, _ = others.stats("gpu_util", gu)
        if m >= 30 and gu <= m * (0.6 + 0.2 * (f < 1)):
            out.append(Cause("gpu_util", round(gu, 1), round(m, 1), f"GPU utilization {gu:.0f}%; peers {m:.0f}%"))
    gc = v["gpu_clock"]
    if gc is not None:
        m, _, _ = others.stats("gpu_clock", gc)
        if m > 0 and gc <= m * (0.85 + 0.1 * (f < 1)):
            out.append(Cause("gpu_clock", round(gc), round(m), f"SM clock {gc:.0f} MHz; peers {m:.0f} MHz"))
    # shares of time in a bad state: at least half the window, and half more than any peer
    for key, name, what in (("gpu_throttled", "gpu_throttled", "GPU clocks held down (power/thermal)"),
                            ("rail_slow", "nic_rail", "network: one of its rails carried under half the median of "
                             "its rails (a slow NIC, cable or port)"),
                            ("rdma_fatal", "rdma_port", "network: an RDMA port of it was down or past its "
                             "symbol-error bound")):
        x = v[key]
        if x is not None:
            m, top, _ = others.stats(key, x)
            if x >= 0.5 * f and x >= top + 0.5 * f:
                out.append(Cause(name, round(x, 2), round(m, 2), f"{what} {x:.0%} of the time; peers {m:.0%}"))
    return out


@dataclass
class NodeTrack:
    frames: deque = field(default_factory=deque)       # (t, dt, figures)
    newest: float = 0.0
    streak: int = 0           # consecutive comparisons with a cause
    quiet: int = 0            # consecutive comparisons without one, while open
    open_since: float | None = None
    first_seen: float | None = None


@dataclass
class JobTrack:
    nodes: dict[str, NodeTrack] = field(default_factory=dict)
    last_eval: float = 0.0


class StragglerWatch:
    def __init__(self, window: float = WINDOW_S, every: float = EVERY_S, open_after: int = OPEN_AFTER,
                 close_after: int = CLOSE_AFTER):
        self.window, self.every, self.open_after, self.close_after = window, every, open_after, close_after
        self.jobs: dict[str, JobTrack] = {}
        self.evaluations = 0
        self.named = 0
        self.unreadable = 0          # frames whose figures could not be read (a hostile or broken node): skipped
        self.last_unreadable = ""

    def feed(self, frames: list[dict]) -> list[tuple[str, str, str, dict[str, Any]]]:
        """Take sample frames; returns events to emit: (node, job, event name, body)."""
        touched = set()
        for fr in frames:
            if fr.get("kind") != "sample" or not isinstance(fr.get("probes"), dict):
                continue
            try:
                t, dt, figs = float(fr["t"]), float(fr.get("dt") or 0.0), figures(fr["probes"])
            except (TypeError, ValueError, KeyError, AttributeError) as err:   # a frame it cannot read: skipped,
                self.unreadable += 1                                              # counted; the others go on
                self.last_unreadable = f"{type(err).__name__}: {err}"[:200]
                continue
            job = self.jobs.setdefault(fr["job"], JobTrack())
            nt = job.nodes.setdefault(fr["node"], NodeTrack())
            nt.frames.append((t, dt, figs))
            nt.newest = max(nt.newest, t)
            while nt.frames and nt.frames[0][0] < nt.newest - KEEP_S:
                nt.frames.popleft()
            touched.add(fr["job"])
        out = []
        for name in touched:
            out += self._maybe_compare(name, self.jobs[name])
        return out

    def keep_only(self, jobs: set[str]) -> None:
        """Forget the tracks of jobs not in `jobs` (the controller's jobs seen lately): bounded state."""
        for name in [j for j in self.jobs if j not in jobs]:
            del self.jobs[name]

    def open(self) -> list[tuple[str, str]]:
        """(job, node) of the stragglers named now."""
        return [(j, n) for j, jt in self.jobs.items() for n, nt in jt.nodes.items() if nt.open_since is not None]

    def _maybe_compare(self, name: str, job: JobTrack) -> list[tuple[str, str, str, dict[str, Any]]]:
        newest = max(nt.newest for nt in job.nodes.values())
        live = {n: nt for n, nt in job.nodes.items() if nt.newest >= newest - self.window}
        if len(live) < 2:
            return []
        horizon = min(nt.newest for nt in live.values())     # every live node has reported up to here
        if horizon - job.last_eval < self.every:
            return []
        job.last_eval = horizon
        wins = self._windows(live, horizon - self.window, horizon)
        recent = self._windows(live, horizon - self.every, horizon)    # the newest slice, new since the last
        if len(wins) < 2:
            return []
        self.evaluations += 1
        events = []
        everyone, everyone_recent = Others(list(wins.values())), Others(list(recent.values()))
        for n, w in wins.items():
            nt = live[n]
            if nt.open_since is None:
                # a cause must hold over the window and over its newest slice: three comparisons in a row then
                # mean three disjoint slices, so a burst shorter than a slice names nobody
                fresh = {c.name for c in causes(recent[n], everyone_recent)} \
                    if n in recent and len(recent) >= 2 else set()
                found = [c for c in causes(w, everyone) if c.name in fresh] if fresh else []
                nt.streak = nt.streak + 1 if found else 0
                if found and nt.first_seen is None:
                    nt.first_seen = horizon - self.every      # the first slice in which it held
                if not found:
                    nt.first_seen = None
                if found and nt.streak >= self.open_after:
                    nt.open_since, nt.quiet = horizon, 0
                    self.named += 1
                    events.append((n, name, "straggler", self._body(n, w, wins, found, nt)))
            else:
                still = causes(w, everyone, clearing=True)
                nt.quiet = 0 if still else nt.quiet + 1
                if nt.quiet >= self.close_after:
                    events.append((n, name, "straggler_end", {
                        "straggler": n, "duration_s": round(horizon - (nt.first_seen or nt.open_since), 1),
                        "reason": f"{n} is back in step with its peers",
                        "evidence": _evidence(w, wins, n)}))
                    nt.open_since, nt.streak, nt.first_seen = None, 0, None
        return events

    def _windows(self, live: dict[str, NodeTrack], start: float, end: float) -> dict[str, Window]:
        """Each node's frames in (start, end] summed; a node with under 60% of the span covered is left out."""
        out = {}
        for n, nt in live.items():
            w = Window()
            for t, dt, figs in nt.frames:
                if start < t <= end:
                    w.wall_s += dt
                    for k, v in figs.items():
                        if k == "limit":
                            w.limit = v
                        else:
                            w.sums[k] = w.sums.get(k, 0.0) + v
            if w.wall_s >= 0.6 * (end - start):
                out[n] = w
        return out

    def _body(self, n: str, w: Window, wins: dict[str, Window], found: list[Cause],
              nt: NodeTrack) -> dict[str, Any]:
        ev = _evidence(w, wins, n)
        text = "; ".join(c.text for c in found)
        waited = ev.get("peers_wait_s_per_s", 0) - ev.get("wait_s_per_s", 0)
        if waited > 0.05:
            text += f"; the other nodes' threads waited {waited:.2f} s/s more than its own"
        return {"straggler": n, "causes": [c.name for c in found], "reason": f"{n}: {text}",
                "since": round(nt.first_seen or 0.0, 3), "nodes": sorted(wins),
                "evidence": {**ev, **{c.name: {"value": c.value, "peers": c.peers} for c in found}}}


def _evidence(w: Window, wins: dict[str, Window], me: str) -> dict[str, float]:
    """The node's rates beside its peers' medians, for every figure it has (only for the node named: O(n))."""
    peers = [p for m, p in wins.items() if m != me]
    out: dict[str, float] = {}
    for k, scale, name in (("cpu_ns", 1e9, "cpu_cores"), ("throttled_ns", 1e9, "throttled_share"),
                           ("runq_ns", 1e9, "runq_s_per_s"), ("wait_ns", 1e9, "wait_s_per_s"),
                           ("tx_bytes", 1, "tx_bytes_per_s"), ("rx_bytes", 1, "rx_bytes_per_s"),
                           ("retrans", 1, "retransmits_per_s"), ("nic_held", 1, "nic_queue_held_per_s"),
                           ("nic_drops", 1, "nic_drops_per_s")):
        v = w.rate(k)
        if v is None:
            continue
        out[name] = round(v / scale, 4)
        others = [r / scale for p in peers if (r := p.rate(k)) is not None]
        if others:
            out[f"peers_{name}"] = round(_median(others), 4)
    for k, name in (("gpu_util", "gpu_util_pct"), ("gpu_clock", "gpu_sm_clock_mhz")):
        v = w.gpu(k)
        if v is not None:
            out[name] = round(v, 1)
            others = [r for p in peers if (r := p.gpu(k)) is not None]
            if others:
                out[f"peers_{name}"] = round(_median(others), 1)
    rtt = w.rtt()
    if rtt is not None:
        out["tcp_srtt_us"] = round(rtt, 1)
        others = [r for p in peers if (r := p.rtt()) is not None]
        if others:
            out["peers_tcp_srtt_us"] = round(_median(others), 1)
    if w.limit:
        out["cpu_limit_cores"] = w.limit
    return out
