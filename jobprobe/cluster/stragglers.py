# SPDX-License-Identifier: Apache-2.0
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
- **the verdict** — `straggler` (verdict "node": a fault of its node, with its causes) or `imbalance` (no cause
  moved; over the newest slice its CPU over its peers' median rose 1.18x over its usual ratio, its own CPU 1.05x
  its baseline, and the others waited for it at least as usual; over the window a third of both rises: the job gave
  it more work — not its node's fault; on a machine the ranks share, its peers' CPU falls as its own rises, so the
  ratio moves where its own CPU alone hardly does. The slice decides because a 10 s window takes 10 s to fill
  with a change that is the same every step after it); each names the nodes that waited for it. A node waited for
  0.3 s/s beyond its usual gap, doing less than usual (its CPU at most 0.8 of its own) with no cause moved — or
  whose threads are stopped (SIGSTOP, a debugger: whatever else moved follows from that) — is a `straggler` of
  cause `unknown`, after 6 s, its reason saying what its threads did: paused, blocked in the kernel, or nothing
  seen (a GPU, a link, a bug no probe of the node reads); it ends when the others wait for it less than half that.

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

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobprobe.cluster.causes import (
    MOVED,
    STALL_FIGURES,
    STALL_RISES,
    STOPPED_SHARE,
    WAITED_STALLS,
    Cause,
    Others,
    Window,
    at_least,
    at_limit,
    causes,
    could_name,
    evidence,
    figures,
    imbalance_body,
    moved,
    straggler_body,
    unknown_cause,
)
from jobprobe.cluster.peers import BASE_ROW, Part, Sums, Table
from jobprobe.cluster.waits import WAITED_S, Waits

WINDOW_S = 10.0
STRAGGLER_KINDS = ("straggler", "unknown")   # a node's open event that is a `straggler` (unknown: its cause)
EVERY_S = 1.0             # a decision every tick, over the window and its newest slice
SLICE_S = 3.0             # the newest slice, in which a cause must hold too (not only in the window's average)
OPEN_S = 4.0              # held this long (one comparison's miss forgiven): a burst of 2 s names nobody
CLOSE_S = 3.0             # an open event ends after this long without it (at the lower clearing bounds)
MISSES = 1                # comparisons without it that do not break a hold (a noisy second)
UNKNOWN_GAP = 0.3         # a node the others wait for this much more than usual (s/s), with no cause moved and ...
UNKNOWN_CPU = 0.8         # ... its CPU at most this share of its usual (doing less, not more: not the job's own
                          # imbalance, whose CPU rises) is named with cause `unknown` (unknown_cause says what its
UNKNOWN_OPEN_S = 6.0      # threads did instead), once it held this long: longer than a cause, which says more
BASE_EVERY_S = 5.0        # a node's figures join its baseline this often while the job is in step
KEEP_S = 60.0             # frames kept per node (a little more than a window, for late nodes)
IMBALANCE_SHARE = 1.18    # a node waited for, whose CPU over its peers' median rose this much over its usual
                          # ratio, its own CPU up too, nothing else moved: more work (a rank given 1.5x the batch on
                          # a 2-core machine three ranks share: its CPU 1.12-1.19x, its peers' down 3-8%, the ratio
                          # 1.17-1.35x; in step it wandered to 1.16-1.18x a few times in 35 recorded trials)
IMBALANCE_CPU = 1.05      # ... its own CPU at least this much over its baseline (not only its peers' fallen)
IMBALANCE_WINDOW = 1 / 3  # both over the newest slice, the others waiting for it there at least as usual; over the
                          # window (which takes 10 s to fill with the change) this part of the two rises, and the
IMBALANCE_WAIT = -WAITED_S  # others' wait for it not below usual by more than its noise (the gap wanders +-0.1 s/s
                          # in 3 s slices in step; a window 0.07 s/s under its baseline gap held one naming 6 s)

BASELINE_N = 12           # a node's own baseline: the median of its last 12 (one a minute) while the job was in step
HELD = 8                  # a job of one node is never compared: only its newest frames are held (none summed), so
                          # that a second node's first comparison has them; ~4 KiB a one-node job (ARCHITECTURE.md)


@dataclass
class NodeTrack:
    sums: Sums                # its job's arrays: its frames' running sums and its baseline are its row's
    row: int
    hold_since: float | None = None   # the first comparison of the current hold (a cause, or for "imbalance",
    misses: int = 0                    # more work); comparisons in a row without it, while holding
    quiet_since: float | None = None  # while open: the first comparison of the current stretch without it
    open_since: float | None = None
    first_seen: float | None = None
    kind: str = ""            # what the streak or the open event is: "straggler" (a node fault) or "imbalance"
    causes: tuple = ()        # the causes an open straggler was named for

    def baseline(self, k: str) -> float | None:
        """The node's own usual value of figure k (None until 3 comparisons in step have been seen): the median of
        its last BASELINE_N."""
        return self.sums.baseline(self.row, k)


class Slice:
    """The newest slice of every node of a job: its windows, figures and their order are read only when a node has
    a cause over the window, or an event is open (most comparisons of a healthy job have neither)."""

    def __init__(self, job: "JobTrack", live: np.ndarray, start: float, end: float, usual: np.ndarray):
        self.job, self.live, self.start, self.end, self.usual = job, live, start, end, usual
        self.table: Part | None = None
        self.waits: Waits | None = None

    def _load(self, n: str) -> tuple[Part, int | None]:
        """The slice's nodes, and node n's place among them (None where n is not compared, or has no peer)."""
        sums = self.job.sums
        if self.table is None:    # a node with under 60% of the slice covered is left out
            t = sums.table(self.start, self.end, self.live, 0.6 * (self.end - self.start))
            self.table, self.waits = t.part(0, sums), Waits(t, self.usual).part(0, sums.names, sums.rows)
        r = sums.rows[n]
        return self.table, r if self.table.member[r] and self.table.count >= 2 else None

    def causes(self, n: str) -> set[str]:
        t, r = self._load(n)
        return set() if r is None else {c.name for c in causes(t.window(r), t, mine=t.values(r))}

    def more_work(self, n: str, nt: NodeTrack) -> bool:
        """Whether the job's own imbalance on node n holds in the newest slice (the whole of both rises there; the
        others waiting for it there too, where the slice says who waits: a slice may hold no poll of NCCL's)."""
        t, r = self._load(n)
        return r is not None and _more_work(n, t.values(r), nt, self.waits if self.waits.knows(n) else None, 1.0,
                                            0.0)

    def figures(self, n: str) -> tuple[dict[str, float | None], float, list[str]]:
        """Node n's figures over the slice, its wait gap there and who waited (its event quotes what decided)."""
        t, r = self._load(n)
        return t.values(r), self.waits.gap_of(n), self.waits.waited_by(n)

    def still(self, n: str) -> bool:
        """Whether node n's open event holds in the newest slice too (where the slice covers it and a peer): the
        event ends `close_s` after it stops holding there, not once the whole window has forgotten the fault."""
        t, r = self._load(n)
        return r is None or StragglerWatch._still(n, t.window(r), t, t.values(r), self.job.nodes[n], self.waits)


@dataclass
class JobTrack:
    sums: Sums = field(default_factory=lambda: Sums(KEEP_S, BASELINE_N))    # its nodes' frames and baselines
    nodes: dict[str, NodeTrack] = field(default_factory=dict)
    last_eval: float = 0.0
    last_base: float = 0.0
    busy: set[int] = field(default_factory=set)    # the rows of its nodes holding a verdict or with an event open
    calm_from: float = 0.0    # the first horizon whose window holds nothing of the last time one was busy
    held: list = field(default_factory=list)        # frames not summed yet: (row, t, dt, figures)


class StragglerWatch:
    trace_all = False         # every compared node's verdict taken (_verdict called), not only where one can hold

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
        taken: dict[str, list[tuple[int, float, float, dict]]] = {}     # job → (row, t, dt, figures)
        try:
            for fr in frames:
                if fr.get("kind") != "sample" or not isinstance(fr.get("probes"), dict):
                    continue
                try:
                    t, dt, figs = float(fr["t"]), float(fr.get("dt") or 0.0), figures(fr["probes"])
                except (TypeError, ValueError, KeyError, AttributeError) as err:   # a frame it cannot read: skipped,
                    self.unreadable += 1                                              # counted; the others go on
                    self.last_unreadable = f"{type(err).__name__}: {err}"[:200]
                    continue
                name, node = fr["job"], fr["node"]
                job = self.jobs.get(name) or self.jobs.setdefault(name, JobTrack())
                nt = job.nodes.get(node) or job.nodes.setdefault(node, NodeTrack(job.sums, job.sums.row(node)))
                taken.setdefault(name, []).append((nt.row, t, dt, figs))
        finally:
            for name, got in taken.items():
                job = self.jobs[name]
                if len(job.nodes) == 1:
                    job.held = (job.held + got)[-HELD:]
                    continue
                job.sums.add(job.held + got)
                job.held = []
        return self._compare([(name, self.jobs[name]) for name in taken])

    def keep_only(self, jobs: set[str]) -> None:
        """Forget the tracks of jobs not in `jobs` (the controller's jobs seen lately): bounded state."""
        for name in [j for j in self.jobs if j not in jobs]:
            del self.jobs[name]

    def open(self) -> list[tuple[str, str]]:
        """(job, node) of the stragglers named now (not the imbalances: no node is at fault)."""
        return [(j, n) for j, jt in self.jobs.items() for n, nt in jt.nodes.items()
                if nt.open_since is not None and nt.kind in STRAGGLER_KINDS]

    def _compare(self, jobs: list[tuple[str, JobTrack]]) -> list[tuple[str, str, str, dict[str, Any]]]:
        """Compare each of these jobs whose every live node has reported a tick more (`every`) since its last
        comparison — all of them side by side, in one table — and decide, node by node, where something can
        change: returns the events."""
        jobs = [(name, job) for name, job in jobs if len(job.nodes) >= 2]
        if not jobs:
            return []
        sizes = [len(job.nodes) for _, job in jobs]
        newest = np.concatenate([job.sums.newest[:m] for (_, job), m in zip(jobs, sizes)])
        starts = np.cumsum([0] + sizes[:-1])
        seg = np.repeat(np.arange(len(jobs)), sizes)
        live = newest >= (np.maximum.reduceat(newest, starts) - self.window)[seg]
        horizons = np.minimum.reduceat(np.where(live, newest, np.inf), starts).tolist()  # all live have come to it
        due = []
        counts = np.add.reduceat(live, starts, dtype=np.int64).tolist()
        for i, ((_, job), n, horizon) in enumerate(zip(jobs, counts, horizons)):
            if n >= 2 and horizon - job.last_eval >= self.every:
                job.last_eval = horizon
                due.append(i)
        if not due:
            return []
        parts = [jobs[i][1].sums.window(horizons[i] - self.window, horizons[i]) for i in due]
        at = [slice(starts[i], starts[i] + sizes[i]) for i in due]
        wins = Table(np.concatenate([d for d, _ in parts], axis=1), np.concatenate([ab for _, ab in parts], axis=1),
                     np.concatenate([live[a] for a in at]), 0.6 * self.window, [sizes[i] for i in due])
        base = np.concatenate([jobs[i][1].sums.base[:, :sizes[i]] for i in due], axis=1)
        waits = Waits(wins, base[BASE_ROW["gap"]])
        look = wins.member.copy() if self.trace_all else wins.member & self._may_hold(wins, waits, base)
        for j, i in enumerate(due):             # the nodes whose state can change: every other one's verdict is nothing
            if jobs[i][1].busy:
                look[[wins.starts[j] + r for r in jobs[i][1].busy]] = True
        look &= wins.member
        seen = np.flatnonzero(look)
        by_job = np.split(seen - wins.starts[wins.seg[seen]], np.searchsorted(wins.seg[seen], np.arange(1, len(due))))
        events = []
        for j, i in enumerate(due):
            if wins.counts[j] < 2:          # under 60% of the window covered: left out
                continue
            self.evaluations += 1
            name, job = jobs[i]
            events += self._decide(name, job, wins, waits, j, live[at[j]], horizons[i], by_job[j].tolist())
        return events

    def _decide(self, name: str, job: JobTrack, table: Table, all_waits: Waits, j: int, live: np.ndarray,
                horizon: float, look: list[int]) -> list[tuple[str, str, str, dict[str, Any]]]:
        """One job's comparison (job j of the table; `live`: which of its nodes are), node by node for the nodes
        in `look`; then, with the job in step, its nodes' figures join their baselines."""
        events = []
        sums = job.sums
        if look:
            wins, waits = table.part(j, sums), all_waits.part(j, sums.names, sums.rows)
            someone_waited_for = waits.any_waited_for()
            recent = Slice(job, live, horizon - self.slice, horizon, sums.baselines("gap"))
        for r in look:
            n, w, mine = sums.names[r], wins.window(r), wins.values(r)
            nt = job.nodes[n]
            deferred = False
            if nt.open_since is None:
                kind, found = self._verdict(n, w, recent, wins, mine, nt, waits, someone_waited_for)
                if kind == "imbalance" and any(m != r and live[m] and ((o := job.nodes[sums.names[m]]).open_since
                                                                       is not None or o.kind in STRAGGLER_KINDS)
                                               for m in job.busy):
                    # another node is (or is becoming) the straggler: this one may have got the CPU it let go — not
                    # named now, and not in step either (its figures must not join its baseline: once the straggler
                    # ended, a rank given more work in its wake had its bigger CPU learnt as usual, never named)
                    kind, deferred = "", True
                if kind and (nt.hold_since is None or kind != nt.kind):
                    nt.hold_since, nt.kind = horizon, kind
                    nt.first_seen = horizon - self.slice      # the first slice in which it held
                if kind:
                    nt.misses = 0
                elif nt.hold_since is not None:
                    nt.misses += 1
                    if nt.misses > MISSES:
                        nt.hold_since, nt.first_seen, nt.kind, nt.misses = None, None, "", 0
                if kind and horizon - nt.hold_since >= (UNKNOWN_OPEN_S if kind == "unknown" else self.open_s):
                    nt.open_since, nt.quiet_since = horizon, None
                    nt.causes = tuple(c.name for c in found)
                    if kind in STRAGGLER_KINDS:
                        self.named += 1
                        events.append((n, name, "straggler", straggler_body(n, w, wins.windows(), found,
                                                                            nt.first_seen, waits.waited_by(n))))
                    else:
                        now, gap, by = recent.figures(n)
                        events.append((n, name, "imbalance", imbalance_body(
                            n, w, wins.windows(), now, nt.first_seen, nt.baseline("cpu"), nt.baseline("cpu_share"),
                            gap, by, self.slice)))
            elif self._still(n, w, wins, mine, nt, waits) and recent.still(n):
                nt.quiet_since = None
            else:
                nt.quiet_since = horizon if nt.quiet_since is None else nt.quiet_since
                if horizon - nt.quiet_since >= self.close_s:
                    end = "straggler_end" if nt.kind in STRAGGLER_KINDS else "imbalance_end"
                    what = "back in step with its peers" if nt.kind in STRAGGLER_KINDS else "no longer waited for"
                    events.append((n, name, end, {
                        "straggler" if nt.kind in STRAGGLER_KINDS else "node": n,
                        "duration_s": round(horizon - (nt.first_seen or nt.open_since), 1),
                        "reason": f"{n} is {what}", "evidence": evidence(w, wins.windows(), n)}))
                    nt.open_since, nt.hold_since, nt.first_seen, nt.kind, nt.causes = None, None, None, "", ()
            (job.busy.add if nt.open_since is not None or nt.hold_since is not None or deferred
             else job.busy.discard)(r)
        # the job in step (nothing open or building up, nor in the window the figures are of): each node's
        # figures, and its wait gap, join its baseline — an episode's end comes while its tail is in the window
        if any(live[r] for r in job.busy):
            job.calm_from = horizon + self.window
        elif horizon - job.last_base >= BASE_EVERY_S and horizon >= job.calm_from:
            job.last_base = horizon
            at = slice(int(table.starts[j]), int(table.starts[j]) + len(sums.names))
            rows = np.flatnonzero(table.member[at])
            sums.in_step(rows, np.vstack([table.vals[:, at][:, rows], all_waits.raw[at][rows]]))
        return events

    @staticmethod
    def _may_hold(t: Table, waits: Waits, base: np.ndarray) -> np.ndarray:
        """The nodes whose verdict (_verdict) may be something, read from the arrays for all nodes at once (a
        superset, each bound a hair wide): a cause over the window (could_name); waited for, with one of
        WAITED_STALLS up from its baseline (`base`: every node's, BASE's rows) and at its peers' median or more;
        more work (_more_work)."""
        x = t.cols(STALL_FIGURES)
        up = at_least(x - base[[BASE_ROW[k] for k in STALL_FIGURES]], STALL_RISES) & waits.is_waited
        some = up.any(1)
        stall = (up[some] & at_least(x[some], t.orders(tuple(np.array(STALL_FIGURES)[some]))[0])).any(0) \
            if some.any() else np.zeros(x.shape[1], bool)
        sbase, cbase = base[BASE_ROW["cpu_share"]], base[BASE_ROW["cpu"]]
        work = (sbase != 0) & (cbase != 0) & (at_least(waits.gaps, IMBALANCE_WAIT) | waits.behind) & \
            at_least(t.col("cpu_share"), (1 + (IMBALANCE_SHARE - 1) * IMBALANCE_WINDOW) * sbase) & \
            at_least(t.col("cpu"), (1 + (IMBALANCE_CPU - 1) * IMBALANCE_WINDOW) * cbase)
        # waited for by UNKNOWN_GAP more than usual, its CPU down to UNKNOWN_CPU of its own: a cause `unknown`
        stuck = (np.nan_to_num(waits.gaps, nan=-1.0) >= 0.99 * UNKNOWN_GAP) & (cbase > 0) & \
            (np.nan_to_num(t.col("cpu"), nan=np.inf) <= 1.01 * UNKNOWN_CPU * cbase)
        return could_name(t) | stall | work | stuck

    def _verdict(self, n: str, w: Window, recent: "Slice", everyone: Others, mine: dict[str, float | None],
                 nt: NodeTrack, waits: Waits, someone_waited_for: bool) -> tuple[str, list[Cause]]:
        """("straggler", its causes), ("imbalance", []) or ("", []) for node n in this comparison.

        A cause must hold over the window and over its newest slice (held for `open_s`, a burst much shorter than
        that names nobody), and must have moved from the node's own
        baseline: a figure that did not change is never evidence (before the node has a baseline, the others must
        be seen waiting for it). A node the others wait for is also named for a
        run-queue wait or a stall that rose over its own baseline even where its peers' are as high (they may share
        its CPU). A node that waits for another while someone is waited for gets no cause at all. A node waited for
        with no cause, whose CPU time and CPU share rose over their baselines (over the newest slice, and a third as
        much over the window), is the job's own imbalance (more work), not a fault —
        unless another node of the job is a straggler then (the caller: on a shared machine the node took the CPU
        the straggler let go)."""
        found = causes(w, everyone, mine=mine)
        if found:
            fresh = recent.causes(n)
            found = [c for c in found if c.name in fresh]
        waited = waits.waited_for(n)

        def is_evidence(c: Cause) -> bool:
            key = MOVED[c.name][0]
            base = nt.baseline(key)
            if base is None:        # no baseline yet (a job's first comparisons): only with the others waiting for
                return waited or not waits.has_gap(n)  # it, or where no probe says who waits (no sched figures)
            return moved(c.name, mine[key], base)
        found = [c for c in found if is_evidence(c)]
        if waited:
            have = {c.name for c in found}
            for key, cause, what in WAITED_STALLS:
                x, b = mine.get(key), nt.baseline(key)
                if cause in have or x is None or b is None or not moved(cause, x, b):
                    continue
                m, _, _ = everyone.stats(key, x)
                if x >= m:
                    found.append(Cause(cause, round(x, 3), round(m, 3),
                                       what.format(x=x, b=b, m=m) + at_limit(cause, mine)))
        if someone_waited_for and waits.waiting(n):
            return "", []                   # it waits for another: whatever else it shows is not why the job is slow
        if waited and (mine.get("stopped") or 0.0) >= STOPPED_SHARE and waits.waited_by_more_than(n, UNKNOWN_GAP):
            # its threads stopped (SIGSTOP, a debugger): what else moved — its GPU idle, its traffic gone — follows
            return "unknown", [unknown_cause(mine, nt.baseline, waits.gap_of(n))]
        if found:
            return "straggler", found
        if _more_work(n, mine, nt, waits, IMBALANCE_WINDOW, IMBALANCE_WAIT) and recent.more_work(n, nt):
            return "imbalance", []
        cpu, usual = mine.get("cpu"), nt.baseline("cpu")
        if waited and waits.waited_by_more_than(n, UNKNOWN_GAP) and cpu is not None and usual and \
                cpu <= UNKNOWN_CPU * usual:
            # everyone waits for it and it does less than usual, and no figure of its node says why: named all the
            # same, with what its threads were doing instead (paused, blocked in the kernel, or nothing seen)
            return "unknown", [unknown_cause(mine, nt.baseline, waits.gap_of(n))]
        return "", []

    @staticmethod
    def _still(n: str, w: Window, everyone: Others, mine: dict[str, float | None], nt: NodeTrack,
               waits: Waits) -> bool:
        """Whether an open event still holds, at the lower clearing bounds (hysteresis). A straggler: one of the
        causes it was named for still far from its peers; or, still waited for, any cause far from its peers, or
        one it was named for still its whole opening rise over the node's own baseline (a noisy neighbour, whose
        peers may be as high; half the rise held a run queue settling after the neighbour went). Being waited for
        alone does not hold it: a rank's place in the ring can leave it waiting a little less than its peers for as
        long as the job runs. Nor does another cause once it waits for its peers: a node whose slow reads were
        gone, waiting for a peer's slow GPU, was kept open 30 s for its GPU's utilization below that peer's (what
        waiting looks like). An imbalance: waited for at least as much as usual, its CPU share and its CPU still
        half their rise (_more_work)."""
        waited = waits.waited_for(n)
        if nt.kind == "imbalance":
            return _more_work(n, mine, nt, waits, 0.5, 0.0)
        if nt.kind == "unknown":        # nothing else holds it: still waited for, at half the bound that named it
            return waits.waited_by_more_than(n, UNKNOWN_GAP / 2)
        found = causes(w, everyone, clearing=True, mine=mine)
        if any(c.name in nt.causes for c in found) or (waited and found):
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


def _more_work(n: str, mine: dict[str, float | None], nt: NodeTrack, waits: Waits | None, part: float,
               waited: float) -> bool:
    """The job's own imbalance on node n: the others wait for it `waited` s/s more than is usual (0: at least as
    much as usual; not asked without `waits`), its CPU over its peers' median `part` of IMBALANCE_SHARE's rise over
    its usual ratio, and its own CPU `part` of IMBALANCE_CPU's over its baseline. Without a usual ratio or CPU yet:
    no."""
    share, sbase, cpu, base = mine.get("cpu_share"), nt.baseline("cpu_share"), mine.get("cpu"), nt.baseline("cpu")
    if share is None or not sbase or cpu is None or not base:
        return False
    return (waits is None or waits.waited_by_more_than(n, waited)) and \
        share >= (1 + (IMBALANCE_SHARE - 1) * part) * sbase and cpu >= (1 + (IMBALANCE_CPU - 1) * part) * base
