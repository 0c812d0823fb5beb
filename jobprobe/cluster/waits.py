# SPDX-License-Identifier: Apache-2.0
"""Who waits for whom: in one comparison of a job's nodes (jobprobe/cluster/stragglers.py), each node's threads'
sleep in lock and socket/pipe waits (`sched.offcpu_lock_ns + offcpu_wait_ns`: where a rank sits in a collective
while a peer is late) against its peers' median, less its own usual gap; and, where NCCL's RAS port is polled, NCCL's
own word on which ranks are behind."""
from __future__ import annotations

from functools import cached_property

import numpy as np

from jobprobe.cluster.peers import Table

# the signature of being waited for: the peers' median wait over the node's, in s of thread sleep per s, at least
WAITED_S = 0.05
WAITED_SHARE = 0.05       # ... and this share of the peers' median wait (a median mostly of threads that always sleep)
SLOWER_S = 0.2            # a node waited for that waits this much more than the least-waiting node waited for (s/s)
SLOWER_SHARE = 1 / 3      # ... and this share of its own gap, waits for that one: it is not the bottleneck


class Waits:
    """Who waits for whom in one comparison: per node, its peers' median wait minus its own (s/s of its threads'
    sleep in lock and socket/pipe waits: where a rank sits in a collective while a peer is late), less the node's
    own usual gap — a rank can wait more or less than its peers for a whole run (rank 0 serving the rendezvous
    store, its place in the ring): being waited for is a change, like every other piece of evidence. Where NCCL's
    RAS port is read (the ncclras probe), NCCL's own word counts too: a node whose ranks were behind their
    communicator's collective count in most polls, while its peers' mostly were not, is waited for. Read for every
    node of a comparison's table at once (NaN: no such figure); part() is one job's, by node name."""
    names: list[str]
    rows: dict[str, int]

    def __init__(self, t: Table, usual: np.ndarray):
        """`usual`: each node's baseline gap (NaN: none yet, 0)."""
        x = t.col("wait")
        med, _, cnt = t.order("wait")
        u = np.where(np.isnan(usual), 0.0, usual)
        self.gaps, self.med, self.x = np.where(cnt > 0, med - x - u, np.nan), med, x
        self.raw = self.gaps + u                      # the gap before its usual one is taken off (its baseline's)
        self.ras = t.col("ras_behind")                # the share of its RAS polls with a rank behind
        self.behind = self.ras >= 0.5                 # NCCL says so: behind in half its polls or more, ...
        if self.behind.any():
            bmed, _, bcnt = t.order("ras_behind")     # ... its peers' (median) in under a quarter
            self.behind &= (bcnt > 0) & (bmed < 0.25)
        self.behind_peers = np.add.reduceat(self.behind, t.starts, dtype=np.int64)[t.seg] - self.behind
        self.bound = np.maximum(WAITED_S, WAITED_SHARE * med)
        self.is_waited = (self.gaps >= self.bound) | self.behind
        self.starts, self.seg = t.starts, t.seg

    def part(self, j: int, names: list[str], rows: dict[str, int]) -> "Waits":
        """Job j's (`names`, and each name's place among them)."""
        w = object.__new__(Waits)
        at = slice(int(self.starts[j]), int(self.starts[j]) + len(names))
        for k in ("gaps", "med", "x", "raw", "ras", "behind", "behind_peers", "bound", "is_waited"):
            setattr(w, k, getattr(self, k)[at])
        w.names, w.rows = names, rows
        w.starts, w.seg = np.zeros(1, dtype=np.int64), np.zeros(len(names), dtype=np.int64)   # one job
        return w

    @cached_property
    def is_waiting(self) -> np.ndarray:
        """Waits for a peer: more than its peers' median by the bound, or NCCL says a peer is behind, or — waited for
        itself, where several are — it waits SLOWER_S more than the least-waiting of those, each against its own
        usual (a rank slowed, but keeping up with a slower one: that one is the bottleneck, not it)."""
        x = self.med - self.gaps                 # its wait less its usual excess over its peers (x + its usual gap)
        waited_x = np.where(self.is_waited & ~np.isnan(x), x, np.inf)
        least = np.minimum.reduceat(waited_x, self.starts)[self.seg]     # each job's
        behind = self.is_waited & np.isfinite(least) & \
            (np.nan_to_num(x, nan=-np.inf) - least >= np.maximum(SLOWER_S, SLOWER_SHARE * self.gaps))
        return (-self.gaps >= self.bound) | ((self.ras == 0) & (self.behind_peers > 0)) | behind

    @cached_property
    def gap(self) -> dict[str, tuple[float, float]]:
        """node → (peers' median − its own − its usual gap, peers' median), for the nodes with a wait figure."""
        return {self.names[r]: (float(self.gaps[r]), float(self.med[r]))
                for r in np.flatnonzero(~np.isnan(self.gaps)).tolist()}

    def has_gap(self, n: str) -> bool:
        return not np.isnan(self.gaps[self.rows[n]])

    def gap_of(self, n: str) -> float:
        """The node's gap (0 without a wait figure)."""
        g = self.gaps[self.rows[n]]
        return 0.0 if np.isnan(g) else float(g)

    def waited_for(self, n: str) -> bool:
        return bool(self.is_waited[self.rows[n]])

    def knows(self, n: str) -> bool:
        """Whether a figure says who waits for n (a wait figure, or a poll of NCCL's RAS port)."""
        r = self.rows[n]
        return not (np.isnan(self.gaps[r]) and np.isnan(self.ras[r]))

    def waited_by_more_than(self, n: str, bound: float) -> bool:
        """The others wait for n by `bound` s/s more than is usual for it, or NCCL says it is behind."""
        r = self.rows[n]
        return bool(self.gaps[r] >= bound or self.behind[r])

    def waiting(self, n: str) -> bool:
        return bool(self.is_waiting[self.rows[n]])

    def waited_by(self, n: str) -> list[str]:
        """The other nodes that wait (for n, when n is the one waited for): those that wait more than is usual for
        them against their peers (or that NCCL says are not behind), sorted. Where none does, though n's peers
        wait for it more than usual (its gap above 0: a peer that always waits most, rank 0 serving the rendezvous
        store, waits a little less than its usual most while n is slow), those that waited longer than n."""
        r = self.rows[n]
        by = (~np.isnan(self.gaps) | ~np.isnan(self.ras)) & (self.is_waiting | (self.gaps < 0) & ~self.is_waited)
        by[r] = False
        if not by.any() and self.gaps[r] > 0:
            by = ~np.isnan(self.gaps) & (self.x > self.x[r])
            by[r] = False
        return sorted(self.names[m] for m in np.flatnonzero(by).tolist())

    def any_waited_for(self) -> bool:
        return bool(self.is_waited.any())
