# SPDX-License-Identifier: Apache-2.0
"""Past one controller: frames partitioned by job over four controllers, each partition with a standby that takes
over when its active controller is SIGKILLed — real nats-server (JetStream, the subject mapping, the generated node
permissions), real controller processes, nodes publishing as agents do (their own keys, their own subjects)."""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, until
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.core.wire import PARTS, inbox_prefix, job_token, msg_id, partition, subject_of, token

REPO = Path(__file__).resolve().parents[1]
JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]
NATS = "/usr/sbin/nats-server"
N = 4
TICK = 1.0
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(NATS), reason="nats-server is not installed (scripts/setup.sh)")]


def jobs_over_partitions(per: int = 2) -> list[str]:
    """Job names, `per` in each of the N partitions (by the server's own hash of their tokens)."""
    out: dict[int, list[str]] = {}
    k = 0
    while any(len(out.get(i, [])) < per for i in range(N)):
        name = f"train-{k}"
        k += 1
        p = partition(job_token(name), N)
        if len(out.setdefault(p, [])) < per:
            out[p].append(name)
    return [j for i in range(N) for j in out[i]]


class Cluster:
    """The controllers: partition 0's first one starts the nats-server (with the mapping), every other one joins it
    with --nats and the controller's key; two per partition."""

    def __init__(self, tmp: Path):
        self.tmp, self.data, self.port = tmp, tmp / "ctl", free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.procs: dict[tuple[int, int], subprocess.Popen] = {}

    def store(self, i: int) -> Path:
        return self.tmp / f"p{i}.db"

    def log(self, i: int, k: int) -> Path:
        return self.tmp / f"c{i}-{k}.log"

    def start(self, i: int, k: int, say: str) -> None:
        args = [*JOBPROBE, "controller", "--partition", f"{i}/{N}", "--store", str(self.store(i))]
        if (i, k) == (0, 0):
            args += ["--data", str(self.data), "--listen", f"127.0.0.1:{self.port}"]
        else:
            args += ["--nats", self.url, "--creds", str(self.data / "auth" / "controller.nk")]
        self.procs[i, k] = p = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                                                stderr=open(self.log(i, k), "ab"))
        until(lambda: say in self.log(i, k).read_text() or p.poll() is not None, 60, f"controller {i}-{k}: {say}")
        assert p.poll() is None, self.log(i, k).read_text()

    def active(self, i: int) -> int:
        (k,) = [k for k in (0, 1) if (i, k) in self.procs and self.procs[i, k].poll() is None
                and "active" in self.log(i, k).read_text()]
        return k

    def enroll(self, node: str) -> Path:
        out = subprocess.run([*JOBPROBE, "controller", "enroll", node, "--data", str(self.data)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return Path(out.stdout.strip().splitlines()[-1])

    def rows(self, i: int, sql: str) -> list[tuple]:
        db = sqlite3.connect(f"file:{self.store(i)}?mode=ro", uri=True)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()

    def close(self) -> None:
        for key, p in sorted(self.procs.items(), reverse=True):   # partition 0's first (the server) last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


class Node:
    """A node as its agent publishes: its own key and inbox, a hello per job, a sample per job and a heartbeat per
    tick."""

    def __init__(self, name: str, jobs: list[str], creds: Path, url: str):
        from jobprobe.transport.natswire import Wire
        self.name, self.jobs = name, jobs
        self.wire = Wire(url, str(creds), name=name, inbox=inbox_prefix(name))
        self.wire.connect()
        self.builders = {j: FrameBuilder(name, j, run=f"r-{name}") for j in jobs}
        self.beat = FrameBuilder(name, "node", run=f"b-{name}")
        self.sent: set[tuple] = set()
        self.first = True

    def tick(self) -> None:
        now = time.time()
        frames = [self.beat.heartbeat(now, TICK, len(self.jobs))]
        for b in self.builders.values():
            if self.first:
                frames.append({**b.hello(probes={"cgroup": {}}), "interval": TICK})
            frames.append(b.sample(now, TICK, {"cgroup": {"cpu_user_ns": 10 ** 8}}, {"cgroup": "ok"}))
        self.first = False
        acks = self.wire.publish([(subject_of(f), msg_id(f), encode(f)) for f in frames], timeout=10,
                                 optional=lambda s: s.startswith("jobprobe.beat."))
        assert all("error" not in a for a in acks), acks
        self.sent |= {(f["node"], f["job"], f["run"], f["seq"]) for f in frames if f["kind"] != "heartbeat"}


def test_four_partitions_by_job_a_standby_takes_over_nothing_lost_nothing_stored_twice(tmp_path):
    jobs = jobs_over_partitions()
    names = [f"gpu-{k:03d}" for k in range(6)]
    placement = {j: [names[(a + s) % 6] for s in range(3)] for a, j in enumerate(jobs)}   # 3 nodes per job
    for j, where in placement.items():   # a job's nodes would have crossed partitions by node
        assert len({partition(token(n), N) for n in where}) > 1, (j, where)
    cl = Cluster(tmp_path)
    nodes: list[Node] = []
    try:
        for i in range(N):
            cl.start(i, 0, "active")
        for i in range(N):
            cl.start(i, 1, "standing by")
        idle = "gpu-idle"
        for n in names + [idle]:
            nodes.append(Node(n, [j for j in jobs if n in placement[j]], cl.enroll(n), cl.url))
        # a frame put straight on another partition's subject (skipping the mapping): refused there, not stored
        stray_job = jobs[0]
        wrong = (partition(job_token(stray_job), N) + 1) % N
        stray = FrameBuilder(names[0], stray_job, run="stray").sample(time.time(), TICK, {}, {})
        nodes[0].wire.publish([(f"{PARTS}.{wrong}.frames.{job_token(stray_job)}.{token(names[0])}", msg_id(stray),
                                encode(stray))], timeout=10)
        victim = 1
        killed_at, took_over = None, None
        for t in range(22):
            for n in nodes:
                n.tick()
            if t == 6:                           # mid-run: the active controller of one partition dies
                k = cl.active(victim)
                cl.procs[victim, k].kill()
                cl.procs[victim, k].wait()
                killed_at, standby = time.monotonic(), 1 - k
            if killed_at and took_over is None and "active" in cl.log(victim, standby).read_text():
                took_over = time.monotonic() - killed_at
            time.sleep(TICK)
        assert took_over is not None, cl.log(victim, standby).read_text()[-2000:]
        sent = set().union(*(n.sent for n in nodes))

        def stored() -> dict[int, list[tuple]]:
            return {i: cl.rows(i, "SELECT node, job, run, seq FROM frames WHERE run != 'controller'") for i in range(N)}
        try:
            until(lambda: set().union(*map(set, stored().values())) >= sent, 60, "every frame sent, stored")
        except AssertionError:
            missing = sent - set().union(*map(set, stored().values()))
            by = {}
            for _, job, _, seq in missing:
                by.setdefault(partition(job_token(job), N), []).append((job, seq))
            first = {k: sorted(v)[:5] for k, v in by.items()}
            raise AssertionError(f"{len(missing)} of {len(sent)} not stored: {first}"
                                 + "".join(f"\n--- {i}-{k}\n" + cl.log(i, k).read_text()[-1500:]
                                           for i in by for k in (0, 1))) from None
        got = stored()
        everything = [key for rows in got.values() for key in rows]
        assert len(everything) == len(set(everything)) == len(sent), "a frame stored twice, or one not sent"
        for i, rows in got.items():             # each job's frames, all in its own partition's store
            assert {partition(job_token(job), N) for _, job, _, _ in rows} == {i}
        why = [r for i in range(N) for r in cl.rows(i, "SELECT reason FROM rejects")]
        assert len(why) == 1 and "not its job's partition" in why[0][0], why
        assert all(not cl.rows(i, "SELECT * FROM events WHERE event LIKE 'node_%'") for i in range(N)), \
            "a node named lost while it beat"
        # two nodes go silent: one with jobs (node_lost per job, each by its job's partition only), the idle one
        # (one node_lost of job `node`, by the partition that owns the node)
        gone = {nodes[2].name, idle}
        live = [n for n in nodes if n.name not in gone]
        for _ in range(int(6 / TICK)):
            for n in live:
                n.tick()
            time.sleep(TICK)

        def lost() -> set[tuple]:
            return {(i, node, job) for i in range(N)
                    for node, job in cl.rows(i, "SELECT node, job FROM events WHERE event = 'node_lost'")}
        expect = {(partition(job_token(j), N), nodes[2].name, j) for j in nodes[2].jobs} | \
            {(partition(token(idle), N), idle, "node")}
        until(lambda: lost() >= expect, 30, "node_lost of the silent nodes")
        assert lost() == expect
    finally:
        for n in nodes:
            n.wire.close()
        cl.close()
    tail = "".join(cl.log(victim, k).read_text() for k in (0, 1))
    assert re.search(r"active: consuming JOBPROBE_P1", tail), tail[-2000:]


def test_several_partitions_stores_read_as_one(tmp_path):
    """`jobprobe query` (and report, summary) given several stores, or their directory, sees one store: every
    table and view over all of them; a job's field from whichever holds it; delivery summed per node."""
    from jobprobe.cluster.store import Store
    d = tmp_path / "stores"
    jobs = jobs_over_partitions(per=1)
    for i, job in enumerate(jobs):
        st = Store(d / f"p{i}.db")
        b = FrameBuilder("gpu-000", job, run="r")
        st.add([b.sample(1000.0 + k, 1.0, {"cgroup": {"cpu_user_ns": 10 ** 6 * (i + 1) * k}}, {"cgroup": "ok"})
                for k in range(3)])
        st.close()

    def query(*args: str) -> list[str]:
        r = subprocess.run([*JOBPROBE, "query", *args, "--format", "csv"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().splitlines()[1:]
    assert query("--store", str(d), "--sql", "SELECT job, COUNT(*) FROM samples GROUP BY job ORDER BY job") == \
        [f"{j},3" for j in sorted(jobs)]
    assert query("--store", str(d), "--sql", "SELECT node, frames FROM delivery") == ["gpu-000,12"]
    two = [str(d / "p1.db"), str(d / "p3.db")]
    assert query("--store", two[0], "--store", two[1], "--job", jobs[3], "--field", "cgroup.cpu_user_ns")[-1] \
        .endswith(",8000000")
    r = subprocess.run([*JOBPROBE, "query", "--store", str(tmp_path / "none"), "--sql", "SELECT 1"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no store" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_lease_has_one_holder_and_a_dead_holders_lease_passes_on(tmp_path):
    """The lease (jobprobe/cluster/lease.py) on a real JetStream key-value bucket: one holder at a time; the holder
    counts itself out before its key can expire, so it has stopped before a standby can take it; a holder that
    stops renewing loses it within LEASE_S; a clean release passes it at once; a restarted controller on the host
    of a holder whose process is gone takes it at once."""
    import asyncio
    import socket as sk

    from jobprobe.bench.local import Nats
    from jobprobe.cluster import lease as L
    srv = Nats(tmp_path)
    srv.start()

    async def run() -> None:
        import nats
        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        a, b = L.Lease(js, "p0", holder="h1:1:a"), L.Lease(js, "p0", holder="h2:1:b")
        await a.open()
        await b.open()
        assert await a.take() and not await b.take()
        for _ in range(3):
            await asyncio.sleep(L.RENEW_S)
            assert await a.keep() and not await b.take()
        stopped = time.monotonic()               # a stops renewing (a hung or dead controller)
        while not await b.take():
            assert time.monotonic() - stopped < L.LEASE_S + 2 * L.TRY_S, "the lease never passed on"
            await asyncio.sleep(0.1)
        took = time.monotonic()
        assert not a.held() and a.until <= took    # a counted itself out before b could have it
        assert not await a.keep()                  # and its next renewal is refused
        await b.release()
        assert await a.take()
        dead = L.Lease(js, "p1", holder=f"{sk.gethostname()}:999999:x")     # a pid that is not running
        await dead.open()
        assert await dead.take()
        fresh = L.Lease(js, "p1")
        await fresh.open()
        assert await fresh.take()                  # its predecessor on this host is gone: at once
        alive = L.Lease(js, "p2", holder=f"{sk.gethostname()}:1:x")          # pid 1 runs
        await alive.open()
        assert await alive.take()
        other = L.Lease(js, "p2")
        await other.open()
        assert not await other.take()
        await nc.close()
    try:
        asyncio.run(run())
    finally:
        srv.stop()


def test_a_partition_given_wrong_is_one_line_and_exit_2_and_the_mapping_block_is_the_servers(tmp_path):
    """`--partition` takes I/N with 0 ≤ I < N ≤ 1024, anything else a one-line refusal (exit 2); `controller
    mappings` prints the block a nats-server takes (the test above ran the server with it)."""
    for bad in ("4/4", "-1/4", "1", "a/b", "0/0", "0/2000", "1/4/2", " 1/4"):
        r = subprocess.run([*JOBPROBE, "controller", "--partition", bad, "--store", str(tmp_path / "s.db")],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--partition" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
    r = subprocess.run([*JOBPROBE, "controller", "mappings", "--partition", "0/4"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ('mappings = {\n  "jobprobe.frames.*.*": '
                        '"jobprobe.part.{{partition(4,1)}}.frames.{{wildcard(1)}}.{{wildcard(2)}}"\n}\n')
