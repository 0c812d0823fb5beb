# SPDX-License-Identifier: Apache-2.0
"""A node's straggler record across jobs (jobprobe/cluster/nodes.py): the controller's real detector names a node
throttled in job after job; the third distinct job makes it a suspect (`node_suspect`, once per window,
`jobprobe_node_suspect` in /metrics); `jobprobe nodes` lists the nodes by the time the others lost to them, from the
store the controller wrote, against what the test made happen."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

from jobprobe.cluster.controller import Controller
from jobprobe.cluster.store import Store

HOUR = 3600.0


def samples(job: str, t: float, slow: str | None, rng: random.Random) -> list[dict]:
    """One second of a three-node job (a, b, c); `slow`: that node CPU-throttled (a limit of 0.25 cores, 60% of the
    second throttled), the others waiting for it."""
    out = []
    for n in "abc":
        cpu, wait, throttled = 0.9e9 * rng.uniform(0.9, 1.1), 0.3e9 * rng.uniform(0.8, 1.2), 0
        cg = {"cpu_user_ns": 0, "cpu_system_ns": 0, "cpu_throttled_ns": 0}
        if slow is not None:
            throttled, wait = (0.6e9, 0.05e9) if n == slow else (0, 0.7e9)
            if n == slow:
                cg["cpu_limit_cores"] = 0.25
        cg.update(cpu_user_ns=int(cpu), cpu_throttled_ns=int(throttled))
        out.append({"v": 1, "kind": "sample", "node": n, "job": job, "run": "r", "seq": int(t), "t": t, "dt": 1.0,
                    "probes": {"cgroup": cg,
                               "sched": {"runq_lat_ns": int(0.02e9), "offcpu_lock_ns": int(wait),
                                         "offcpu_wait_ns": 0},
                               "net": {"tcp_tx_bytes": 10 << 20, "tcp_rx_bytes": 10 << 20, "tcp_retransmits": 0}}})
    return out


def a_job(ctl: Controller, store: Store, job: str, slow: str, t0: float) -> list[dict]:
    """200 s of `job`, `slow` throttled from 60 s to 120 s in, through the controller's detector; every frame and
    event stored as the controller stores them. Its events."""
    rng = random.Random(job)
    events = []
    for s in range(200):
        t = t0 + s
        batch = samples(job, t, slow if 60 <= s < 120 else None, rng)
        ev = ctl.straggler_events(batch, t)
        store.add(batch + ev, received=t)
        events += ev
    return events


def test_a_node_named_in_three_jobs_is_a_suspect_once_and_listed_first(tmp_path):
    store = Store(tmp_path / "s.db")
    ctl = Controller(store, "nats://unused")
    now = time.time()
    made: list[dict] = []
    for k, (job, slow) in enumerate([("j1", "b"), ("j2", "c"), ("j3", "b"), ("j4", "b"), ("j5", "b")]):
        made += [dict(e, _job=job) for e in a_job(ctl, store, job, slow, now - (6 - k) * HOUR)]
    named = [(e["_job"], e["event"], e["node"]) for e in made if e["event"] in ("straggler", "node_suspect")]
    # the detector named each slow node in its job; b became a suspect with its third job (j4), and once only
    assert named == [("j1", "straggler", "b"), ("j2", "straggler", "c"), ("j3", "straggler", "b"),
                     ("j4", "straggler", "b"), ("j4", "node_suspect", "b"), ("j5", "straggler", "b")], named
    (sus,) = [e for e in made if e["event"] == "node_suspect"]
    assert sus["suspect"] == "b" and sus["jobs"] == ["j1", "j3", "j4"] and sus["episodes"] == 3, sus
    assert "named the straggler of 3 jobs" in sus["reason"]

    # the jobs' summaries say how long the others waited for each node (what `summary` writes: waited_for)
    waited = {"j1": {"b": 40.5}, "j2": {"c": 12.0}, "j3": {"b": 33.0}, "j4": {"b": 30.0}, "j5": {"b": 1.5, "c": 9.0}}
    store.add([ctl.node_event("a", job, "summary", now - HOUR, {"waited_for": w}) for job, w in waited.items()],
              received=now)
    store.close()
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "nodes", "--store", str(tmp_path / "s.db"),
                          "--since", "1d", "--format", "json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = {r["node"]: r for r in json.loads(res.stdout)}
    assert [r["node"] for r in json.loads(res.stdout)] == ["b", "c"]        # the most time lost to it first
    ends = {(e["_job"], e["node"]): e["duration_s"] for e in made if e["event"] == "straggler_end"}
    b, c = rows["b"], rows["c"]
    assert (b["jobs"], b["episodes"], b["suspect"]) == (["j1", "j3", "j4", "j5"], 4, True), b
    assert b["lost_s"] == 40.5 + 33.0 + 30.0 + 1.5 and c["lost_s"] == 12.0     # j5 never named c: not counted
    assert b["seconds"] == round(sum(d for (_, n), d in ends.items() if n == "b"), 1) and b["seconds"] > 4 * 50
    assert b["causes"] == {"cpu_throttled": 4} and (c["jobs"], c["suspect"]) == (["j2"], False), c
    # a window that holds only the last two jobs: b named in two, no suspect
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "nodes", "--store", str(tmp_path / "s.db"),
                          "--since", "3h"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "SUSPECT" not in res.stdout and res.stdout.splitlines()[1].startswith("b "), \
        res.stdout
    bad = subprocess.run([sys.executable, "-m", "jobprobe.cli", "nodes", "--store", str(tmp_path / "s.db"),
                          "--since", "forever"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    # /metrics: b a suspect
    from prometheus_client import CollectorRegistry, generate_latest

    from jobprobe.cluster.metrics import MetricsCollector
    reg = CollectorRegistry()
    reg.register(MetricsCollector(ctl))
    text = generate_latest(reg).decode()
    assert 'jobprobe_node_suspect{node="b"} 1.0' in text and 'jobprobe_node_suspect{node="c"}' not in text
