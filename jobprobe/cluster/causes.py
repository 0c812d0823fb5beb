# SPDX-License-Identifier: Apache-2.0
"""Straggler causes: what one node's frames say (figures), summed over a window (Window), the figures compared
(values_of), and the figures in which a node is far from its peers (causes; could_name reads the same bounds across
every node of a comparison at once) or moved from its own baseline (moved), and what an event says of them
(evidence, straggler_body, imbalance_body). The watch that compares a job's nodes over time, and decides who is
waited for, is jobprobe/cluster/stragglers.py; jobprobe/cluster/peers.py holds every node's running sums and its
baseline as arrays.

Each cause names its figure and its bounds here, once: opening bounds, the lower ones an open straggler must fall
under to be cleared (hysteresis), and how far from the node's own baseline a figure must move to be evidence.
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobprobe.core.numbers import is_number

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
        return {k: v for k, v in d.items() if is_number(v)} \
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
    if "offcpu_stopped_ns" in sc:           # what a node waited for with no cause was doing (unknown_cause)
        out["stopped_ns"] = sc["offcpu_stopped_ns"]
    if "offcpu_io_ns" in sc:
        out["dstate_ns"] = sc["offcpu_io_ns"]
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


# every figure _figures gives, summed over a window (and `limit`, the newest value, not a sum)
SUMMED = ("cpu_ns", "throttled_ns", "mem_dt", "mem_full", "runq_ns", "wait_ns", "gpu_dt", "gpu_util", "gpu_clock",
          "gpu_throttled", "mem_stall_ns", "io_stall_ns", "reclaim_ns", "tx_bytes", "rx_bytes", "retrans", "rtt_w",
          "rtt_n", "ras_dt", "ras_behind", "nic_held", "nic_drops", "rail_dt", "rail_slow", "rdma_dt", "rdma_fatal",
          "stopped_ns", "dstate_ns")


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


# Each compared figure, read from a window's sums (values_of; None: the node does not report it): (figure, sum,
# per, scale) — per None: the sum per second of wall time over `scale` (seconds per second for the times, per second
# for the counts); else the sum over the sum `per` (an average over the frames that carry it: GPU and port shares,
# the TCP round trip over its segments)
VALUES = (("throttled", "throttled_ns", None, 1e9), ("runq", "runq_ns", None, 1e9), ("retrans", "retrans", None, 1.0),
          ("nic_held", "nic_held", None, 1.0), ("rtt", "rtt_w", "rtt_n", None),
          ("gpu_util", "gpu_util", "gpu_dt", None), ("gpu_clock", "gpu_clock", "gpu_dt", None),
          ("gpu_throttled", "gpu_throttled", "gpu_dt", None), ("rail_slow", "rail_slow", "rail_dt", None),
          ("rdma_fatal", "rdma_fatal", "rdma_dt", None), ("mem_stall", "mem_stall_ns", None, 1e9),
          ("io_stall", "io_stall_ns", None, 1e9), ("reclaim", "reclaim_ns", None, 1e9), ("wait", "wait_ns", None, 1e9),
          ("cpu", "cpu_ns", None, 1e9), ("ras_behind", "ras_behind", "ras_dt", None),
          ("mem_full", "mem_full", "mem_dt", None), ("stopped", "stopped_ns", None, 1e9),
          ("dstate", "dstate_ns", None, 1e9))
FIGURES = tuple(f for f, _, _, _ in VALUES)

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


# the stalls a node the others wait for is named for where they rose over its own baseline, even where its peers'
# are as high (they may share its CPU): (figure, cause, the words)
WAITED_STALLS = (("runq", "runq", "threads waited {x:.2f} s per s for a CPU (run queue), up from {b:.2f}; peers "
                  "{m:.2f}"),
                 ("mem_stall", "memory_pressure", "threads stalled {x:.2f} s per s on memory, up from {b:.2f}; peers "
                  "{m:.2f}"),
                 ("io_stall", "io_pressure", "threads stalled {x:.2f} s per s on I/O, up from {b:.2f}; peers {m:.2f}"),
                 ("reclaim", "memory_reclaim", "threads reclaimed memory {x:.2f} s per s, up from {b:.2f}; peers "
                  "{m:.2f}"))
STALL_FIGURES = tuple(k for k, _, _ in WAITED_STALLS)
STALL_RISES = np.array([[MOVED[c][1]] for _, c, _ in WAITED_STALLS])   # (a column)



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
            s = self.sorted[k] = self.column(k)
        i = bisect.bisect_left(s, mine) if mine is not None else len(s)
        skip = i < len(s) and s[i] == mine
        n = len(s) - skip

        def at(j: int) -> float:
            return s[j + 1] if skip and j >= i else s[j]
        if n == 0:
            return 0.0, 0.0, 0
        med = at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
        return med, at(n - 1), n

    def column(self, k: str) -> list[float]:
        """Figure k of every node that has it, sorted."""
        return sorted(x for v in self.vals if (x := v[k]) is not None)


def values_of(w: Window) -> dict[str, float | None]:
    """Every compared figure of a window (VALUES; None: the node does not report it)."""
    s = w.sums
    inv = 1.0 / w.wall_s if w.wall_s > 0 else 0.0
    out: dict[str, float | None] = {}
    for name, k, per, scale in VALUES:
        if per is None:
            out[name] = s[k] * inv / scale if k in s else None
        else:
            n = s.get(per)
            out[name] = s[k] / n if n else None
    return out


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


THROTTLED = 0.10          # CPU throttled this share of the window or more, and this much more than every peer
GPU_UTIL_PEERS = 30       # GPU utilization compared where the peers' median is this (%) or more ...
GPU_UTIL_OF = 0.6         # ... and named at this share of it or less (clearing: 0.2 more)
GPU_CLOCK_OF = 0.85       # SM clock named at this share of the peers' median or less (clearing: 0.1 more)
BAD_SHARE = 0.5           # a share of time in a bad state: at least half the window, and half more than any peer
SHARES = (("gpu_throttled", "gpu_throttled", "GPU clocks held down (power/thermal)"),
          ("rail_slow", "nic_rail", "network: one of its rails carried under half the median of its rails (a slow "
           "NIC, cable or port)"),
          ("rdma_fatal", "rdma_port", "network: an RDMA port of it was down or past its symbol-error bound"))

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
    if thr is not None and thr >= THROTTLED * f:     # (the absolute bound first: most nodes' peers go unread)
        m, top, _ = others.stats("throttled", thr)
        if thr >= top + THROTTLED * f:
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
        if m >= GPU_UTIL_PEERS and gu <= m * (GPU_UTIL_OF + 0.2 * (f < 1)):
            out.append(Cause("gpu_util", round(gu, 1), round(m, 1), f"GPU utilization {gu:.0f}%; peers {m:.0f}%"))
    gc = v["gpu_clock"]
    if gc is not None:
        m, _, _ = others.stats("gpu_clock", gc)
        if m > 0 and gc <= m * (GPU_CLOCK_OF + 0.1 * (f < 1)):
            out.append(Cause("gpu_clock", round(gc), round(m), f"SM clock {gc:.0f} MHz; peers {m:.0f} MHz"))
    for key, name, what in SHARES:
        x = v[key]
        if x is not None and x >= BAD_SHARE * f:
            m, top, _ = others.stats(key, x)
            if x >= top + BAD_SHARE * f:
                out.append(Cause(name, round(x, 2), round(m, 2), f"{what} {x:.0%} of the time; peers {m:.0%}"))
    return out


def evidence(w: Window, wins: dict[str, Window], me: str) -> dict[str, float]:
    """Node `me`'s rates (its window w) beside its peers' medians (wins: every node's window), for every figure it
    has: an event's evidence (only for the node named: O(n))."""
    peers = [p for m, p in wins.items() if m != me]
    out: dict[str, float] = {}
    for k, scale, name in (("cpu_ns", 1e9, "cpu_cores"), ("throttled_ns", 1e9, "throttled_share"),
                           ("runq_ns", 1e9, "runq_s_per_s"), ("wait_ns", 1e9, "wait_s_per_s"),
                           ("tx_bytes", 1, "tx_bytes_per_s"), ("rx_bytes", 1, "rx_bytes_per_s"),
                           ("retrans", 1, "retransmits_per_s"), ("nic_held", 1, "nic_queue_held_per_s"),
                           ("nic_drops", 1, "nic_drops_per_s"), ("mem_stall_ns", 1e9, "mem_stall_s_per_s"),
                           ("io_stall_ns", 1e9, "io_stall_s_per_s"), ("reclaim_ns", 1e9, "reclaim_s_per_s"),
                           ("stopped_ns", 1e9, "stopped_s_per_s"), ("dstate_ns", 1e9, "dstate_s_per_s")):
        v = w.rate(k)
        if v is None:
            continue
        out[name] = round(v / scale, 4)
        others = [r / scale for p in peers if (r := p.rate(k)) is not None]
        if others:
            out[f"peers_{name}"] = round(median_or_zero(others), 4)
    for k, name in (("gpu_util", "gpu_util_pct"), ("gpu_clock", "gpu_sm_clock_mhz")):
        v = w.gpu(k)
        if v is not None:
            out[name] = round(v, 1)
            others = [r for p in peers if (r := p.gpu(k)) is not None]
            if others:
                out[f"peers_{name}"] = round(median_or_zero(others), 1)
    rtt = w.rtt()
    if rtt is not None:
        out["tcp_srtt_us"] = round(rtt, 1)
        others = [r for p in peers if (r := p.rtt()) is not None]
        if others:
            out["peers_tcp_srtt_us"] = round(median_or_zero(others), 1)
    if w.limit:
        out["cpu_limit_cores"] = w.limit
    return out


STOPPED_SHARE = 0.3     # s per s of its threads stopped: paused
DSTATE_RISE = 0.3       # s per s more in uninterruptible sleep than its usual: blocked in the kernel


def unknown_cause(mine: dict[str, float | None], base: Any, gap: float) -> Cause:
    """The cause `unknown` of a node the others wait for with no figure of its node moved, and what its threads were
    doing instead, from its own off-CPU reasons and CPU (`base(figure)`: its own usual value, or None): paused
    (stopped or traced), blocked in the kernel (uninterruptible sleep up from its usual), or neither — a GPU, a
    link or a bug no probe of the node sees."""
    stopped, dstate, cpu = mine.get("stopped"), mine.get("dstate"), mine.get("cpu")
    d0, c0 = base("dstate"), base("cpu")
    if stopped is not None and stopped >= STOPPED_SHARE:
        what = f"paused: its threads were stopped {stopped:.2f} s per s (SIGSTOP, a debugger)"
    elif dstate is not None and dstate - (d0 or 0.0) >= DSTATE_RISE:
        what = f"blocked in the kernel: its threads in uninterruptible sleep {dstate:.2f} s per s" + \
            (f", usually {d0:.2f}" if d0 is not None else "")
    else:
        what = "no figure of its node moved"
    if cpu is not None:
        what += f"; its CPU {cpu:.2f} cores" + (f", usually {c0:.2f}" if c0 is not None else "")
    return Cause("unknown", round(gap, 3), 0.0, f"cause unknown — {what}; the others waited {gap:.2f} s per s "
                 "more for it than is usual")


def straggler_body(n: str, w: Window, wins: dict[str, Window], found: list[Cause], since: float | None,
                   waited_by: list[str]) -> dict[str, Any]:
    """A `straggler` event's body: node n (its window w; every compared node's, wins), named for `found` since
    `since`, waited for by `waited_by`."""
    ev = evidence(w, wins, n)
    text = "; ".join(c.text for c in found)
    waited = ev.get("peers_wait_s_per_s", 0) - ev.get("wait_s_per_s", 0)
    if waited > 0.05:
        text += f"; the other nodes' threads waited {waited:.2f} s/s more than its own"
    return {"straggler": n, "verdict": "node", "causes": [c.name for c in found], "reason": f"{n}: {text}",
            "since": round(since or 0.0, 3), "nodes": sorted(wins), "waited_by": waited_by,
            "evidence": {**ev, **{c.name: {"value": c.value, "peers": c.peers} for c in found}}}


def imbalance_body(n: str, w: Window, wins: dict[str, Window], mine: dict[str, float | None], since: float | None,
                   cpu_base: float | None, share_base: float | None, waited: float,
                   waited_by: list[str], over_s: float) -> dict[str, Any]:
    """An `imbalance` event's body: node n (its window w; every compared node's windows, wins) given more work
    since `since`: its figures over the last `over_s` seconds (`mine`, which decided), its CPU and CPU share's
    baselines, how much more the others waited."""
    ev = evidence(w, wins, n)
    cpu, base = mine.get("cpu") or 0.0, cpu_base or 0.0
    share, sbase = mine.get("cpu_share") or 0.0, share_base or 0.0
    return {"node": n, "verdict": "imbalance", "since": round(since or 0.0, 3), "nodes": sorted(wins),
            "reason": f"{n} has more work than its peers (the job's own imbalance, not its node): its CPU rose "
                      f"to {cpu:.2f} cores from {base:.2f} ({share:.2f}x its peers', usually {sbase:.2f}x) "
                      f"with nothing on its node changed, and the others' threads waited {waited:.2f} s/s more "
                      f"than its own, over the last {over_s:g} s",
            "waited_by": waited_by,
            "evidence": {**ev, "cpu_cores_baseline": round(base, 4), "cpu_share": round(share, 3),
                         "cpu_share_baseline": round(sbase, 3)}}


def could_name(t: Any) -> np.ndarray:
    """The nodes of a comparison's table (jobprobe/cluster/peers.py: every node's figures, a row a figure, and
    their order across the nodes) that causes() may name at its opening bounds, read for all nodes at once: the
    nodes to ask it about — no other has a cause. Each bound a hair wide (a node on its edge is asked), never
    narrower; as in causes(), a figure's order is read only where a node is over its absolute bound."""
    x = t.cols(_ABOVE_KEYS)
    near = at_least(x, _ABOVE_LO)
    ok = np.zeros(x.shape[1], bool)
    if (some := near.any(1)).any():
        m, _, n = t.orders(tuple(k for k, s in zip(_ABOVE_KEYS, some) if s))
        ok |= (near[some] & ((n > 0) | ~_ABOVE_NEED[some]) &
               at_least(x[some], _ABOVE_MULT[some] * m + _ABOVE_ADD[some])).any(0)
    x, by = t.cols(_TOP_KEYS), np.array([[THROTTLED]] + [[BAD_SHARE]] * len(SHARES))
    near = at_least(x, by)
    if (some := near.any(1)).any():
        top = t.orders(tuple(k for k, s in zip(_TOP_KEYS, some) if s))[1]
        ok |= (near[some] & at_least(x[some], top + by[some])).any(0)
    gu, gc = t.cols(("gpu_util", "gpu_clock"))
    if not (np.isnan(gu).all() and np.isnan(gc).all()):
        mu, mc = t.orders(("gpu_util", "gpu_clock"))[0]
        ok |= at_least(mu, GPU_UTIL_PEERS) & at_least(mu * GPU_UTIL_OF, gu) | (mc > 0) & at_least(mc * GPU_CLOCK_OF, gc)
    return ok & t.member


# ABOVE, and the figures named when over every peer's, as arrays (could_name)
_ABOVE_KEYS = tuple(a[0] for a in ABOVE)
_ABOVE_LO, _ABOVE_MULT, _ABOVE_ADD = (np.array([[a[i]] for a in ABOVE], float) for i in (2, 3, 4))
_ABOVE_NEED = np.array([[a[5]] for a in ABOVE])
_TOP_KEYS = ("throttled",) + tuple(k for k, _, _ in SHARES)


def at_least(x: np.ndarray, y: Any) -> np.ndarray:
    """x >= y, a billionth wide (NaN, an absent figure: never)."""
    return x >= y - 1e-9
