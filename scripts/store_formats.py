# SPDX-License-Identifier: Apache-2.0
"""What a store costs per sample, by format, on real frames: the numbers the store's format is chosen by.

    python scripts/store_formats.py FRAMES.mpk… [--json OUT]

The sample frames of the files (an agent's --out, `jobprobe run --out`) are written in each format into a scratch
directory and the bytes on disk divided by the samples:
- sqlite-json: today's store (jobprobe/cluster/store.py: each frame a JSON body, its indexes);
- sqlite-wide: one typed column per numeric field (lists flattened, field.0, field.1, …), the rest JSON;
- sqlite-blocks: one row per node, job, run and minute; each field's values of that minute one column — integers
  delta-encoded, floats as they are — zlib-compressed into a BLOB, the rest zlib'd msgpack (column names in
  every block);
- store-compacted: the store itself past its raw window (jobprobe/cluster/compact.py: lossless column blocks a
  minute long, paths in a codebook, floats byte-transposed), with its 10 s and 1 min rollups counted apart;
- parquet-zstd, duckdb: the wide table in those formats, when pyarrow / duckdb are installed.
MB per node-day = bytes per sample × 86 400 / 10⁶ (one sample a second).

`--gpus N` adds to each sample the gpu probe's section of N GPUs of a training node (this machine has none):
every field of probes/gpu.py's `gpus[]`, values moving as a busy H100's do — utilization, power, energy, PCIe and
NVLink rates and the job's floats changing every second, clocks mostly steady, temperatures drifting, errors 0 —
synthetic, so its figure is an estimate, labelled as such.
"""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import tempfile
import zlib
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobprobe.cluster.report import frames_of_files  # noqa: E402
from jobprobe.cluster.store import Store  # noqa: E402


def flat(probes: dict) -> tuple[dict, dict]:
    """(numeric leaves as probe.field[.i] → number or None, the rest as probe.field → value)."""
    nums, rest = {}, {}
    for p, fields in probes.items():
        if not isinstance(fields, dict):
            rest[p] = fields
            continue
        for k, v in fields.items():
            name = f"{p}.{k}"
            if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                nums[name] = v
            elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                for i, x in enumerate(v):
                    nums[f"{name}.{i}"] = x
            else:
                rest[name] = v
    return nums, rest


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))


def sqlite_json(samples: list[dict], d: Path) -> int:
    st = Store(d / "json.db")
    st.add(samples)
    st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    st.db.execute("VACUUM")
    st.close()
    return size(d / "json.db")


def wide_rows(samples: list[dict]) -> tuple[list[str], list[tuple]]:
    cols: dict[str, bool] = {}       # name → every value an int
    flats = []
    for f in samples:
        nums, rest = flat(f["probes"])
        for k, v in nums.items():
            cols[k] = cols.get(k, True) and (v is None or isinstance(v, int))
        flats.append((f, nums, rest))
    names = sorted(cols)
    rows = [(f["node"], f["job"], f.get("run", ""), f["seq"], f["t"], f["dt"],
             *[nums.get(c) for c in names], json.dumps(rest, separators=(",", ":"), default=str) if rest else None)
            for f, nums, rest in flats]
    return ["node", "job", "run", "seq", "t", "dt", *names, "rest"], rows, cols


def sqlite_wide(samples: list[dict], d: Path) -> int:
    names, rows, ints = wide_rows(samples)
    db = sqlite3.connect(d / "wide.db")
    decl = ", ".join(f'"{c}" {"INTEGER" if ints.get(c, True) else "REAL"}' for c in names[6:-1])
    db.execute(f'CREATE TABLE s(node TEXT, job TEXT, run TEXT, seq INTEGER, t REAL, dt REAL, {decl}, rest TEXT, '
               'PRIMARY KEY (node, job, run, seq)) WITHOUT ROWID')
    db.executemany(f"INSERT INTO s VALUES ({','.join('?' * len(names))})", rows)
    db.commit()
    db.execute("VACUUM")
    db.close()
    return size(d / "wide.db")


def block(values: list, integer: bool) -> bytes:
    """One field's values over a block: integers delta-encoded (None as a mask), floats as they are."""
    mask = bytes(v is None for v in values)
    if integer:
        prev, deltas = 0, []
        for v in values:
            x = 0 if v is None else v
            deltas.append(x - prev)
            prev = x
        body = msgpack.packb(deltas)
    else:
        body = msgpack.packb([0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
                              for v in values])
    return zlib.compress((b"\1" + mask if any(mask) else b"\0") + body, 6)


def sqlite_blocks(samples: list[dict], d: Path, seconds: int = 60) -> int:
    names, rows, ints = wide_rows(samples)
    groups: dict[tuple, list[tuple]] = {}
    for r in rows:
        groups.setdefault((r[0], r[1], r[2], int(r[4] // seconds)), []).append(r)
    db = sqlite3.connect(d / "blocks.db")
    db.execute("CREATE TABLE b(node TEXT, job TEXT, run TEXT, minute INTEGER, n INTEGER, seq0 INTEGER, t BLOB, "
               "cols BLOB, rest BLOB, PRIMARY KEY (node, job, run, minute)) WITHOUT ROWID")
    for (node, job, run, minute), rs in groups.items():
        cols = {c: block([r[6 + i] for r in rs], ints.get(c, True)) for i, c in enumerate(names[6:-1])}
        db.execute("INSERT INTO b VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (node, job, run, minute, len(rs), rs[0][3], block([round(r[4] * 1000) for r in rs], True),
                    msgpack.packb(cols), zlib.compress(msgpack.packb([r[-1] for r in rs]), 6)))
    db.commit()
    db.execute("VACUUM")
    db.close()
    return size(d / "blocks.db")


def store_compacted(samples: list[dict], d: Path) -> tuple[int, dict]:
    """(bytes per sample of the store's level-1 blocks, {level: of its rollups}): the blocks table's pages (after a
    VACUUM) shared out between the levels by their bytes, its indexes' with them. Left out: what a store holds once
    whatever its size (the codebook of paths, empty tables' pages)."""
    st = Store(d / "compact.db")
    st.add(samples)
    now = max(f["t"] for f in samples) + 7200
    while st.compact(now, raw_s=0):
        pass
    st.db.execute("VACUUM")
    pages = dict(st.db.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall())
    levels = dict(st.db.execute("SELECT level, SUM(LENGTH(data)) FROM blocks GROUP BY level").fetchall())
    st.close()
    block_pages = sum(pages.get(t, 0) for t in ("blocks", "blocks_job", "blocks_t"))
    share = {lv: round(block_pages * levels.get(lv, 0) / max(1, sum(levels.values()))) for lv in (1, 10, 60)}
    return share[1], {lv: share[lv] for lv in (10, 60)}


def parquet(samples: list[dict], d: Path) -> int | None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    names, rows, _ = wide_rows(samples)
    table = pa.table({c: [r[i] for r in rows] for i, c in enumerate(names)})
    pq.write_table(table, d / "s.parquet", compression="zstd", row_group_size=1 << 20)
    return (d / "s.parquet").stat().st_size


def duck(samples: list[dict], d: Path) -> int | None:
    try:
        import duckdb
    except ImportError:
        return None
    names, rows, ints = wide_rows(samples)
    con = duckdb.connect(str(d / "s.duckdb"))
    decl = ", ".join(f'"{c}" {"BIGINT" if ints.get(c, True) else "DOUBLE"}' for c in names[6:-1])
    con.execute(f"CREATE TABLE s(node VARCHAR, job VARCHAR, run VARCHAR, seq BIGINT, t DOUBLE, dt DOUBLE, {decl}, "
                "rest VARCHAR)")
    con.executemany(f"INSERT INTO s VALUES ({','.join('?' * len(names))})", rows)
    con.execute("CHECKPOINT")
    con.close()
    return size(d / "s.duckdb")


def with_gpus(samples: list[dict], n: int) -> list[dict]:
    """The samples with a synthetic gpu section of n GPUs (see the module's docstring)."""
    import random
    rnd = random.Random(11)
    temp = [65.0] * n
    out = []
    for f in samples:
        gpus = []
        for i in range(n):
            temp[i] = min(85.0, max(45.0, temp[i] + rnd.uniform(-0.4, 0.4)))
            util = min(100, max(0, int(rnd.gauss(93, 5))))
            power = int(rnd.gauss(550_000, 60_000))
            gpus.append({
                "index": i, "uuid": f"GPU-6f3c2a8e-1b4d-4c5e-9f0a-{i:012d}", "name": "NVIDIA H100 80GB HBM3",
                "rule": "process", "lost": False, "shared": False, "job_procs": 1, "other_procs": 0,
                "job_mem_bytes": 71_000_000_000 + rnd.choice((0, 0, 0, 2 << 20)),
                "procs": [{"pid": 41000 + i, "mem_bytes": 71_000_000_000}], "sharing": "exclusive",
                "job_mem_share": 71_000_000_000 / 85_520_809_984, "job_sm_pct": util * rnd.uniform(0.97, 1.0),
                "job_mem_util_pct": rnd.uniform(30, 50), "job_enc_pct": 0.0, "job_dec_pct": 0.0,
                "others_sm_pct": 0.0, "util_samples": rnd.choice((5, 6)), "util_source": "ProcessesUtilizationInfo",
                "job_energy_mj": power * rnd.uniform(0.98, 1.02), "energy_split": "exclusive", "accounting": False,
                "exited": [], "util_gpu_pct": util, "util_mem_pct": int(rnd.gauss(40, 8)),
                "mem_used_bytes": 71_500_000_000 + rnd.choice((0, 0, 0, 2 << 20)), "mem_total_bytes": 85_520_809_984,
                "sm_clock_mhz": 1980 if rnd.random() < 0.9 else 1755, "mem_clock_mhz": 2619, "power_mw": power,
                "energy_mj": int(power * rnd.uniform(0.98, 1.02)), "temp_c": int(temp[i]),
                "pcie_tx_bytes_per_s": int(rnd.uniform(1e8, 5e9)), "pcie_rx_bytes_per_s": int(rnd.uniform(1e8, 5e9)),
                "nvlink_tx_bytes": int(rnd.gauss(9e10, 1e10)), "nvlink_rx_bytes": int(rnd.gauss(9e10, 1e10)),
                "clock_event_reasons": 0, "clock_event_names": [], "ecc_corrected": 0, "ecc_uncorrected": 0,
                "remapped_rows_corrected": 0, "remapped_rows_uncorrected": 0, "remap_pending": False,
                "remap_failure": False, "xid_errors": 0, "gpm_sm_active_pct": rnd.uniform(80, 99),
                "gpm_sm_occupancy_pct": rnd.uniform(40, 60), "gpm_tensor_active_pct": rnd.uniform(50, 80),
                "gpm_dram_bw_pct": rnd.uniform(30, 60), "ofu_pct": rnd.uniform(50, 80), "mig": []})
        probes = {**f["probes"], "gpu": {"gpus": gpus, "ngpus": n, "node_gpus": n}}
        out.append({**f, "probes": probes, "status": {**f.get("status", {}), "gpu": "ok"}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--gpus", type=int, default=0, metavar="N", help="add a synthetic gpu section of N GPUs")
    args = ap.parse_args()
    samples = [f for f in frames_of_files(args.files) if f.get("kind") == "sample"]
    if args.gpus:
        samples = with_gpus(samples, args.gpus)
    if not samples:
        print("no sample frames in the files", file=sys.stderr)
        return 2
    out = {"samples": len(samples), "fields": len(wide_rows(samples[:1])[0]) - 7, "synthetic_gpus": args.gpus}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name, fn in (("sqlite-json", sqlite_json), ("sqlite-wide", sqlite_wide), ("sqlite-blocks", sqlite_blocks),
                         ("store-compacted", store_compacted), ("parquet-zstd", parquet), ("duckdb", duck)):
            n = fn(samples, d)
            if isinstance(n, tuple):
                n, ups = n
                for lv, b in ups.items():
                    keep = {10: 7, 60: 90}[lv]
                    out[f"rollup_{lv}s"] = {"bytes_per_sample": round(b / len(samples), 1),
                                            "mb_per_node_day": round(b / len(samples) * 86400 / 1e6, 2),
                                            "kept_days": keep}
                    per = b / len(samples)
                    print(f"  rollup {lv:>2} s  {per:8.1f} B/sample  {per * 86400 / 1e6:7.2f} "
                          f"MB/node-day (kept {keep} days: {per * 86400 / 1e6 * keep:.1f} MB per node)",
                          flush=True)
            if n is not None:
                out[name] = {"bytes_per_sample": round(n / len(samples), 1),
                             "mb_per_node_day": round(n / len(samples) * 86400 / 1e6, 1)}
                print(f"{name:14} {n / len(samples):8.1f} B/sample  {n / len(samples) * 86400 / 1e6:7.1f} MB/node-day",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
