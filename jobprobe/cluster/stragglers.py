"""Stragglers: in a job spanning nodes, the node the others wait for — named, with why, and who waited.

In a data-parallel job every rank waits at each collective for the slowest, so one throttled, crowded or badly
connected node sets the pace of all. The controller sees every node's frames of the same job on the same clock;
per job, at every tick, it compares the nodes over the last `window` seconds (10) and the newest `slice` (3 s)
(jobprobe/cluster/causes.py reads the figures and holds each cause's bounds):

- **who waits for whom** — each node's threads' sleep in lock and socket/pipe waits (`sched.offcpu_lock_ns +
  offcpu_wait_ns`: where a rank sits in a collective while a peer is late) against its peers' median: the node the
  others wait for has the least — less than is usual for it (its own baseline gap: a rank may wait more or less than
  its peers for a whole run). A node that waits for another while someone is waited for is never given a cause.
- **causes** — a figure in which the node is far from its peers (CPU throttled by its group's limit, run-queue
  wait, memory or I/O stalls (PSI) and reclaim, the queue in front of its interface, TCP round-trip time or
  retransmits, a slow rail, a dead RDMA port, GPU utilization, SM clock or throttle reasons), over the window and
  over its newest slice, **and that moved from the node's own baseline** (the median of its figures over the last
  minute, one sample each 5 s, while nothing was open or building up): a figure that did not change is never
  evidence. A node the others wait for is also named for a run-queue wait or a stall that rose over its own baseline
  even where its peers' are as high (they may share its CPU: a noisy neighbour).
- **the verdict** — `straggler` (verdict "node": a fault of its node, with its causes) or `imbalance` (the node is
  waited for, no cause moved, its CPU over its peers' median rose 1.18x over its usual ratio, its own CPU up too:
  the job gave it more work — not its node's fault; on a machine the ranks share, its peers' CPU falls as its own
  rises, so the ratio moves where its own CPU alone hardly does); each names the nodes that waited for it.

An event opens after its verdict has held for `open_s` (4 s; one comparison without it forgiven), and closes
(`straggler_end`, `imbalance_end`) after `close_s` (3 s) in which it did not hold at the lower clearing bounds over
the window and its newest slice both (being waited for alone does not hold a straggler open — one of its causes
must): hysteresis and a minimum duration, so a burst of 2 s or less (it holds in the newest slice for its length +
3 s) names nobody, and an event ends ~3 + 3 s after its fault (chosen on recorded faults: docs/PERFORMANCE.md,
"Stragglers"). A job whose nodes all look alike has no event. Figures absent from a node's frames (no sched probe,
no GPU) are not compared; without wait figures, a cause before the node has a baseline names it on its peers'
comparison alone.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from jobprobe.cluster.causes import (MOVED, Cause, Others, Series, Window, at_limit, causes, cpu_shares, figures,
                                     median_or_zero, moved, values_of)

WINDOW_S = 10.0
EVERY_S = 1.0             # a decision every tick, over the window and its newest slice
SLICE_S = 3.0             # the newest slice, in which a cause must hold too (not only in the window's average)
OPEN_S = 4.0              # held this long (one comparison's miss forgiven): a burst of 2 s names nobody
CLOSE_S = 3.0             # an open event ends after this long without it (at the lower clearing bounds)
MISSES = 1                # comparisons without it that do not break a hold (a noisy second)
BASE_EVERY_S = 5.0        # a node's figures join its baseline this often while the job is in step
KEEP_S = 60.0             # frames kept per node (a little more than a window, for late nodes)
# the signature of being waited for: the peers' median wait over the node's, in s of thread sleep per s, at least
WAITED_S = 0.05
WAITED_SHARE = 0.05       # ... and this share of the peers' median wait (a median mostly of threads that always sleep)
IMBALANCE_SHARE = 1.18    # a node waited for, whose CPU over its peers' median rose this much over its usual
                          # ratio, its own CPU up too, nothing else moved: more work (a rank given 1.5x the batch on
                          # a 2-core machine three ranks share: its CPU 1.12-1.19x, its peers' down 3-8%, the ratio
                          # 1.17-1.35x; in step it wandered to 1.16-1.18x a few times in 35 recorded trials)
IMBALANCE_CPU = 1.05      # ... its own CPU at least this much over its baseline (not only its peers' fallen)

BASELINE_N = 12           # a node's own baseline: the median of its last 12 (one a minute) while the job was in step


@dataclass
class NodeTrack:
    series: Series = field(default_factory=lambda: Series(KEEP_S))     # its frames' figures, with running sums
    hold_since: float | None = None   # the first comparison of the current hold (a cause, or for "imbalance",
    misses: int = 0                    # more work); comparisons in a row without it, while holding
    quiet_since: float | None = None  # while open: the first comparison of the current stretch without it
    open_since: float | None = None
    first_seen: float | None = None
    kind: str = ""            # what the streak or the open event is: "straggler" (a node fault) or "imbalance"
    causes: tuple = ()        # the causes an open straggler was named for
    history: deque = field(default_factory=lambda: deque(maxlen=BASELINE_N))   # {figure: value} while in step

    baselines: dict = field(default_factory=dict)                 # figure → its baseline, until history changes

    def baseline(self, k: str) -> float | None:
        """The node's own usual value of figure k (None until 3 comparisons in step have been seen)."""
        if k not in self.baselines:
            xs = [h[k] for h in self.history if h.get(k) is not None]
            self.baselines[k] = statistics.median(xs) if len(xs) >= 3 else None
        return self.baselines[k]

    def in_step(self, values: dict[str, float | None]) -> None:
        """The node's figures of a comparison in which the job was in step join its baseline."""
        self.history.append(values)
        self.baselines.clear()


@dataclass
class Waits:
    """Who waits for whom in one comparison: per node, its peers' median wait minus its own (s/s of its threads'
    sleep in lock and socket/pipe waits: where a rank sits in a collective while a peer is late), less the node's
    own usual gap — a rank can wait more or less than its peers for a whole run (rank 0 serving the rendezvous
    store, its place in the ring): being waited for is a change, like every other piece of evidence. Where NCCL's
    RAS port is read (the ncclras probe), NCCL's own word counts too: a node whose ranks were behind their
    communicator's collective count in most polls, while its peers' mostly were not, is waited for."""
    gap: dict[str, tuple[float, float]]      # node → (peers' median − its own − its usual gap, peers' median)
    behind: dict[str, float] = field(default_factory=dict)   # node → share of its RAS polls with a rank behind

    @classmethod
    def of(cls, values: dict[str, dict[str, float | None]], everyone: "Others",
           usual: "dict[str, float | None] | None" = None) -> "Waits":
        """`usual`: each node's baseline gap (none yet: 0)."""
        gap, behind = {}, {}
        for n, v in values.items():
            x = v.get("wait")
            if x is not None:
                med, _, cnt = everyone.stats("wait", x)
                if cnt:
                    gap[n] = (med - x - ((usual or {}).get(n) or 0.0), med)
            if v.get("ras_behind") is not None:
                behind[n] = v["ras_behind"]
        return cls(gap, behind)

    def raw(self, n: str, usual: float | None) -> float | None:
        """The node's gap before its usual one is taken off (for its baseline)."""
        g = self.gap.get(n)
        return None if g is None else g[0] + (usual or 0.0)

    def waited_for(self, n: str) -> bool:
        return self.waited_by_more_than(n, max(WAITED_S, WAITED_SHARE * self.gap[n][1]) if n in self.gap else 0.0)

    def waited_by_more_than(self, n: str, bound: float) -> bool:
        """The others wait for n by `bound` s/s more than is usual for it, or NCCL says it is behind."""
        g = self.gap.get(n)
        return g is not None and g[0] >= bound or self._behind(n)

    def waiting(self, n: str) -> bool:
        g = self.gap.get(n)
        if g is not None and -g[0] >= max(WAITED_S, WAITED_SHARE * g[1]):
            return True
        return self.behind.get(n) == 0 and any(self._behind(m) for m in self.behind if m != n)

    def _behind(self, n: str) -> bool:
        """NCCL says so: its ranks behind in at least half its polls, its peers' (median) in under a quarter."""
        b = self.behind.get(n)
        if b is None or b < 0.5:
            return False
        peers = sorted(x for m, x in self.behind.items() if m != n)
        return bool(peers) and median_or_zero(peers) < 0.25

    def waited_by(self, n: str) -> list[str]:
        """The other nodes that wait (for n, when n is the one waited for): those that wait more than is usual for
        them against their peers (or that NCCL says are not behind), sorted."""
        return sorted(m for m in self.gap.keys() | self.behind.keys() if m != n and (
            self.waiting(m) or self.gap.get(m, (0.0,))[0] < 0 and not self.waited_for(m)))

    def any_waited_for(self) -> bool:
        return any(self.waited_for(n) for n in self.gap.keys() | self.behind.keys())


class Slice:
    """The newest slice of every node: its figures and their order are read only when a node has a cause over the
    window (most comparisons of a healthy job have none)."""

    def __init__(self, live: dict[str, NodeTrack], start: float, end: float):
        self.live, self.start, self.end = live, start, end
        self.wins: dict[str, Window] | None = None
        self.values: dict[str, dict[str, float | None]] = {}
        self.others: Others | None = None

        self.waits: Waits | None = None

    def _load(self) -> dict[str, Window]:
        if self.wins is None:     # a node with under 60% of the slice covered is left out
            self.wins = {m: w for m, nt in self.live.items()
                         if (w := nt.series.window(self.start, self.end)).wall_s >= 0.6 * (self.end - self.start)}
            self.values = {m: values_of(w) for m, w in self.wins.items()}
            self.others = cpu_shares(self.values, Others(list(self.wins.values()), list(self.values.values())))
        return self.wins

    def causes(self, n: str) -> set[str]:
        wins = self._load()
        if n not in wins or len(wins) < 2:
            return set()
        return {c.name for c in causes(wins[n], self.others, mine=self.values[n])}

    def still(self, n: str, usual: dict[str, float | None]) -> bool:
        """Whether node n's open event holds in the newest slice too (where the slice covers it and a peer): the
        event ends `close_s` after it stops holding there, not once the whole window has forgotten the fault."""
        wins = self._load()
        if n not in wins or len(wins) < 2:
            return True
        if self.waits is None:
            self.waits = Waits.of(self.values, self.others, usual)
        return StragglerWatch._still(n, wins[n], self.others, self.values[n], self.live[n], self.waits)


@dataclass
class JobTrack:
    nodes: dict[str, NodeTrack] = field(default_factory=dict)
    last_eval: float = 0.0
    last_base: float = 0.0


class StragglerWatch:
    def __init__(self, window: float = WINDOW_S, every: float = EVERY_S, slice_s: float = SLICE_S,
                 open_s: float = OPEN_S, close_s: float = CLOSE_S):
        self.window, self.every, self.slice, self.open_s, self.close_s = window, every, slice_s, open_s, close_s
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
            nt.series.add(t, dt, figs)
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
        """(job, node) of the stragglers named now (not the imbalances: no node is at fault)."""
        return [(j, n) for j, jt in self.jobs.items() for n, nt in jt.nodes.items()
                if nt.open_since is not None and nt.kind == "straggler"]

    def _maybe_compare(self, name: str, job: JobTrack) -> list[tuple[str, str, str, dict[str, Any]]]:
        newest = max(nt.series.newest for nt in job.nodes.values())
        live = {n: nt for n, nt in job.nodes.items() if nt.series.newest >= newest - self.window}
        if len(live) < 2:
            return []
        horizon = min(nt.series.newest for nt in live.values())     # every live node has reported up to here
        if horizon - job.last_eval < self.every:
            return []
        job.last_eval = horizon
        wins = {n: w for n, nt in live.items()          # a node with under 60% of the window covered is left out
                if (w := nt.series.window(horizon - self.window, horizon)).wall_s >= 0.6 * self.window}
        if len(wins) < 2:
            return []
        self.evaluations += 1
        events = []
        values = {n: values_of(w) for n, w in wins.items()}
        everyone = cpu_shares(values, Others(list(wins.values()), list(values.values())))
        recent = Slice(live, horizon - self.slice, horizon)
        usual = {n: nt.baseline("gap") for n, nt in live.items()}
        waits = Waits.of(values, everyone, usual)
        someone_waited_for = waits.any_waited_for()
        for n, w in wins.items():
            nt = live[n]
            if nt.open_since is None:
                kind, found = self._verdict(n, w, recent, everyone, values[n], nt, waits, someone_waited_for)
                if kind == "imbalance" and any(m != n and (o.open_since is not None or o.kind == "straggler")
                                               for m, o in live.items()):
                    kind = ""    # another node is (or is becoming) the straggler: this one got the CPU it let go
                if kind and (nt.hold_since is None or kind != nt.kind):
                    nt.hold_since, nt.kind = horizon, kind
                    nt.first_seen = horizon - self.slice      # the first slice in which it held
                if kind:
                    nt.misses = 0
                elif nt.hold_since is not None:
                    nt.misses += 1
                    if nt.misses > MISSES:
                        nt.hold_since, nt.first_seen, nt.kind, nt.misses = None, None, "", 0
                if kind and horizon - nt.hold_since >= self.open_s:
                    nt.open_since, nt.quiet_since = horizon, None
                    nt.causes = tuple(c.name for c in found)
                    if kind == "straggler":
                        self.named += 1
                        events.append((n, name, "straggler", self._body(n, w, wins, found, nt, waits)))
                    else:
                        events.append((n, name, "imbalance", self._imbalance_body(n, w, wins, values[n], nt, waits)))
            elif self._still(n, w, everyone, values[n], nt, waits) and recent.still(n, usual):
                nt.quiet_since = None
            else:
                nt.quiet_since = horizon if nt.quiet_since is None else nt.quiet_since
                if horizon - nt.quiet_since >= self.close_s:
                    end = "straggler_end" if nt.kind == "straggler" else "imbalance_end"
                    what = "back in step with its peers" if nt.kind == "straggler" else "no longer waited for"
                    events.append((n, name, end, {
                        "straggler" if nt.kind == "straggler" else "node": n,
                        "duration_s": round(horizon - (nt.first_seen or nt.open_since), 1),
                        "reason": f"{n} is {what}", "evidence": _evidence(w, wins, n)}))
                    nt.open_since, nt.hold_since, nt.first_seen, nt.kind, nt.causes = None, None, None, "", ()
        # the job in step (nothing open or building up): each node's figures, and its wait gap, join its baseline
        if horizon - job.last_base >= BASE_EVERY_S and \
                all(nt.open_since is None and nt.hold_since is None for nt in live.values()):
            job.last_base = horizon
            for n in wins:
                live[n].in_step({**values[n], "gap": waits.raw(n, usual[n])})
        return events

    def _verdict(self, n: str, w: Window, recent: "Slice", everyone: Others, mine: dict[str, float | None],
                 nt: NodeTrack, waits: Waits, someone_waited_for: bool) -> tuple[str, list[Cause]]:
        """("straggler", its causes), ("imbalance", []) or ("", []) for node n in this comparison.

        A cause must hold over the window and over its newest slice (held for `open_s`, a burst much shorter than
        that names nobody), and must have moved from the node's own
        baseline: a figure that did not change is never evidence (before the node has a baseline, the others must
        be seen waiting for it). A node the others wait for is also named for a
        run-queue wait or a stall that rose over its own baseline even where its peers' are as high (they may share
        its CPU). A node that waits for another while someone is waited for gets no cause at all. A node waited for
        with no cause, whose CPU time rose over its baseline, is the job's own imbalance (more work), not a fault —
        unless another node of the job is a straggler then (the caller: on a shared machine the node took the CPU
        the straggler let go)."""
        found = causes(w, everyone, mine=mine)
        if found:
            fresh = recent.causes(n)
            found = [c for c in found if c.name in fresh]
        waited = waits.waited_for(n)

        def evidence(c: Cause) -> bool:
            key = MOVED[c.name][0]
            base = nt.baseline(key)
            if base is None:        # no baseline yet (a job's first comparisons): only with the others waiting for
                return waited or n not in waits.gap    # it, or where no probe says who waits (no sched figures)
            return moved(c.name, mine[key], base)
        found = [c for c in found if evidence(c)]
        if waited:
            have = {c.name for c in found}
            for key, cause, what in (("runq", "runq", "threads waited {x:.2f} s per s for a CPU (run queue), up "
                                      "from {b:.2f}; peers {m:.2f}"),
                                     ("mem_stall", "memory_pressure", "threads stalled {x:.2f} s per s on memory, "
                                      "up from {b:.2f}; peers {m:.2f}"),
                                     ("io_stall", "io_pressure", "threads stalled {x:.2f} s per s on I/O, up from "
                                      "{b:.2f}; peers {m:.2f}"),
                                     ("reclaim", "memory_reclaim", "threads reclaimed memory {x:.2f} s per s, up "
                                      "from {b:.2f}; peers {m:.2f}")):
                x, b = mine.get(key), nt.baseline(key)
                if cause in have or x is None or b is None or not moved(cause, x, b):
                    continue
                m, _, _ = everyone.stats(key, x)
                if x >= m:
                    found.append(Cause(cause, round(x, 3), round(m, 3),
                                       what.format(x=x, b=b, m=m) + at_limit(cause, mine)))
        if someone_waited_for and waits.waiting(n):
            return "", []                   # it waits for another: whatever else it shows is not why the job is slow
        if found:
            return "straggler", found
        if _more_work(n, mine, nt, waits, 1.0):
            return "imbalance", []
        return "", []

    @staticmethod
    def _still(n: str, w: Window, everyone: Others, mine: dict[str, float | None], nt: NodeTrack,
               waits: Waits) -> bool:
        """Whether an open event still holds, at the lower clearing bounds (hysteresis). A straggler: a cause still
        far from its peers, or — still waited for — one of the causes it was named for still its whole opening
        rise over the node's own baseline (a noisy neighbour, whose peers may be as high; half the rise held a run
        queue settling after the neighbour went). Being waited for
        alone does not hold it: a rank's place in the ring can leave it waiting a little less than its peers for as
        long as the job runs. An imbalance: waited for at least as much as usual, its CPU share and its CPU still
        half their rise (_more_work)."""
        waited = waits.waited_for(n)
        if nt.kind == "imbalance":
            return _more_work(n, mine, nt, waits, 0.5)
        if causes(w, everyone, clearing=True, mine=mine):
            return True
        if not waited:
            return False
        for c in nt.causes:
            if c not in MOVED:
                continue
            x, base = mine.get(MOVED[c][0]), nt.baseline(MOVED[c][0])
            if x is not None and base is not None and moved(c, x, base):
                return True
        return False

    def _body(self, n: str, w: Window, wins: dict[str, Window], found: list[Cause], nt: NodeTrack,
              waits: Waits) -> dict[str, Any]:
        ev = _evidence(w, wins, n)
        text = "; ".join(c.text for c in found)
        waited = ev.get("peers_wait_s_per_s", 0) - ev.get("wait_s_per_s", 0)
        if waited > 0.05:
            text += f"; the other nodes' threads waited {waited:.2f} s/s more than its own"
        return {"straggler": n, "verdict": "node", "causes": [c.name for c in found], "reason": f"{n}: {text}",
                "since": round(nt.first_seen or 0.0, 3), "nodes": sorted(wins),
                "waited_by": waits.waited_by(n),
                "evidence": {**ev, **{c.name: {"value": c.value, "peers": c.peers} for c in found}}}

    def _imbalance_body(self, n: str, w: Window, wins: dict[str, Window], mine: dict[str, float | None],
                        nt: NodeTrack, waits: Waits) -> dict[str, Any]:
        ev = _evidence(w, wins, n)
        cpu, base = mine.get("cpu") or 0.0, nt.baseline("cpu") or 0.0
        share, sbase = mine.get("cpu_share") or 0.0, nt.baseline("cpu_share") or 0.0
        waited = waits.gap.get(n, (0.0, 0.0))[0]
        return {"node": n, "verdict": "imbalance", "since": round(nt.first_seen or 0.0, 3), "nodes": sorted(wins),
                "reason": f"{n} has more work than its peers (the job's own imbalance, not its node): its CPU rose "
                          f"to {cpu:.2f} cores from {base:.2f} ({share:.2f}x its peers', usually {sbase:.2f}x) "
                          f"with nothing on its node changed, and the others' threads waited {waited:.2f} s/s more "
                          f"than its own",
                "waited_by": waits.waited_by(n),
                "evidence": {**ev, "cpu_cores_baseline": round(base, 4), "cpu_share": round(share, 3),
                             "cpu_share_baseline": round(sbase, 3)}}


def _more_work(n: str, mine: dict[str, float | None], nt: NodeTrack, waits: Waits, part: float) -> bool:
    """The job's own imbalance on node n: the others wait for it more than is usual (by WAITED_S; at least as much
    as usual, `part` < 1: while it holds), its CPU over its peers' median `part` of IMBALANCE_SHARE's rise over its
    usual ratio, and its own CPU `part` of IMBALANCE_CPU's over its baseline. Without a usual ratio or CPU yet: no."""
    share, sbase, cpu, base = mine.get("cpu_share"), nt.baseline("cpu_share"), mine.get("cpu"), nt.baseline("cpu")
    if share is None or not sbase or cpu is None or not base:
        return False
    return waits.waited_by_more_than(n, WAITED_S if part >= 1 else 0.0) and \
        share >= (1 + (IMBALANCE_SHARE - 1) * part) * sbase and cpu >= (1 + (IMBALANCE_CPU - 1) * part) * base


def _evidence(w: Window, wins: dict[str, Window], me: str) -> dict[str, float]:
    """The node's rates beside its peers' medians, for every figure it has (only for the node named: O(n))."""
    peers = [p for m, p in wins.items() if m != me]
    out: dict[str, float] = {}
    for k, scale, name in (("cpu_ns", 1e9, "cpu_cores"), ("throttled_ns", 1e9, "throttled_share"),
                           ("runq_ns", 1e9, "runq_s_per_s"), ("wait_ns", 1e9, "wait_s_per_s"),
                           ("tx_bytes", 1, "tx_bytes_per_s"), ("rx_bytes", 1, "rx_bytes_per_s"),
                           ("retrans", 1, "retransmits_per_s"), ("nic_held", 1, "nic_queue_held_per_s"),
                           ("nic_drops", 1, "nic_drops_per_s"), ("mem_stall_ns", 1e9, "mem_stall_s_per_s"),
                           ("io_stall_ns", 1e9, "io_stall_s_per_s"), ("reclaim_ns", 1e9, "reclaim_s_per_s")):
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
