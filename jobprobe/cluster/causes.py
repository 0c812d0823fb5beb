"""Straggler causes: what one node's frames say (figures), summed over a window (Window), and the figures in which
a node is far from its peers (causes) or moved from its own baseline (moved). The watch that compares a job's nodes
over time, and decides who is waited for, is jobprobe/cluster/stragglers.py.

Each cause names its figure and its bounds here, once: opening bounds, the lower ones an open straggler must fall
under to be cleared (hysteresis), and how far from the node's own baseline a figure must move to be evidence.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any

# clock-event reasons that are throttling, not idling or an application's own clock choice (NVML bits)
GPU_THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80 | 0x100     # SW power, HW slowdown, SW/HW thermal, power brake


_NUMBER_TYPES = frozenset((int, float))


def figures(probes: dict) -> dict[str, float]:
    """What one sample frame says, per figure (absent when its probe did not report it, or reported null). Read
    as it comes (this runs per frame of every node); a frame whose values are not all numbers where figures are
    read (a null: a figure its host cannot tell) is read again with only its numbers."""
    try:
        out = _figures(probes)
        if _NUMBER_TYPES.issuperset(map(type, out.values())):
            return out
    except (TypeError, AttributeError):
        pass
    return _figures(_numbers(probes))


def _numbers(probes: Any) -> dict:
    """Each probe's numbers only (and its `gpus` / `nics` records' numbers); NCCL RAS's status as it is."""
    def nums(d: Any) -> dict:
        return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)} \
            if isinstance(d, dict) else {}
    out = {}
    for name, d in (probes.items() if isinstance(probes, dict) else ()):
        out[name] = dict(d) if name == "ncclras" and isinstance(d, dict) else nums(d)
        for key in ("gpus", "nics"):
            items = d.get(key) if isinstance(d, dict) else None
            if isinstance(items, list):
                out[name][key] = [nums(x) for x in items]
    return out


def _figures(probes: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    cg = probes.get("cgroup") or {}
    if "cpu_user_ns" in cg:
        out["cpu_ns"] = cg.get("cpu_user_ns", 0) + cg.get("cpu_system_ns", 0)
    if "cpu_throttled_ns" in cg:
        out["throttled_ns"] = cg["cpu_throttled_ns"]
    if "cpu_limit_cores" in cg:
        out["limit"] = cg["cpu_limit_cores"]
    if cg.get("mem_limit_bytes") and "mem_bytes" in cg:      # a frame at 90% of its memory limit or more
        out["mem_dt"], out["mem_full"] = 1.0, float(cg["mem_bytes"] >= 0.9 * cg["mem_limit_bytes"])
    sc = probes.get("sched") or {}
    if "runq_lat_ns" in sc:
        out["runq_ns"] = sc["runq_lat_ns"]
    if "offcpu_lock_ns" in sc:
        out["wait_ns"] = sc.get("offcpu_lock_ns", 0) + sc.get("offcpu_wait_ns", 0)
    cu = probes.get("cuda") or {}
    if "sync_ns" in cu:       # NCCL: a rank waits for its peers inside the CUDA synchronize and NCCL calls, where it
        gpu_wait = cu["sync_ns"] + sum(v for k, v in cu.items()                          # may spin on its CPU:
                                       if k.startswith("nccl_") and k.endswith("_ns") and isinstance(v, (int, float)))
        out["wait_ns"] = max(out.get("wait_ns", 0), gpu_wait)   # the larger of the two, as a blocking wait is in both
    ps = probes.get("pressure") or {}
    for key, name in (("mem_some_ns", "mem_stall_ns"), ("io_some_ns", "io_stall_ns")):
        if isinstance(ps.get(key), (int, float)):       # null where the kernel does not report it
            out[name] = ps[key]
    mem = probes.get("memory") or {}
    if "direct_reclaim_ns" in mem or "memcg_reclaim_ns" in mem:
        out["reclaim_ns"] = mem.get("direct_reclaim_ns", 0) + mem.get("memcg_reclaim_ns", 0)
    net = probes.get("net") or {}
    if "tcp_tx_bytes" in net:
        out["tx_bytes"] = net.get("tcp_tx_bytes", 0) + net.get("udp_tx_bytes", 0)
        out["rx_bytes"] = net.get("tcp_rx_bytes", 0) + net.get("udp_rx_bytes", 0)
        out["retrans"] = net.get("tcp_retransmits", 0)
        if net.get("tcp_srtt_us") is not None and net.get("tcp_tx_packets"):
            out["rtt_w"] = net["tcp_srtt_us"] * net["tcp_tx_packets"]    # averaged over the window by segments
            out["rtt_n"] = net["tcp_tx_packets"]
    ras = probes.get("ncclras") or {}
    if ras.get("polled") and isinstance(ras.get("ranks_behind_here"), int):   # a fresh status of NCCL's RAS port
        out["ras_dt"] = 1.0
        out["ras_behind"] = float(ras["ranks_behind_here"] > 0)
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
    n = util = clock = 0
    throttled = 0.0
    for g in (probes.get("gpu") or {}).get("gpus") or ():          # one pass: this runs per frame of every node
        if isinstance(g, dict) and "util_gpu_pct" in g:
            n += 1
            util += g["util_gpu_pct"]
            clock += g.get("sm_clock_mhz", 0)
            if int(g.get("clock_event_reasons", 0)) & GPU_THROTTLE_BITS:
                throttled = 1.0
    if n:
        out["gpu_dt"], out["gpu_util"], out["gpu_clock"], out["gpu_throttled"] = 1.0, util / n, clock / n, throttled
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
class _Cum:
    """Everything of a node's frames up to one frame: wall time, each figure's sum and count, the newest limit."""
    wall: float = 0.0
    sums: dict = field(default_factory=dict)
    ns: dict = field(default_factory=dict)
    limit: float | None = None
    limit_t: float = float("-inf")

    def then(self, t: float, dt: float, figs: dict[str, float]) -> "_Cum":
        sums, ns = self.sums.copy(), self.ns.copy()
        get, nget = sums.get, ns.get
        for k, v in figs.items():
            sums[k] = get(k, 0) + v
            ns[k] = nget(k, 0) + 1
        if "limit" in figs:                  # the newest limit, not a sum
            del sums["limit"], ns["limit"]
            return _Cum(self.wall + dt, sums, ns, figs["limit"], t)
        return _Cum(self.wall + dt, sums, ns, self.limit, self.limit_t)


class Series:
    """One node's frames in time order, kept `keep` s, with running sums: a window's figures are the difference of
    two running sums (O(figures)), not a sum over its frames — a comparison each tick costs what one did each 5 s."""

    def __init__(self, keep: float):
        self.keep = keep
        self.frames: list[tuple[float, float, dict, _Cum]] = []   # (t, dt, figures, the sums up to and with it)
        self.base = _Cum()                                          # the sums before the first frame kept
        self.newest = 0.0

    def add(self, t: float, dt: float, figs: dict[str, float]) -> None:
        i = len(self.frames)
        while i and self.frames[i - 1][0] > t:       # a late frame: put in time order, the sums after it redone
            i -= 1
        redo = self.frames[i:]
        del self.frames[i:]
        for ft, fdt, ff, _ in [(t, dt, figs, None), *redo]:
            prev = self.frames[-1][3] if self.frames else self.base
            self.frames.append((ft, fdt, ff, prev.then(ft, fdt, ff)))
        self.newest = max(self.newest, t)
        drop = 0
        while drop < len(self.frames) and self.frames[drop][0] < self.newest - self.keep:
            drop += 1
        if drop:
            self.base = self.frames[drop - 1][3]
            del self.frames[:drop]

    def window(self, start: float, end: float) -> Window:
        """The frames in (start, end] summed."""
        a = b = None
        for i in range(len(self.frames) - 1, -1, -1):
            t = self.frames[i][0]
            if b is None and t <= end:
                b = self.frames[i][3]
            if t <= start:
                a = self.frames[i][3]
                break
        a = a or self.base
        w = Window()
        if b is None:
            return w
        w.wall_s = b.wall - a.wall
        ans, asums = a.ns, a.sums
        for k, x in b.sums.items():
            if b.ns[k] - ans.get(k, 0):
                w.sums[k] = x - asums.get(k, 0)
        if b.limit_t > start:
            w.limit = b.limit
        return w


@dataclass
class Cause:
    name: str
    value: float
    peers: float
    text: str


def median_or_zero(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# each compared figure (values_of reads them from a window; None: the node does not report it)
FIGURES = ("throttled", "runq", "retrans", "nic_held", "rtt", "gpu_util", "gpu_clock", "gpu_throttled", "rail_slow",
           "rdma_fatal", "mem_stall", "io_stall", "reclaim", "wait", "cpu", "ras_behind")

# How far a figure must move from the node's own baseline to count as evidence (in the direction of its cause), by
# cause: a figure that did not change is never evidence, however far it is from the peers'. (name, figure, rise)
MOVED = {"cpu_throttled": ("throttled", 0.10), "runq": ("runq", 0.15), "net_retransmits": ("retrans", 5.0),
         "nic_queue": ("nic_held", 50.0), "net_rtt": ("rtt", 500.0), "gpu_util": ("gpu_util", -20.0),
         "gpu_clock": ("gpu_clock", None), "gpu_throttled": ("gpu_throttled", 0.5), "nic_rail": ("rail_slow", 0.5),
         "rdma_port": ("rdma_fatal", 0.5), "memory_pressure": ("mem_stall", 0.05),
         "io_pressure": ("io_stall", 0.10), "memory_reclaim": ("reclaim", 0.03)}


def moved(cause: str, value: float, base: float, share: float = 1.0) -> bool:
    """Whether `value` moved from the node's own `base` far enough in the direction of `cause` (`share` of the
    rise: 1/2 for the lower bound that keeps an open event open)."""
    _, rise = MOVED[cause]
    if rise is None:                     # the SM clock: down by 10% of its baseline
        return value <= (1 - 0.1 * share) * base
    return value - base >= rise * share if rise > 0 else value - base <= rise * share


class Others:
    """Every node's value of every figure, each figure sorted once per comparison, when first asked for (most
    nodes of a healthy job are under a cause's absolute bound, and their peers' figure is never read): a node's
    peers' median and maximum (all but itself) in O(log n), so a comparison of an n-node job costs O(n log n)."""

    def __init__(self, wins: list[Window], values: "list[dict[str, float | None]] | None" = None):
        """`values`: each window's figures already read (values_of), in the same order — not read twice."""
        self.vals = values if values is not None else [values_of(w) for w in wins]
        self.sorted: dict[str, list[float]] = {}

    def stats(self, k: str, mine: float | None) -> tuple[float, float, int]:
        """(median, max, count) of figure k over the other nodes: `mine` taken out once."""
        s = self.sorted.get(k)
        if s is None:
            s = self.sorted[k] = sorted(x for v in self.vals if (x := v[k]) is not None)
        i = bisect.bisect_left(s, mine) if mine is not None else len(s)
        skip = i < len(s) and s[i] == mine
        n = len(s) - skip

        def at(j: int) -> float:
            return s[j + 1] if skip and j >= i else s[j]
        if n == 0:
            return 0.0, 0.0, 0
        med = at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
        return med, at(n - 1), n


def values_of(w: Window) -> dict[str, float | None]:
    """Every compared figure of a window (None: the node does not report it): seconds per second for the times,
    per second for the counts, an average over the frames that carry it for GPU and port shares."""
    s = w.sums
    inv = 1.0 / w.wall_s if w.wall_s > 0 else 0.0

    def per_s(k: str, scale: float = 1.0) -> float | None:
        return s[k] * inv / scale if k in s else None

    def share(k: str, per: str) -> float | None:
        n = s.get(per)
        return s[k] / n if n else None
    rtt_n = s.get("rtt_n")
    return {"throttled": per_s("throttled_ns", 1e9), "runq": per_s("runq_ns", 1e9), "retrans": per_s("retrans"),
            "nic_held": per_s("nic_held"), "rtt": s["rtt_w"] / rtt_n if rtt_n else None,
            "gpu_util": share("gpu_util", "gpu_dt"), "gpu_clock": share("gpu_clock", "gpu_dt"),
            "gpu_throttled": share("gpu_throttled", "gpu_dt"), "rail_slow": share("rail_slow", "rail_dt"),
            "rdma_fatal": share("rdma_fatal", "rdma_dt"), "mem_stall": per_s("mem_stall_ns", 1e9),
            "io_stall": per_s("io_stall_ns", 1e9), "reclaim": per_s("reclaim_ns", 1e9), "wait": per_s("wait_ns", 1e9),
            "cpu": per_s("cpu_ns", 1e9), "ras_behind": share("ras_behind", "ras_dt"),
            "mem_full": share("mem_full", "mem_dt")}


# Figures in which a node is named when far above its peers' median: (figure, cause, at least, × the median,
# + this, only with peers reporting it, digits kept, the words). `clearing` halves "at least" and "+ this".
ABOVE = (
    ("runq", "runq", 0.25, 3, 0.15, False, 3,
     "threads waited {x:.2f} s per s for a CPU (run queue); peers {m:.2f}"),
    ("retrans", "net_retransmits", 5, 5, 5, False, 1,
     "network: {x:.0f} TCP retransmits/s (a slow or lossy link); peers {m:.0f}/s"),
    ("nic_held", "nic_queue", 50, 10, 50, True, 1,
     "network: the queue in front of its interface held packets back or dropped them {x:.0f} times/s "
     "({drops:.0f} drops/s) — a link slower than what it sends; peers {m:.0f}/s"),
    ("rtt", "net_rtt", 1000, 4, 500, True, 0,
     "network: its TCP round trips take {xk:.1f} ms (a queue on a slow link); peers {mk:.2f} ms"),
    ("mem_stall", "memory_pressure", 0.10, 3, 0.05, False, 3,
     "threads stalled {x:.2f} s per s on memory (PSI memory some: reclaim, refaults, swap-in); peers {m:.2f}"),
    ("io_stall", "io_pressure", 0.20, 3, 0.10, False, 3,
     "threads stalled {x:.2f} s per s on I/O (PSI io some); peers {m:.2f}"),
    ("reclaim", "memory_reclaim", 0.05, 3, 0.025, False, 3,
     "threads stalled {x:.2f} s per s on reclaiming memory in its own threads; peers {m:.2f}"),
)


STALLS = ("memory_pressure", "io_pressure", "memory_reclaim")   # said with the memory limit, where it is at it


def at_limit(cause: str, v: dict[str, float | None]) -> str:
    """What a stall cause adds where the node's group sat at its memory limit most of the window."""
    full = v.get("mem_full") or 0.0
    if cause not in STALLS or full < 0.5:
        return ""
    return f"; at its memory limit {full:.0%} of the time (its page cache reclaimed: what it reads again comes " \
           "from the disk)"


def causes(me: Window, peers: "list[Window] | Others", clearing: bool = False,
           mine: "dict[str, float | None] | None" = None) -> list[Cause]:
    """The figures in which `me` is far from all its peers (a list of their windows, or an Others made from
    every node's, `me` included). `clearing`: the lower bounds an open straggler must fall under to be cleared
    (hysteresis). `mine`: values_of(me), where already read."""
    others = peers if isinstance(peers, Others) else Others([me, *peers])
    f = 0.5 if clearing else 1.0
    out: list[Cause] = []
    v = mine if mine is not None else values_of(me)

    thr = v["throttled"]
    if thr is not None and thr >= 0.10 * f:          # (the absolute bound first: most nodes' peers go unread)
        m, top, _ = others.stats("throttled", thr)
        if thr >= top + 0.10 * f:
            lim = f" (limit {me.limit:g} cores)" if me.limit else ""
            out.append(Cause("cpu_throttled", round(thr, 3), round(m, 3),
                             f"CPU throttled {thr:.0%} of the time by its cgroup's CPU limit{lim}; peers {m:.0%}"))
    for key, name, lo, mult, add, need_peers, digits, text in ABOVE:
        x = v[key]
        if x is None or x < lo * f:
            continue
        m, _, n = others.stats(key, x)
        if (n or not need_peers) and x >= mult * m + add * f:
            words = text.format(x=x, m=m, xk=x / 1000, mk=m / 1000, drops=me.rate("nic_drops") or 0)
            words += at_limit(name, v)
            out.append(Cause(name, round(x, digits) if digits else round(x), round(m, digits) if digits else round(m),
                             words))
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
        if x is not None and x >= 0.5 * f:
            m, top, _ = others.stats(key, x)
            if x >= top + 0.5 * f:
                out.append(Cause(name, round(x, 2), round(m, 2), f"{what} {x:.0%} of the time; peers {m:.0%}"))
    return out


def cpu_shares(values: dict[str, dict[str, float | None]], everyone: Others) -> Others:
    """Each node's CPU over its peers' median, into its figures (`cpu_share`): what more work moves on a shared
    machine, where the others' CPU falls as one rank's rises."""
    for v in values.values():
        cpu = v.get("cpu")
        med = everyone.stats("cpu", cpu)[0] if cpu is not None else 0.0
        v["cpu_share"] = cpu / med if cpu is not None and med > 0 else None
    return everyone
