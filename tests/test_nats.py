# SPDX-License-Identifier: Apache-2.0
"""Frames leave the node: agents publish to a real nats-server (JetStream) started here on loopback, a real
`jobprobe controller` stores them. Each agent also writes its frames to a file (--out): the independent record of
what was produced, against which the store is checked frame by frame — every (node, job, run, seq), none twice.
Faults: the controller SIGKILLed mid-run, the NATS server down for 20 s, the spool's bound reached."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import time
import zlib
from types import SimpleNamespace

import msgpack
import pytest

from conftest import IS_ROOT, free_port, make_certs
from conftest import until as wait_for
from jobprobe.core.frame import FrameBuilder, MalformedFrame, StreamReader, encode
from jobprobe.core.wire import frames_subject
from natsite import FAKE_CLOCK, JOBPROBE, NATS, REPO, NatsServer, Site, need_nats  # noqa: F401


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    s.nats.start()
    yield s
    s.close()


def complete(site: Site, timeout: float = 30) -> set[tuple]:
    """Wait until the store holds every frame the agents wrote; then no frame twice and no gap."""
    want = site.produced()
    assert want
    wait_for(lambda: set(site.stored()) >= want, timeout, f"the store to hold all {len(want)} frames")
    rows = site.stored()
    assert len(rows) == len(set(rows)) and set(rows) == want
    runs: dict[tuple, list[int]] = {}
    for node, job, run, seq in rows:
        runs.setdefault((node, job, run), []).append(seq)
    assert all(sorted(s) == list(range(len(s))) for s in runs.values())
    return want


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_three_nodes_every_frame_arrives_across_a_controller_killed_mid_run(site):
    site.start_controller()
    for node in ("n1", "n2", "n3"):
        site.start_agent(node)
    time.sleep(2)
    site.controller.send_signal(signal.SIGKILL)   # mid-run, mid-batch perhaps: nothing acked that is not stored
    site.controller.wait()
    time.sleep(2)
    site.start_controller()
    time.sleep(2)
    site.stop_agents()                           # each job's last frame, then the spool is flushed
    got = complete(site)
    assert {n for n, *_ in got} == {"n1", "n2", "n3"} and len(got) > 3 * 20
    res = subprocess.run([*JOBPROBE, "controller", "stats", "--store", str(site.store), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    st = json.loads(res.stdout)
    # freshness, against the frames' own times in the agents' files (an independent record of what was sent)
    gaps: dict[str, float] = {}
    for node in ("n1", "n2", "n3"):
        for path in (site.tmp / node / "out").glob("*.mpk"):
            with open(path, "rb") as f:
                ts = [fr["t"] for fr in sorted(StreamReader(f), key=lambda fr: fr["seq"]) if fr["kind"] == "sample"]
            gaps[node] = max(gaps.get(node, 0.0), max(b - a for a, b in zip(ts, ts[1:])))
    for node in ("n1", "n2", "n3"):
        n = st["nodes"][node]
        assert n["dropped_at_source"] == 0 and n["rejected"] == 0 and n["duplicates"] >= 0
        assert abs(n["longest_gap_s"] - gaps[node]) <= 0.001, (n, gaps[node])
        assert n["arrival_delay_s"]["median"] >= 0 and n["newest_sample_age_s"] > 0


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_a_node_eight_days_behind_is_named_and_its_frames_kept_for_the_retention_after_they_came(site):
    """An agent whose clock is 8 days behind (a fake clock) beside one on time: its frames' times are past the
    7-day retention as they come. The controller names it (`clock_skew`, its offset against the stream's time of
    its messages, in `controller stats`), the one on time is not named, and a controller started again — which
    sweeps retention at once — keeps every frame of both (before: the first sweep deleted them, silently)."""
    site.start_controller()
    site.start_agent("behind", clock_s=-8 * 86400)
    site.start_agent("ontime")
    time.sleep(2)
    site.stop_agents()
    want = complete(site)
    assert {n for n, *_ in want} == {"behind", "ontime"}
    site.controller.terminate()
    site.controller.wait(timeout=30)
    site.start_controller()                       # its first sweep: retention by the frames' time and receipt
    wait_for(lambda: "retention swept" in (site.tmp / "controller.log").read_text(), 30, "the first sweep")
    assert set(site.stored()) == want             # every frame of both kept
    res = subprocess.run([*JOBPROBE, "controller", "stats", "--store", str(site.store), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    nodes = json.loads(res.stdout)["nodes"]
    assert nodes["behind"]["clock"]["skewed"] and abs(nodes["behind"]["clock"]["offset_s"] + 8 * 86400) < 30, nodes
    assert "clock" not in nodes["ontime"], nodes["ontime"]
    db = sqlite3.connect(f"file:{site.store}?mode=ro", uri=True)
    events = db.execute("SELECT node, json_extract(body, '$.offset_s') FROM events WHERE event = 'clock_skew'"
                        ).fetchall()
    ts = db.execute("SELECT MAX(t) FROM frames WHERE node = 'behind' AND run != 'controller'").fetchone()[0]
    db.close()
    assert [n for n, _ in events] == ["behind"], events            # once, not per frame or batch
    assert time.time() - ts > 8 * 86400 - 60                        # its frames' own times, 8 days ago


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_the_nats_server_down_for_20_s_the_spool_holds_then_every_frame_arrives(site):
    site.start_controller()
    site.start_agent("n1")
    time.sleep(1.5)
    site.nats.stop()
    time.sleep(20)
    st = site.status("n1")
    (job,) = st["jobs"]
    nats_sink = next(v for k, v in job["sinks"].items() if k.startswith("nats:"))
    assert nats_sink["depth"] >= 60 and nats_sink["dropped"] == 0, nats_sink   # 20 s at 4 frames/s, waiting
    site.nats.start()
    time.sleep(2)
    site.stop_agents()
    complete(site, timeout=60)


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_a_full_spool_drops_the_oldest_and_counts_exactly_what_is_missing(site):
    site.start_controller()
    site.start_agent("n1", spool_mb=0.02)       # 20 KiB: a few dozen frames
    time.sleep(1)
    site.nats.stop()
    time.sleep(12)
    dropped = next(v for k, v in site.status("n1")["jobs"][0]["sinks"].items() if k.startswith("nats:"))["dropped"]
    assert dropped > 0
    site.nats.start()
    # the spool drained into the server again (waited for: slower beside other work) before the agent stops
    sink = wait_for(lambda: (v := next(v for k, v in site.status("n1")["jobs"][0]["sinks"].items()
                                       if k.startswith("nats:")))["depth"] == 0 and v, 60, "the spool to drain")
    dropped = sink["dropped"]
    site.stop_agents()
    want = site.produced()
    wait_for(lambda: len(site.stored()) >= len(want) - dropped, 30, "what was not dropped to arrive")
    time.sleep(1)
    missing = want - set(site.stored())
    assert len(missing) == dropped, (len(missing), dropped)
    log = (site.tmp / "n1" / "agent.log").read_text()
    assert "spool" in log and "dropped" in log
    # the controller's own figures agree to the frame: the running total survives the frames that carried the
    # per-interval counts being dropped, seq says what is missing, and the run's hello was kept through the bound
    res = subprocess.run([*JOBPROBE, "controller", "stats", "--store", str(site.store), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    n1 = json.loads(res.stdout)["nodes"]["n1"]
    assert n1["dropped_at_source"] == dropped and n1["missing_frames"] == dropped, (n1, dropped)
    db = sqlite3.connect(f"file:{site.store}?mode=ro", uri=True)
    assert db.execute("SELECT COUNT(*) FROM frames WHERE node = 'n1' AND kind = 'hello'").fetchone()[0] == 1
    db.close()


AUTH = """authorization {
  users = [
    {user: n1, password: s3cret-n1,
     permissions: {publish: ["jobprobe.frames.*.n1", "jobprobe.beat.n1"], subscribe: ["_INBOX_JP.n1.>"]}}
    {user: n2, password: s3cret-n2,
     permissions: {publish: ["jobprobe.frames.*.n2", "jobprobe.beat.n2"], subscribe: ["_INBOX_JP.n2.>"]}}
    {user: controller, password: s3cret-ctl}
  ]
}
"""


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_a_node_publishes_only_its_own_frames_and_a_stranger_is_refused(tmp_path):
    """Per-node users whose server permissions allow their own subject only: n1 flows; n2's credentials used on
    another node's subject are refused by the server, and wrong credentials are refused at connect — both logged,
    nothing of theirs stored — while n1 keeps flowing. (A frame whose `node` is not its subject's node, sent with
    the right credentials, is the controller's to refuse: test_a_thousand_mutated_frames….)"""
    site = Site(tmp_path)
    try:
        site.nats.start(AUTH)
        creds = {}
        for user, pw in (("n1", "s3cret-n1"), ("n2", "s3cret-n2"), ("controller", "s3cret-ctl"), ("bad", "guess")):
            creds[user] = tmp_path / f"{user}.pass"
            creds[user].write_text(f"{user if user != 'bad' else 'n1'}:{pw}\n")
            creds[user].chmod(0o600)
        site.start_controller(creds["controller"])
        site.start_agent("n1", creds=creds["n1"])
        site.start_agent("n1-forged", creds=creds["n2"])    # node name n1-forged: its subject is not n2's
        site.start_agent("n3", creds=creds["bad"])          # user n1 with a wrong password
        time.sleep(3)
        site.stop_agents()
        n1 = {k for k in site.produced() if k[0] == "n1"}
        wait_for(lambda: n1 <= set(site.stored()), 30, "n1's frames")
        assert {r[0] for r in site.stored()} == {"n1"}                # nothing of the others
        forged = (tmp_path / "n1-forged" / "agent.log").read_text()
        bad = (tmp_path / "n3" / "agent.log").read_text()
        assert "frames wait in the spool" in forged and "ermission" in forged, forged
        assert "frames wait in the spool" in bad and "uthorization" in bad, bad
    finally:
        site.close()


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_a_three_server_jetstream_cluster_loses_nothing_when_a_server_dies(tmp_path):
    """Three nats-servers clustered, the stream replicated on all three (--replicas 3); two nodes publish to the
    cluster's URLs; the server the controller is not told about first is killed mid-run: every frame arrives."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    routes = ", ".join(f"nats://127.0.0.1:{c}" for _, c in ports)
    servers = []
    for i, (p, c) in enumerate(ports):
        d = tmp_path / f"s{i}"
        d.mkdir()
        (d / "nats.conf").write_text(f'server_name: s{i}\nlisten: "127.0.0.1:{p}"\n'
                                     f'jetstream {{ store_dir: "{d}/js" }}\n'
                                     f'cluster {{ name: jp, listen: "127.0.0.1:{c}", routes: [{routes}] }}\n')
        servers.append(subprocess.Popen([NATS, "-c", str(d / "nats.conf")], stdout=subprocess.DEVNULL,
                                        stderr=open(d / "log", "wb")))
    site = Site(tmp_path)
    site.nats.url = ",".join(f"nats://127.0.0.1:{p}" for p, _ in ports)
    try:
        site.controller = subprocess.Popen([*JOBPROBE, "controller", "--nats", site.nats.url, "--store",
                                            str(site.store), "--replicas", "3"], cwd=REPO, stdout=subprocess.DEVNULL,
                                           stderr=open(tmp_path / "controller.log", "ab"))
        wait_for(lambda: "consuming" in (tmp_path / "controller.log").read_text() or site.controller.poll() is not None,
                 60, "the controller to make its replicated stream")
        assert site.controller.poll() is None, (tmp_path / "controller.log").read_text()
        site.start_agent("n1")
        site.start_agent("n2")
        time.sleep(2)
        servers[2].kill()
        servers[2].wait()
        killed_at = len(site.stored())
        # the two left elect the stream's new leader (a few seconds); meanwhile frames wait in the spools
        wait_for(lambda: len(site.stored()) > killed_at + 8, 60, "frames to flow again through the two servers left")
        site.stop_agents()
        got = complete(site, timeout=60)
        assert {n for n, *_ in got} == {"n1", "n2"}
    finally:
        site.close()
        for s in servers:
            if s.poll() is None:
                s.terminate()
                s.wait(timeout=10)


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make test certificates")
def test_tls_with_the_servers_ca_flows_and_without_it_frames_wait(tmp_path):
    """The server requires TLS: an agent given its CA (--nats-ca) and the controller (--ca) connect and every frame
    arrives; an agent without it fails the certificate check, says so, and its frames wait in its spool."""
    ca = make_certs(tmp_path)
    site = Site(tmp_path)
    try:
        site.nats.start(f'tls {{ cert_file: "{tmp_path}/server.pem", key_file: "{tmp_path}/server.key" }}\n')
        site.controller = subprocess.Popen([*JOBPROBE, "controller", "--nats", site.nats.url, "--store",
                                            str(site.store), "--ca", str(ca)], cwd=REPO, stdout=subprocess.DEVNULL,
                                           stderr=open(tmp_path / "controller.log", "ab"))
        wait_for(lambda: "consuming" in (tmp_path / "controller.log").read_text(), 30, "the controller over TLS")
        site.start_agent("n1", ca=ca)
        site.start_agent("n2")                              # the system's CAs only: this server is not among them
        time.sleep(2)
        depth = next(v for k, v in site.status("n2")["jobs"][0]["sinks"].items() if k.startswith("nats:"))["depth"]
        site.stop_agents()
        n1 = {k for k in site.produced() if k[0] == "n1"}
        wait_for(lambda: n1 <= set(site.stored()), 30, "n1's frames over TLS")
        assert {r[0] for r in site.stored()} == {"n1"} and depth > 0
        assert "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "n2" / "agent.log").read_text()
    finally:
        site.close()


# ---- the publisher against the server's limits and its going away ------------------------------------------
def stream_ids(url: str, make: dict | None = None) -> list[str]:
    """The Nats-Msg-Id of every message in stream FRAMES, in order (nats-py, the controller's client: the two
    clients checked against each other); with `make`, the stream is made first, with those settings."""
    import asyncio

    import nats

    async def go():
        nc = await nats.connect(url)
        js = nc.jetstream()
        try:
            if make is not None:
                await js.add_stream(name="FRAMES", subjects=["jobprobe.frames.>"], duplicate_window=60, **make)
                return []
            n = (await js.stream_info("FRAMES")).state.last_seq
            return [(await js.get_msg("FRAMES", i)).headers["Nats-Msg-Id"] for i in range(1, n + 1)]
        finally:
            await nc.close()
    return asyncio.run(go())


def sink_frame(i: int) -> dict:
    return {"node": "n1", "job": "j", "run": "r1", "seq": i}


@pytest.mark.integration
@need_nats
def test_frames_the_server_cannot_take_are_counted_lost_and_never_block_the_ones_behind(tmp_path):
    """The server takes messages up to 8 KiB (max_payload), the stream up to 3000 bytes (max_msg_size): frames
    past the first are never sent, those past the second are refused by JetStream for good — both counted
    dropped, skipped; every other frame arrives, in order, none held up behind them."""
    from jobprobe.exporters.nats import NatsSink
    server = NatsServer(tmp_path)
    server.start("max_payload: 8192\n")
    sink = None
    try:
        stream_ids(server.url, make={"max_msg_size": 3000})
        sink = NatsSink(server.url, tmp_path / "spool", compress=False)
        rng = random.Random(3)
        sizes = [rng.choice([10, 500, 2500, 2500, 4000, 20_000]) for _ in range(300)]
        sizes[0], sizes[-1] = 20_000, 4000                        # at the head of the spool, and last
        for i, n in enumerate(sizes):
            sink.write(sink_frame(i), os.urandom(n))
            if i % 50 == 0:
                time.sleep(0.1)                                   # several windows, some of them begun by a big one
        wait_for(lambda: sink.spool.depth() == 0, 30, "the spool to empty")
        st = sink.job_stats("j")
        big = [i for i, n in enumerate(sizes) if n > 3000]
        assert st["dropped"] == len(big) and st["written"] == len(sizes) - len(big) and st["depth"] == 0, st
        assert stream_ids(server.url) == [f"n1/j/r1/{i}" for i, n in enumerate(sizes) if n <= 3000]
        assert sink.state == "ok"
    finally:
        if sink is not None:
            sink.close(timeout=2)
        server.stop()


def connz(http_port: int) -> list[str]:
    """The names of the clients a nats-server has now (its monitoring endpoint)."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/connz", timeout=2) as r:
        return [c.get("name", "") for c in json.load(r).get("connections") or []]


@pytest.mark.integration
@need_nats
def test_a_server_in_lame_duck_mode_is_left_for_the_next_at_once(tmp_path):
    """Two servers in the sink's list; the first is put in lame-duck mode (`nats-server --signal ldm`) with a 20 s
    grace period before it closes anyone: the idle sink moves to the second within seconds, not when the first
    closes the connection, and frames flow there."""
    from jobprobe.exporters.nats import NatsSink
    servers, ports = [], []
    sink = None
    try:
        for name in ("s1", "s2"):
            d = tmp_path / name
            d.mkdir()
            s = NatsServer(d)
            ports.append(free_port())
            s.start(f'http: "127.0.0.1:{ports[-1]}"\nlame_duck_duration: "60s"\nlame_duck_grace_period: "20s"\n')
            stream_ids(s.url, make={})
            servers.append(s)
        sink = NatsSink(",".join(s.url for s in servers), tmp_path / "spool", compress=False)
        for i in range(5):
            sink.write(sink_frame(i), b"x" * 100)
        wait_for(lambda: sink.spool.depth() == 0 and any("jobprobe-agent" in c for c in connz(ports[0])), 20,
                 "the frames on the first server")
        subprocess.run([NATS, "--signal", f"ldm={servers[0].proc.pid}"], check=True, timeout=10,
                       capture_output=True)
        t0 = time.monotonic()
        wait_for(lambda: any("jobprobe-agent" in c for c in connz(ports[1])), 10, "the sink on the second server")
        assert time.monotonic() - t0 < 5 and servers[0].proc.poll() is None     # well inside the grace period
        for i in range(5, 10):
            sink.write(sink_frame(i), b"x" * 100)
        wait_for(lambda: sink.spool.depth() == 0, 10, "the frames on the second server")
        assert stream_ids(servers[1].url) == [f"n1/j/r1/{i}" for i in range(5, 10)]
        assert sink.job_stats("j")["dropped"] == 0
    finally:
        if sink is not None:
            sink.close(timeout=2)
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()


# ---- unit: the controller's checks, the spool ---------------------------------------------------------------
def frame(node="n1", job="j", seq=0, **extra) -> dict:
    b = FrameBuilder(node, job, run="r1")
    return {**b.sample(time.time(), 1.0, {"cgroup": {"cpu_user_ns": 1}}, {"cgroup": "ok"}), "seq": seq, **extra}


def test_a_thousand_mutated_frames_are_refused_and_counted_and_the_good_ones_stored(tmp_path):
    from jobprobe.cluster.controller import Controller
    from jobprobe.cluster.store import REJECT_SAMPLES, Store
    store = Store(tmp_path / "s.db")
    ctl = Controller(store, "nats://unused")
    rng = random.Random(7)
    good = encode(frame())
    huge = msgpack.packb({str(k): k for k in range(200_000)})
    assert len(huge) > 1 << 20
    msgs, n_good = [], 0
    for i in range(1000):
        kind = i % 8
        if kind == 0:
            data = good[:rng.randrange(1, len(good))]                      # truncated
        elif kind == 1:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))   # noise
        elif kind == 2:
            data = encode(frame(seq="x"))                                   # wrong type
        elif kind == 3:
            data = encode(frame(kind="bogus"))                              # unknown kind
        elif kind == 4:
            data = huge                                                     # a map past the size bound
        elif kind == 5:
            data = encode(frame(node="n2"))                                 # another node's frame on n1's subject
        elif kind == 6:
            data = [encode([1, 2, 3]),                                      # not a map
                    zlib.compress(b"\0" * (4 << 20)),                      # a zlib bomb: inflates past the bound
                    b"\x78garbage"][i % 3]                                  # says zlib, is not
        else:
            data = encode(frame(seq=i))                                     # a good one, as agents send it or plain
            data = zlib.compress(data) if i % 16 == 7 else data
            n_good += 1
        msgs.append(SimpleNamespace(subject=frames_subject("n1", "j"), data=data))
    frames = ctl.take(msgs)
    store.add(frames)
    assert len(frames) == n_good and ctl.counts["rejected"] == 1000 - n_good
    db = sqlite3.connect(tmp_path / "s.db")
    assert db.execute("SELECT SUM(n) FROM reject_counts").fetchone()[0] == 1000 - n_good
    reasons = {r for (r,) in db.execute("SELECT reason FROM reject_counts")}
    assert reasons == {"malformed", "subject", "quota_frame_size"}, reasons      # the map past 1 MiB: at the door
    assert db.execute("SELECT COUNT(*) FROM rejects").fetchone()[0] == len(reasons) * REJECT_SAMPLES
    assert db.execute("SELECT COUNT(*) FROM frames").fetchone()[0] == n_good
    assert db.execute("SELECT rejected FROM delivery WHERE node = 'n1'").fetchone()[0] == 1000 - n_good
    with pytest.raises(MalformedFrame, match="a node publishes its own frames"):
        ctl.check(frames_subject("n1", "j"), encode(frame(node="n2")))
    # stored twice: once
    assert store.add([frame(seq=7)]) == (0, 1)


def test_node_lost_after_three_silent_intervals_and_back(tmp_path):
    from jobprobe.cluster.controller import Controller
    from jobprobe.cluster.store import Store
    ctl = Controller(Store(tmp_path / "s.db"), "nats://unused")
    hello = {**frame(), "kind": "hello", "interval": 2.0}
    assert ctl.seen([hello, frame(seq=1)], now=100.0) == []
    assert ctl.lost_nodes(now=105.9) == []                              # 2.95 intervals
    (lost,) = ctl.lost_nodes(now=106.1)
    assert (lost["event"], lost["node"], lost["job"], lost["silent_s"]) == ("node_lost", "n1", "j", 6.1)
    assert ctl.lost_nodes(now=200.0) == []                              # once
    (back,) = ctl.seen([frame(seq=2)], now=210.0)
    assert back["event"] == "node_back" and back["silent_s"] == 110.0


def test_the_spool_keeps_order_across_a_restart_and_drops_the_oldest_past_its_bound(tmp_path):
    from jobprobe.exporters.spool import Spool
    sp = Spool(tmp_path / "sp", max_bytes=64 << 10, segment_bytes=16 << 10)
    for i in range(10):
        sp.append(f"id{i}", "s", "j", b"x" * 100)
    sp.acked(sp.take(4))
    sp.close()
    sp = Spool(tmp_path / "sp", max_bytes=64 << 10, segment_bytes=16 << 10)   # a new agent
    assert [r[3] for r in sp.peek(100)] == [f"id{i}" for i in range(4, 10)]
    for i in range(10, 2000):
        sp.append(f"id{i}", "s", "j", b"x" * 100)
    left = [r[3] for r in sp.peek(10_000)]
    assert len(left) + sp.lost["j"] == 2000 - 4                         # every frame: waiting, or counted lost
    assert left == [f"id{i}" for i in range(2000 - len(left), 2000)]     # the newest kept, in order
    assert sum(p.stat().st_size for p in (tmp_path / "sp").glob("seg-*")) <= (64 << 10) + (16 << 10)
    # frames handed to the server and not yet acked are never the ones dropped: they may be in the stream already
    sent = sp.take(3)
    for i in range(2000, 4000):
        sp.append(f"id{i}", "s", "j", b"x" * 100)
    assert sp.peek(3) == sent and sp.inflight == 3
    sp.acked(sent)
    assert sp.inflight == 0 and sent[0] not in sp.peek(10)


def test_a_spool_left_by_an_agent_of_before_job_subjects_goes_out_on_them(tmp_path):
    """Records spooled on `jobprobe.frames.<node>` (an agent before frames carried their job in the subject) are
    read back on `jobprobe.frames.<job>.<node>`, which a stream takes; newer subjects are left as they are."""
    from jobprobe.core.wire import beat_subject
    from jobprobe.exporters.spool import Spool
    sp = Spool(tmp_path / "sp")
    sp.append("a", "jobprobe.frames.gpu-1", "train.7", b"x")
    sp.append("b", frames_subject("gpu-1", "train.7"), "train.7", b"x")
    sp.append("c", beat_subject("gpu-1"), "node", b"x")
    sp.close()
    sp = Spool(tmp_path / "sp")
    assert [r[4] for r in sp.peek(10)] == ["jobprobe.frames.train_2e7.gpu-1"] * 2 + ["jobprobe.beat.gpu-1"]
    sp.close()


def test_stats_counts_drops_from_the_running_total_and_missing_frames_from_seq_the_start_included(tmp_path):
    """A run whose first 5 frames never arrived, and whose frames that carried 50 of its 150 dropped frames' counts
    were dropped too: the running total says 150, seq says 5 missing, the start's gap is 5 intervals."""
    from jobprobe.cluster.metrics import stats
    from jobprobe.cluster.store import Store
    store = Store(tmp_path / "s.db")
    frames = []
    for seq in range(5, 10):
        f = frame(seq=seq, t=1000.0 + seq, dt=2.0)
        f["probes"]["self"] = {"sink_dropped": 20, "sink_dropped_total": 100 + 10 * (seq - 5)}
        frames.append(f)
    frames[-1]["probes"]["self"]["sink_dropped_total"] = 150
    store.add(frames)
    n1 = stats(store, now=2000.0)["nodes"]["n1"]
    assert n1["dropped_at_source"] == 150 and n1["missing_frames"] == 5 and n1["longest_gap_s"] == 10.0, n1


@pytest.mark.skipif(not IS_ROOT, reason="mounts a tmpfs: needs root (CI runs as root)")
def test_a_cursor_the_disk_refuses_is_counted_and_its_frames_go_again_after_a_restart(tmp_path, monkeypatch, caplog):
    """The spool's cursor written after an ack: a full disk refuses it. Not an error of the publisher's (before: the
    OSError left acked() half done and went up to the publisher); counted and said once, and the next agent reads
    the frames from the cursor that was written — sent again, kept once by their message ids and the store's keys."""
    from jobprobe.core.safefile import Dir
    from jobprobe.exporters.spool import Spool
    sp = Spool(tmp_path / "spool", 1 << 20)
    for i in range(6):
        sp.append(f"n/j/r/{i}", "s", "j", b"x" * 10)
    sp.acked(sp.take(2))                                   # the cursor at the third record
    real = Dir.write_atomic

    def full(self, name, data):
        if name == "cursor":
            raise OSError(28, "No space left on device")
        return real(self, name, data)
    monkeypatch.setattr(Dir, "write_atomic", full)
    sp.acked(sp.take(2))
    sp.acked(sp.take(1))
    assert sp.cursor_errors == 2 and sp.depth() == 1
    assert len([r for r in caplog.records if "cursor could not be written" in r.getMessage()]) == 1
    sp.close()
    monkeypatch.setattr(Dir, "write_atomic", real)
    again = Spool(tmp_path / "spool", 1 << 20)             # the next agent: from the cursor written last
    assert [r[3] for r in again.peek(10)] == [f"n/j/r/{i}" for i in range(2, 6)]
    again.close()


def test_a_full_disk_loses_no_frame_uncounted_and_leaves_the_spool_readable(tmp_path, caplog):
    """The spool on a 64 KiB tmpfs, no server: each of 419 frames is either still in the spool or counted dropped
    (what the self probe's sink_dropped sums), the failures are said in a line or two rather than one per frame,
    and a short write is taken back: the spool reads back whole."""
    from jobprobe.exporters.nats import NatsSink
    from jobprobe.exporters.spool import Spool
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "jobprobe-test", str(disk)], check=True)
    sink = sp = None
    try:
        sink = NatsSink(f"nats://127.0.0.1:{free_port()}", disk / "spool", max_bytes=1 << 20)   # nothing listens
        job = sink.for_job("j")
        for i in range(419):
            f = {**sink_frame(i), "v": 1, "kind": "sample", "noise": os.urandom(300 + i % 97)}  # zlib cannot shrink
            job.write(f, encode(f))
        st = job.stats()
        sink.close(timeout=0.5)
        assert st["dropped"] > 0 and st["depth"] + st["dropped"] == 419, st
        said = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert 1 <= len(said) <= 2, [r.getMessage() for r in said]
        sp = Spool(disk / "spool", 1 << 20)                 # the next agent: every frame kept is there, none cut
        assert sp.depth() == st["depth"] and not sp.lost and sp.cut == 0
        seqs = [int(r[3].rsplit("/", 1)[-1]) for r in sp.peek(1000)]
        assert seqs == sorted(set(seqs)) and seqs[0] == 0                  # in order, none twice
    finally:
        for held in (sink, sp):          # their fds closed, or the tmpfs cannot be unmounted
            if held is not None:
                held.close(**({"timeout": 0} if held is sink else {}))
        subprocess.run(["umount", str(disk)], check=True)


def test_a_record_cut_at_a_segments_end_is_skipped_counted_and_written_after(tmp_path):
    """A crash mid-write (or a short write that could not be taken back) leaves half a record at the end of the
    last segment: read back without error, counted lost for its job (read from what is left of it), and cut off
    so that the records appended next are read too."""
    from jobprobe.exporters.spool import Spool
    sp = Spool(tmp_path / "sp")
    for i in range(5):
        sp.append(f"id{i}", "s", "j", b"x" * 100)
    sp.close()
    seg = tmp_path / "sp" / "seg-0"
    rec = msgpack.packb(["id5", "s", "j", b"x" * 100, False], use_bin_type=True)
    seg.write_bytes(seg.read_bytes() + rec[:len(rec) // 2])
    sp = Spool(tmp_path / "sp")
    assert [r[3] for r in sp.peek(10)] == [f"id{i}" for i in range(5)]
    assert sp.cut == 1 and sp.lost == {"j": 1}
    sp.append("id6", "s", "j", b"y" * 100)
    sp.close()
    sp = Spool(tmp_path / "sp")
    assert [r[3] for r in sp.peek(10)] == [f"id{i}" for i in range(5)] + ["id6"] and sp.cut == 0
    sp.close()


def test_a_runs_hello_outlives_the_spools_bound_and_is_never_counted_lost(tmp_path):
    """The hello holds the run's schema and interval: when its segment goes, it is written again at the end (kept
    across a restart too); every other frame of that segment is counted lost — the count equals what is missing."""
    from jobprobe.exporters.spool import Spool
    sp = Spool(tmp_path / "sp", max_bytes=64 << 10, segment_bytes=16 << 10)
    sp.append("hello-a", "s", "a", b"h" * 100, keep=True)
    for i in range(2000):
        sp.append(f"a{i}", "s", "a", b"x" * 100)
    ids = [r[3] for r in sp.peek(10_000)]
    assert "hello-a" in ids and ids.count("hello-a") == 1
    assert len(ids) - 1 + sp.lost["a"] == 2000                            # the hello is neither lost nor doubled
    sp.close()
    sp = Spool(tmp_path / "sp", max_bytes=64 << 10, segment_bytes=16 << 10)
    assert [r[3] for r in sp.peek(10_000)].count("hello-a") == 1 and sp.peek(10_000)[ids.index("hello-a")][7]


def test_query_reads_the_store_as_sql_as_a_field_over_time_and_in_three_formats(tmp_path):
    from jobprobe.cluster.store import Store
    store = Store(tmp_path / "s.db")
    frames = [frame(node=n, seq=i, t=1000.0 + i) for n in ("n1", "n2") for i in range(3)]
    for i, f in enumerate(frames):
        f["probes"] = {"cgroup": {"cpu_user_ns": 100 * i}}
    assert sum(store.add([f], received=f["t"] + 0.2)[0] for f in frames) == 6     # each came as it was made
    store.close()

    def query(*args):
        return subprocess.run([*JOBPROBE, "query", "--store", str(tmp_path / "s.db"), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    res = query("--job", "j", "--field", "cgroup.cpu_user_ns", "--node", "n2", "--format", "csv")
    assert res.returncode == 0, res.stderr
    rows = [ln.split(",") for ln in res.stdout.splitlines()]
    assert rows[0] == ["node", "run", "seq", "t", "dt", "value"]
    assert [(r[0], r[2], r[5]) for r in rows[1:]] == [("n2", "0", "300"), ("n2", "1", "400"), ("n2", "2", "500")]
    res = query("--sql", "SELECT node, COUNT(*) AS n FROM frames GROUP BY node ORDER BY node", "--format", "jsonl")
    assert [json.loads(x) for x in res.stdout.splitlines()] == [{"node": "n1", "n": 3}, {"node": "n2", "n": 3}]
    res = query("--sql", "SELECT COUNT(*) AS frames FROM samples")
    assert res.stdout.split() == ["frames", "6"]
    for bad, says in ((["--sql", "SELEC nonsense"], "query:"), (["--job", "j", "--field", "x;drop"], "not a field"),
                      (["--job", "j"], "needs --field")):
        res = query(*bad)
        assert res.returncode == 2 and says in res.stderr and res.stderr.count("\n") == 1, res.stderr
    res = subprocess.run([*JOBPROBE, "query", "--store", str(tmp_path / "none.db"), "--sql", "SELECT 1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no store" in res.stderr
    # retention: frames older than the bound go, by their own time and when they came
    store = Store(tmp_path / "s.db")
    assert store.forget_before(1001.5) == 4
    assert store.sql("SELECT COUNT(*) FROM frames")[1] == [(2,)]
