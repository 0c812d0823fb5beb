# SPDX-License-Identifier: Apache-2.0
"""The agent's own NATS client (jobprobe/transport/natswire.py), its nkey signing (the `nkeys` package, as
nats-py's) and
its protocol manners: every path against a real nats-server started here — the server verifying the nonce
signature is the independent judge of the nkey code —, async INFO against a socket that plays the server, and the
refusal to send a password in clear."""
from __future__ import annotations

import base64
import json
import os
import socket
import time

import nkeys
import pytest

from conftest import until as wait_for
from jobprobe.transport.credentials import Credentials, NatsError, PlaintextPassword, new_user_nkey
from jobprobe.transport.natswire import NoResponders, TooLarge, Wire
from natsite import NatsServer, Site, need_nats


def test_a_new_user_nkey_is_one_that_nkeys_reads_back():
    seed, public = new_user_nkey()
    assert seed.startswith("SU") and len(seed) == 58 and public.startswith("U") and len(public) == 56
    assert nkeys.from_seed(seed.encode()).public_key.decode() == public
    assert new_user_nkey()[0] != seed                          # a new key each time


def test_an_nkey_signs_the_nonce_and_a_mistyped_seed_is_refused(tmp_path):
    seed, public = new_user_nkey()
    nk = tmp_path / "n1.nk"
    nk.write_text(seed + "\n")
    fields = Credentials(str(nk)).connect_fields("a-nonce")
    assert fields["nkey"] == public and len(fields["sig"]) == 86
    sig = base64.urlsafe_b64decode(fields["sig"] + "==")
    assert nkeys.from_seed(seed.encode()).verify(b"a-nonce", sig)       # nkeys' own check of the signature
    with pytest.raises(nkeys.ErrInvalidSignature):
        nkeys.from_seed(seed.encode()).verify(b"another-nonce", sig)
    broken = seed[:10] + ("A" if seed[10] != "A" else "B") + seed[11:]
    nk.write_text(broken + "\n")
    with pytest.raises(ValueError, match="checksum"):
        Credentials(str(nk))
    nk.write_text("SU not base32 at all!\n")
    with pytest.raises(ValueError, match="nkey seed"):
        Credentials(str(nk))
    nk.write_text(public + "\n")                               # a public key where the seed goes
    with pytest.raises(ValueError, match="SU"):
        Credentials(str(nk))


def test_credentials_files(tmp_path):
    seed, public = new_user_nkey()
    creds = tmp_path / "n1.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJhbGciOi.payload.sig\n------END NATS USER JWT------\n\n"
                     "************************* IMPORTANT *************************\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")
    c = Credentials(str(creds))
    assert (c.jwt, c.seed) == ("eyJhbGciOi.payload.sig", seed)
    fields = c.connect_fields("a-nonce")
    assert fields["jwt"] == c.jwt and "nkey" not in fields and len(fields["sig"]) == 86
    nk = tmp_path / "n1.nk"
    nk.write_text(seed + "\n")
    fields = Credentials(str(nk)).connect_fields("a-nonce")
    assert fields["nkey"] == public
    pw = tmp_path / "n1.pass"
    pw.write_text("n1:s3cret\n")
    assert Credentials(str(pw)).connect_fields(None) == {"user": "n1", "pass": "s3cret"}
    pw.write_text("no colon here\n")
    with pytest.raises(ValueError, match="user:password"):
        Credentials(str(pw))


def test_a_password_is_never_sent_in_clear_to_another_host(tmp_path):
    """user:password or a token, without TLS, to a host that is not loopback: refused when the Wire is made (the
    agent's command line), unless allowed explicitly; TLS, loopback and nkeys pass."""
    pw = tmp_path / "n1.pass"
    pw.write_text("n1:s3cret\n")
    nk = tmp_path / "n1.nk"
    nk.write_text(new_user_nkey()[0] + "\n")
    for url, creds in (("nats://10.0.0.5:4222", pw), ("nats-host:4222", pw), ("nats://u:p@10.0.0.5:4222", None),
                       ("nats://s3cret-token@nats.example.org", None), ("nats://127.0.0.1:4222,10.0.0.5", pw),
                       ("nats://[2001:db8::1]:4222", pw), ("nats://localhost.example.org:4222", pw)):
        with pytest.raises(PlaintextPassword, match="in clear") as err:
            Wire(url, str(creds) if creds else None)
        assert "s3cret" not in str(err.value) and "allow_plaintext_password" in str(err.value)
        Wire(url, str(creds) if creds else None, allow_plaintext_password=True)        # told: taken
    for url, creds, tls in (("nats://127.0.0.1:4222", pw, {}), ("nats://127.8.9.1", pw, {}), ("localhost:4222", pw, {}),
                            ("nats://[::1]:4222", pw, {}), ("nats://u:p@localhost", None, {}),
                            ("tls://10.0.0.5:4222", pw, {}), ("nats://10.0.0.5:4222", pw, {"tls_ca": "/ca.pem"}),
                            ("nats://10.0.0.5:4222", nk, {}), ("nats://10.0.0.5:4222", None, {})):
        Wire(url, str(creds) if creds else None, **tls)
    from jobprobe.exporters.nats import NatsSink
    with pytest.raises(PlaintextPassword):
        NatsSink("nats://10.0.0.5:4222", tmp_path / "spool", creds=str(pw))


class FakeServer:
    """One connection of a socket that plays a NATS server: INFO, then PONG to the client's PING; the test says
    the rest."""

    def __init__(self, info: dict):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self.listener.getsockname()[1]}"
        self.info, self.conn = info, None

    def accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.sendall(b"INFO " + json.dumps(self.info).encode() + b"\r\n")
        got = b""
        while b"PING\r\n" not in got:
            got += self.conn.recv(4096)
        self.conn.sendall(b"PONG\r\n")

    def close(self) -> None:
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()


def test_an_info_at_any_time_updates_max_payload_and_says_lame_duck():
    import threading
    fake = FakeServer({"server_id": "fake", "max_payload": 4096, "headers": True})
    t = threading.Thread(target=fake.accept)
    t.start()
    w = Wire(fake.url)
    w.connect()
    t.join()
    try:
        assert w.max_payload == 4096 and not w.lame_duck
        assert w.fits("id-1", b"x" * 4000) and not w.fits("id-1", b"x" * 4096)
        with pytest.raises(TooLarge):                        # never sent: the server would close the connection
            w.publish([("t.1", "id-1", b"x" * 5000)])
        fake.conn.sendall(b'INFO {"server_id":"fake","max_payload":65536,"connect_urls":["10.9.9.9:4222"]}\r\n')
        wait_for(lambda: (w.service(), w.max_payload == 65536)[1], 5, "the new max_payload")
        assert w.servers == [fake.url]                       # a server named by a server is not trusted with creds
        assert w.fits("id-1", b"x" * 5000) and not w.lame_duck
        fake.conn.sendall(b'PING\r\nINFO {"server_id":"fake","max_payload":65536,"ldm":true}\r\n')
        wait_for(lambda: (w.service(), w.lame_duck)[1], 5, "lame-duck mode to be noticed")
        assert fake.conn.recv(4096).endswith(b"PONG\r\n")   # (after the client's SUB)
        fake.conn.sendall(b"INFO {not json\r\n")
        with pytest.raises(NatsError, match="INFO"):
            wait_for(lambda: w.service(), 5, "a broken INFO refused")
    finally:
        w.close()
        fake.close()


@pytest.fixture
def server(tmp_path):
    s = NatsServer(tmp_path)
    yield s
    s.stop()


def make_stream(url: str) -> None:
    """The stream, made through the other client (nats-py, the controller's), so the two are checked against
    each other."""
    import asyncio

    import nats

    async def go():
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(name="T", subjects=["t.>"], duplicate_window=60)
        await nc.close()
    asyncio.run(go())


@pytest.mark.integration
@need_nats
def test_wire_publishes_acks_in_order_and_the_server_drops_a_resend(server):
    server.start()
    make_stream(server.url)
    w = Wire(server.url)
    w.connect()
    msgs = [(f"t.{i % 3}", f"id-{i}", os.urandom(i % 700)) for i in range(600)]
    acks = w.publish(msgs[:300]) + w.publish(msgs[300:])
    assert [a["seq"] for a in acks] == list(range(1, 601))
    again = w.publish(msgs[10:12])                             # a resend after a lost ack: stored once
    assert [a.get("duplicate") for a in again] == [True, True] and [a["seq"] for a in again] == [11, 12]
    with pytest.raises(NoResponders):                          # a subject no stream takes
        w.publish([("nowhere.x", "id-x", b"x")], timeout=2)
    w.service()                                                # idle: nothing pending, nothing raised
    w.close()


@pytest.mark.integration
@need_nats
def test_wire_says_when_the_server_is_gone_or_refuses(server, tmp_path):
    w = Wire(server.url, timeout=1)
    with pytest.raises(ConnectionRefusedError):
        w.connect()
    server.start('authorization { users = [ {user: a, password: b} ] }\n')
    bad = tmp_path / "bad.pass"
    bad.write_text("a:wrong\n")
    with pytest.raises(NatsError, match="uthorization"):
        Wire(server.url, creds=str(bad)).connect()
    good = tmp_path / "good.pass"
    good.write_text("a:b\n")
    w = Wire(server.url, creds=str(good))
    w.connect()
    server.stop()
    time.sleep(0.2)
    with pytest.raises(ConnectionError):
        w.service()


@pytest.mark.integration
@need_nats
def test_agent_and_controller_clients_sign_with_one_nkey_and_the_server_judges(server, tmp_path):
    """The agent's Wire and the controller's nats-py (auth_options) take the same `.nk` file; the server verifies
    both signatures. A key the server does not know, and no key at all, are refused."""
    import asyncio

    import nats

    from jobprobe.transport.credentials import auth_options
    (seed, public), (stranger, _) = new_user_nkey(), new_user_nkey()
    server.start(f'authorization {{ users = [ {{nkey: {public}}} ] }}\n')
    files = {}
    for name, s in (("n1", seed), ("stranger", stranger)):
        files[name] = tmp_path / f"{name}.nk"
        files[name].write_text(s + "\n")
    w = Wire(server.url, creds=str(files["n1"]))
    w.connect()
    w.service()
    w.close()
    for creds in (files["stranger"], None):
        with pytest.raises(NatsError, match="uthorization"):
            Wire(server.url, creds=str(creds) if creds else None).connect()

    async def controller(creds) -> str:
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0,
                                **auth_options(str(creds)))
        try:
            return (await nc.request("$JS.API.INFO", b"", timeout=2)).data.decode()
        finally:
            await nc.close()
    assert "jetstream" in asyncio.run(controller(files["n1"]))
    with pytest.raises(Exception, match="uthorization"):
        asyncio.run(controller(files["stranger"]))


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
def test_an_agent_with_an_nkey_flows_and_an_unknown_nkey_is_refused(tmp_path):
    """The server verifies the agent's Ed25519 signature of its nonce: n1's key (a `.nk` seed) is a user of the
    server, allowed its own subject only; another key is refused at connect; nothing of it is stored."""
    keys = {n: new_user_nkey() for n in ("n1", "stranger")}
    seeds, public = {n: k[0] for n, k in keys.items()}, keys["n1"][1]
    site = Site(tmp_path)
    try:
        site.nats.start('authorization { users = [\n'
                        f'  {{nkey: {public}, permissions: {{publish: ["jobprobe.frames.*.n1", "jobprobe.beat.n1"], '
                        f'subscribe: ["_INBOX_JP.n1.>"]}}}}\n'
                        '  {user: controller, password: s3cret-ctl}\n] }\n')
        files = {}
        for n, s in seeds.items():
            files[n] = tmp_path / f"{n}.nk"
            files[n].write_text(s + "\n")
            files[n].chmod(0o600)
        ctl = tmp_path / "controller.pass"
        ctl.write_text("controller:s3cret-ctl\n")
        site.start_controller(ctl)
        site.start_agent("n1", creds=files["n1"])
        site.start_agent("n2", creds=files["stranger"])
        time.sleep(2.5)
        site.stop_agents()
        n1 = {k for k in site.produced() if k[0] == "n1"}
        wait_for(lambda: n1 <= set(site.stored()), 30, "n1's frames")
        assert {r[0] for r in site.stored()} == {"n1"}
        log = (tmp_path / "n2" / "agent.log").read_text()
        assert "frames wait in the spool" in log and "uthorization" in log, log
    finally:
        site.close()


@pytest.mark.root
def test_the_agent_refuses_a_malformed_credentials_file_in_one_line(tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "n1.pass"
    bad.write_text("no colon\n")
    for creds in (bad, tmp_path / "absent.pass"):
        r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "agent", "--send", "nats://127.0.0.1:1",
                            "--nats-creds", str(creds), "--socket", str(tmp_path / "a.sock"), "--state",
                            str(tmp_path / "st.json"), "--spool", str(tmp_path / "spool")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and str(creds) in r.stderr, r


def test_the_sink_subscribes_what_it_serves_from_its_own_thread(tmp_path):
    """NatsSink.serve() from the agent's thread while the publisher connects in its own: only the publisher's
    thread writes to the connection — the SUB included (made from the agent's thread, it raced a refused login that
    closed the socket under it: an agent died at start with EBADF) — and the served subject is subscribed."""
    import threading

    from jobprobe.exporters.nats import NatsSink
    fake = FakeServer({"server_id": "fake", "max_payload": 65536, "headers": True})
    t = threading.Thread(target=fake.accept)
    t.start()
    sink = NatsSink(fake.url, tmp_path / "spool", node="n1")
    writers, send = [], sink.wire._send

    def spy(data: bytes) -> None:
        writers.append((threading.current_thread().name, data))
        send(data)
    sink.wire._send = spy
    try:
        t.join(5)
        sink.serve("jobprobe.control.n1", lambda req: b"")
        got = b""
        fake.conn.settimeout(5)
        while b"SUB jobprobe.control.n1" not in got:
            got += fake.conn.recv(4096)
        assert writers and {name for name, _ in writers} == {"nats"}, writers
    finally:
        sink.closing.set()
        sink.wake.set()
        sink.hurry.set()
        sink.thread.join(5)
        sink.spool.close()
        fake.close()
