# SPDX-License-Identifier: Apache-2.0
"""Fenced writes (docs/ARCHITECTURE.md, "Two controllers, one store"): the store refuses a write from a controller
whose lease has passed to another — on a plain Store, and with two real controller processes on one store, the
active one paused (SIGSTOP) past its lease and woken after its standby took over."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import until
from jobprobe.cluster.store import Fenced, Store
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.core.wire import msg_id, subject_of

REPO = Path(__file__).resolve().parents[1]
JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]
NATS = "/usr/sbin/nats-server"


def frames(n: int, start: int = 0) -> list[dict]:
    b = FrameBuilder("n1", "j1", run="r1")
    b.seq = start
    return [b.sample(1000.0 + k, 1.0, {"cgroup": {"cpu_user_ns": k}}, {"cgroup": "ok"}) for k in range(n)]


def keys(path: Path) -> list[tuple]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT node, job, run, seq FROM frames ORDER BY seq").fetchall()
    finally:
        db.close()


def test_a_writer_whose_token_is_not_the_newest_stores_nothing(tmp_path):
    """Token 4's holder writes; token 5 is taken by another writer on the same file; every write of token 4's
    holder (frames, a refusal, retention, compaction) is then refused with Fenced and leaves nothing; a writer with no
    token is refused once a token exists; taking a token smaller than the stored one is refused; a store nobody
    fenced takes writes with no token at all."""
    path = tmp_path / "s.db"
    old, new, plain = Store(path), Store(path), Store(path)
    old.take_fence(0, 4, "old")
    assert old.add(frames(1)) == (1, 0)
    new.take_fence(0, 5, "new")
    with pytest.raises(Fenced):
        old.add(frames(3, start=1))
    assert keys(path) == [("n1", "j1", "r1", 0)], "a fenced writer's batch was (partly) stored"
    for write in (lambda: old.reject({("n1", "malformed", 1): [1, 1]}, [(1.0, "s", "n1", "bad", 1, b"")]),
                  lambda: old.forget_before(2e9),
                  lambda: old.compact(2e9, 0), lambda: plain.add(frames(1, start=1))):
        with pytest.raises(Fenced):
            write()
    assert keys(path) == [("n1", "j1", "r1", 0)]
    assert new.sql("SELECT COUNT(*) FROM rejects")[1] == [(0,)]
    assert new.sql("SELECT COUNT(*) FROM reject_counts")[1] == [(0,)]
    with pytest.raises(Fenced):
        old.take_fence(0, 4, "old")        # a smaller token never comes back
    assert new.add(frames(2, start=1)) == (2, 0)
    assert len(keys(path)) == 3
    free = Store(tmp_path / "free.db")     # `jobprobe run`, tests, readers: no lease, no fence
    assert free.add(frames(2)) == (2, 0)
    free.reject({("", "malformed", 1): [1, 1]}, [(1.0, "s", None, "bad", 1, b"")])
    for s in (old, new, plain, free):
        s.close()


@pytest.mark.integration
@pytest.mark.skipif(not os.path.exists(NATS), reason="nats-server is not installed (scripts/setup.sh)")
def test_a_paused_active_controller_woken_after_its_standby_took_over_writes_nothing(tmp_path):
    """Two controllers of one partition on one store; a publisher sends a frame every 50 ms throughout. The active
    one is SIGSTOPped 13 s (past its lease), the standby takes over, the old one is SIGCONTed and runs on. From the
    store: the old holder's last write came before the new holder took the fence, the new holder's token is the
    larger, no node was said lost (the old one's stale view never landed), and every frame sent is stored exactly
    once."""
    from jobprobe.bench.local import Nats
    from jobprobe.transport.natswire import Wire
    srv = Nats(tmp_path)
    srv.start()
    store = tmp_path / "store.db"
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"c{k}.log" for k in (0, 1)]

    def start(k: int, say: str) -> subprocess.Popen:
        p = subprocess.Popen([*JOBPROBE, "controller", "--nats", srv.url, "--store", str(store)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=open(logs[k], "ab"))
        procs.append(p)
        until(lambda: say in logs[k].read_text() or p.poll() is not None, 60, f"controller {k}: {say}")
        assert p.poll() is None, logs[k].read_text()
        return p
    sent: set[tuple] = set()
    stop = threading.Event()
    wire = Wire(srv.url, name="n1")
    wire.connect()

    def publish() -> None:
        b, beat = FrameBuilder("n1", "j1", run="r1"), FrameBuilder("n1", "node", run="b1")
        out = [{**b.hello(probes={"cgroup": {}}), "interval": 1.0}]
        while not stop.is_set():
            now = time.time()
            out += [b.sample(now, 0.05, {"cgroup": {"cpu_user_ns": 1}}, {"cgroup": "ok"}),
                    beat.heartbeat(now, 1.0, 1)]
            acks = wire.publish([(subject_of(f), msg_id(f), encode(f)) for f in out], timeout=10,
                                optional=lambda s: s.startswith("jobprobe.beat."))
            assert all("error" not in a for a in acks), acks
            sent.update((f["node"], f["job"], f["run"], f["seq"]) for f in out if f["kind"] != "heartbeat")
            out = []
            time.sleep(0.05)
    pub = threading.Thread(target=publish, daemon=True)
    try:
        old = start(0, "active")
        start(1, "standing by")
        pub.start()
        time.sleep(3)
        old.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        until(lambda: "active" in logs[1].read_text(), 30, "the standby to take over")
        took = time.monotonic() - stopped
        time.sleep(max(0.0, 13 - (time.monotonic() - stopped)))
        old.send_signal(signal.SIGCONT)
        time.sleep(5)
        stop.set()
        pub.join(15)
        until(lambda: set(keys(store)) >= sent, 30, "every frame sent, stored")
        assert old.poll() is None, "the woken controller died: " + logs[0].read_text()[-2000:]
        print(f"takeover {took:.1f} s after SIGSTOP")
    finally:
        stop.set()
        wire.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        srv.stop()
    got = keys(store)
    stored = [k for k in got if k[2] != "controller"]
    assert len(stored) == len(set(stored)) and set(stored) == sent, "a frame lost, or stored twice"
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        lost = db.execute("SELECT node, job, received FROM events WHERE event = 'node_lost'").fetchall()
        fence = {h.split(":")[1]: (tok, taken, last) for h, tok, taken, last in
                 db.execute("SELECT holder, token, taken, last_write FROM fence WHERE part = 0")}
    finally:
        db.close()
    assert not lost, f"a node said lost while it published (the paused controller's stale view): {lost}"
    mine, theirs = fence[str(procs[0].pid)], fence[str(procs[1].pid)]
    assert theirs[0] > mine[0], f"the new holder's token is not the larger: {fence}"
    assert mine[2] is not None and mine[2] < theirs[1], \
        f"the old holder wrote {mine[2] - theirs[1]:.3f} s after the new one took the fence: {fence}"
    assert "fenced" in logs[0].read_text(), "the woken controller never tried to write (the fence not exercised): " \
        + logs[0].read_text()[-2000:]
