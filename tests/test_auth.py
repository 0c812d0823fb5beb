# SPDX-License-Identifier: Apache-2.0
"""Authenticated by default: the one-command controller's nats-server admits only the controller's key and the
keys `jobprobe controller enroll` made, each node limited to its own subjects — checked against the real server,
with real agents, and a cluster-wide trace that works under exactly the generated permissions."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, until

REPO = Path(__file__).resolve().parents[1]
JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]
NATS = shutil.which("nats-server") or "/usr/sbin/nats-server"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(NATS), reason="nats-server is not installed (scripts/setup.sh)")]


class Controller:
    """`jobprobe controller --data D` (one-command mode: it starts its own nats-server) as a process."""

    def __init__(self, tmp: Path, listen: str = "127.0.0.1", extra: tuple = (), scheme: str = "nats"):
        self.data, self.port = tmp / "ctl", free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tmp / "controller.log"
        self.proc = subprocess.Popen([*JOBPROBE, "controller", "--data", str(self.data), "--listen",
                                      f"{listen}:{self.port}", *extra], cwd=REPO, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "ab"))
        until(lambda: "consuming" in self.log.read_text() or self.proc.poll() is not None, 30, "the controller")
        assert self.proc.poll() is None, self.log.read_text()

    def enroll(self, node: str) -> Path:
        out = subprocess.run([*JOBPROBE, "controller", "enroll", node, "--data", str(self.data)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        path = Path(out.stdout.strip().splitlines()[-1])
        assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
        return path

    def stored(self, sql: str) -> list[tuple]:
        import sqlite3
        db = sqlite3.connect(f"file:{self.data / 'store.db'}?mode=ro", uri=True)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


@pytest.fixture
def ctl(tmp_path):
    c = Controller(tmp_path)
    yield c
    c.close()


async def _client(url: str, seed: Path | None, inbox: str = "_INBOX", errors: list | None = None):
    import nats

    async def said(err: Exception) -> None:
        if errors is not None:
            errors.append(str(err))
    opts = {"servers": [url], "connect_timeout": 2, "allow_reconnect": False, "error_cb": said,
            "inbox_prefix": inbox}
    if seed:
        opts["nkeys_seed"] = str(seed)
    return await nats.connect(**opts)


def test_anonymous_and_unknown_keys_are_refused(ctl, tmp_path):
    from jobprobe.transport.credentials import NatsError, new_user_nkey
    from jobprobe.transport.natswire import Wire
    with pytest.raises(NatsError, match="Authorization Violation"):
        Wire(ctl.url, name="anonymous").connect()
    stranger = tmp_path / "stranger.nk"
    stranger.write_text(new_user_nkey()[0] + "\n")
    with pytest.raises(NatsError, match="Authorization Violation"):
        Wire(ctl.url, str(stranger), name="stranger").connect()
    with pytest.raises(Exception, match="Authorization Violation"):
        asyncio.run(_client(ctl.url, None))


def test_a_node_publishes_and_reads_only_its_own_subjects(ctl):
    from jobprobe.core.frame import FrameBuilder, encode
    seeds = {n: ctl.enroll(n) for n in ("n1", "n2")}

    async def as_n1() -> tuple[list[str], bool]:
        errors: list[str] = []
        nc = await _client(ctl.url, seeds["n1"], "_INBOX_JP.n1", errors)
        js = nc.jetstream()
        b = FrameBuilder("n1", "j", run="r")
        ack = await js.publish("jobprobe.frames.j.n1", encode(b.sample(time.time(), 1.0, {}, {})))
        assert ack.stream == "JOBPROBE"
        forged = FrameBuilder("n2", "j", run="forged")
        await nc.publish("jobprobe.frames.j.n2", encode(forged.sample(time.time(), 1.0, {}, {})))
        await nc.publish("jobprobe.beat.n2", encode(forged.heartbeat(time.time(), 1.0, 0)))
        for subject in ("jobprobe.frames.>", "_INBOX.>", "jobprobe.ctl.node.n2", ">"):
            await nc.subscribe(subject)
        for subject in ("jobprobe.ctl.trace", "jobprobe.ctl.node.n2", "$JS.API.STREAM.DELETE.JOBPROBE",
                        "$KV.jobprobe_leases.p0"):
            await nc.publish(subject, json.dumps({"job": "j"}).encode())
        await nc.flush()
        await asyncio.sleep(0.5)
        await nc.close()
        return errors
    errors = asyncio.run(as_n1())
    text = "\n".join(errors).lower()
    for what in ("Publish to \"jobprobe.frames.j.n2\"", "Publish to \"jobprobe.beat.n2\"",
                 "Subscription to \"jobprobe.frames.>\"",
                 "Subscription to \"_INBOX.>\"", "Subscription to \"jobprobe.ctl.node.n2\"",
                 "Publish to \"jobprobe.ctl.trace\"", "Publish to \"jobprobe.ctl.node.n2\"",
                 "Publish to \"$JS.API.STREAM.DELETE.JOBPROBE\"", "Publish to \"$KV.jobprobe_leases.p0\""):
        assert what.lower() in text, f"not refused: {what}\n{text}"
    until(lambda: ctl.stored("SELECT COUNT(*) FROM frames WHERE node = 'n1'")[0][0] == 1, 10, "n1's frame stored")
    assert ctl.stored("SELECT COUNT(*) FROM frames WHERE node = 'n2'")[0][0] == 0

    async def stream_alive() -> bool:       # the delete was refused: the controller's key still sees the stream
        nc = await _client(ctl.url, ctl.data / "auth" / "controller.nk")
        try:
            return (await nc.jetstream().stream_info("JOBPROBE")).config.name == "JOBPROBE"
        finally:
            await nc.close()
    assert asyncio.run(stream_alive())


class Agent:
    def __init__(self, tmp: Path, node: str, url: str, creds: Path, job: str = "train", ca: Path | None = None):
        from jobprobe.node.control import call
        self.dir = tmp / node
        self.dir.mkdir()
        self.log = self.dir / "agent.log"
        self.proc = subprocess.Popen(
            [*JOBPROBE, "agent", "--node", node, "--send", url, "--nats-creds", str(creds), "--spool",
             str(self.dir / "spool"), "--socket", str(self.dir / "agent.sock"), "--state", str(self.dir / "jobs.json"),
             "--probes", "cgroup,self", "--interval", "0.5"] + (["--nats-ca", str(ca)] if ca else []), cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"))

        def up():
            try:
                return call(str(self.dir / "agent.sock"), {"cmd": "status"})
            except Exception:
                return None
        until(up, 60, f"agent {node}")
        self.sleeper = subprocess.Popen(["sleep", "600"])
        r = call(str(self.dir / "agent.sock"), {"cmd": "attach", "pid": self.sleeper.pid, "job": job})
        assert r["ok"], r

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self.sleeper.kill()
        self.sleeper.wait()


@pytest.mark.kernel
def test_a_cluster_trace_works_under_the_generated_permissions_and_a_wrong_key_is_said(ctl, tmp_path):
    agents = [Agent(tmp_path, n, ctl.url, ctl.enroll(n)) for n in ("n1", "n2")]
    old = tmp_path / "n5-old.nk"
    shutil.copy(ctl.enroll("n5"), old)
    ctl.enroll("n5")                                   # enrolled again: a new key, the old one revoked
    revoked = Agent(tmp_path, "n5", ctl.url, old, job="other")
    wrong = Agent(tmp_path, "n3", ctl.url, ctl.enroll("n4"), job="other")   # another node's key
    agents += [revoked, wrong]
    try:
        until(lambda: ctl.stored("SELECT COUNT(DISTINCT node) FROM frames WHERE node IN ('n1', 'n2')")[0][0] == 2,
              30, "frames of n1 and n2 in the store")
        until(lambda: "Authorization Violation" in revoked.log.read_text(), 30, "n5 (a revoked key) to say it")
        # n3 runs with n4's key: the server refuses its frames and its control subject, and it says so
        until(lambda: "Permissions Violation" in wrong.log.read_text(), 30, "n3 (another node's key) to say it")
        # …its control subject included: a node whose trace requests could never arrive says so
        until(lambda: 'refused a subscription: Permissions Violation for Subscription to "jobprobe.ctl.node.n3"'
              in wrong.log.read_text(), 30, "n3 to say its control subject is refused")
        assert ctl.stored("SELECT COUNT(*) FROM frames WHERE node IN ('n3', 'n5')")[0][0] == 0
        out = subprocess.run([*JOBPROBE, "trace", "--job", "train", "--duration", "2", "--nats", ctl.url,
                              "--nats-creds", str(ctl.data / "auth" / "controller.nk")], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "n1: scheduled" in out.stdout and "n2: scheduled" in out.stdout, out.stdout
        # the person's request without the controller's key: refused
        bad = subprocess.run([*JOBPROBE, "trace", "--job", "train", "--nats", ctl.url,
                              "--nats-creds", str(ctl.enroll("n9"))], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and "ermission" in bad.stderr, bad.stderr
    finally:
        for a in agents:
            a.close()


def test_the_documented_permissions_are_the_generated_ones():
    """docs/DEPLOY.md's block is what natsauth writes into the server's config (the cluster trace above ran under
    the generated ones): the docs cannot drift from the code."""
    import re

    from jobprobe.transport.natsauth import node_permissions
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    m = re.search(r"<!-- node-permissions (\S+) -->\n```json\n(.*?)\n```", text, re.S)
    assert m, "docs/DEPLOY.md has no node-permissions block"
    assert json.loads(m.group(2)) == node_permissions(m.group(1))


def test_not_loopback_without_tls_is_refused_and_a_killed_controller_takes_its_server(tmp_path):
    port = free_port()
    out = subprocess.run([*JOBPROBE, "controller", "--data", str(tmp_path / "a"), "--listen", f"0.0.0.0:{port}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "TLS" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    c = Controller(tmp_path)
    pid = int((c.data / "nats-server.pid").read_text())
    c.proc.kill()
    c.proc.wait()
    until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
          10, "its nats-server to go with it")
    with socket.socket() as squatter:            # something else on the port: refused, never used
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", c.port))
        squatter.listen()
        out = subprocess.run([*JOBPROBE, "controller", "--data", str(c.data), "--listen", f"127.0.0.1:{c.port}"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "something else listens" in out.stderr, out.stderr


@pytest.mark.kernel
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make test certificates")
def test_on_every_address_with_tls_an_enrolled_agent_with_the_ca_flows_and_plaintext_is_refused(tmp_path):
    """The documented path (docs/DEPLOY.md §6): `jobprobe controller tls 127.0.0.1` makes the CA and the server's
    certificate, then --listen 0.0.0.0 with --tls-cert/--tls-key, the controller checking its own server against
    --ca, an agent with its enrolled key and --nats-ca; a client without TLS is refused."""
    out = subprocess.run([*JOBPROBE, "controller", "tls", "--data", str(tmp_path), "127.0.0.1", "localhost"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ca = Path(out.stdout.splitlines()[-1])
    tls = tmp_path / "tls"
    assert ca == tls / "ca.pem" and stat.S_IMODE((tls / "server.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tls / "ca.key").stat().st_mode) == 0o600 and stat.S_IMODE(tls.stat().st_mode) == 0o700
    c = Controller(tmp_path, listen="0.0.0.0", scheme="tls", extra=(
        "--tls-cert", str(tls / "server.pem"), "--tls-key", str(tls / "server.key"), "--ca", str(ca)))
    agent = None
    try:
        agent = Agent(tmp_path, "n1", c.url, c.enroll("n1"), ca=ca)
        until(lambda: c.stored("SELECT COUNT(*) FROM frames WHERE node = 'n1'")[0][0] > 0, 30, "n1's frames, TLS")
        with socket.create_connection(("127.0.0.1", c.port), timeout=5) as sock:   # a plaintext client
            info = json.loads(sock.recv(4096).split(b" ", 1)[1])
            assert info["tls_required"] is True and info["auth_required"] is True
            sock.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
            sock.settimeout(5)
            said = b""
            while True:                          # the server refuses it and hangs up; it is never answered PONG
                try:
                    chunk = sock.recv(4096)
                except (ConnectionResetError, socket.timeout):
                    break
                if not chunk:
                    break
                said += chunk
            assert b"PONG" not in said, said
    finally:
        if agent is not None:
            agent.close()
        c.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make certificates")
def test_controller_tls_keeps_its_ca_and_refuses_a_name_that_is_no_host(tmp_path):
    """Run again with another name: a new server certificate from the same CA (agents keep their ca.pem), valid for
    the new name (checked by openssl verify against the CA); a name that could write into openssl's config (a comma,
    a newline, a slash) or none at all: one line, exit 2, nothing made."""
    def tls(*names):
        return subprocess.run([*JOBPROBE, "controller", "tls", "--data", str(tmp_path), *names], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert tls("ctl.example.org").returncode == 0
    d = tmp_path / "tls"
    ca = (d / "ca.pem").read_bytes()
    assert tls("10.0.0.5", "ctl-2.example.org").returncode == 0
    assert (d / "ca.pem").read_bytes() == ca
    for name in ("ctl-2.example.org", "10.0.0.5"):
        flag = "-verify_ip" if name[0].isdigit() else "-verify_hostname"
        v = subprocess.run(["openssl", "verify", "-CAfile", str(d / "ca.pem"), flag, name, str(d / "server.pem")],
                           capture_output=True, text=True)
        assert v.returncode == 0, v.stderr
    v = subprocess.run(["openssl", "verify", "-CAfile", str(d / "ca.pem"), "-verify_hostname", "ctl.example.org",
                        str(d / "server.pem")], capture_output=True, text=True)
    assert v.returncode != 0                          # the first name is no longer this certificate's
    made = sorted(p.name for p in d.iterdir())
    for bad in (["a,DNS:evil.org"], ["a\nb"], ["x/y"], []):
        out = tls(*bad)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "controller tls" in out.stderr, out.stderr
    assert sorted(p.name for p in d.iterdir()) == made == ["ca.key", "ca.pem", "ca.srl", "server.key", "server.pem"]
