# SPDX-License-Identifier: Apache-2.0
"""The store past its raw window: samples compacted into column blocks, rolled up, kept per level.

Samples arrive as whole frames (JSON bodies in `frames`, the raw window: the last `raw_s`, 10 minutes by default).
Past it, the controller's sweep moves them, five minutes of one (node, job, run) at a time, into `blocks` — level 1:
the frames themselves, lossless (jobprobe/cluster/blocks.py; docs/PERFORMANCE.md, "The store"). Once an hour of a run
is all in level-1 blocks, it is rolled up into one level-10 and one level-60 block: per bucket of 10 s or 1 min, each
numeric field's sum, min and max and the bucket's sample count and summed `dt` (a mean is sum/n, a rate sum/dt; a
list of maps' fields by index: GPU i's) — an hour a block, so that a rollup costs a few bytes per bucket. Each level
has its own retention (LEVELS: 1 s kept a day, 10 s a week, 1 min 90 days). A path of a frame's leaves is stored
once, in `paths`; blocks name it by number.

Exactly once still holds past the raw window: a sample whose key is in a level-1 block already is a duplicate
(Store.add asks `seen_in_blocks`); a late sample of a span already compacted becomes a block of its own, and its
hour's rollups are made again.
"""
from __future__ import annotations

import json
import math
import sqlite3
from typing import Any, Iterable

from jobprobe.cluster import blocks
from jobprobe.core.numbers import is_number

BLOCK_S = 300                              # a level-1 block: five minutes of one node's job (a minute: 1.4× the bytes)
HOUR = 3600.0                               # a rollup block: one hour of one node's job, at each level
LEVELS = {1: 86400.0, 10: 7 * 86400.0, 60: 90 * 86400.0}    # level (its step, s) → how long it is kept
RAW_S = 600.0                               # whole frames kept as JSON this long
GROUPS_PER_STEP = 100                       # (node, job, run, span)s compacted per call: a bounded pause

SCHEMA = """
CREATE TABLE IF NOT EXISTS paths(id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS blocks(level INTEGER NOT NULL, node TEXT NOT NULL, job TEXT NOT NULL, run TEXT NOT NULL,
    seq0 INTEGER NOT NULL, seq1 INTEGER NOT NULL, t0 REAL NOT NULL, t1 REAL NOT NULL, n INTEGER NOT NULL,
    data BLOB NOT NULL, received REAL, hour INTEGER, PRIMARY KEY (level, node, job, run, seq0)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_job ON blocks(job, level, t1);
CREATE INDEX IF NOT EXISTS blocks_t ON blocks(level, t1);
"""


class Paths:
    """The store's codebook: a leaf's path ↔ its number (made on first use, in the store's transaction)."""

    def __init__(self, db: sqlite3.Connection, schema: str = "main"):
        self.db, self.schema = db, schema
        self.ids: dict[tuple, int] = {}
        self.paths: dict[int, tuple] = {}
        self.load()

    def load(self) -> None:
        try:
            rows = self.db.execute(f"SELECT id, path FROM {self.schema}.paths").fetchall()
        except sqlite3.OperationalError:       # a store made before blocks: none
            rows = []
        for i, p in rows:
            path = tuple(json.loads(p))
            self.ids[path], self.paths[i] = i, path

    def id(self, path: tuple) -> int:
        i = self.ids.get(path)
        if i is None:
            i = self.db.execute("INSERT INTO paths(path) VALUES (?)", (json.dumps(list(path)),)).lastrowid
            self.ids[path], self.paths[i] = i, path
        return i

    def path(self, i: int) -> tuple:
        if i not in self.paths:
            self.load()
        return self.paths[i]


def compact_step(db: sqlite3.Connection, book: Paths, before: float) -> int:
    """Move up to GROUPS_PER_STEP blocks' worth (BLOCK_S each) of samples out of `frames` into level-1 blocks, in
    one transaction: those whose span of time ended before `before` and that were received before it too (a node's
    backfill, or a clock behind, stays whole for the raw window after it came). How many were moved (0: none)."""
    span_end = math.floor(before / BLOCK_S) * BLOCK_S    # whole spans only: a block is never cut short
    groups = db.execute(
        "SELECT node, job, run, CAST(t / ? AS INTEGER) AS m FROM frames WHERE kind = 'sample' AND t < ? AND "
        "received < ? GROUP BY node, job, run, m LIMIT ?", (BLOCK_S, span_end, before, GROUPS_PER_STEP)).fetchall()
    moved = 0
    with db:
        for node, job, run, m in groups:
            rows = db.execute("SELECT seq, body, received FROM frames WHERE node = ? AND job = ? AND run = ? AND "
                              "kind = 'sample' AND t >= ? AND t < ? AND received < ? ORDER BY seq",
                              (node, job, run, m * BLOCK_S, (m + 1) * BLOCK_S, before)).fetchall()
            if not rows:
                continue
            frames = [json.loads(b) for _, b, _ in rows]
            _put(db, 1, node, job, run, frames[0]["seq"], frames[-1]["seq"], frames[0]["t"], frames[-1]["t"],
                 len(frames), blocks.encode(frames, book.id), max(r for _, _, r in rows))
            db.execute("DELETE FROM blocks WHERE level IN (10, 60) AND node = ? AND job = ? AND run = ? AND "
                       "hour = ?", (node, job, run, int(frames[0]["t"] // HOUR)))    # a late span: made again
            db.executemany("DELETE FROM frames WHERE node = ? AND job = ? AND run = ? AND seq = ?",
                           [(node, job, run, s) for s, _, _ in rows])
            moved += len(rows)
    return moved


def rollup_step(db: sqlite3.Connection, book: Paths, before: float) -> int:
    """Roll up to GROUPS_PER_STEP hours of runs whose level-1 blocks are complete (the hour ended before `before`)
    and not rolled up yet: one level-10 and one level-60 block each (`hour`: the hour's number; seq0..seq1: the
    frames rolled up). How many."""
    hours = db.execute(
        "SELECT node, job, run, CAST(t0 / ? AS INTEGER) AS h FROM blocks WHERE level = 1 AND t1 < ? "
        "GROUP BY node, job, run, h EXCEPT SELECT node, job, run, hour FROM blocks WHERE level = 10 LIMIT ?",
        (HOUR, math.floor(before / HOUR) * HOUR, GROUPS_PER_STEP)).fetchall()
    with db:
        for node, job, run, h in hours:
            frames, received, seqs = [], None, []
            for data, got, s0, s1 in db.execute(
                    "SELECT data, received, seq0, seq1 FROM blocks WHERE level = 1 AND node = ? AND job = ? AND "
                    "run = ? AND t0 >= ? AND t0 < ?", (node, job, run, h * HOUR, (h + 1) * HOUR)):
                frames += blocks.decode(data, [("t",), ("dt",), ("probes",)], book.path)
                received = got if received is None or (got is not None and got > received) else received
                seqs += [s0, s1]
            frames.sort(key=lambda f: f["t"])
            for level in (10, 60):
                recs = [r for _, r in sorted(rollup(frames, level).items())]
                _put(db, level, node, job, run, min(seqs), max(seqs), recs[0]["t0"], recs[-1]["t1"], len(recs),
                     blocks.encode(recs, book.id), received, hour=h)
    return len(hours)


def _put(db: sqlite3.Connection, level: int, node: str, job: str, run: str, seq0: int, seq1: int, t0: float,
         t1: float, n: int, data: bytes, received: float | None, hour: int | None = None) -> None:
    """received: when its newest frame came (retention counts from it too: a node whose clock is behind); hour:
    the hour's number (UNIX s // 3600) of a rollup, of a level-1 block its t0's."""
    db.execute("INSERT OR REPLACE INTO blocks(level, node, job, run, seq0, seq1, t0, t1, n, data, received, hour) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (level, node, job, run, seq0, seq1, t0, t1, n, data, received,
                int(t0 // HOUR) if hour is None else hour))


def numeric(frame: dict) -> Iterable[tuple[tuple, float]]:
    """(path, value) of a sample's finite numbers under `probes` (bools and lists of numbers left out; a list of
    maps' elements in, by index: one GPU's fields)."""
    for path, v in blocks.leaves(frame.get("probes") or {}, ("probes",)):
        if blocks.finite(v) and path[-1] != blocks.LEN:
            yield path, v


def rollup(frames: list[dict], level: int) -> dict[int, dict]:
    """Per bucket of `level` s (its number: t // level): n, dt (summed), t0/t1 (first/last sample's t), and per
    numeric field its sum, min and max — as a frame-like map {probes: {probe: {field: {sum, min, max}}}}."""
    out: dict[int, dict] = {}
    for f in frames:
        b = int(f["t"] // level)
        r = out.setdefault(b, {"t": b * level, "n": 0, "dt": 0.0, "t0": f["t"], "t1": f["t"], "probes": {}})
        r["n"] += 1
        r["dt"] += float(f.get("dt") or 0.0)
        r["t0"], r["t1"] = min(r["t0"], f["t"]), max(r["t1"], f["t"])
        for path, v in numeric(f):
            node = r
            for k in path[:-1]:
                node = node.setdefault(k, {})
            agg = node.get(path[-1])
            if agg is None:
                node[path[-1]] = {"sum": v, "min": v, "max": v}
            else:
                agg["sum"] += v
                agg["min"] = min(agg["min"], v)
                agg["max"] = max(agg["max"], v)
    return out


def seen_in_blocks(db: sqlite3.Connection, book: Paths, node: str, job: str, run: str, seq: int) -> bool:
    """Whether a sample of this key is in a level-1 block already (a resend after its span was compacted)."""
    key = (node, job, run)
    row = db.execute("SELECT MAX(seq1) FROM (SELECT seq1 FROM blocks WHERE level = 1 AND node = ? AND job = ? AND "
                     "run = ? ORDER BY seq0 DESC LIMIT 1)", key).fetchone()
    if row[0] is None or row[0] < seq:        # past the run's newest block: new (the common case, one seek)
        return False
    return any(seq in blocks.column(data, book.ids.get(("seq",), -1)) for (data,) in db.execute(
        "SELECT data FROM blocks WHERE level = 1 AND node = ? AND job = ? AND run = ? AND seq0 <= ? AND seq1 >= ?",
        key + (seq, seq)))


def forget_levels(db: sqlite3.Connection, now: float) -> int:
    """Each level's blocks older than its retention go — by their own time and by when they came: a node whose
    clock is days behind has its blocks kept as long as anyone's (a block made before receipts were kept: its time).
    How many."""
    with db:
        return sum(db.execute("DELETE FROM blocks WHERE level = ? AND t1 < ? AND COALESCE(received, t1) < ?",
                              (level, now - keep, now - keep)).rowcount for level, keep in LEVELS.items())


def samples(db: sqlite3.Connection, book: Paths, job: str, node: str | None = None, since: float = -math.inf,
            until: float = math.inf, only: list[tuple] | None = None, raw: bool = True) -> list[dict]:
    """A job's samples (of one node, within [since, until] when given), raw (unless not `raw`) and compacted, in
    time order; from the store `book.schema` of the connection."""
    sch = book.schema
    q = f"SELECT body FROM {sch}.frames WHERE kind = 'sample' AND job = ? AND t >= ? AND t <= ?"
    args: list[Any] = [job, since, until]
    if node is not None:
        q, args = q + " AND node = ?", args + [node]
    out = [json.loads(b) for (b,) in db.execute(q, args)] if raw else []
    if not has_blocks(db, sch):
        return sorted(out, key=lambda f: (f["t"], f["node"]))
    q = f"SELECT data FROM {sch}.blocks WHERE level = 1 AND job = ? AND t1 >= ? AND t0 <= ?"
    args = [job, since, until]
    if node is not None:
        q, args = q + " AND node = ?", args + [node]
    keep = None if only is None else [("node",), ("job",), ("run",), ("seq",), ("t",), ("dt",), ("kind",)] + only
    for (data,) in db.execute(q, args):
        out += [f for f in blocks.decode(data, keep, book.path) if since <= f["t"] <= until]
    out.sort(key=lambda f: (f["t"], f["node"]))
    return out


def levels(db: sqlite3.Connection, book: Paths, job: str, level: int, node: str | None = None) -> list[dict]:
    """A job's rollups at `level` (10 or 60), every node's: {node, run, t, t0, t1, n, dt, probes: {…: {sum, min,
    max}}}, in time order."""
    if not has_blocks(db, book.schema):
        return []
    q = f"SELECT node, run, data FROM {book.schema}.blocks WHERE level = ? AND job = ?"
    args: list[Any] = [level, job]
    if node is not None:
        q, args = q + " AND node = ?", args + [node]
    out = []
    for n, run, data in db.execute(q + " ORDER BY t0", args):
        out += [{"node": n, "run": run, **rec} for rec in blocks.decode(data, paths=book.path)]
    return out


def column_over(db: sqlite3.Connection, book: Paths, path: tuple, since: float, until: float,
                job: str | None = None, node: str | None = None) -> list[tuple]:
    """One leaf of the samples within [since, until] (of a job, of a node, when given), raw and compacted:
    (node, job, run, seq, t, dt, value) rows, inflating only the columns it reads from each block."""
    sch = book.schema
    where, args = "kind = 'sample' AND t >= ? AND t <= ?", [since, until]
    for col, v in (("job", job), ("node", node)):
        if v is not None:
            where, args = where + f" AND {col} = ?", args + [v]
    out = list(db.execute(f"SELECT node, job, run, seq, t, dt, json_extract(body, ?) FROM {sch}.frames "
                          f"WHERE {where}", [json_path(path)] + args))
    if not has_blocks(db, sch):
        return out
    where = "level = 1 AND t1 >= ? AND t0 <= ?" + (" AND job = ?" if job is not None else "") + \
        (" AND node = ?" if node is not None else "")
    ids = [book.ids.get(p, -1) for p in (("seq",), ("t",), ("dt",), path)]
    for n, j, run, data in db.execute(f"SELECT node, job, run, data FROM {sch}.blocks WHERE {where}",
                                      [v for v in (since, until, job, node) if v is not None]):
        seqs, ts, dts, vals = blocks.columns(data, ids)
        out += [(n, j, run, q, t, dt, v) for q, t, dt, v in zip(seqs, ts, dts, vals) if since <= t <= until]
    return out


def totals(db: sqlite3.Connection, book: Paths, path: tuple, since: float, until: float) -> dict[str, list]:
    """Per node, over every job's samples within [since, until], raw and compacted: [sum, max, samples] of one
    numeric leaf — a block wholly inside the window summed at once, without a row per sample."""
    out: dict[str, list] = {}

    def add(node: str, vals: list) -> None:
        vals = [v for v in vals if is_number(v)]
        if vals:
            a = out.setdefault(node, [0, vals[0], 0])
            a[0] += sum(vals)
            a[1] = max(a[1], max(vals))
            a[2] += len(vals)
    sch = book.schema
    for node, v in db.execute(f"SELECT node, json_extract(body, ?) FROM {sch}.frames WHERE kind = 'sample' AND "
                              "t >= ? AND t <= ?", (json_path(path), since, until)):
        add(node, [v])
    if not has_blocks(db, sch):
        return out
    vid, tid = book.ids.get(path, -1), book.ids.get(("t",), -1)
    for node, t0, t1, data in db.execute(f"SELECT node, t0, t1, data FROM {sch}.blocks WHERE level = 1 AND "
                                         "t1 >= ? AND t0 <= ?", (since, until)):
        if since <= t0 and t1 <= until:
            add(node, blocks.column(data, vid))
        else:
            ts, vals = blocks.columns(data, [tid, vid])
            add(node, [v for t, v in zip(ts, vals) if since <= t <= until])
    return out


def json_path(path: tuple) -> str:
    """A leaf's path as SQLite's JSON path: `$.probes.gpu.gpus[0].power_mw`."""
    return "$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def has_blocks(db: sqlite3.Connection, schema: str) -> bool:
    """Whether the store `schema` has blocks at all (a store made before them has none)."""
    return db.execute(f"SELECT 1 FROM {schema}.sqlite_master WHERE name = 'blocks'").fetchone() is not None
