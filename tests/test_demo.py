# SPDX-License-Identifier: Apache-2.0
"""`make demo`'s node part as it is shipped (scripts/demo.sh agent): a controller with its own nats-server, this node
enrolled, an agent sending two jobs' frames to it — everything the agent wrote to its files arrived in the store, and
nothing was refused (an agent the server does not know would be: `Authorization Violation`)."""
from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from conftest import free_port
from jobprobe.core.frame import StreamReader

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.kernel
@pytest.mark.integration
def test_the_demos_agent_sends_every_frame_to_its_controller():
    res = subprocess.run(["bash", "scripts/demo.sh", "agent"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DEMO_NATS_PORT": str(free_port())})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Authorization Violation" not in res.stderr and "refused" not in res.stderr, res.stderr[-2000:]
    db = sqlite3.connect(f"file:{REPO / 'out/controller/store.db'}?mode=ro", uri=True)
    try:
        stored = dict(db.execute("SELECT job, COUNT(*) FROM frames WHERE kind = 'sample' GROUP BY job").fetchall())
    finally:
        db.close()
    for job in ("demo-a", "demo-b"):
        with open(REPO / f"out/agent/{job}.mpk", "rb") as f:
            written = sum(1 for fr in StreamReader(f) if fr.get("kind") == "sample")
        assert written >= 5 and stored.get(job) == written, (job, written, stored)
    assert "where the time went:" in res.stdout and "straggler" not in res.stdout.split("== jobprobe report")[0]
    # the day's jobs: both, with the owner their attach gave them, ended
    jobs = res.stdout.split("== jobprobe jobs")[1]
    rows = [ln for ln in jobs.splitlines() if ln.startswith("demo-")]
    assert sorted(r.split()[0] for r in rows) == ["demo-a", "demo-b"], jobs
    assert all("account=reference,user=demo" in r for r in rows) and "2 jobs, 1 failed" in jobs, jobs
    # demo-b crashed on purpose (exit 3): said so in its row and in its summary, demo-a ended well
    ends = {r.split()[0]: r for r in rows}
    assert "exit 3 FAILED" in ends["demo-b"] and "exit 0" in ends["demo-a"] and "FAILED" not in ends["demo-a"], jobs
    assert "ended: exit 3" in res.stdout.split("demo-b crashed")[1], res.stdout[-3000:]
