# SPDX-License-Identifier: Apache-2.0
"""Any control request — the JSON a local client or the controller sends the agent (attach, detach, status, probes,
trace) — is answered, or refused with one line (BadInput: the reply's `error`, the CLI's exit 2); never an internal
error, and the agent answers `status` after each. A real Agent (the `self` probe only: nothing loaded) and its
ControlServer's handler, the path every request takes once read off the socket. And the state file a restarted agent
reads, whatever it holds."""
from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobprobe.core.errors import BadInput
from jobprobe.node.agent import Agent
from jobprobe.node.config import Config
from jobprobe.node.control import ControlServer

JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                 st.text(max_size=8), st.sampled_from(["self", "cgroup", "+self", "-self", "0", "/",
                                                                       "/sys/fs/cgroup", "job-1", "1.5"])),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                       max_leaves=5)
KEYS = ["cgroup", "slurm_job", "k8s_pod", "job", "probes", "labels", "from_start", "note", "wait", "defer", "toggle",
        "duration", "at", "pid"]
FIELDS = st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=4)), JSONISH, max_size=4)
ME = os.getpid()
# a request that would be honoured, with some of its fields given any value; and one wholly of any shape
REQUEST = st.one_of(
    st.builds(lambda job, rest: {"cmd": "attach", "pid": ME, "job": job, **rest}, st.text(min_size=1, max_size=6),
              FIELDS),
    st.builds(lambda cmd, rest: {"cmd": cmd, "job": "j", **rest}, st.sampled_from(["detach", "probes", "trace"]),
              FIELDS),
    st.builds(lambda cmd, rest: {"cmd": cmd, **rest},
              st.one_of(st.sampled_from(["attach", "detach", "status", "probes", "trace"]), JSONISH), FIELDS))


def live_pid(v) -> bool:
    try:
        return int(v) <= 2**22
    except (TypeError, ValueError, OverflowError):
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent")
    # no trace directory: a trace request is checked whole, then refused for it — a window opened would run py-spy
    # on this test's own process for up to 600 s (it did: phase 1 slowed by minutes)
    a = Agent(Config(interval=1.0, probes="self", out=str(d / "out"), socket=str(d / "agent.sock"),
                     state=str(d / "jobs.json"), attach_wait=0.0, trace_dir=""))
    yield ControlServer(a, str(d / "agent.sock"))
    a.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=REQUEST)
def test_any_request_is_answered_or_refused_in_one_line(server, req):
    if "j" not in server.agent.jobs:                # the job the requests name: this test's own process
        server.handle({"cmd": "attach", "pid": ME, "job": "j"})
    if live_pid(req.get("pid")) and req["pid"] != ME:
        del req["pid"]                              # another real process would be attached: not what this is about
    req = json.loads(json.dumps(req))              # as it arrives: JSON (NaN and Infinity included, as Python's)
    try:
        reply = server.handle(req)
    except BadInput as err:
        assert str(err) and "\n" not in str(err)
    else:                # done, or (a trace window) refused with its reason
        assert reply["ok"] is True or reply.get("state") == "refused" and "\n" not in reply["why"], reply
        json.dumps(reply, default=str)
    assert server.handle({"cmd": "status"})["ok"] is True
    for job in set(server.agent.jobs) - {"j"}:      # what an example attached is let go before the next one
        server.agent.detach(job)


# ---- the state file: written by the agent (jobs.json), read by the next one at its start. A disk that filled, a
# crash mid-write on a filesystem without atomic rename, a hand edit: whatever it holds, the agent starts, attaches
# what it can, says why for the rest, and writes the file anew.
SPEC = st.fixed_dictionaries({"job": st.text(min_size=1, max_size=6)}, optional={
    "pid": st.one_of(st.just(ME), JSONISH), "probes": st.one_of(st.just("self"), JSONISH), "labels": JSONISH,
    "from_start": JSONISH, "cgroup": JSONISH, "note": JSONISH})
STATE = st.one_of(st.binary(max_size=60),
                  st.builds(lambda jobs: json.dumps({"jobs": jobs}).encode(), st.lists(st.one_of(SPEC, JSONISH),
                                                                                      max_size=3)),
                  JSONISH.map(lambda v: json.dumps(v).encode()))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=STATE)
def test_any_state_file_lets_the_agent_start(tmp_path, body):
    state = tmp_path / "jobs.json"
    state.write_bytes(body)
    a = Agent(Config(interval=1.0, probes="self", out=str(tmp_path / "out"), socket=str(tmp_path / "agent.sock"),
                     state=str(state), attach_wait=0.0, trace_dir=""))
    try:
        a.persist = True
        out = a.restore()
        assert isinstance(out, list) and all(isinstance(x, dict) for x in out)
        kept = json.loads(state.read_text())["jobs"]          # written anew: the jobs it has, nothing else
        assert sorted(d["job"] for d in kept) == sorted(a.jobs) + sorted(a.pending)
    finally:
        a.persist = False
        for job in list(a.jobs):
            a.detach(job)
        a.close()


def test_a_state_file_with_a_job_and_junk_attaches_the_job_and_says_why_for_the_rest(tmp_path):
    state = tmp_path / "jobs.json"
    state.write_text(json.dumps({"jobs": [{"job": "x", "pid": ME, "probes": "self"}, {"job": "y", "pid": "me"}, 7]}))
    a = Agent(Config(interval=1.0, probes="self", out=str(tmp_path / "out"), socket=str(tmp_path / "agent.sock"),
                     state=str(state), attach_wait=0.0, trace_dir=""))
    try:
        a.persist = True
        out = a.restore()
        assert [o.get("state") for o in out][1:] == ["gone", "gone"] and "pid must be a number" in out[1]["why"]
        assert list(a.jobs) == ["x"] and [d["job"] for d in json.loads(state.read_text())["jobs"]] == ["x"]
    finally:
        a.persist = False
        a.detach("x")
        a.close()


# ---- the controller's side: a trace request on jobprobe.ctl.trace (any client that may publish there), and what
# each node answers it, of any shape
class FakeNode:
    def __init__(self, job: str):
        self.lost, self.jobs = False, {job: 1e18}       # it sent frames of the job "just now"


class FakeNats:
    """Answers each node's control request with `answers` in turn (bytes as the node sent them)."""
    def __init__(self, answers: list[bytes]):
        self.answers, self.asked = list(answers), []

    async def request(self, subject, data, timeout):
        self.asked.append(json.loads(data))
        if not self.answers:
            raise TimeoutError("no answer")
        return type("Msg", (), {"data": self.answers.pop(0)})()


@settings(max_examples=300, deadline=None)
@given(req=st.one_of(st.builds(lambda rest: {"job": "j", **rest}, st.dictionaries(
           st.sampled_from(["at", "duration", "job", "x"]), JSONISH, max_size=3)), JSONISH),
       answers=st.lists(st.one_of(JSONISH.map(lambda v: json.dumps(v).encode()), st.binary(max_size=12)),
                        max_size=2))
def test_any_cluster_trace_request_and_any_node_answer_get_one_reply(req, answers):
    import asyncio

    from jobprobe.cluster.trace import cluster_trace
    nc = FakeNats(answers)
    out = asyncio.run(cluster_trace({"a": FakeNode("j"), "b": FakeNode("j")}, nc, req if isinstance(req, dict) else {}))
    json.dumps(out)                                # a reply that can be sent
    assert isinstance(out["ok"], bool)
    if not out["ok"] and "error" in out:
        assert "\n" not in out["error"] and nc.asked == []      # refused before any node was asked
    else:
        assert set(out["nodes"]) == {"a", "b"} and all(isinstance(a, dict) for a in out["nodes"].values())
        for asked in nc.asked:                     # what the nodes were asked is a time ahead and a length
            assert math.isfinite(asked["at"]) and math.isfinite(asked["duration"]) and asked["duration"] > 0
