# SPDX-License-Identifier: Apache-2.0
"""Unit tier: a store written by each earlier schema (PRAGMA user_version 0, 1, 2) opens, is brought to this one
(cluster/store.py migrate) and answers `summary` and `query` as it did before.

Each earlier store is made the way it was: a store of this version with raw samples, level-1 blocks and rollups is
taken back to the older schema by the changes its migration undoes (0: `rejects` without bodies, no
`reject_counts`; 1: blocks without `received`; 2: no `hour`, a rollup's hour in its seq0), so the answers of the
same data before and after are compared.
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest

from conftest import SAMPLES_T0, samples
from jobprobe.cluster import compact
from jobprobe.cluster.store import VERSION, Store

HOUR = int(compact.HOUR)


def answers(path) -> dict[str, str]:
    """What the command line says of the store: the job's summary and a rolled-up field."""
    def cli(*args: str) -> str:
        res = subprocess.run([sys.executable, "-m", "jobprobe.cli", *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout
    summary = json.loads(cli("summary", "--store", str(path), "--job", "j", "--format", "json"))
    return {"summary": json.dumps(summary, sort_keys=True),
            **{f"query {level}": cli("query", "--store", str(path), "--job", "j", "--field", "cgroup.cpu_user_ns",
                                     "--level", str(level), "--format", "jsonl") for level in (10, 60)},
            "raw": cli("query", "--store", str(path), "--job", "j", "--field", "cgroup.cpu_user_ns",
                       "--format", "jsonl")}


def downgrade(path, version: int) -> None:
    """The store at `path` taken back to schema `version` (what migrate's steps from it undo)."""
    db = sqlite3.connect(path)
    with db:
        if version < 3:
            db.execute("UPDATE blocks SET seq0 = hour, seq1 = hour WHERE level IN (10, 60)")
            db.execute("ALTER TABLE blocks DROP COLUMN hour")
        if version < 2:
            db.execute("ALTER TABLE blocks DROP COLUMN received")
        if version < 1:
            db.execute("ALTER TABLE rejects DROP COLUMN body")
            db.execute("DROP TABLE reject_counts")
        db.execute(f"PRAGMA user_version = {version}")
    db.close()


@pytest.mark.parametrize("version", range(VERSION))
def test_a_store_of_each_earlier_version_opens_and_answers_as_it_did(tmp_path, version):
    path = tmp_path / "s.db"
    store = Store(path)
    start = (int(SAMPLES_T0) // HOUR + 1) * HOUR - 200         # across an hour's end: two hours rolled up
    store.add(samples("a", "j", 400, start=start) + samples("b", "j", 400, start=start), received=start + 400)
    late = start + 2 * HOUR + 10
    store.add(samples("a", "j", 30, start=start + 400, seq0=400), received=late)   # came late: still raw
    while store.compact(start + 2 * HOUR, raw_s=0):
        pass
    store.close()
    hours = sqlite3.connect(path).execute("SELECT DISTINCT hour FROM blocks WHERE level = 60").fetchall()
    assert len(hours) == 2, hours
    before = answers(path)
    downgrade(path, version)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == version
    assert answers(path) == before                          # a reader of the old store, not migrated
    Store(path).close()                                     # a writer opens it: migrated
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == VERSION
    # the rollups' hours back in `hour`, their seq0..seq1 the frames they rolled up
    rows = db.execute("SELECT b.hour, b.seq0, b.seq1, (SELECT MIN(seq0) FROM blocks l WHERE l.level = 1 AND "
                      "l.node = b.node AND l.hour = b.hour), (SELECT MAX(seq1) FROM blocks l WHERE l.level = 1 AND "
                      "l.node = b.node AND l.hour = b.hour) FROM blocks b WHERE level IN (10, 60)").fetchall()
    assert len(rows) == 8 and all(h in {x for (x,) in hours} and (s0, s1) == (m0, m1) for h, s0, s1, m0, m1 in rows)
    assert answers(path) == before
    # and it goes on: the late samples and the next hour's compacted, their hours rolled up again beside the
    # migrated rollups, each bucket once
    store = Store(path)
    store.add(samples("a", "j", 60, start=start + 2 * HOUR, seq0=10_000), received=late)
    while store.compact(late + 4 * HOUR, raw_s=0):
        pass
    assert store.sql("SELECT COUNT(*) FROM frames WHERE kind = 'sample'")[1] == [(0,)]
    per = [(r["node"], r["t"]) for r in store.rollups("j", 60)]
    assert len(per) == len(set(per)) and {h for (h,) in store.sql("SELECT DISTINCT hour FROM blocks WHERE level = "
                                                                   "60 AND node = 'a'")[1]} == \
        {x for (x,) in hours} | {(start + 2 * HOUR) // HOUR}
    n = sum(r["n"] for r in store.rollups("j", 60))
    assert n == 400 + 400 + 30 + 60, n
    store.close()
