# SPDX-License-Identifier: Apache-2.0
"""A cluster site for the tests: a real nats-server on loopback (NatsServer), agents and a controller started as
processes against it (Site), and what they need (need_nats: skip where nats-server is not installed). Used by
test_nats, test_natswire, test_liveness, test_stragglers and test_tsdb."""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import until as wait_for
from jobprobe.bench.ddp import Nats as NatsServer  # noqa: F401 (a nats-server on loopback, for the tests)
from jobprobe.core.frame import StreamReader

REPO = Path(__file__).resolve().parents[1]
JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]
NATS = shutil.which("nats-server") or "/usr/sbin/nats-server"
need_nats = pytest.mark.skipif(not os.path.exists(NATS), reason="nats-server is not installed (scripts/setup.sh)")


# an agent whose clock is off: its time.time() moved by argv[1] seconds (frames, file names, the publish header)
FAKE_CLOCK = ("import sys, time; _real = time.time; _off = float(sys.argv.pop(1)); time.time = lambda: _real() + _off;"
              " from jobprobe.cli import main; sys.exit(main())")


def answering(sock: Path) -> dict | None:
    """The status an agent answers on its socket, or None while it does not answer yet."""
    from jobprobe.node.control import call
    try:
        return call(str(sock), {"cmd": "status"})
    except Exception:
        return None


class Site:
    """A NATS server, a controller, agents (each its own node name, spool and control socket), all real."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.nats = NatsServer(tmp)
        self.store = tmp / "store.db"
        self.controller: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.sleepers: list[subprocess.Popen] = []

    def start_controller(self, creds: Path | None = None) -> None:
        self.controller = subprocess.Popen([*JOBPROBE, "controller", "--nats", self.nats.url, "--store",
                                            str(self.store)] + (["--creds", str(creds)] if creds else []), cwd=REPO,
                                           stdout=subprocess.DEVNULL, stderr=open(self.tmp / "controller.log", "ab"))
        wait_for(lambda: "consuming" in (self.tmp / "controller.log").read_text(), 30, "the controller to consume")

    def start_agent(self, node: str, spool_mb: float = 64, creds: Path | None = None, ca: Path | None = None,
                    clock_s: float = 0.0) -> None:
        """clock_s: the agent's clock that far off (a fake clock: its time.time() moved, nothing else)."""
        d = self.tmp / node
        d.mkdir(exist_ok=True)
        self.agents[node] = subprocess.Popen(
            ([sys.executable, "-c", FAKE_CLOCK, str(clock_s)] if clock_s else JOBPROBE) + ["agent", "--node", node,
             "--send", self.nats.url, "--spool", str(d / "spool"),
             "--spool-max-mb", str(spool_mb), "--socket", str(d / "agent.sock"), "--state", str(d / "jobs.json"),
             "--out", str(d / "out"), "--probes", "cgroup,self", "--interval", "0.25"]
            + (["--nats-creds", str(creds)] if creds else []) + (["--nats-ca", str(ca)] if ca else []), cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=open(d / "agent.log", "ab"))
        from jobprobe.node.control import call
        wait_for(lambda: answering(d / "agent.sock"), 60, f"agent {node}")
        sleeper = subprocess.Popen(["sleep", "600"])
        self.sleepers.append(sleeper)
        r = call(str(d / "agent.sock"), {"cmd": "attach", "pid": sleeper.pid, "job": f"job-{node}"})
        assert r["ok"], r

    def status(self, node: str) -> dict:
        from jobprobe.node.control import call
        return call(str(self.tmp / node / "agent.sock"), {"cmd": "status"})

    def stop_agents(self) -> None:
        for p in self.agents.values():
            p.send_signal(signal.SIGTERM)
        for p in self.agents.values():
            p.wait(timeout=60)

    def produced(self) -> set[tuple]:
        """(node, job, run, seq) of every frame the agents wrote to their files."""
        out = set()
        for node in self.agents:
            for path in (self.tmp / node / "out").glob("*.mpk"):
                with open(path, "rb") as f:
                    out |= {(fr["node"], fr["job"], fr["run"], fr["seq"]) for fr in StreamReader(f)}
        return out

    def stored(self) -> list[tuple]:
        if not self.store.exists():
            return []
        db = sqlite3.connect(f"file:{self.store}?mode=ro", uri=True)
        try:
            return db.execute("SELECT node, job, run, seq FROM frames WHERE run != 'controller'").fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            db.close()

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.controller is not None and self.controller.poll() is None:
            self.controller.terminate()
            self.controller.wait(timeout=30)
        for s in self.sleepers:
            s.kill()
            s.wait()
        self.nats.stop()


