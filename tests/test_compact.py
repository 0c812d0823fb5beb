# SPDX-License-Identifier: Apache-2.0
"""The store past its raw window (jobprobe/cluster/compact.py, jobprobe/cluster/blocks.py): column blocks give back
the frames they took, exactly; rollups equal the raw samples aggregated by hand; exactly once holds across the
compaction; each level goes at its own retention."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SAMPLES_T0 as T0
from conftest import samples
from jobprobe.cluster import blocks, compact
from jobprobe.cluster.store import Store
from jobprobe.core.frame import FrameBuilder

keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.floats(allow_nan=False), st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
frame_like = st.dictionaries(keys, values, max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(frame_like, min_size=1, max_size=12))
def test_a_block_gives_back_exactly_the_frames_it_took(frames):
    """Any maps at all — ints past 64 bits, floats, None, bools, strings, ragged lists, empty maps, keys missing in
    some frames — come back equal and of the same types, whole and with a codebook of paths."""
    assert blocks.decode(blocks.encode(frames)) == frames
    book: dict[tuple, int] = {}
    rev: dict[int, tuple] = {}

    def ids(p: tuple) -> int:
        if p not in book:
            book[p] = len(book)
            rev[book[p]] = p
        return book[p]
    assert blocks.decode(blocks.encode(frames, ids), paths=rev.__getitem__) == frames
    out = blocks.decode(blocks.encode(frames, ids), paths=rev.__getitem__)
    assert typed(out) == typed(frames)  # the same types, not only equal values (1 == 1.0 == True); key order may differ


def test_a_block_says_its_format_and_one_of_an_unknown_format_is_refused():
    """Each block starts with its format (blocks.FORMAT): a block of before formats ([n, columns]: format 0, what a
    store of an older version holds) reads the same; one of a newer format, or bytes that are no block, are refused
    with a line that says so — never misread."""
    import msgpack
    import pytest
    frames = samples("a", "j", 5)
    new = blocks.encode(frames)
    assert msgpack.unpackb(new)[0] == blocks.FORMAT == 1
    n, cols = blocks.parts(new)
    old = msgpack.packb([n, cols], use_bin_type=True)               # format 0
    assert blocks.decode(old) == frames == blocks.decode(new)
    assert blocks.column(old, ["probes", "cgroup", "cpu_user_ns"]) == [f["probes"]["cgroup"]["cpu_user_ns"]
                                                                       for f in frames]
    for bad, says in ((msgpack.packb([blocks.FORMAT + 1, n, cols], use_bin_type=True), "format 2"),
                      (msgpack.packb({"n": 1}), "not a block")):
        with pytest.raises(ValueError, match=says):
            blocks.decode(bad)


def typed(x):
    """A value with each scalar's type beside it and maps in key order: equal only if types and values are."""
    if isinstance(x, dict):
        return ("map", sorted((k, typed(v)) for k, v in x.items()))
    if isinstance(x, list):
        return ("list", [typed(v) for v in x])
    return (type(x).__name__, repr(x))


def test_compacted_samples_come_back_whole_and_once(tmp_path):
    st_ = Store(tmp_path / "s.db")
    raw = samples("a", "j", 150) + samples("b", "j", 150)
    st_.add(raw, received=T0 + 1000)
    before = st_.samples_of("j")
    assert len(before) == 300
    while st_.compact(T0 + 5000):
        pass
    assert st_.sql("SELECT COUNT(*) FROM frames WHERE kind = 'sample'")[1] == [(0,)]
    blocks_of = {(f["node"], f["t"] // compact.BLOCK_S) for f in raw}
    assert st_.sql("SELECT COUNT(*) FROM blocks WHERE level = 1")[1][0][0] == len(blocks_of)
    after = st_.samples_of("j")
    assert after == before == sorted(raw, key=lambda f: (f["t"], f["node"]))
    assert st_.count_samples("j") == 300
    cols, rows = st_.field("j", "cgroup.cpu_user_ns", node="a")
    assert [r[5] for r in rows] == [f["probes"]["cgroup"]["cpu_user_ns"] for f in raw[:150]]
    # a resend of compacted samples stores nothing; a late one (its seq never came) is kept, and compacted too
    assert st_.add(raw[:20] + raw[200:210], received=T0 + 1000) == (0, 30)
    late = samples("a", "j", 1, start=T0 + 400, seq0=10 ** 6)
    assert st_.add(late, received=T0 + 1000) == (1, 0)
    while st_.compact(T0 + 5000):
        pass
    assert len(st_.samples_of("j")) == 301 and st_.add(late, received=T0 + 1000) == (0, 1)
    st_.close()
    # a reader of the file sees the same
    ro = Store(tmp_path / "s.db", readonly=True)
    assert ro.samples_of("j", node="b") == raw[150:]
    ro.close()


def test_rollups_equal_the_raw_samples_aggregated_by_hand(tmp_path):
    st_ = Store(tmp_path / "s.db")
    raw = samples("a", "j", 185, start=T0 + 7)      # buckets cut mid-way, at both ends
    late = samples("a", "j", 1, start=T0 + 33.5, seq0=5000)   # a late sample in a bucket compacted before it
    st_.add(raw, received=T0 + 1000)
    while st_.compact(T0 + 5000):
        pass
    st_.add(late, received=T0 + 1000)
    while st_.compact(T0 + 5000):
        pass
    every = raw + late
    for level in (10, 60):
        got = {r["t"]: r for r in st_.rollups("j", level)}
        by_hand: dict[float, list[dict]] = {}
        for f in every:
            by_hand.setdefault(math.floor(f["t"] / level) * level, []).append(f)
        assert sorted(got) == sorted(by_hand)
        for t, fs in by_hand.items():
            r = got[t]
            assert r["n"] == len(fs) and r["dt"] == sum(f["dt"] for f in fs)
            assert (r["t0"], r["t1"]) == (min(f["t"] for f in fs), max(f["t"] for f in fs))
            for probe, field in (("cgroup", "cpu_user_ns"), ("cgroup", "mem_bytes"), ("sched", "runq_lat_p99_us")):
                vals = [f["probes"][probe][field] for f in fs]
                agg = r["probes"][probe][field]
                assert agg["min"] == min(vals) and agg["max"] == max(vals)
                assert math.isclose(agg["sum"], sum(vals), rel_tol=1e-12)
            assert "gpu" not in r["probes"] and set(r["probes"]["net"]) == {"top_peers"}   # None, strings: not
            peer = [f["probes"]["net"]["top_peers"][0]["tx_bytes"] for f in fs]    # a list of maps: by index
            assert r["probes"]["net"]["top_peers"][0]["tx_bytes"] == \
                {"sum": sum(peer), "min": min(peer), "max": max(peer)}
            assert "runq_lat_us_log2" not in r["probes"]["sched"]                   # lists of numbers: not
        rows = st_.rolled("j", "cgroup.cpu_user_ns", level)[1]                  # query --field --level
        assert [(t, n, total) for _, _, t, n, total, _, _, _ in rows] == [
            (t, len(fs), sum(f["probes"]["cgroup"]["cpu_user_ns"] for f in fs)) for t, fs in sorted(by_hand.items())]


def test_each_level_goes_at_its_own_retention(tmp_path):
    st_ = Store(tmp_path / "s.db")
    raw = samples("a", "j", 120)
    st_.add(raw, received=T0 + 1000)
    while st_.compact(T0 + 5000):
        pass
    count = {lv: st_.sql("SELECT COUNT(*) FROM blocks WHERE level = ?", (lv,))[1][0][0] for lv in (1, 10, 60)}
    minutes = len({f["t"] // compact.BLOCK_S for f in raw})
    hours = len({f["t"] // 3600 for f in raw})         # a rollup block per hour and level
    assert count == {1: minutes, 10: hours, 60: hours}     # (minutes: level-1 blocks, BLOCK_S each)
    # a level's blocks go once both their time and when they came are past its retention (they came at T0 + 1000)
    compact.forget_levels(st_.db, T0 + 1000 + compact.LEVELS[1] - 1)          # a day after their time, not after
    assert st_.sql("SELECT COUNT(*) FROM blocks WHERE level = 1")[1][0][0] == minutes     # they came: kept
    compact.forget_levels(st_.db, T0 + 1000 + compact.LEVELS[1] + 1)          # a day on: the 1 s level gone
    assert [st_.sql("SELECT COUNT(*) FROM blocks WHERE level = ?", (lv,))[1][0][0] for lv in (1, 10, 60)] == \
        [0, hours, hours]
    compact.forget_levels(st_.db, T0 + 1000 + compact.LEVELS[10] + 1)
    assert [st_.sql("SELECT COUNT(*) FROM blocks WHERE level = ?", (lv,))[1][0][0] for lv in (1, 10, 60)] == \
        [0, 0, hours]
    compact.forget_levels(st_.db, T0 + 1000 + compact.LEVELS[60] + 1)
    assert st_.sql("SELECT COUNT(*) FROM blocks")[1] == [(0,)]


def test_a_node_eight_days_behind_is_kept_for_the_retention_after_its_frames_came(tmp_path):
    """A node whose clock is 8 days behind: its frames' times are past every retention the moment they come. Kept
    — raw, then compacted, then rolled up — for each retention counted from when they came; gone after it. (Before:
    deleted by the first sweep, a minute after they came, without a word.)"""
    st_ = Store(tmp_path / "s.db")
    came = T0 + 8 * 86400
    st_.add(samples("late", "j", 120), received=came)
    assert st_.forget_before(came + 60 - 7 * 86400) == 0           # the controller's sweep a minute on: kept
    assert st_.sql("SELECT COUNT(*) FROM frames")[1][0][0] == 120
    while st_.compact(came + 700):                                  # past the raw window after they came
        pass
    compact.forget_levels(st_.db, came + 700)
    assert st_.sql("SELECT SUM(n) FROM blocks WHERE level = 1")[1][0][0] == 120
    assert {lv for (lv,) in st_.sql("SELECT level FROM blocks")[1]} == {1, 10, 60}
    compact.forget_levels(st_.db, came + compact.LEVELS[1] + 1)
    assert {lv for (lv,) in st_.sql("SELECT level FROM blocks")[1]} == {10, 60}


def test_a_field_over_a_window_and_the_hottest_nodes_read_raw_and_compacted_alike(tmp_path):
    """field() and top() over a window: the same rows whether the samples are raw or in blocks, and equal to the
    samples filtered and summed by hand; and through `jobprobe query --top`."""
    import subprocess
    import sys
    from pathlib import Path
    st_ = Store(tmp_path / "s.db")
    raw = [f for n in ("a", "b", "c") for f in samples(n, f"j{n}", 700)]
    st_.add(raw, received=T0 + 1000)
    lo, hi = T0 + 100, T0 + 650

    def by_hand_top() -> list[tuple]:
        per: dict[str, list] = {}
        for f in raw:
            if lo <= f["t"] <= hi:
                v = f["probes"]["cgroup"]["cpu_user_ns"]
                a = per.setdefault(f["node"], [0, v, 0])
                a[0], a[1], a[2] = a[0] + v, max(a[1], v), a[2] + 1
        return sorted(((k, *v) for k, v in per.items()), key=lambda r: -r[1])
    want_field = [(f["node"], "r1", f["seq"], f["t"], f["dt"], f["probes"]["cgroup"]["cpu_user_ns"]) for f in raw
                  if f["job"] == "jb" and lo <= f["t"] <= hi]
    raw_field, raw_top = st_.field("jb", "cgroup.cpu_user_ns", since=lo, until=hi)[1], st_.top("cgroup.cpu_user_ns",
                                                                                               lo, hi)[1]
    while st_.compact(T0 + 5000):
        pass
    assert st_.sql("SELECT COUNT(*) FROM frames WHERE kind = 'sample'")[1] == [(0,)]
    assert st_.field("jb", "cgroup.cpu_user_ns", since=lo, until=hi)[1] == raw_field == want_field
    assert st_.top("cgroup.cpu_user_ns", lo, hi)[1] == raw_top == by_hand_top()
    st_.close()
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "query", "--store", str(tmp_path / "s.db"), "--top",
                        "cgroup.cpu_user_ns", "--last", str(10 ** 10), "--format", "csv"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [ln.split(",")[0] for ln in r.stdout.split()[1:]] == [row[0] for row in sorted(
        ((n, sum(f["probes"]["cgroup"]["cpu_user_ns"] for f in raw if f["node"] == n)) for n in "abc"),
        key=lambda x: -x[1])]


def test_the_sql_face_sees_compacted_samples_of_the_window_asked(tmp_path):
    """`jobprobe query --sql … --last S`: `samples` and `frames` hold the compacted samples of the window too, once
    each, bodies equal to the frames; without --last, the raw window's only."""
    import json
    st_ = Store(tmp_path / "s.db")
    raw = samples("a", "j", 900) + samples("b", "j", 900)
    st_.add(raw, received=T0)
    while st_.compact(T0 + 900 + 600 - 300):      # the last 300 s stay raw
        pass
    st_.close()
    ro = Store(tmp_path / "s.db", readonly=True)
    left = ro.sql("SELECT COUNT(*) FROM samples")[1][0][0]
    assert 0 < left < 1800
    assert ro.expand(T0 + 100) == sum(1 for f in raw if f["t"] >= T0 + 100) - left
    got = ro.sql("SELECT body FROM samples WHERE t >= ? ORDER BY t, node", (T0 + 100,))[1]
    assert [json.loads(b) for (b,) in got] == sorted((f for f in raw if f["t"] >= T0 + 100),
                                                      key=lambda f: (f["t"], f["node"]))
    assert ro.sql("SELECT COUNT(*), COUNT(DISTINCT node || '/' || seq) FROM frames WHERE kind = 'sample'")[1] == \
        [(len(got), len(got))]
    ro.close()


def test_the_store_bench_generates_a_store_its_queries_read_whole(tmp_path):
    """`jobprobe bench store`, small: the generated store answers its two queries with every sample of the hour
    (the bench asserts the counts), and the hottest node is one of its nodes."""
    from jobprobe.bench import storebench
    res = storebench.bench_store(nodes=16, hours=2, workdir=str(tmp_path))
    assert res["samples"] == 16 * 2 * 3600 and res["job_field_hour_8_nodes"]["rows"] == 8 * 3600
    assert res["hottest_node_hour"]["node"].startswith("sim")
    assert "hottest node" in storebench.markdown(res)


def test_a_field_inside_a_list_of_maps_reads_by_index_raw_compacted_and_rolled_up(tmp_path):
    """`gpu.gpus.1.power_mw`: GPU 1's power, from raw frames (SQLite's JSON path with [1]), from blocks (its own
    column) and from the rollups alike."""
    st_ = Store(tmp_path / "s.db")
    b = FrameBuilder("a", "j", run="r")
    raw = [b.sample(T0 + k, 1.0, {"gpu": {"gpus": [{"index": i, "power_mw": 1000 * k + i} for i in range(2)]}},
                    {"gpu": "ok"}) for k in range(400)]
    st_.add(raw, received=T0 + 1000)
    want = [1000 * k + 1 for k in range(400)]
    assert [r[5] for r in st_.field("j", "gpu.gpus.1.power_mw")[1]] == want
    while st_.compact(T0 + 5000):
        pass
    assert st_.sql("SELECT COUNT(*) FROM frames WHERE kind = 'sample'")[1] == [(0,)]
    assert [r[5] for r in st_.field("j", "gpu.gpus.1.power_mw")[1]] == want
    assert sum(r[4] for r in st_.rolled("j", "gpu.gpus.1.power_mw", 60)[1]) == sum(want)
    assert st_.top("gpu.gpus.1.power_mw", T0, T0 + 399)[1] == [("a", sum(want), max(want), 400)]


def test_samples_received_late_stay_whole_for_the_raw_window_after_they_came(tmp_path):
    """A backfill (or a node whose clock is behind): samples whose own time is long past, received now, are not
    compacted until the raw window has passed since they came."""
    st_ = Store(tmp_path / "s.db")
    old = samples("a", "j", 120)                          # T0…: ten hours before it came
    now = T0 + 36_000
    st_.add(old, received=now)
    assert st_.compact(now) == 0 and st_.compact(now + compact.RAW_S - 1) == 0
    assert st_.sql("SELECT COUNT(*) FROM samples")[1] == [(120,)]
    while st_.compact(now + compact.RAW_S + 1):
        pass
    assert st_.sql("SELECT COUNT(*) FROM samples")[1] == [(0,)] and st_.samples_of("j") == old
