# SPDX-License-Identifier: Apache-2.0
"""Per-node quotas and bounded state at the controller (jobprobe/cluster/quota.py, controller.py Refusals): one node
over its quota has the excess refused, counted per reason and minute, kept whole only for its first few, logged once
a minute — and nothing changes for the other nodes. Through Controller.ingest into a real store; the real path
(nats-server, the controller as a process) is tests/test_hostile.py's."""
from __future__ import annotations

import logging
import tracemalloc
import zlib
from types import SimpleNamespace

import pytest

from jobprobe.cluster.controller import Controller
from jobprobe.cluster.quota import BURST_S, LIVE_JOB_S, Limits, Quotas
from jobprobe.cluster.refusals import REJECT_LOG_PER_MIN
from jobprobe.cluster.store import REJECT_SAMPLES, Store
from jobprobe.core.errors import BadInput
from jobprobe.core.frame import encode
from jobprobe.core.wire import frames_subject

T0 = 1_790_000_000.0


def frame(node: str, job: str, seq: int, t: float) -> dict:
    return {"v": 1, "kind": "sample", "node": node, "job": job, "run": "r1", "seq": seq, "t": t, "dt": 1.0,
            "probes": {"cgroup": {"cpu_user_ns": 1000 + seq}}, "status": {"cgroup": "ok"}}


def msg(f: dict) -> SimpleNamespace:
    return SimpleNamespace(subject=frames_subject(f["node"], f["job"]), data=zlib.compress(encode(f)))


def test_a_node_over_its_frame_rate_is_refused_and_refills_and_others_are_untouched():
    q = Quotas(Limits(frames_per_s=10))
    burst = int(10 * BURST_S)
    assert [q.admit("a", "j", 100, T0) for _ in range(burst)] == [None] * burst
    assert q.admit("a", "j", 100, T0) == "quota_frames"
    assert q.admit("b", "j", 100, T0) is None                   # another node: its own bucket
    assert q.admit("a", "j", 100, T0 + 0.05) == "quota_frames"  # half a frame's worth refilled
    assert q.admit("a", "j", 100, T0 + 0.125) is None           # one and a quarter
    assert q.admit("a", "j", 100, T0 + 0.125) == "quota_frames"


def test_bytes_frame_size_and_live_jobs_each_bound_a_node():
    q = Quotas(Limits(bytes_per_s=1000, max_frame=600, live_jobs=3))
    assert q.admit("a", "j", 601, T0) == "quota_frame_size"
    n = int(1000 * BURST_S / 500)
    assert [q.admit("a", "j", 500, T0) for _ in range(n + 1)] == [None] * n + ["quota_bytes"]
    q = Quotas(Limits(live_jobs=3))
    assert [q.admit("a", f"j{k}", 10, T0) for k in range(4)] == [None, None, None, "quota_jobs"]
    assert q.admit("a", "j1", 10, T0 + 1) is None                # a live job's next frame: in
    assert q.admit("a", None, 10, T0 + 1) is None                # a heartbeat is no job
    late = T0 + LIVE_JOB_S + 0.5                                  # j0 and j2 not seen since T0: no longer live
    assert [q.admit("a", j, 10, late) for j in ("j9", "j8", "j7")] == [None, None, "quota_jobs"]   # j1, j9, j8


def test_a_refused_message_takes_nothing_from_the_node():
    q = Quotas(Limits(bytes_per_s=100, frames_per_s=1))
    assert q.admit("a", "j", 10_000, T0) == "quota_bytes"
    assert [q.admit("a", "j", 100, T0) for _ in range(int(BURST_S))] == [None] * int(BURST_S)


def test_limits_from_the_command_line():
    assert Limits.parse(["frames_per_s=50", "live_jobs=7"]) == Limits(frames_per_s=50.0, live_jobs=7)
    for bad in (["x=1"], ["live_jobs"], ["bytes_per_s=-3"], ["max_frame=nan"], ["frames_per_s=inf"]):
        with pytest.raises(BadInput):
            Limits.parse(bad)


def test_ten_thousand_job_names_from_one_node_cost_the_others_nothing(tmp_path, caplog):
    """One node publishes a sample for each of 10 000 job names in a batch, between two honest nodes' frames:
    the honest frames are all stored; the flooding node's first live_jobs jobs are stored, every other one is
    refused as quota_jobs — counted, a few kept whole, the log a few lines."""
    store = Store(tmp_path / "s.db")
    ctl = Controller(store, "nats://unused")
    lim = ctl.quotas.limits
    flood = [msg(frame("bad", f"job{k}", 0, T0)) for k in range(10_000)]
    honest = [msg(frame(n, "train", s, T0 + s)) for s in range(3) for n in ("h1", "h2")]
    caplog.set_level(logging.WARNING, "jobprobe.cluster.controller")
    batch = honest[:2] + flood[:5000] + honest[2:4] + flood[5000:] + honest[4:]
    for i in range(0, len(batch), 512):
        assert ctl.ingest(batch[i:i + 512], now=T0 + 1) == batch[i:i + 512]
    rows = dict(((n, c) for n, c in store.sql("SELECT node, COUNT(*) FROM frames WHERE run = 'r1' GROUP BY node")[1]))
    assert rows == {"h1": 3, "h2": 3, "bad": lim.live_jobs}
    assert store.sql("SELECT node, reason, SUM(n) FROM reject_counts GROUP BY node, reason")[1] == \
        [("bad", "quota_jobs", 10_000 - lim.live_jobs)]
    assert store.sql("SELECT COUNT(*) FROM rejects")[1][0][0] == REJECT_SAMPLES
    assert store.sql("SELECT rejected FROM delivery WHERE node = 'bad'")[1][0][0] == 10_000 - lim.live_jobs
    said = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(said) == REJECT_LOG_PER_MIN, [r.getMessage() for r in said[:3]]
    ctl.ingest([msg(frame("h1", "train", 3, T0 + 70))], now=T0 + 70)     # the next minute: one line for the rest
    ctl.refuse("x", "bad", "why", 1, "quota_jobs", b"", T0 + 70)
    summary = [r.getMessage() for r in caplog.records if "more refused frames of node 'bad'" in r.getMessage()]
    assert summary == [f"… and {10_000 - lim.live_jobs - REJECT_LOG_PER_MIN} more refused frames of node 'bad' "
                       "(quota_jobs) in that minute"], summary


def test_refusals_are_kept_for_the_retention_only(tmp_path):
    store = Store(tmp_path / "s.db")
    ctl = Controller(store, "nats://unused")
    ctl.ingest([SimpleNamespace(subject=frames_subject("n", "j"), data=b"\x00garbage")] * 5, now=T0)
    ctl.ingest([SimpleNamespace(subject=frames_subject("n", "j"), data=b"\x00garbage")] * 5, now=T0 + 3600)
    assert store.sql("SELECT SUM(n) FROM reject_counts")[1][0][0] == 10
    store.forget_before(T0 + 1800)
    assert store.sql("SELECT SUM(n) FROM reject_counts")[1][0][0] == 5
    assert store.sql("SELECT COUNT(*) FROM rejects WHERE received < ?", (T0 + 1800,))[1][0][0] == 0


def test_a_job_of_one_node_costs_the_controller_a_few_kib(tmp_path):
    """What the controller keeps of a job (straggler track, ends, freshness, quota) is allocated as the job needs
    it: a one-node job of ten samples holds under 8 KiB, measured on 500 of them (a job's straggler arrays were
    ~90 KiB from its first frame)."""
    ctl = Controller(Store(tmp_path / "s.db"), "nats://unused", limits=Limits(live_jobs=10_000))

    def jobs(k0: int, n: int, s: int) -> list:
        return [msg(frame("n", f"job{k}", s, T0 + s)) for k in range(k0, k0 + n)]
    for s in range(10):
        ctl.ingest(jobs(0, 50, s), now=T0 + s)          # warm: caches, the first arrays
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for s in range(10):
        for k in range(100, 600, 250):
            ctl.ingest(jobs(k, 250, s), now=T0 + s)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    print(f"{grown / 500:.0f} B per one-node job of 10 samples")
    assert grown / 500 < 8 << 10, [str(d) for d in after.compare_to(before, "lineno")[:5]]
