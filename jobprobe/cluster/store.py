# SPDX-License-Identifier: Apache-2.0
"""The controller's store: every frame of every node, in SQLite.

Why SQLite: it is in Python's standard library (nothing to install or run), one file, and in WAL mode readers
(`jobprobe query`, `jobprobe controller stats`) read a consistent snapshot while the controller writes — the one
concurrency this store needs (a single writer). Its JSON functions query frame fields without a schema per probe:
`json_extract(body, '$.probes.cgroup.cpu_user_ns')`. At the controller's rate (docs/PERFORMANCE.md) one file holds
days of a large cluster; retention by age keeps it bounded.

Tables and views:
- `frames(node, job, run, seq, kind, t, dt, received, body)` — every stored frame, keyed by (node, job, run, seq):
  storing a frame twice is impossible, so a resend or a redelivery after a controller crash is a no-op. `t`: the
  frame's own time (end of its interval, UNIX s); `received`: when the controller stored it; `body`: the whole frame
  as JSON.
- `samples`, `events` (views of frames; `events.event` is the event's name): what queries mostly want.
- `reject_counts(node, reason, minute, n, bytes)` — messages refused, counted per node, reason (a short kind:
  `malformed`, `subject`, `quota_frames`…) and minute (UNIX s // 60).
- `rejects(received, subject, node, reason, size, body)` — the first REJECT_SAMPLES refusals of each node, reason
  and minute, whole reason text and the body's first REJECT_BODY bytes: for diagnosis. Both kept for the retention.
- `delivery(node, …)` — per node: frames stored, duplicates, rejected, newest frame time, last received, lost.
- `fence(part, token, holder, taken, last_write, writes)` — the lease tokens of the controllers that held the store
  (take_fence); every write checks in its own transaction that the newest is its own (Fenced otherwise).
Controller-made events (`node_lost`, `node_back`) are frames of run `controller` in `frames`.

Partitions (`jobprobe controller --partition I/N`): each partition has its own store (the two controllers of a
partition share it). A reader given several stores — `Store([p0.db, p1.db, …], readonly=True)`, or a directory of
them — sees them as one: the same tables and views, made of every store's (UNION ALL: a job's frames are all in one
partition's store, so nothing is counted twice), `delivery` summed per node. SQLite attaches at most MAX_STORES.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable

from jobprobe.cluster import compact

SAMPLES = "SELECT node, job, run, seq, t, dt, received, body FROM frames WHERE kind = 'sample'"
EVENTS = ("SELECT node, job, run, seq, t, received, json_extract(body, '$.event') AS event, body FROM frames "
          "WHERE kind = 'event'")


def views(create: str) -> str:
    """The `samples` and `events` views over whatever `frames` is where they are made (`create`: "CREATE VIEW IF
    NOT EXISTS" in a store, "CREATE TEMP VIEW" in a reader over several stores or compacted samples)."""
    return f"{create} samples AS {SAMPLES};\n{create} events AS {EVENTS};"


SCHEMA = """
CREATE TABLE IF NOT EXISTS frames(
    node TEXT NOT NULL, job TEXT NOT NULL, run TEXT NOT NULL, seq INTEGER NOT NULL,
    kind TEXT NOT NULL, t REAL NOT NULL, dt REAL NOT NULL, received REAL NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (node, job, run, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS frames_t ON frames(t);
CREATE INDEX IF NOT EXISTS frames_job ON frames(job, t);
{views}
CREATE TABLE IF NOT EXISTS rejects(received REAL NOT NULL, subject TEXT, node TEXT, reason TEXT NOT NULL,
    size INTEGER NOT NULL, body BLOB);
CREATE TABLE IF NOT EXISTS reject_counts(node TEXT NOT NULL, reason TEXT NOT NULL, minute INTEGER NOT NULL,
    n INTEGER NOT NULL, bytes INTEGER NOT NULL, PRIMARY KEY (node, reason, minute)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS delivery(node TEXT PRIMARY KEY, frames INTEGER NOT NULL DEFAULT 0,
    duplicates INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0, newest_t REAL, last_received REAL,
    lost INTEGER NOT NULL DEFAULT 0);
""".replace("{views}", views("CREATE VIEW IF NOT EXISTS"))


MAX_STORES = 10     # SQLite's limit on attached databases
VERSION = 3         # PRAGMA user_version of a store this code writes (migrate() brings older ones to it)
REJECT_SAMPLES = 3  # refusals kept whole per node, reason and minute (the rest only counted)
REJECT_BODY = 256   # bytes of a kept refusal's body


def migrate(db: sqlite3.Connection) -> None:
    """An older store brought to VERSION, in one transaction. 0 → 1: `rejects` held one row per refusal and no
    body; its rows are counted into `reject_counts` (reason `unclassified`: their text is kept in rejects). 1 → 2:
    `blocks.received` (when a block's newest frame came; NULL in older blocks: retention by their own time). 2 → 3:
    `blocks.hour` (a rollup's hour, which it kept in seq0; seq0..seq1 now the frames it rolled up, where their
    level-1 blocks are still kept)."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > VERSION:
        raise ValueError(f"the store is of version {version}, newer than this jobprobe's {VERSION}: upgrade jobprobe")
    with db:
        if version < 1:
            if "body" not in [r[1] for r in db.execute("PRAGMA table_info(rejects)")]:
                db.execute("ALTER TABLE rejects ADD COLUMN body BLOB")
            db.execute("INSERT OR REPLACE INTO reject_counts SELECT COALESCE(node, ''), 'unclassified', "
                       "CAST(received / 60 AS INTEGER), COUNT(*), SUM(size) FROM rejects "
                       "GROUP BY COALESCE(node, ''), CAST(received / 60 AS INTEGER)")
        if version < 2 and "received" not in [r[1] for r in db.execute("PRAGMA table_info(blocks)")]:
            db.execute("ALTER TABLE blocks ADD COLUMN received REAL")
        if version < 3 and "hour" not in [r[1] for r in db.execute("PRAGMA table_info(blocks)")]:
            db.execute("ALTER TABLE blocks ADD COLUMN hour INTEGER")
            db.execute("UPDATE blocks SET hour = CASE WHEN level = 1 THEN CAST(t0 / 3600 AS INTEGER) ELSE seq0 END")
            # a rollup's seq0..seq1 from its hour's level-1 blocks, where those are kept (else the hour, as before)
            db.execute("UPDATE OR IGNORE blocks AS r SET (seq0, seq1) = (SELECT MIN(b.seq0), MAX(b.seq1) FROM blocks b "
                       "WHERE b.level = 1 AND b.node = r.node AND b.job = r.job AND b.run = r.run AND "
                       "b.hour = r.hour) WHERE r.level IN (10, 60) AND EXISTS (SELECT 1 FROM blocks b WHERE "
                       "b.level = 1 AND b.node = r.node AND b.job = r.job AND b.run = r.run AND b.hour = r.hour)")
        db.execute(f"PRAGMA user_version = {VERSION}")

# Fencing (docs/ARCHITECTURE.md, "Two controllers, one store"): each controller that takes its partition's lease
# writes the lease's token here (jobprobe/cluster/lease.py: a newer holder's is always larger); a write is refused
# unless the newest token of its partition is its own. The newest FENCE_KEEP rows per partition are kept (~100 B
# each): one row per takeover. `last_write`/`writes`: each holder's last committed write, and how many.
FENCE = """
CREATE TABLE IF NOT EXISTS fence(part INTEGER NOT NULL, token INTEGER NOT NULL, holder TEXT NOT NULL,
    taken REAL NOT NULL, last_write REAL, writes INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (part, token));
"""
FENCE_KEEP = 16


class Fenced(Exception):
    """A write refused: another controller took the lease since this one did (a larger token in `fence`), or this
    writer holds none and the store is fenced. Nothing of the write was stored; the writer must stop writing."""


def store_files(path: str | Path | list) -> list[str]:
    """The store files a reader was given: a file, a directory (every *.db in it), or a list of either."""
    if isinstance(path, (list, tuple)):
        return [f for p in path for f in store_files(p)]
    if Path(path).is_dir():
        found = sorted(str(p) for p in Path(path).glob("*.db"))
        if not found:
            raise FileNotFoundError(f"no store (*.db) in {path}")
        return found
    if not Path(path).exists():
        raise FileNotFoundError(f"no store at {path}")
    return [str(path)]


class Store:
    def __init__(self, path: str | Path | list, readonly: bool = False):
        if readonly:
            files = store_files(path)
            self.path = ",".join(files)
            if len(files) == 1:
                self.db = sqlite3.connect(f"file:{files[0]}?mode=ro", uri=True, timeout=30)
                self.books = [compact.Paths(self.db)]
            else:
                self.db = _union(files)
                self.books = [compact.Paths(self.db, f"p{k}") for k in range(len(files))]
            return
        self.path = str(path)
        # frames hold other users' command lines and stacks: the store is its owner's alone (SQLite makes the
        # -wal and -shm files with the database's own mode)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        os.chmod(self.path, 0o600)
        self.db = sqlite3.connect(self.path, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: durable at each checkpoint, never corrupt
        new = not self.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'frames'").fetchone()
        self.db.executescript(SCHEMA + compact.SCHEMA + FENCE)
        self.db.commit()
        if new:
            self.db.execute(f"PRAGMA user_version = {VERSION}")
        migrate(self.db)
        self.books = [compact.Paths(self.db)]
        self.fence: tuple[int, int] | None = None   # (partition, token) of the lease this writer holds

    # ---- fencing (the controller: take_fence when it takes the lease; every write checked) ---------------------
    def take_fence(self, part: int, token: int, holder: str) -> None:
        """This writer holds partition `part`'s lease with `token`: written, so that any writer with a smaller one
        (the holder before, woken from a pause) is refused from now on. Fenced when a larger token is there."""
        self.db.execute("BEGIN IMMEDIATE")
        with self.db:
            newest = self._newest_token(part)
            if newest is not None and newest > token:
                raise Fenced(f"partition {part}: token {token} is older than the store's {newest}")
            self.db.execute("INSERT OR IGNORE INTO fence(part, token, holder, taken) VALUES (?, ?, ?, ?)",
                            (part, token, holder, time.time()))
            self.db.execute("DELETE FROM fence WHERE part = ? AND token NOT IN (SELECT token FROM fence WHERE "
                            "part = ? ORDER BY token DESC LIMIT ?)", (part, part, FENCE_KEEP))
        self.fence = (part, token)

    def _newest_token(self, part: int) -> int | None:
        return self.db.execute("SELECT MAX(token) FROM fence WHERE part = ?", (part,)).fetchone()[0]

    @contextlib.contextmanager
    def _writing(self):
        """One write transaction, fenced: BEGIN IMMEDIATE takes the write lock first, so no other writer's token can
        land between the check and the commit; then the check (the partition's newest token is ours; a writer
        holding none is refused once any was written) — Fenced, and nothing written, when it fails."""
        self.db.execute("BEGIN IMMEDIATE")
        with self.db:
            if self.fence is None:
                if self.db.execute("SELECT 1 FROM fence LIMIT 1").fetchone():
                    raise Fenced("the store is fenced (a controller holds it) and this writer holds no token")
            else:
                part, token = self.fence
                newest = self._newest_token(part)
                if newest != token:
                    raise Fenced(f"partition {part}: token {token} is no longer the store's ({newest})")
                self.db.execute("UPDATE fence SET last_write = ?, writes = writes + 1 WHERE part = ? AND token = ?",
                                (time.time(), part, token))
            yield

    # ---- writing (the controller) --------------------------------------------------------------------------
    def add(self, frames: Iterable[dict], received: float | None = None) -> tuple[int, int]:
        """Store frames in one transaction: (stored, duplicates). The caller acks them after this returns. A value
        JSON cannot hold (NaN, inf) raises ValueError and nothing of the batch is stored."""
        now = time.time() if received is None else received
        stored = dup = 0
        per_node: dict[str, list[float]] = {}
        frames = list(frames)
        if not frames:      # no transaction at all (a fenced writer's empty batch writes nothing either)
            return 0, 0
        with self._writing():
            for f in frames:
                cur = self.db.execute(
                    "INSERT OR IGNORE INTO frames VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (f["node"], f["job"], f.get("run", ""), f["seq"], f["kind"], float(f["t"]), float(f["dt"]), now,
                     json.dumps(f, separators=(",", ":"), default=str, allow_nan=False)))
                n = per_node.setdefault(f["node"], [0, 0, 0.0])
                if cur.rowcount and f["kind"] == "sample" and compact.seen_in_blocks(
                        self.db, self.books[0], f["node"], f["job"], f.get("run", ""), f["seq"]):
                    self.db.execute("DELETE FROM frames WHERE node = ? AND job = ? AND run = ? AND seq = ?",
                                    (f["node"], f["job"], f.get("run", ""), f["seq"]))
                    cur = None     # compacted already: a duplicate
                if cur is not None and cur.rowcount:
                    stored += 1
                    n[0] += 1
                    if f["kind"] == "sample":
                        n[2] = max(n[2], float(f["t"]))
                else:
                    dup += 1
                    n[1] += 1
            for node, (ok, dups, newest) in per_node.items():
                self.db.execute(
                    "INSERT INTO delivery(node, frames, duplicates, newest_t, last_received) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT(node) DO UPDATE SET frames = frames + excluded.frames, "
                    "duplicates = duplicates + excluded.duplicates, "
                    "newest_t = MAX(COALESCE(newest_t, 0), COALESCE(excluded.newest_t, 0)), "
                    "last_received = excluded.last_received",
                    (node, ok, dups, newest or None, now))
        return stored, dup

    def reject(self, counts: dict[tuple[str, str, int], list[int]], kept: list[tuple]) -> None:
        """Refusals in one transaction: counts {(node, reason, minute): [n, bytes]} added to reject_counts and to
        each node's `delivery.rejected` (node '' : no node could be read from the subject); kept: rows of
        `rejects` (received, subject, node, reason text, size, body)."""
        per_node: dict[str, int] = {}
        with self._writing():
            self.db.executemany(
                "INSERT INTO reject_counts VALUES (?, ?, ?, ?, ?) ON CONFLICT(node, reason, minute) DO UPDATE "
                "SET n = n + excluded.n, bytes = bytes + excluded.bytes",
                [(node, reason, minute, n, size) for (node, reason, minute), (n, size) in counts.items()])
            self.db.executemany("INSERT INTO rejects VALUES (?, ?, ?, ?, ?, ?)", kept)
            for (node, _, _), (n, _) in counts.items():
                if node:
                    per_node[node] = per_node.get(node, 0) + n
            self.db.executemany("INSERT INTO delivery(node, rejected) VALUES (?, ?) ON CONFLICT(node) DO UPDATE "
                                "SET rejected = rejected + excluded.rejected", list(per_node.items()))

    def next_controller_seq(self, node: str, job: str) -> int:
        row = self.db.execute("SELECT MAX(seq) FROM frames WHERE node = ? AND job = ? AND run = 'controller'",
                              (node, job)).fetchone()
        return 0 if row[0] is None else row[0] + 1

    def compact(self, now: float, raw_s: float = compact.RAW_S) -> int:
        """One step of moving samples past the raw window into blocks (compact.compact_step), else of rolling up
        the hours complete (compact.rollup_step): how much was done (0: nothing left). Then each level's
        retention."""
        with self._writing():     # each step commits its own transaction: fenced one by one
            moved = compact.compact_step(self.db, self.books[0], now - raw_s)
        if not moved:
            with self._writing():
                moved = compact.rollup_step(self.db, self.books[0], now - raw_s)
        if not moved:
            with self._writing():
                compact.forget_levels(self.db, now)
        return moved

    def forget_before(self, t: float) -> int:
        """Retention: frames older than t — by their own time and by when they came: a node whose clock is days
        behind has its frames kept for the retention after they came, not deleted at once — and refusals received
        before it. How many frames."""
        with self._writing():
            self.db.execute("DELETE FROM rejects WHERE received < ?", (t,))
            self.db.execute("DELETE FROM reject_counts WHERE minute < ?", (int(t // 60),))
            return self.db.execute("DELETE FROM frames WHERE t < ? AND received < ?", (t, t)).rowcount

    # ---- reading ---------------------------------------------------------------------------------------
    def sql(self, query: str, params: Iterable[Any] = ()) -> tuple[list[str], list[tuple]]:
        cur = self.db.execute(query, tuple(params))
        cols = [d[0] for d in cur.description or ()]
        return cols, cur.fetchall()

    def field(self, job: str, field: str, node: str | None = None, since: float = -math.inf,
              until: float = math.inf) -> tuple[list[str], list[tuple]]:
        """One probe field of a job's samples over time, raw and compacted: `cgroup.cpu_user_ns` is
        probes.cgroup.cpu_user_ns."""
        path = _field_path(field)
        rows = [(n, run, seq, t, dt, v) for book in self.books
                for n, _, run, seq, t, dt, v in compact.column_over(self.db, book, path, since, until, job, node)]
        rows.sort(key=lambda r: (r[3], r[0]))
        return ["node", "run", "seq", "t", "dt", "value"], rows

    def top(self, field: str, since: float, until: float = math.inf, n: int = 10) -> tuple[list[str], list[tuple]]:
        """The nodes with the most of a field over [since, until], every job's samples: (node, sum, max, samples)
        — the cluster's hottest nodes by CPU, memory, I/O…"""
        path = _field_path(field)
        per: dict[str, list] = {}
        for book in self.books:
            for node, (total, peak, k) in compact.totals(self.db, book, path, since, until).items():
                a = per.setdefault(node, [0, peak, 0])
                a[0], a[1], a[2] = a[0] + total, max(a[1], peak), a[2] + k
        rows = sorted(((k, *v) for k, v in per.items()), key=lambda r: -r[1])[:n]
        return ["node", "sum", "max", "samples"], rows

    def samples_of(self, job: str, node: str | None = None, since: float = -math.inf, until: float = math.inf,
                   only: list[tuple] | None = None) -> list[dict]:
        """A job's sample frames, whole (or only the leaves under `only`'s paths, with their keys), raw and
        compacted, from every store read, in time order."""
        out = [f for book in self.books for f in compact.samples(self.db, book, job, node, since, until, only)]
        return sorted(out, key=lambda f: (f["t"], f["node"])) if len(self.books) > 1 else out

    def rolled(self, job: str, field: str, level: int, node: str | None = None,
               since: float = -math.inf) -> tuple[list[str], list[tuple]]:
        """One field of a job from its rollups (level 10 or 60): per node and bucket, n, sum, min, max, mean."""
        path = _field_path(field)
        rows = []
        for r in self.rollups(job, level, node):
            if r["t"] + level <= since:
                continue
            agg = r
            for k in path:
                agg = agg.get(k) if isinstance(agg, dict) else None
            if isinstance(agg, dict) and "sum" in agg:
                rows.append((r["node"], r["run"], r["t"], r["n"], agg["sum"], agg["min"], agg["max"],
                             agg["sum"] / r["n"]))
        return ["node", "run", "t", "n", "sum", "min", "max", "mean"], rows

    def count_samples(self, job: str) -> int:
        """How many samples of a job the store holds, raw and compacted."""
        n = self.sql("SELECT COUNT(*) FROM samples WHERE job = ?", (job,))[1][0][0]
        if compact.has_blocks(self.db, "main"):
            n += self.sql("SELECT COALESCE(SUM(n), 0) FROM blocks WHERE level = 1 AND job = ?", (job,))[1][0][0]
        return n

    def rollups(self, job: str, level: int, node: str | None = None) -> list[dict]:
        """A job's rollups at level 10 or 60 (compact.levels), from every store read."""
        return sorted((r for book in self.books for r in compact.levels(self.db, book, job, level, node)),
                      key=lambda r: (r["t"], r["node"]))

    def expand(self, since: float, until: float = math.inf, job: str | None = None) -> int:
        """A reader's SQL face over compacted samples too: the samples of [since, until] (of one job) decoded from
        their blocks into a TEMP table, and `frames`, `samples`, `events` (TEMP views of the same names) over the
        raw ones and those. How many samples it decoded."""
        self.db.execute("CREATE TEMP TABLE IF NOT EXISTS compacted(node TEXT, job TEXT, run TEXT, seq INTEGER, "
                        "kind TEXT, t REAL, dt REAL, received REAL, body TEXT)")
        n = 0
        for book in self.books:
            if not compact.has_blocks(self.db, book.schema):
                continue
            q = f"SELECT DISTINCT job FROM {book.schema}.blocks WHERE level = 1 AND t1 >= ? AND t0 <= ?"
            for j in ([job] if job is not None else [r[0] for r in self.db.execute(q, (since, until))]):
                rows = [(f["node"], f["job"], f.get("run", ""), f["seq"], "sample", f["t"], f["dt"], None,
                         json.dumps(f, separators=(",", ":"), default=str))
                        for f in compact.samples(self.db, book, j, since=since, until=until, raw=False)]
                self.db.executemany("INSERT INTO temp.compacted VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
                n += len(rows)
        raw = " UNION ALL ".join(f"SELECT * FROM {b.schema}.frames" for b in self.books)
        self.db.executescript(f"""
            DROP VIEW IF EXISTS temp.frames; DROP VIEW IF EXISTS temp.samples; DROP VIEW IF EXISTS temp.events;
            CREATE TEMP VIEW frames AS {raw} UNION ALL SELECT * FROM temp.compacted;
            {views("CREATE TEMP VIEW")}""")
        return n

    def close(self) -> None:
        self.db.close()


def _field_path(field: str) -> tuple:
    if not all(part.replace("_", "").replace("-", "").isalnum() for part in field.split(".")):
        raise ValueError(f"not a field name: {field!r} (probe.field, e.g. cgroup.cpu_user_ns)")
    return ("probes", *(int(p) if p.isdigit() else p for p in field.split(".")))   # 0: a list's first


def _union(files: list[str]) -> sqlite3.Connection:
    """One read-only connection over several stores: each attached, and TEMP views of the same names as a store's
    tables and views over all of them."""
    if len(files) > MAX_STORES:
        raise ValueError(f"{len(files)} stores: at most {MAX_STORES} can be read as one (query them in groups)")
    db = sqlite3.connect("file::memory:", uri=True, timeout=30)
    for k, f in enumerate(files):
        db.execute("ATTACH DATABASE ? AS ?", (f"file:{f}?mode=ro", f"p{k}"))

    def every(table: str) -> str:
        return " UNION ALL ".join(f"SELECT * FROM p{k}.{table}" for k in range(len(files)))
    db.executescript(f"""
        CREATE TEMP VIEW frames AS {every('frames')};
        CREATE TEMP VIEW rejects AS {every('rejects')};
        CREATE TEMP VIEW reject_counts AS {every('reject_counts')};
        CREATE TEMP VIEW delivery AS SELECT node, SUM(frames) AS frames, SUM(duplicates) AS duplicates,
            SUM(rejected) AS rejected, MAX(newest_t) AS newest_t, MAX(last_received) AS last_received,
            SUM(lost) AS lost FROM ({every('delivery')}) GROUP BY node;
        {views("CREATE TEMP VIEW")}""")
    return db
