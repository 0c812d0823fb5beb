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
    ps = probes.get("pressure") or {}
    for key, name in (("memory_some_ns", "mem_stall_ns"), ("io_some_ns", "io_stall_ns")):
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
        out["gpu_util"] = sum(g["util_gpu_pct"] for g in gpus) / len(gpus)        # (statistics.fmean: 4x the cost,
        out["gpu_clock"] = sum(g.get("sm_clock_mhz", 0) for g in gpus) / len(gpus)  # per frame of every node)
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


def median_or_zero(xs: list[float]) -> float:
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
    "mem_stall": lambda w: (w.rate("mem_stall_ns") or 0) / 1e9 if "mem_stall_ns" in w.sums else None,
    "io_stall": lambda w: (w.rate("io_stall_ns") or 0) / 1e9 if "io_stall_ns" in w.sums else None,
    "reclaim": lambda w: (w.rate("reclaim_ns") or 0) / 1e9 if "reclaim_ns" in w.sums else None,
    "wait": lambda w: (w.rate("wait_ns") or 0) / 1e9 if "wait_ns" in w.sums else None,
    "cpu": lambda w: (w.rate("cpu_ns") or 0) / 1e9 if "cpu_ns" in w.sums else None,
}

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
    """Every node's value of every figure, sorted once per comparison: a node's peers' median and maximum (all
    but itself) in O(log n), so a comparison of an n-node job costs O(n log n), not O(n²)."""

    def __init__(self, wins: list[Window], values: "list[dict[str, float | None]] | None" = None):
        """`values`: each window's figures already read (values_of), in the same order — not read twice."""
        vals = values if values is not None else [values_of(w) for w in wins]
        self.sorted = {k: sorted(x for v in vals if (x := v[k]) is not None) for k in GET}

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


def values_of(w: Window) -> dict[str, float | None]:
    """Every compared figure of a window (None: the node does not report it)."""
    return {k: g(w) for k, g in GET.items()}


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
    if thr is not None:
        m, top, _ = others.stats("throttled", thr)
        if thr >= 0.10 * f and thr >= top + 0.10 * f:
            lim = f" (limit {me.limit:g} cores)" if me.limit else ""
            out.append(Cause("cpu_throttled", round(thr, 3), round(m, 3),
                             f"CPU throttled {thr:.0%} of the time by its cgroup's CPU limit{lim}; peers {m:.0%}"))
    for key, name, lo, mult, add, need_peers, digits, text in ABOVE:
        x = v[key]
        if x is None:
            continue
        m, _, n = others.stats(key, x)
        if (n or not need_peers) and x >= lo * f and x >= mult * m + add * f:
            words = text.format(x=x, m=m, xk=x / 1000, mk=m / 1000, drops=me.rate("nic_drops") or 0)
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
        if x is not None:
            m, top, _ = others.stats(key, x)
            if x >= 0.5 * f and x >= top + 0.5 * f:
                out.append(Cause(name, round(x, 2), round(m, 2), f"{what} {x:.0%} of the time; peers {m:.0%}"))
    return out
