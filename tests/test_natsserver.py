# SPDX-License-Identifier: Apache-2.0
"""The one-command controller's own nats-server (jobprobe/cluster/natsserver.py), supervised: SIGKILLed twice mid-run
it is started again each time, /metrics says so, and every frame an agent's sink sent across the outages is
stored exactly once (the real exporter: spooled, resent from the spool after each outage)."""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, until
from jobprobe.core.frame import FrameBuilder, encode

REPO = Path(__file__).resolve().parents[1]
JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]
NATS = "/usr/sbin/nats-server"
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(NATS), reason="nats-server is not installed (scripts/setup.sh)")]


def server_of(ctl: int) -> int | None:
    """The pid of the nats-server child of process `ctl`, or None."""
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if comm == "nats-server" and int(rest[1]) == ctl:
            return int(d.name)
    return None


def metric(port: int, name: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_its_nats_server_killed_twice_is_restarted_and_nothing_sent_is_lost(tmp_path):
    from jobprobe.exporters.nats import NatsSink
    data, port, mport = tmp_path / "ctl", free_port(), free_port()
    log = tmp_path / "ctl.log"
    ctl = subprocess.Popen([*JOBPROBE, "controller", "--data", str(data), "--listen", f"127.0.0.1:{port}",
                            "--metrics", f"127.0.0.1:{mport}"], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=open(log, "ab"))
    sink = None
    stop = threading.Event()
    sent: set[tuple] = set()
    try:
        until(lambda: "active" in log.read_text() or ctl.poll() is not None, 60, "the controller active")
        assert ctl.poll() is None, log.read_text()
        out = subprocess.run([*JOBPROBE, "controller", "enroll", "n1", "--data", str(data)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        sink = NatsSink(f"nats://127.0.0.1:{port}", tmp_path / "spool", creds=out.stdout.strip().splitlines()[-1],
                        node="n1")

        def agent() -> None:
            b = FrameBuilder("n1", "j1", run="r1")
            f = {**b.hello(probes={"cgroup": {}}), "interval": 1.0}
            while True:
                sink.write(f, encode(f))
                sent.add((f["node"], f["job"], f["run"], f["seq"]))
                if stop.wait(0.05):
                    return
                f = b.sample(time.time(), 0.05, {"cgroup": {"cpu_user_ns": 1}}, {"cgroup": "ok"})
        writer = threading.Thread(target=agent, daemon=True)
        writer.start()
        seen: list[tuple[float, float | None]] = []      # (when, nats_up) every 20 ms

        def poll() -> None:
            while not stop.wait(0.02):
                seen.append((time.monotonic(), metric(mport, "jobprobe_controller_nats_up")))
        threading.Thread(target=poll, daemon=True).start()
        restarted = []
        for kill in range(2):
            time.sleep(3)
            pid = until(lambda: server_of(ctl.pid), 10, "the controller's nats-server")
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            new = until(lambda: (server_of(ctl.pid) or pid) != pid and server_of(ctl.pid), 30,
                        f"a new nats-server after kill {kill + 1}")
            until(lambda: metric(mport, "jobprobe_controller_nats_up") == 1, 30, "nats_up 1 again")
            restarted.append(time.monotonic() - killed)
            assert any(t > killed and v == 0 for t, v in seen), f"nats_up never said 0 after kill {kill + 1}"
            assert new != pid
        assert metric(mport, "jobprobe_controller_nats_server_restarts_total") == 2
        time.sleep(2)
        stop.set()
        writer.join(10)
        sink.close(timeout=30)
        assert sink.spool.depth() == 0, "the sink never delivered its spool"
        sink = None

        def stored() -> list[tuple]:
            db = sqlite3.connect(f"file:{data / 'store.db'}?mode=ro", uri=True)
            try:
                return db.execute("SELECT node, job, run, seq FROM frames WHERE run != 'controller'").fetchall()
            finally:
                db.close()
        try:
            until(lambda: set(stored()) >= sent, 30, "every frame sent, stored")
        except AssertionError:
            missing = sorted(sent - set(stored()))
            raise AssertionError(f"{len(missing)} of {len(sent)} not stored, first {missing[:5]}\n"
                                 + log.read_text()[-3000:]) from None
        rows = stored()
        assert len(rows) == len(set(rows)) and set(rows) == sent
        said = log.read_text()
        assert len(re.findall(r"nats-server \(pid \d+\) exited: killed by signal SIGKILL", said)) == 2, said[-3000:]
        print(f"{len(sent)} frames; back (nats_up 1) {', '.join(f'{s:.1f}' for s in restarted)} s after each kill")
    finally:
        stop.set()
        if sink is not None:
            sink.close(timeout=1)
        server = server_of(ctl.pid)
        if ctl.poll() is None:
            ctl.terminate()
            try:
                ctl.wait(30)
            except subprocess.TimeoutExpired:
                ctl.kill()
                ctl.wait()
        if server is not None and Path(f"/proc/{server}").exists():
            os.kill(server, signal.SIGKILL)
