# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench store`: the store's queries over a simulated day of a cluster.

A store holding `hours` of `nodes` nodes at 1 s (jobs of 8 nodes), generated straight into the store's format
(ingesting a day through NATS would take a day): level-1 blocks of the standard sample of `bench controller`, its
values varied per sample; each block's columns spliced from a few encoded templates with its own times, seqs and
names (encoding every block would take an hour here). Rollups are not made (the queries read the last hour: its
level-1 blocks). Then, in a reader of the file as `jobprobe query` opens it:
- one job's field over the last hour of its 8 nodes (`jobprobe query --job J --field cgroup.cpu_user_ns --last 3600`);
- the cluster's hottest nodes by CPU over the last hour (`jobprobe query --top cgroup.cpu_user_ns --last 3600`);
each timed cold (the first, the file's pages maybe not in memory) and warm (median of 5).
"""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from jobprobe.bench.controller import PROBES, STATUS
from jobprobe.bench.overhead import scratch
from jobprobe.cluster import blocks, compact
from jobprobe.core.frame import FrameBuilder

TEMPLATES = 8


def bench_store(nodes: int = 200, hours: float = 24.0, workdir: str | None = None, progress=None) -> dict:
    with scratch(workdir, "jobprobe-bench-store-") as work:
        return _bench(nodes, hours, work, progress)


def _vary(rnd: random.Random, probes: dict) -> dict:
    out = {}
    for p, fields in probes.items():
        o = {}
        for k, v in fields.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                o[k] = v
            elif isinstance(v, int):
                o[k] = max(0, int(v * rnd.uniform(0.8, 1.2)))
            else:
                o[k] = v * rnd.uniform(0.8, 1.2)
        out[p] = o
    return out


def generate(path: Path, nodes: int, hours: float, end: float, say=lambda s: None) -> int:
    """The store at `path`: level-1 blocks of `nodes` nodes for the `hours` before `end`. How many samples."""
    from jobprobe.cluster.store import Store
    st = Store(path)
    book = st.books[0]
    rnd = random.Random(7)
    n = int(compact.BLOCK_S)
    templates = []
    with st.db:
        for k in range(TEMPLATES):
            b = FrameBuilder("template", "template", run="template")
            templates.append(blocks.parts(blocks.encode(
                [b.sample(end + i, 1.0, _vary(rnd, PROBES), STATUS) for i in range(n)], book.id)))
    spans = int(hours * 3600 // n)
    start = end - spans * n
    total = 0
    t0 = time.monotonic()
    for node in range(nodes):
        name, job, run = f"sim{node:05d}", f"job{node // 8}", f"run{node:05d}"
        rows = []
        for s in range(spans):
            ts = start + s * n
            keys = blocks.parts(blocks.encode([{"t": ts + i + 1.0, "seq": s * n + i, "node": name, "job": job,
                                                "run": run} for i in range(n)], book.id))[1]
            spliced = {c[0]: c for c in templates[(node + s) % TEMPLATES][1]}
            spliced.update({c[0]: c for c in keys})
            rows.append((1, name, job, run, s * n, s * n + n - 1, ts + 1.0, ts + n, n,
                         blocks.pack(n, list(spliced.values())), ts + n, int((ts + 1.0) // compact.HOUR)))
        with st.db:
            st.db.executemany("INSERT OR REPLACE INTO blocks(level, node, job, run, seq0, seq1, t0, t1, n, data, "
                              "received, hour) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        total += spans * n
        if node % 50 == 49:
            say(f"{node + 1} nodes written ({time.monotonic() - t0:.0f} s)")
    st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    st.close()
    return total


def _timed(fn) -> tuple[float, float, object]:
    t = time.perf_counter()
    out = fn()
    cold = time.perf_counter() - t
    warm = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t)
    return cold, statistics.median(warm), out


def _bench(nodes: int, hours: float, work: Path, progress) -> dict:
    from jobprobe.cluster.store import Store
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    path = work / "store.db"
    end = float(int(time.time()) // 3600 * 3600)
    t = time.monotonic()
    samples = generate(path, nodes, hours, end, say)
    res: dict = {"nodes": nodes, "hours": hours, "samples": samples, "generated_s": round(time.monotonic() - t, 1),
                 "store_mb": round(path.stat().st_size / 1e6, 1)}
    st = Store(path, readonly=True)
    try:
        cold, warm, (_, rows) = _timed(lambda: st.field("job0", "cgroup.cpu_user_ns", since=end - 3599.5))
        assert len(rows) == 8 * 3600, len(rows)
        res["job_field_hour_8_nodes"] = {"rows": len(rows), "cold_s": round(cold, 3), "warm_s": round(warm, 3)}
        cold, warm, (_, top) = _timed(lambda: st.top("cgroup.cpu_user_ns", end - 3599.5))
        assert sum(r[3] for r in st.top("cgroup.cpu_user_ns", end - 3599.5, n=nodes)[1]) == nodes * 3600
        res["hottest_node_hour"] = {"node": top[0][0], "cold_s": round(cold, 3), "warm_s": round(warm, 3)}
    finally:
        st.close()
    say(str(res))
    return res


def markdown(res: dict) -> str:
    f, h = res["job_field_hour_8_nodes"], res["hottest_node_hour"]
    return "\n".join([
        "| | |", "| - | - |",
        f"| a simulated day: {res['nodes']} nodes × {res['hours']:.0f} h at 1 s ({res['samples']:,} samples) | "
        f"store {res['store_mb']} MB (values varied at random: size from real frames is scripts/store_formats.py's) |",
        f"| one job's field over the last hour, 8 nodes ({f['rows']} rows) | {f['cold_s']} s cold, {f['warm_s']} s "
        "warm |",
        f"| the hottest node by CPU over the last hour, every node | {h['cold_s']} s cold, {h['warm_s']} s warm |",
    ])
