# SPDX-License-Identifier: Apache-2.0
"""A job's nodes side by side, as arrays (numpy), for jobprobe/cluster/stragglers.py: each node's frames as running
sums and its baseline (Sums), and a comparison — a window of every node of one job or of several jobs at once, its
figures and each figure's order across a job's nodes (Table; Part: one job's, by node name). A comparison is a few
array operations over all the nodes compared, whatever their number; Python objects (a Window, a node's figures) are
made only for the nodes a decision is taken on."""
from __future__ import annotations

import numpy as np

from jobprobe.cluster.causes import FIGURES, SUMMED, VALUES, Others, Window

KEYS = SUMMED + ("limit",)              # a frame's figures, as read into a row
NS = len(SUMMED)
WIDTH = 1 + 2 * NS                      # a running sum: wall time, each figure's sum, how many frames carried it
COLUMNS = FIGURES + ("cpu_share",)      # a table's figures: values_of's, and the CPU over the peers' median
BASE = COLUMNS + ("gap",)               # a baseline's: those, and how much less than its peers the node waited
_SUM = {k: i for i, k in enumerate(SUMMED)}
_COL = {k: i for i, k in enumerate(COLUMNS)}
BASE_ROW = {k: i for i, k in enumerate(BASE)}     # a figure's row in Sums.base
_RATE = [(j, _SUM[k], scale) for j, (_, k, per, scale) in enumerate(VALUES) if per is None]   # values_of's per_s
_SHARE = [(j, _SUM[k], _SUM[per]) for j, (_, k, per, _) in enumerate(VALUES) if per is not None]  # and its shares
_RJ, _RK, _RS = (np.array(x) for x in zip(*_RATE))
_SJ, _SK, _SP = (np.array(x) for x in zip(*_SHARE))


class Sums:
    """A job's nodes' frames in time order, each node's kept `keep` s: per node (a row) and frame, its time, the
    running sums of every figure up to and with that frame (a window is the difference of two frames' sums) and the
    CPU limit it said (NaN: none). Position `lo - 1` of a row holds the sums of the frames no longer kept (its base;
    position 0 is all zeros), `lo` to `hi - 1` the frames kept. Also each node's history of figures in comparisons
    in which its job was in step (the last `history`), and its baseline: their medians."""

    def __init__(self, keep: float, history: int):
        self.keep, self.history = keep, history
        self.names: list[str] = []
        self.rows: dict[str, int] = {}
        self._resize(0, 8)          # grown as nodes and frames come: a job of one node has no row (stragglers.HELD)

    def row(self, name: str) -> int:
        """The node's row (a new one for a node not seen before)."""
        r = self.rows.get(name)
        if r is None:
            r = self.rows[name] = len(self.names)
            self.names.append(name)
            if r >= len(self.lo) and r:      # a job's first node alone has no row yet: it is never compared
                self._resize(max(2, 2 * r), self.t.shape[1])
        return r

    def _resize(self, rows: int, depth: int) -> None:
        """Room for `rows` nodes of `depth` frames each, what is held kept."""
        grown = {"t": np.full((rows, depth), np.inf), "c": np.zeros((rows, depth, WIDTH)),
                 "own": np.full((rows, depth), np.nan), "lo": np.ones(rows, np.int64),
                 "hi": np.ones(rows, np.int64), "newest": np.zeros(rows),
                 "hist": np.full((rows, self.history, len(BASE)), np.nan), "hp": np.zeros(rows, np.int64),
                 "base": np.full((len(BASE), rows), np.nan)}
        grown["t"][:, 0] = -np.inf
        if "t" in self.__dict__:
            n, d = self.t.shape
            for name, a in grown.items():
                at = (slice(n), slice(d)) if name in ("t", "c", "own") else \
                    (slice(None), slice(n)) if name == "base" else slice(n)
                a[at] = getattr(self, name)
        self.__dict__.update(grown)

    def add(self, frames: list[tuple[int, float, float, dict]]) -> None:
        """Frames (row, t, dt, figures), in the order they came: each put in time order among its node's, the sums
        after a late one redone; then each node's frames older than `keep` before its newest are dropped."""
        vals = np.array([list(map(f.get, KEYS)) for _, _, _, f in frames], dtype=float)     # None: NaN
        have = ~np.isnan(vals[:, :NS])
        x = np.empty((len(frames), WIDTH))
        x[:, 0] = [dt for _, _, dt, _ in frames]
        x[:, 1:1 + NS] = np.where(have, vals[:, :NS], 0.0)
        x[:, 1 + NS:] = have
        rows = np.array([r for r, _, _, _ in frames], np.int64)
        ts = np.array([t for _, t, _, _ in frames])
        lims = vals[:, NS]
        if len(set(rows.tolist())) == len(rows) and (ts >= self.t[rows, self.hi[rows] - 1]).all():
            self._append(rows, ts, x, lims)          # the usual batch: a frame of each node, newer than its last
            return
        if (rows == rows[0]).all() and ts[0] >= self.t[rows[0], self.hi[rows[0]] - 1] and (ts[1:] >= ts[:-1]).all():
            self._extend(int(rows[0]), ts, x, lims)  # frames of one node, in time order
            return
        seg: list[int] = []                          # else in runs of one frame per node, a late frame alone
        in_seg: set[int] = set()

        def flush() -> None:
            if seg:
                self._append(rows[seg], ts[seg], x[seg], lims[seg])
                seg.clear()
                in_seg.clear()
        for i, r in enumerate(rows.tolist()):
            if r in in_seg:
                flush()
            if ts[i] >= self.t[r, self.hi[r] - 1]:
                seg.append(i)
                in_seg.add(r)
            else:
                flush()
                self._insert(r, float(ts[i]), x[i], lims[i])
        flush()

    def _append(self, r: np.ndarray, ts: np.ndarray, x: np.ndarray, lims: np.ndarray) -> None:
        """One frame for each of rows r (distinct), each newer than its row's last."""
        p = self.hi[r]
        if p.max() >= self.t.shape[1]:
            self._compact(r[p >= self.t.shape[1]])
            p = self.hi[r]
        self.c[r, p] = self.c[r, p - 1] + x
        self.t[r, p] = ts
        self.own[r, p] = lims
        self.hi[r] = p + 1
        self.newest[r] = np.maximum(self.newest[r], ts)
        self._drop(r)

    def _extend(self, r: int, ts: np.ndarray, x: np.ndarray, lims: np.ndarray) -> None:
        """Frames of row r, in time order, each newer than its last: their sums one after another, as _append's."""
        if self.hi[r] + len(ts) > self.t.shape[1]:
            self._compact(np.array([r]), len(ts))
        p, q = int(self.hi[r]), int(self.hi[r]) + len(ts)
        run = x.copy()
        run[0] = self.c[r, p - 1] + run[0]
        self.c[r, p:q] = np.add.accumulate(run, axis=0)
        self.t[r, p:q], self.own[r, p:q] = ts, lims
        self.hi[r] = q
        self.newest[r] = max(self.newest[r], ts.max())
        self._drop(np.array([r]))

    def _insert(self, r: int, t: float, x: np.ndarray, lim: float) -> None:
        """A late frame of row r: put after the frames not newer than it, the sums of those after it redone."""
        if self.hi[r] >= self.t.shape[1]:
            self._compact(np.array([r]))
        lo, hi = int(self.lo[r]), int(self.hi[r])
        i = lo + int((self.t[r, lo:hi] <= t).sum())
        c = self.c[r]
        redo = np.vstack([c[i - 1] + x, np.diff(c[i - 1:hi], axis=0)])     # the frames after it: their own figures
        c[i:hi + 1] = np.add.accumulate(redo, axis=0)
        for a in (self.t[r], self.own[r]):
            a[i + 1:hi + 1] = a[i:hi].copy()
        self.t[r, i], self.own[r, i] = t, lim
        self.hi[r] = hi + 1
        self.newest[r] = max(self.newest[r], t)
        self._drop(np.array([r]))

    def _drop(self, r: np.ndarray) -> None:
        """Rows r's frames older than `keep` before their newest leave the kept ones (their sums stay, the base)."""
        lo = (self.t[r] < (self.newest[r] - self.keep)[:, None]).sum(1)    # the dropped are -inf, the unused inf
        gone = lo > self.lo[r]
        if gone.any():
            r, lo = r[gone], lo[gone]
            self.t[r] = np.where(np.arange(self.t.shape[1]) < lo[:, None], -np.inf, self.t[r])
            self.lo[r] = lo

    def _compact(self, r: np.ndarray, room: int = 1) -> None:
        """Rows r, full: their base and kept frames moved to the front, with `room` frames more (the depth doubled
        until that leaves them at most half full). Rows whose frames came together move together."""
        depth = self.t.shape[1]
        shift = self.lo[r] - 1
        for sh in np.unique(shift).tolist():
            g = r[shift == sh]
            for a in (self.t, self.c, self.own):
                a[g, :depth - sh] = a[g, sh:]
            self.t[g, depth - sh:] = np.inf
        self.t[r, 0] = -np.inf
        used = self.hi[r] - shift
        self.lo[r], self.hi[r] = 1, used
        if int(used.max()) + room > depth // 2:
            while int(used.max()) + room > depth // 2:
                depth *= 2
            self._resize(len(self.lo), depth)

    def window(self, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Every node's frames in (start, end] summed — a column a node: wall time, each figure's sum, how many
        frames carried it — and, a column a node, the positions of its newest frame at or before start and end."""
        n = len(self.names)
        rows = np.arange(n)
        first = int(self.lo[:n].min()) - 1            # before it every row's times are -inf, from `past` inf
        t = self.t[:n, first:int(self.hi[:n].max())]
        ab = np.vstack([(t <= start).sum(1), (t <= end).sum(1)]) + (first - 1)
        return np.ascontiguousarray((self.c[rows, ab[1]] - self.c[rows, ab[0]]).T), ab

    def limit(self, r: int, a: int, b: int) -> float | None:
        """The CPU limit that row r's newest frame after position a, up to b, said (None: none did)."""
        said = np.flatnonzero(~np.isnan(self.own[r, a + 1:b + 1]))
        return float(self.own[r, a + 1 + said[-1]]) if len(said) else None

    def table(self, start: float, end: float, among: np.ndarray, cover: float) -> "Table":
        """The nodes' windows (start, end] side by side: those of `among` (a mask of rows) whose frames cover
        `cover` s of it are compared."""
        return Table(*self.window(start, end), among, cover, [len(self.names)])

    def baseline(self, r: int, k: str) -> float | None:
        """Row r's own usual value of figure k (None until 3 comparisons in step have had it)."""
        j = BASE_ROW.get(k)
        v = np.nan if j is None else self.base[j, r]
        return None if np.isnan(v) else float(v)

    def baselines(self, k: str | tuple[str, ...]) -> np.ndarray:
        """Every node's baseline of figure k (NaN: none); of several, a row each."""
        j = BASE_ROW[k] if isinstance(k, str) else [BASE_ROW[x] for x in k]
        return self.base[j, :len(self.names)]

    def in_step(self, r: np.ndarray, vals: np.ndarray) -> None:
        """Rows r's figures (BASE's, a row each; NaN: absent) of a comparison in which the job was in step join
        their history; each baseline is the median of its figure's last `history` values (fewer than 3: none)."""
        p = self.hp[r]
        self.hist[r, p] = vals.T
        self.hp[r] = (p + 1) % self.history
        h = np.sort(self.hist[r], axis=1)                   # NaN last
        n = (~np.isnan(h)).sum(1)
        i, j = np.arange(len(r))[:, None], np.arange(h.shape[2])
        upper, lower = h[i, n // 2, j], h[i, np.maximum(n // 2 - 1, 0), j]
        self.base[:, r] = np.where(n >= 3, np.where(n % 2 == 1, upper, (lower + upper) / 2), np.nan).T


def order_stats(x: np.ndarray, seg: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """For each figure (a row of x) and node (a column; NaN: a node without that figure), (median, max, count) of
    the figure over the other nodes of its job that have it — the node's own value taken out once, as Others.stats
    does; (0, 0, 0) where no other node has it. The jobs' nodes side by side: node i is of job seg[i], whose nodes
    start at starts[seg[i]]."""
    have = ~np.isnan(x)
    f = np.arange(len(x))[:, None]
    o = np.argsort(x, axis=1, kind="stable")   # NaN last
    if len(starts) > 1:                         # by job, then by value
        o = np.take_along_axis(o, np.argsort(seg[o], axis=1, kind="stable"), 1)
    s = x[f, o]
    cnt = np.add.reduceat(have, starts, axis=1, dtype=np.int64)[:, seg]    # its job's nodes that have it
    first, last = starts[seg], np.append(starts[1:], x.shape[1])[seg] - 1

    def v(i: np.ndarray) -> np.ndarray:        # the i-th of its job's values in order (out of range: one not used)
        return s[f, np.minimum(np.maximum(first + i, first), last)]
    h = (cnt - 1) // 2                          # a node that has the figure: the others' middle, and the one below
    below, mid, above = v(h - 1), v(h), v(h + 1)
    mid_ = np.where(mid >= x, above, mid)       # the others' k-th: the k-th in order, or the next where its own
    below_ = np.where(below >= x, mid, below)   # value sits at or before it (as bisect_left finds it)
    med = np.where(cnt % 2 == 0, mid_, (below_ + mid_) / 2)
    top, most = v(cnt - 2), v(cnt - 1)
    top = np.where(top >= x, most, top)
    h = cnt // 2                                # a node without it: the middle of all
    mid = v(h)
    med = np.where(have, med, np.where(cnt % 2 == 1, mid, (v(h - 1) + mid) / 2))
    top = np.where(have, top, most)
    n = cnt - have
    none = n == 0
    med[none] = top[none] = 0.0
    return med, top, n


class Table:
    """A comparison of one job or of several side by side: every node's window, as arrays (a node a column) — its
    wall time, sums, which figures its frames carried, where it starts and ends among its frames; its figures
    (COLUMNS, a row each; NaN: absent or a node not compared), and each figure's order across the compared nodes of
    its job, when first asked for. part() is one job's, for the decisions taken node by node."""

    def __init__(self, d: np.ndarray, ab: np.ndarray, among: np.ndarray, cover: float, sizes: list[int]):
        """d, ab: Sums.window's of each job, side by side; `among`: the nodes that may be compared, those whose
        frames cover `cover` s of the window are; `sizes`: each job's number of nodes."""
        self.wall, self.sums, self.have, self.ab = d[0], d[1:1 + NS], d[1 + NS:] != 0, ab
        self.member = among & (self.wall >= cover)
        self.starts = np.cumsum([0] + sizes[:-1])
        self.seg = np.repeat(np.arange(len(sizes)), sizes)
        self.counts = np.add.reduceat(self.member, self.starts, dtype=np.int64)     # each job's compared nodes
        v = np.full((len(COLUMNS), len(self.wall)), np.nan)        # values_of, for every node at once (the same
        inv = np.zeros(len(self.wall))                              # operations, in the same order)
        np.divide(1.0, self.wall, out=inv, where=self.wall > 0)
        v[_RJ] = np.where(self.have[_RK], self.sums[_RK] * inv / _RS[:, None], np.nan)
        per = np.where(self.have[_SP], self.sums[_SP], 0.0)
        share = np.full(per.shape, np.nan)
        np.divide(self.sums[_SK], per, out=share, where=per != 0)
        v[_SJ] = share
        v[:, ~self.member] = np.nan
        self.vals = v
        self.med, self.top, self.cnt = np.zeros(v.shape), np.zeros(v.shape), np.zeros(v.shape, np.int64)
        self._ordered = [False] * len(COLUMNS)
        med = self.orders(("cpu", "wait", "gpu_util", "gpu_clock"))[0][0]     # (the figures every comparison reads)
        np.divide(v[_COL["cpu"]], med, out=v[_COL["cpu_share"]], where=med > 0)    # cpu_share

    def col(self, k: str) -> np.ndarray:
        """Figure k of every node (NaN: absent, or a node not compared)."""
        return self.vals[_COL[k]]

    def cols(self, keys: tuple[str, ...]) -> np.ndarray:
        return self.vals[[_COL[k] for k in keys]]

    def order(self, k: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each node's peers' (median, max, count) of figure k (order_stats), read when first asked for."""
        return tuple(a[0] for a in self.orders((k,)))     # type: ignore[return-value]

    def orders(self, keys: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """order() of several figures: a row each."""
        j = [_COL[k] for k in keys]
        new = [c for c in j if not self._ordered[c]]
        if new:
            self.med[new], self.top[new], self.cnt[new] = order_stats(self.vals[new], self.seg, self.starts)
            for c in new:
                self._ordered[c] = True
        return self.med[j], self.top[j], self.cnt[j]

    def part(self, j: int, sums: Sums) -> "Part":
        """Job j's nodes (`sums`: its frames)."""
        return Part(self, int(self.starts[j]), sums)


class Part(Others):
    """One job's nodes of a Table, by name: a node's window and figures, every node's windows, the peers' median
    and maximum of a figure (Others)."""

    def __init__(self, t: Table, at: int, sums: Sums):
        end = at + len(sums.names)
        self.wall, self.sums, self.have = t.wall[at:end], t.sums[:, at:end], t.have[:, at:end]
        self.ab, self.member, self.vals = t.ab[:, at:end], t.member[at:end], t.vals[:, at:end]
        self.count = int(self.member.sum())
        self.frames, self.names, self.rows = sums, sums.names, sums.rows
        self.sorted: dict[str, list[float]] = {}
        self._windows: dict[str, Window] | None = None

    def column(self, k: str) -> list[float]:
        x = self.vals[_COL[k]]
        return np.sort(x[~np.isnan(x)]).tolist()

    def values(self, r: int) -> dict[str, float | None]:
        """Node r's figures (values_of's, and cpu_share)."""
        return {k: None if v != v else v for k, v in zip(COLUMNS, self.vals[:, r].tolist())}

    def window(self, r: int) -> Window:
        return Window(float(self.wall[r]), {k: v for k, v, h in zip(SUMMED, self.sums[:, r].tolist(),
                                                                    self.have[:, r].tolist()) if h},
                      self.frames.limit(r, int(self.ab[0, r]), int(self.ab[1, r])))

    def windows(self) -> dict[str, Window]:
        """Every compared node's window, by name."""
        if self._windows is None:
            self._windows = {self.names[r]: self.window(r) for r in np.flatnonzero(self.member).tolist()}
        return self._windows
