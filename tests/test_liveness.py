# SPDX-License-Identifier: Apache-2.0
"""Node liveness that does not depend on jobs: an agent with no job sends heartbeats, a clean stop is announced, and
the controller declares lost only a node that went silent — naming only the jobs that were live then."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from types import SimpleNamespace

import msgpack
import pytest

from conftest import until as wait_for
from jobprobe.cluster.summary import MIN_SAMPLES
from jobprobe.core.frame import FrameBuilder, MalformedFrame, encode
from jobprobe.core.wire import beat_subject, subject_of


def ctl_for(tmp_path):
    from jobprobe.cluster.controller import Controller
    from jobprobe.cluster.store import Store
    return Controller(Store(tmp_path / "s.db"), "nats://unused")


def hello(b: FrameBuilder, interval: float = 1.0) -> dict:
    return {**b.hello(probes={}), "interval": interval}


def sample(b: FrameBuilder) -> dict:
    return b.sample(time.time(), 1.0, {"cgroup": {"cpu_user_ns": 1}}, {"cgroup": "ok"})


def beat(b: FrameBuilder, interval: float = 1.0, jobs: int = 0, stopping: bool = False) -> dict:
    return b.heartbeat(time.time(), interval, jobs, stopping)


def events(out: list[dict]) -> list[tuple]:
    return [(e["event"], e["node"], e["job"]) for e in out]


# ---- the controller: seen / lost_nodes ---------------------------------------------------------------------
def test_an_idle_node_sending_heartbeats_is_never_lost(tmp_path):
    ctl = ctl_for(tmp_path)
    job, node = FrameBuilder("n1", "j1", "r1"), FrameBuilder("n1", "node", "b1")
    assert ctl.seen([hello(job), sample(job)], now=100.0) == []
    out = []
    for k in range(1, 121):                 # its job ended at 100; then two minutes of heartbeats only
        now = 100.0 + k
        out += ctl.seen([beat(node)], now=now) + ctl.lost_nodes(now + 0.99)
    assert out == [] and ctl.nodes["n1"].heartbeats == 120 and not ctl.nodes["n1"].lost


def test_a_node_that_goes_silent_is_lost_after_three_intervals_naming_only_the_jobs_live_then(tmp_path):
    ctl = ctl_for(tmp_path)
    old, a, b = (FrameBuilder("n1", j, "r1") for j in ("old", "a", "b"))
    ctl.seen([hello(old, 2.0), sample(old)], now=100.0)          # a job that ended long ago (no heartbeat between)
    ctl.seen([hello(a, 2.0), hello(b, 2.0)], now=150.0)
    for k in range(10):
        ctl.seen([sample(a), sample(b)], now=152.0 + 2 * k)       # last at 170
    assert ctl.lost_nodes(now=175.9) == []                        # 2.95 intervals
    out = ctl.lost_nodes(now=176.1)
    assert sorted(events(out)) == [("node_lost", "n1", "a"), ("node_lost", "n1", "b")]
    assert {e["silent_s"] for e in out} == {6.1}
    assert ctl.lost_nodes(now=300.0) == []                        # once
    back = ctl.seen([sample(a)], now=310.0)
    assert sorted(events(back)) == [("node_back", "n1", "a"), ("node_back", "n1", "b")]


def test_an_idle_node_that_goes_silent_is_lost_as_itself_and_its_ended_job_is_not_named(tmp_path):
    ctl = ctl_for(tmp_path)
    job, node = FrameBuilder("n2", "j1", "r1"), FrameBuilder("n2", "node", "b1")
    ctl.seen([hello(job), sample(job), sample(job)], now=100.0)  # its last frame, then (same tick) a heartbeat
    ctl.seen([beat(node, interval=0.5)], now=100.0)
    assert ctl.lost_nodes(now=101.4) == []                        # the heartbeat's interval: 0.5 s
    (lost,) = ctl.lost_nodes(now=101.6)
    assert (lost["event"], lost["node"], lost["job"], lost["run"]) == ("node_lost", "n2", "node", "controller")
    (back,) = ctl.seen([beat(node, interval=0.5)], now=110.0)
    assert (back["event"], back["job"], back["silent_s"]) == ("node_back", "node", 10.0)


def test_a_stopping_heartbeat_means_no_node_lost_ever_and_its_next_frame_no_node_back(tmp_path):
    ctl = ctl_for(tmp_path)
    job, node = FrameBuilder("n3", "j1", "r1"), FrameBuilder("n3", "node", "b1")
    ctl.seen([hello(job), sample(job)], now=100.0)
    ctl.seen([sample(job), beat(node, jobs=1, stopping=True)], now=101.0)   # SIGTERM: last frame, then the stop
    assert all(ctl.lost_nodes(now=101.0 + s) == [] for s in (3.1, 10.0, 3600.0))
    assert ctl.nodes["n3"].stopped and not ctl.nodes["n3"].lost
    restarted = FrameBuilder("n3", "j1", "r2")
    assert ctl.seen([hello(restarted), sample(restarted)], now=5000.0) == []    # back: no node_back
    assert not ctl.nodes["n3"].stopped
    (lost,) = ctl.lost_nodes(now=5003.5)                          # and silent again, not announced: lost
    assert (lost["event"], lost["job"]) == ("node_lost", "j1")


def test_heartbeats_refresh_freshness_through_ingest_and_are_not_stored(tmp_path):
    ctl = ctl_for(tmp_path)
    job, node = FrameBuilder("n1", "j1", "r1"), FrameBuilder("n1", "node", "b1")
    frames = [hello(job)] + [sample(job) for _ in range(MIN_SAMPLES)] + [beat(node) for _ in range(5)]
    msgs = [SimpleNamespace(subject=subject_of(f), data=encode(f)) for f in frames]
    assert ctl.ingest(msgs, now=100.0) == msgs                    # every message acked
    for k in range(1, 6):
        ctl.ingest([], now=100.0 + k, beats=[SimpleNamespace(subject=beat_subject("n1"), data=encode(beat(node)))])
    ctl.ingest([], now=107.9)                                     # 2.9 intervals after the last heartbeat
    db = sqlite3.connect(tmp_path / "s.db")
    assert db.execute("SELECT kind, COUNT(*) FROM frames GROUP BY kind ORDER BY kind").fetchall() == \
        [("event", 1), ("hello", 1), ("sample", MIN_SAMPLES)]        # the event: j1's summary (below)
    assert db.execute("SELECT event, job FROM events").fetchall() == [("summary", "j1")]   # no node_lost: the
    # beats kept it; j1, whose samples stopped while its node lived on, ended there (its summary)
    assert ctl.nodes["n1"].heartbeats == 10 and ctl.nodes["n1"].last == 105.0
    assert ctl.counts["stored"] == 1 + MIN_SAMPLES and ctl.counts["rejected"] == 0


def test_a_heartbeats_fields_are_checked(tmp_path):
    ctl = ctl_for(tmp_path)
    node = FrameBuilder("n1", "node", "b1")
    ctl.check(beat_subject("n1"), encode(beat(node, interval=3600, jobs=0, stopping=True)))
    ctl.check(beat_subject("n1"), encode({k: v for k, v in beat(node).items() if k != "stopping"}))
    for bad in ({"interval": 0}, {"interval": -1.0}, {"interval": 3601}, {"interval": "1"}, {"interval": None},
                {"interval": True}, {"jobs": -1}, {"jobs": 1.5}, {"jobs": True}, {"jobs": None}, {"stopping": 1},
                {"stopping": "yes"}):
        with pytest.raises(MalformedFrame, match="heartbeat field"):
            ctl.check(beat_subject("n1"), encode({**beat(node), **bad}))
    nan = msgpack.packb({**beat(node), "interval": float("nan")})
    with pytest.raises(MalformedFrame):
        ctl.check(beat_subject("n1"), nan)


# ---- the agent's side ----------------------------------------------------------------------------------------
def spooled(spool) -> list[dict]:
    import zlib

    from jobprobe.core.frame import decode
    return [decode(zlib.decompress(rec[6])) for rec in spool.peek(1000)]


def test_an_idle_agent_spools_one_heartbeat_per_tick_while_none_waits_and_announces_its_stop(tmp_path):
    from jobprobe.node.agent import Agent
    from jobprobe.node.config import Config
    cfg = Config(nats="nats://127.0.0.1:1", spool=str(tmp_path / "spool"), node="n1", interval=0.5,
                 state=str(tmp_path / "jobs.json"), socket=str(tmp_path / "agent.sock"))
    agent = Agent(cfg)
    close_sink, agent.nats.close = agent.nats.close, lambda timeout=5.0: None   # the spool stays readable
    try:
        agent.tick()                       # no job: a heartbeat; the server is unreachable, so it waits
        agent.tick()                       # the last one waits still: a stale heartbeat would help no one
        agent.tick()
        got = spooled(agent.nats.spool)
        assert [(f["kind"], f["job"], f["interval"], f["jobs"], f["stopping"]) for f in got] == \
            [("heartbeat", "node", 0.5, 0, False)]
        assert got[0]["run"] != agent.run_id and agent.nats.heartbeats_skipped == 2
        assert "node" not in agent.nats.counts                 # in no job's counters
        agent.close()
        agent.close()                      # twice: the stop is announced once
        got = spooled(agent.nats.spool)
        assert [(f["kind"], f["stopping"], f["seq"]) for f in got] == \
            [("heartbeat", False, 0), ("heartbeat", True, 3)]
    finally:
        agent.close()
        close_sink(timeout=0.2)


# ---- the real path: nats-server, controller, agents ------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.kernel
def test_idle_and_cleanly_stopped_agents_are_not_lost_and_a_killed_one_is(tmp_path):
    from jobprobe.node.control import call
    from natsite import JOBPROBE, NATS, REPO, Site, answering
    if not os.path.exists(NATS):
        pytest.skip("nats-server is not installed (scripts/setup.sh)")
    site = Site(tmp_path)
    site.nats.start()
    try:
        site.start_controller()

        def agent(node: str) -> subprocess.Popen:
            d = tmp_path / node
            d.mkdir()
            p = subprocess.Popen(
                [*JOBPROBE, "agent", "--node", node, "--send", site.nats.url, "--spool", str(d / "spool"),
                 "--socket", str(d / "agent.sock"), "--state", str(d / "jobs.json"), "--probes", "self",
                 "--interval", "0.25"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(d / "agent.log", "ab"))
            site.agents[node] = p
            wait_for(lambda: answering(d / "agent.sock"), 60, f"agent {node}")
            return p

        def events(node: str) -> list[tuple]:
            db = sqlite3.connect(f"file:{site.store}?mode=ro", uri=True)
            try:
                return db.execute("SELECT event, job FROM events WHERE node = ? AND event LIKE 'node_%' ORDER BY t",
                                  (node,)).fetchall()
            except sqlite3.OperationalError:
                return []
            finally:
                db.close()

        def stored(node: str) -> list[tuple]:
            db = sqlite3.connect(f"file:{site.store}?mode=ro", uri=True)
            try:
                return db.execute("SELECT kind, job FROM frames WHERE node = ? AND run != 'controller'",
                                  (node,)).fetchall()
            except sqlite3.OperationalError:
                return []
            finally:
                db.close()

        a = agent("idle")
        short = subprocess.Popen(["sleep", "1"])
        site.sleepers.append(short)
        r = call(str(tmp_path / "idle" / "agent.sock"), {"cmd": "attach", "pid": short.pid, "job": "short"})
        assert r["ok"], r
        wait_for(lambda: ("sample", "short") in stored("idle"), 15, "the short job's frames in the store")
        short.wait()
        wait_for(lambda: not call(str(tmp_path / "idle" / "agent.sock"), {"cmd": "status"})["jobs"], 10,
                 "the short job to end")
        time.sleep(8 * 0.25 + 1.0)         # idle for 8 of its intervals (and the controller's fetch wait)
        assert events("idle") == []
        assert all(kind != "heartbeat" for kind, _ in stored("idle"))
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
        time.sleep(5 * 0.25 + 1.0)         # stopped for 5 of its intervals
        assert events("idle") == []
        k = agent("killed")                # idle too; then gone without a word
        time.sleep(1.0)
        k.kill()
        k.wait()
        wait_for(lambda: events("killed") == [("node_lost", "node")], 10, "the killed node's node_lost")
        assert events("idle") == []
        # an agent SIGKILLed under a running job, and not restarted: the job ended there with its node — its
        # summary says `node lost`, a bad end
        c = agent("crashed")
        busy = subprocess.Popen(["sleep", "60"])
        site.sleepers.append(busy)
        assert call(str(tmp_path / "crashed" / "agent.sock"), {"cmd": "attach", "pid": busy.pid, "job": "busy"})["ok"]
        wait_for(lambda: stored("crashed").count(("sample", "busy")) >= 4, 15, "the busy job's samples stored")
        c.kill()
        c.wait()
        wait_for(lambda: events("crashed") == [("node_lost", "busy")], 10, "node_lost naming the busy job")

        def summary() -> dict | None:
            db = sqlite3.connect(f"file:{site.store}?mode=ro", uri=True)
            try:
                got = db.execute("SELECT body FROM events WHERE job = 'busy' AND event = 'summary'").fetchall()
            finally:
                db.close()
            return json.loads(got[0][0]) if got else None
        ended = wait_for(summary, 15, "the busy job's summary")["ended"]
        assert (ended["how"], ended["cause"], ended["ok"], ended["node"]) == ("node lost", "node_lost", False,
                                                                               "crashed"), ended
    finally:
        site.close()
