# SPDX-License-Identifier: Apache-2.0
"""`jobprobe agent --k8s URL`: pods attached by annotation and detached when they go, against a kubelet `/pods`
endpoint served by the test (the real PodList JSON shape; no kubelet runs here) and real cgroup2 groups laid out as
the kubelet lays them: the systemd driver with containerd's and CRI-O's scope names, and the cgroupfs driver. The
kubelet then answers garbage, fails, and goes away: attached pods keep being probed. The API server's list, as the
manifest asks for it (this node's pods by field selector, over TLS verified against the cluster CA); a self-signed
peer never receives the bearer token unless its CA is given, and `--k8s-insecure` with a token is refused."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import until as wait_for
from conftest import workload
from jobprobe.core.errors import BadInput
from jobprobe.core.frame import StreamReader
from jobprobe.exporters.file import job_path
from jobprobe.node import k8s
from jobprobe.node.k8s import PodWatcher, split_probes, wanted_pods
from kubefake import ON, TOKEN, UIDS, Kubelet, pod, pod_a_listed, pod_list, self_signed  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
def test_wanted_pods_reads_the_annotation_and_skips_ended_pods():
    doc = pod_list(pod("a", {"jobprobe.io/probe": "true", "jobprobe.io/probes": "cgroup,sched"}), pod("b"),
                   pod("c", {"jobprobe.io/probe": "true"}, phase="Succeeded"),
                   pod("d", {"jobprobe.io/probe": "false"}))
    got = wanted_pods(doc)
    assert list(got) == [UIDS["a"]] and got[UIDS["a"]].probes == "cgroup,sched"
    assert got[UIDS["a"]].job == "train/a"
    assert got[UIDS["a"]].labels() == {"namespace": "train", "pod": "a", "pod_uid": UIDS["a"], "containers": "main"}
    for bad in ([], {"kind": "Status"}, {"items": [{"spec": {}}]}):
        with pytest.raises(ValueError):
            wanted_pods(bad)
    assert abs(got[UIDS["a"]].started - time.time()) < 5
    old = wanted_pods(pod_list(pod("a", {"jobprobe.io/probe": "true"}, started="2026-01-02T03:04:05Z")))
    assert old[UIDS["a"]].started == 1767323045.0
    assert split_probes("cgroup,bogus,-sched", {"cgroup", "sched"}) == ("cgroup,-sched", ["bogus"])
    # whose it was: its controlling owner, and the pod labels the operator allow-listed (and only those)
    owned = pod("a", {"jobprobe.io/probe": "true"})
    owned["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs-1"},
                                            {"kind": "Job", "name": "train-7", "controller": True}]
    owned["metadata"]["labels"] = {"team": "vision", "app.kubernetes.io/name": "trainer", "secret": "s3"}
    got = wanted_pods(pod_list(owned), ("team", "app.kubernetes.io/name", "absent"))[UIDS["a"]].labels()
    assert got == {"namespace": "train", "pod": "a", "pod_uid": UIDS["a"], "containers": "main", "owner": "Job/train-7",
                   "team": "vision", "app_kubernetes_io_name": "trainer"}, got
    for refs in ("x", [{"kind": 3}], []):
        owned["metadata"]["ownerReferences"] = refs
        assert "owner" not in wanted_pods(pod_list(owned))[UIDS["a"]].labels()
    owned["metadata"]["labels"] = "not a map"
    with pytest.raises(ValueError):
        wanted_pods(pod_list(owned))
    assert split_probes(None, {"cgroup"}) == (None, [])


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(the peer's cert, its key, a CA that did not sign it)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    base = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(base / "peer")
    other, _ = self_signed(base / "other")
    return cert, key, other


@pytest.fixture
def token(tmp_path, monkeypatch):
    """A bearer token file; and no service account CA (this is not a pod): the default is the system's CAs."""
    monkeypatch.setattr(k8s, "CA", str(tmp_path / "no-serviceaccount" / "ca.crt"))
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)




def test_a_token_is_never_sent_to_a_peer_that_is_not_verified(tls, token, monkeypatch):
    """A self-signed peer: with a token and no CA, or the wrong CA, the handshake fails and no request (so no token)
    reaches the server; with the right CA (given, or the service account's by default) the list comes back with
    the token; --k8s-insecure with a token is refused before any connection, as is a token over http://."""
    cert, key, other = tls
    kubelet = Kubelet(tls=(cert, key))
    kubelet.answer = pod_list(pod("a", ON))
    try:
        for ca in (None, str(other)):
            with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
                PodWatcher(None, kubelet.url, token_file=token, ca_file=ca).fetch()
        assert kubelet.seen == []                       # not a request, so never the token

        assert list(PodWatcher(None, kubelet.url, token_file=token, ca_file=str(cert)).fetch()) == [UIDS["a"]]
        assert kubelet.seen == [("/pods", f"Bearer {TOKEN}")]
        monkeypatch.setattr(k8s, "CA", str(cert))       # in a pod: the service account's ca.crt, by default
        assert list(PodWatcher(None, kubelet.url, token_file=token).fetch()) == [UIDS["a"]]
        assert len(kubelet.seen) == 2

        for url, needle in ((kubelet.url, "a token is never sent to an unverified peer"),
                            (kubelet.url.replace("https:", "http:"), "a token is never sent in clear")):
            with pytest.raises(BadInput, match=needle):
                PodWatcher(None, url, token_file=token, ca_file=str(cert), insecure=url.startswith("https:"))
        assert len(kubelet.seen) == 2                   # refused up front: nothing was asked
        # unverified but anonymous (no token: nothing to give away) is allowed
        assert list(PodWatcher(None, kubelet.url, insecure=True).fetch()) == [UIDS["a"]]
        assert kubelet.seen[-1] == ("/pods", None)
    finally:
        kubelet.stop()


def test_the_api_server_is_asked_for_this_nodes_pods_only(tls, token):
    """With a node name the list is the API server's, narrowed by `spec.nodeName` (RBAC: `list pods`), served from
    its watch cache; the node name is quoted, whatever it holds."""
    cert, key, _ = tls
    api = Kubelet(tls=(cert, key))
    api.answer = pod_list(pod("a", ON))
    try:
        for node in ("node-1", "gpu node&x=1"):
            w = PodWatcher(None, api.url, token_file=token, ca_file=str(cert), node=node)
            assert list(w.fetch()) == [UIDS["a"]]
            path, auth = api.seen[-1]
            url = urllib.parse.urlsplit(path)
            assert url.path == "/api/v1/pods" and auth == f"Bearer {TOKEN}"
            assert urllib.parse.parse_qs(url.query) == {"fieldSelector": [f"spec.nodeName={node}"],
                                                        "resourceVersion": ["0"]}
        with pytest.raises(BadInput, match="--k8s-node: empty"):
            PodWatcher(None, api.url, token_file=token, ca_file=str(cert), node=" ")
    finally:
        api.stop()


@pytest.mark.kernel
@pytest.mark.parametrize("extra,needle", [
    (["--k8s-insecure"], "a token is never sent to an unverified peer"),
    (["--k8s=http://127.0.0.1:9"], "a token is never sent in clear")])
def test_cli_refuses_a_token_for_an_unverified_peer(tmp_path, extra, needle):
    """Said at start in one line, exit 2: no program loaded, no socket, nothing sent."""
    (tmp_path / "token").write_text(TOKEN)
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "agent", "--socket", str(tmp_path / "agent.sock"),
                          "--state", str(tmp_path / "jobs.json"), "--out", str(tmp_path / "out"), "--probes",
                          "cgroup", "--k8s=https://127.0.0.1:9", "--k8s-node=node-1", "--k8s-token-file",
                          str(tmp_path / "token"), *extra], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res
    assert res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr
    assert not (tmp_path / "agent.sock").exists()


@pytest.mark.kernel
@pytest.mark.integration
def test_pods_are_attached_by_annotation_and_let_go_when_they_leave(make_cgroup, tmp_path):
    root = make_cgroup().path
    uscore = {k: v.replace("-", "_") for k, v in UIDS.items()}
    groups = {   # each pod's group and one container group in it, named as each kubelet layout names them
        "a": root / "kubepods.slice/kubepods-burstable.slice" / f"kubepods-burstable-pod{uscore['a']}.slice"
             / "cri-containerd-aaaa.scope",
        "b": root / "kubepods.slice/kubepods-besteffort.slice" / f"kubepods-besteffort-pod{uscore['b']}.slice"
             / "cri-containerd-bbbb.scope",
        "c": root / "kubepods.slice" / f"kubepods-pod{uscore['c']}.slice" / "crio-cccc.scope",
        "d": root / "kubepods/burstable" / f"pod{UIDS['d']}" / "dddd",
    }
    for g in groups.values():
        g.mkdir(parents=True)
    sleepers = [subprocess.Popen(["sleep", "600"], preexec_fn=lambda g=g: (g / "cgroup.procs").write_text(
        str(os.getpid()))) for g in groups.values()]
    kubelet = Kubelet()
    on = {"jobprobe.io/probe": "true"}
    kubelet.answer = pod_list(pod("a", on), pod("b"))
    out, sock, log = tmp_path / "out", tmp_path / "agent.sock", tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "agent", "--socket", str(sock), "--state",
                              str(tmp_path / "jobs.json"), "--out", str(out), "--interval", "0.5", "--probes",
                              "cgroup", "--k8s", kubelet.url, "--k8s-every", "0.5"], cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    from jobprobe.node.control import call

    def status():
        try:
            return call(str(sock), {"cmd": "status"})
        except Exception:
            return None

    def jobs():
        s = status()
        return {j["job"]: j for j in s["jobs"]} if s else {}

    def frames(job):
        with open(job_path(str(out), job), "rb") as f:
            return list(StreamReader(f))

    burner = None
    try:
        wait_for(lambda: "train/a" in jobs(), 60, "pod a to be attached")
        burner = subprocess.Popen(workload("burn", 1.0), stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: (groups["a"] / "cgroup.procs").write_text(str(os.getpid())))
        assert burner.wait(timeout=60) == 0
        # the other pods, as they come: c asks for a probe that does not exist, d for the default set
        kubelet.answer = pod_list(pod("a", on), pod("b"),
                                  pod("c", {**on, "jobprobe.io/probes": "cgroup,bogus"}, containers=("x", "y")),
                                  pod("d", on))
        wait_for(lambda: {"train/c", "train/d"} <= set(jobs()), 30, "pods c and d to be attached")
        js = jobs()
        assert "train/b" not in js                                      # no annotation: not probed
        assert js["train/c"]["probes"] == {"cgroup": "ok"} and "bogus" in js["train/c"]["note"], js["train/c"]
        hello_c = frames("train/c")[0]
        assert hello_c["labels"] == {"namespace": "train", "pod": "c", "pod_uid": UIDS["c"], "containers": "x,y"}
        assert hello_c["target"]["cgroup"] == str(groups["c"].parent)
        assert frames("train/d")[0]["target"]["cgroup"] == str(groups["d"].parent)

        # the kubelet answers garbage, then an error, then nothing at all: the pods stay attached and probed
        for answer in (b"<html>not json</html>", 500, None):
            if answer is None:
                kubelet.stop()
            else:
                kubelet.answer = answer
            n = len(frames("train/a"))
            wait_for(lambda: len(frames("train/a")) >= n + 4, 30, f"frames to go on ({answer!r})")
            assert {"train/a", "train/c", "train/d"} <= set(jobs())
        text = log.read_text()
        assert "kubelet at" in text and "attached pods go on" in text, text

        # back, without pod a: a is let go (a last frame); the others stay
        kubelet.answer = pod_list(pod("b"), pod("c", {**on, "jobprobe.io/probes": "cgroup,bogus"}), pod("d", on))
        kubelet.start()
        wait_for(lambda: "train/a" not in jobs(), 90, "pod a to be let go once the kubelet answers again")
        assert {"train/c", "train/d"} <= set(jobs())
        ended = next(r for r in status()["recent"] if r["job"] == "train/a")
        assert "left the kubelet's list" in ended["why"], ended
        assert "answers again" in log.read_text()
        # pod a's frames, from its start (from_start) to the detach, against the pod group's own cpu.stat
        pod_a = groups["a"].parent
        usage_ns = int(dict(ln.split() for ln in (pod_a / "cpu.stat").read_text().splitlines())["usage_usec"]) * 1000
        fa = frames("train/a")
        assert fa[0]["from_start"] is True
        cpu = sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"]
                  for f in fa if f["kind"] == "sample")
        assert usage_ns > 0.2e9 and abs(cpu - usage_ns) <= 0.02 * usage_ns + 1e6, (cpu, usage_ns)

        # pods that ended, as the kubelet writes it, while their groups still hold a process (a pod's sandbox,
        # until the kubelet stops it): c's container x OOM-killed, d past its activeDeadlineSeconds — each last
        # frame's `end` is the pod's word, the agent's own (no process has exited) having none
        c = pod("c", {**on, "jobprobe.io/probes": "cgroup,bogus"}, phase="Failed")
        c["status"]["containerStatuses"] = [
            {"name": "y", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
            {"name": "x", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
        d = pod("d", on, phase="Failed")
        d["status"]["reason"] = "DeadlineExceeded"
        kubelet.answer = pod_list(pod("b"), c, d)
        wait_for(lambda: not {"train/c", "train/d"} & set(jobs()), 30, "the ended pods c and d to be let go")

        def end(job):
            return [f for f in frames(job) if f["kind"] == "sample"][-1].get("end")
        assert {k: end("train/c").get(k) for k in ("cause", "signal")} == {"cause": "oom_kill", "signal": 9}, \
            end("train/c")
        assert "OOMKilled (container x)" in end("train/c")["scheduler"]
        assert end("train/d")["cause"] == "timeout" and "DeadlineExceeded" in end("train/d")["scheduler"], \
            end("train/d")
    finally:
        kubelet.stop()
        if burner is not None and burner.poll() is None:
            burner.kill()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        for p in sleepers:
            p.kill()
            p.wait()


@pytest.mark.kernel
@pytest.mark.integration
def test_the_agent_lists_its_nodes_pods_from_a_verified_api_server(make_cgroup, tmp_path, tls):
    """The manifest's way, end to end: `--k8s URL --k8s-node NODE --k8s-ca CA --k8s-token-file FILE` against an
    HTTPS API server served by the test: the pod is attached from the node's list, every request carried the token
    to the verified peer and asked for this node only, and the pod is let go when it leaves the list."""
    cert, key, _ = tls
    group, sleeper, api = pod_a_listed(make_cgroup().path, cert, key)
    (tmp_path / "token").write_text(TOKEN)
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "agent", "--socket", str(sock), "--state",
                              str(tmp_path / "jobs.json"), "--out", str(tmp_path / "out"), "--interval", "0.5",
                              "--probes", "cgroup", "--k8s", api.url, "--k8s-node", "node-1", "--k8s-ca", str(cert),
                              "--k8s-token-file", str(tmp_path / "token"), "--k8s-every", "0.5"], cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "agent.log", "w"))
    from jobprobe.node.control import call

    def status():
        try:
            return call(str(sock), {"cmd": "status"})
        except Exception:
            return None

    def jobs():
        s = status()
        return {j["job"] for j in s["jobs"]} if s else set()

    try:
        wait_for(lambda: "train/a" in jobs(), 60, "pod a to be attached from the API server's list")
        api.answer = pod_list()
        wait_for(lambda: "train/a" not in jobs(), 30, "pod a to be let go")
        ended = next(r for r in status()["recent"] if r["job"] == "train/a")
        assert "left the API server's list" in ended["why"], ended
        query = urllib.parse.urlencode({"fieldSelector": "spec.nodeName=node-1", "resourceVersion": "0"})
        assert api.seen and set(api.seen) == {(f"/api/v1/pods?{query}", f"Bearer {TOKEN}")}, api.seen
    finally:
        api.stop()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        sleeper.kill()
        sleeper.wait()


JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
                                 st.sampled_from(["true", "Running", "Succeeded", "cgroup", "2026-01-02T03:04:05Z",
                                                  "9999-12-31T23:59:59+14:00", "0001-01-01T00:00:00-14:00"])),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                       max_leaves=6)


def fields(keys: list[str], values) -> st.SearchStrategy:
    return st.dictionaries(st.one_of(st.sampled_from(keys), st.text(max_size=3)), values, max_size=len(keys))


# an ended pod's status: its containers' ends and its reasons, of the kubelet's shape or any other
TERMINATED = st.builds(lambda code, reason: {"name": "c",
                                             "state": {"terminated": {"exitCode": code, "reason": reason}}},
                       st.one_of(st.integers(-5, 300), JSONISH), st.one_of(st.sampled_from(["OOMKilled", "Error"]),
                                                                           JSONISH))
ENDED = fields(["containerStatuses", "conditions", "reason"],
               st.one_of(JSONISH, st.lists(st.one_of(TERMINATED, JSONISH), max_size=3),
                         st.sampled_from(["Evicted", "DeadlineExceeded"]),
                         st.just([{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])))


# a pod list's own shape with any values in it: annotated pods with some fields given any JSON value
POD = st.builds(
    lambda meta, ann, rest: {"metadata": {"uid": "u", "name": "p", **meta,
                                          "annotations": {"jobprobe.io/probe": "true", **ann}}, **rest},
    fields(["uid", "name", "namespace", "annotations"], JSONISH),
    fields(["jobprobe.io/probe", "jobprobe.io/probes"], JSONISH),
    fields(["spec", "status"], st.one_of(JSONISH, fields(["containers", "phase", "startTime"], JSONISH),
                                         st.builds(lambda phase, rest: {"phase": phase, **rest},
                                                   st.sampled_from(["Failed", "Succeeded"]), ENDED))))


@settings(max_examples=300, deadline=None)
@given(doc=st.one_of(JSONISH, st.builds(lambda items: {"items": items}, st.lists(st.one_of(POD, JSONISH), max_size=3))))
def test_any_pod_list_is_read_or_refused_as_not_a_pod_list(doc):
    """What the kubelet or the API server answers is read into pods whose every field is what the agent needs (a
    string where it names something), or refused as a whole with ValueError (the watcher keeps its pods and asks
    again later); never another exception."""
    ended: dict[str, dict] = {}
    try:
        pods = wanted_pods(doc, ended=ended)
    except ValueError as err:
        assert str(err) and "\n" not in str(err)
        return
    from jobprobe.cluster.framecheck import _end
    from jobprobe.core import ends
    for end in ended.values():         # how an ended pod ended: what a frame's `end` may hold, or nothing
        _end(ends.record("the pod ended", end["status"], False, False, scheduler=end))
    for uid, p in pods.items():
        assert uid == p.uid and all(isinstance(v, str) for v in (p.uid, p.name, p.namespace, p.job))
        assert all(isinstance(c, str) for c in p.containers) and (p.probes is None or isinstance(p.probes, str))
        assert p.started is None or isinstance(p.started, float)
        assert all(isinstance(v, str) for v in p.labels().values())
