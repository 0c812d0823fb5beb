"""The agent's own NATS client (exporters/natswire.py) and its Ed25519/nkey signing (exporters/ed25519.py):
signatures checked against RFC 8032's test vectors, and every path against a real nats-server started here —
the server verifying the nonce signature is the independent judge of the nkey code."""
from __future__ import annotations

import os
import time

import pytest

from conftest import until as wait_for
from test_nats import NatsServer, Site, need_nats

from jobprobe.exporters import ed25519
from jobprobe.exporters.natswire import Credentials, NatsError, NoResponders, Wire

# RFC 8032 §7.1, TEST 1 and TEST 2: (secret key, public key, message, signature)
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24"
     "655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb"
     "00d291612bb0c00"),
]


@pytest.mark.parametrize("sk,pk,msg,sig", RFC8032)
def test_ed25519_matches_rfc8032(sk, pk, msg, sig):
    assert ed25519.public_key(bytes.fromhex(sk)).hex() == pk
    assert ed25519.sign(bytes.fromhex(sk), bytes.fromhex(msg)).hex() == sig


def test_nkey_seed_round_trip_and_refusals():
    seed = os.urandom(32)
    text = ed25519.user_seed(seed)
    assert text.startswith("SU") and len(text) == 58
    got, public = ed25519.nkey_from_seed(text)
    assert got == seed and public.startswith("U") and len(public) == 56
    broken = text[:10] + ("A" if text[10] != "A" else "B") + text[11:]
    with pytest.raises(ValueError, match="checksum"):
        ed25519.nkey_from_seed(broken)
    with pytest.raises(ValueError):
        ed25519.nkey_from_seed("not base32 at all!")


def test_credentials_files(tmp_path):
    seed = ed25519.user_seed(os.urandom(32))
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
    assert fields["nkey"] == ed25519.nkey_from_seed(seed)[1]
    pw = tmp_path / "n1.pass"
    pw.write_text("n1:s3cret\n")
    assert Credentials(str(pw)).connect_fields(None) == {"user": "n1", "pass": "s3cret"}
    pw.write_text("no colon here\n")
    with pytest.raises(ValueError, match="user:password"):
        Credentials(str(pw))


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
@pytest.mark.kernel
@need_nats
def test_an_agent_with_an_nkey_flows_and_an_unknown_nkey_is_refused(tmp_path):
    """The server verifies the agent's Ed25519 signature of its nonce: n1's key (a `.nk` seed) is a user of the
    server, allowed its own subject only; another key is refused at connect; nothing of it is stored."""
    seeds = {n: ed25519.user_seed(os.urandom(32)) for n in ("n1", "stranger")}
    public = ed25519.nkey_from_seed(seeds["n1"])[1]
    site = Site(tmp_path)
    try:
        site.nats.start('authorization { users = [\n'
                        f'  {{nkey: {public}, permissions: {{publish: ["jobprobe.frames.n1"], subscribe: ["_INBOX.>"]}}}}\n'
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
