# SPDX-License-Identifier: Apache-2.0
"""How a job ended, for jobs the agent did not start (attached by their cgroup, as a scheduler's prolog does): real
processes in real groups ending each way — exit 0, exit 3, SIGTERM, SIGKILL, the OOM killer under a v1 memory limit,
the group removed under a running job — each said as itself in the job's last frame (`end`), in `jobprobe summary`
and in the agent's /metrics, against what the test itself did to each (and the process's own wait status where its
parent is the test).

Kernel tier (root): the leads' wait status comes from the kernel's taskstats exit records.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, serving_agent, until
from jobprobe.core.frame import StreamReader
from jobprobe.node.agent import Agent
from jobprobe.node.config import Config
from jobprobe.node.control import call

pytestmark = pytest.mark.kernel
REPO = Path(__file__).resolve().parents[1]

# The job: says it is ready, then does what its stdin says.
JOB = r"""
import os, signal, sys, time
print("ready", flush=True)
how = sys.stdin.readline().split()
if how[0] == "exit":
    sys.exit(int(how[1]))
if how[0] == "term":
    os.kill(os.getpid(), signal.SIGTERM)
if how[0] == "oom":
    hold = []
    while True:
        hold.append(bytearray(b"x") * (8 << 20))
time.sleep(120)
"""

# job → what the test does, and the `end` its last frame must carry (cause, code; oom_kills at least 1 for oom)
CASES = {
    "ok": ("exit 0", {"cause": "exit", "exit_code": 0}, "exit 0", False),
    "crash": ("exit 3", {"cause": "exit", "exit_code": 3}, "exit 3", True),
    "term": ("term", {"cause": "signal", "signal": 15}, "SIGTERM", True),
    "killed": ("kill", {"cause": "signal", "signal": 9}, "SIGKILL", True),
    "oom": ("oom", {"cause": "oom_kill", "signal": 9}, "OOM kill (SIGKILL)", True),
    "removed": ("remove", {"cause": "group_removed"}, "group removed", False),
}


@pytest.fixture
def agent(tmp_path):
    port = free_port()
    cfg = Config(interval=0.25, probes="cgroup", out=str(tmp_path / "out"), socket=str(tmp_path / "run" / "a.sock"),
                 state=str(tmp_path / "run" / "jobs.json"), attach_wait=5.0, prometheus=f"127.0.0.1:{port}")
    with serving_agent(cfg) as a:
        yield a


def last_sample(agent: Agent, job: str) -> dict:
    with open(Path(agent.cfg.out, f"{job}.mpk"), "rb") as f:
        return [fr for fr in StreamReader(f) if fr["kind"] == "sample"][-1]


def test_each_way_a_job_ends_is_said_as_itself_in_its_last_frame_summary_and_metrics(agent, make_cgroup,
                                                                                      make_memcg, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    memcg = make_memcg(64, memsw=True)
    procs, groups = {}, {}
    try:
        for job in CASES:
            cg = groups[job] = make_cgroup(f"end-{job}")
            joins = [cg.path / "cgroup.procs"] + ([memcg / "cgroup.procs"] if job == "oom" else [])
            procs[job] = subprocess.Popen([sys.executable, str(tmp_path / "job.py")], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True,
                                          preexec_fn=lambda joins=joins: [p.write_text(str(os.getpid()))
                                                                          for p in joins])
            assert procs[job].stdout.readline().strip() == "ready"
            r = call(agent.cfg.socket, {"cmd": "attach", "cgroup": str(cg.path), "job": job}, timeout=60)
            assert r["ok"], r
        # each job seen with its process by a tick of the agent before it ends
        until(lambda: all(agent.jobs[j].had_procs for j in CASES), 20, "every job sampled with its process")
        for job, (do, *_) in CASES.items():
            p = procs[job]
            if do == "kill":
                p.kill()
            elif do == "remove":         # its process moved out, its group removed: the process runs on
                (groups[job].path.parent / "cgroup.procs").write_text(str(p.pid))
                groups[job].path.rmdir()
            else:
                p.stdin.write(do + "\n")
                p.stdin.flush()
        until(lambda: not set(CASES) & set(agent.jobs), 30, "every job let go")
        waited = {job: procs[job].wait(timeout=20) for job in CASES if job != "removed"}
        # the test's own view of each, from wait(): what the agent had to find out from the kernel
        assert waited == {"ok": 0, "crash": 3, "term": -15, "killed": -9, "oom": -9}, waited
        assert int(dict(line.split() for line in (memcg / "memory.oom_control").read_text().splitlines())
                   ["oom_kill"]) >= 1
        text = urllib.request.urlopen(f"http://{agent.cfg.prometheus}/metrics", timeout=5).read().decode()
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    series = {s.labels["job"]: s.labels for s in fams["jobprobe_job_end"].samples}
    for job, (_, want, how, bad) in CASES.items():
        end = last_sample(agent, job)["end"]
        print(job, end)
        assert {k: end.get(k) for k in want} == want and end["why"], (job, end)
        assert ("exit_code" in end or "signal" in end) == (job != "removed"), (job, end)
        assert (end.get("oom_kills", 0) >= 1) == (job == "oom"), (job, end)
        out = subprocess.run([sys.executable, "-m", "jobprobe.cli", "summary", "--format", "json",
                              str(Path(agent.cfg.out, f"{job}.mpk"))], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        ended = json.loads(out.stdout)["ended"]
        assert (ended["how"], ended["cause"], ended["ok"]) == (how, want["cause"], not bad), (job, ended)
        assert (series[job]["how"], series[job]["cause"], series[job]["failed"]) == \
            (how, want["cause"], str(bad).lower()), (job, series[job])
    counted = {(s.labels["cause"], s.labels["failed"]): s.value for s in fams["jobprobe_jobs_ended"].samples}
    assert counted == {("exit", "false"): 1, ("exit", "true"): 1, ("signal", "true"): 2, ("oom_kill", "true"): 1,
                       ("group_removed", "false"): 1}, counted
