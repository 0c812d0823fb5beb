# SPDX-License-Identifier: Apache-2.0
"""--k8s-pod: a pod's cgroup2 group found by UID in the kubelet's two layouts (fixture trees), and a real group laid
out as the kubelet's systemd driver makes it, with a burner in one of its containers, attached from the command line.
(No kubelet runs here: the groups are made by the test, named as the kubelet names them.) And the DaemonSet
manifest's privileges: `list pods` only (never `nodes/proxy` or a wildcard), never `--k8s-insecure`."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import workload
from jobprobe.core.errors import BadInput
from jobprobe.node.targets.k8s import k8s_pod_cgroup, k8s_pod_target

UID = "0f6c1d2e-3b4a-4c5d-8e9f-a0b1c2d3e4f5"
OTHER = "0f6c1d2e-3b4a-4c5d-8e9f-a0b1c2d3e4f6"
JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]


def usage_usec(group) -> int:
    return int(dict(ln.split() for ln in (group / "cpu.stat").read_text().splitlines())["usage_usec"])


def systemd_pod(root, uid, qos="burstable"):
    u = uid.replace("-", "_")
    return root / "kubepods.slice" / f"kubepods-{qos}.slice" / f"kubepods-{qos}-pod{u}.slice"


def test_finds_the_pod_in_both_kubelet_layouts(tmp_path):
    sysd = systemd_pod(tmp_path / "a", UID)
    (sysd / "cri-containerd-0123abcd.scope").mkdir(parents=True)
    assert k8s_pod_cgroup(UID, str(tmp_path / "a")) == str(sysd)
    assert k8s_pod_cgroup(UID.replace("-", "_"), str(tmp_path / "a")) == str(sysd)   # either spelling
    guaranteed = tmp_path / "b" / "kubepods.slice" / f"kubepods-pod{UID.replace('-', '_')}.slice"
    guaranteed.mkdir(parents=True)
    assert k8s_pod_cgroup(UID, str(tmp_path / "b")) == str(guaranteed)
    cgroupfs = tmp_path / "c" / "kubepods" / "besteffort" / f"pod{UID}"
    (cgroupfs / "0123abcd").mkdir(parents=True)
    assert k8s_pod_cgroup(UID, str(tmp_path / "c")) == str(cgroupfs)
    nested = tmp_path / "d" / "kubelet.slice" / "kubelet-kubepods.slice" / \
        f"kubelet-kubepods-pod{UID.replace('-', '_')}.slice"
    nested.mkdir(parents=True)
    assert k8s_pod_cgroup(UID, str(tmp_path / "d")) == str(nested)


def test_another_pod_is_not_this_one_and_not_searched(tmp_path):
    other = systemd_pod(tmp_path, OTHER)
    # a group named like our pod inside another pod's tree is not where the kubelet puts pods
    (other / f"pod{UID}").mkdir(parents=True)
    assert k8s_pod_cgroup(UID, str(tmp_path)) is None
    assert k8s_pod_cgroup(OTHER, str(tmp_path)) == str(other)
    assert k8s_pod_cgroup(UID[:-1] + "0", str(tmp_path)) is None


@pytest.mark.parametrize("uid,needle", [("nginx-7d9c", "not a pod UID"), (UID + "0", "not a pod UID")])
def test_a_malformed_uid_is_bad_input(uid, needle):
    with pytest.raises(BadInput, match=needle):
        k8s_pod_target(uid)


def one_line_error(res, needle):
    assert res.returncode == 2 and "Traceback" not in res.stderr, res
    assert res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr


@pytest.mark.kernel
def test_cli_pod_that_is_not_here():
    res = subprocess.run([*JOBPROBE, "run", "--k8s-pod", UID, "--probes", "cgroup"], capture_output=True, text=True,
                         timeout=60)
    one_line_error(res, f"pod {UID} has no cgroup2 group on this node")


@pytest.mark.kernel
def test_cli_attaches_to_a_pod_and_counts_every_container(make_cgroup):
    """Two containers of one pod burn CPU; the pod's frames carry both, checked against the pod group's cpu.stat."""
    root = make_cgroup()
    pod = systemd_pod(root.path, UID)
    containers = [pod / "cri-containerd-aaaa.scope", pod / "cri-containerd-bbbb.scope"]
    for c in containers:
        c.mkdir(parents=True)
    procs = []
    try:
        agent = subprocess.Popen([*JOBPROBE, "run", "--k8s-pod", UID, "--probes", "cgroup", "--stdout", "json",
                                  "--interval", "0.25"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hello = json.loads(agent.stdout.readline())
        assert hello["kind"] == "hello" and hello["target"]["cgroup"] == str(pod), hello
        assert hello["job"] == f"pod-{UID}"
        usage0 = usage_usec(pod)
        for c in containers:
            procs.append(subprocess.Popen(workload("burncpu", 0.5), stderr=subprocess.PIPE, text=True,
                                          preexec_fn=lambda c=c: (c / "cgroup.procs").write_text(str(os.getpid()))))
        for p in procs:
            assert p.wait(timeout=60) == 0
        time.sleep(0.6)     # two more ticks: the last CPU is in a frame
        agent.send_signal(2)
        out, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, err
        usage = usage_usec(pod) - usage0
        frames = [json.loads(line) for line in out.splitlines()]
        cpu = sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"]
                  for f in frames if f["kind"] == "sample")
        print(f"pod {UID}: frames {cpu / 1e6:.0f} ms CPU, the pod group's cpu.stat {usage / 1e3:.0f} ms")
        # both containers burned (0.5 s of their own CPU time each), and the pod holds them both
        assert all(usage_usec(c) > 0.2e6 for c in containers)
        assert abs(usage - sum(usage_usec(c) for c in containers)) <= len(containers)   # (each rounded to µs)
        assert abs(cpu - usage * 1000) <= 0.02 * usage * 1000
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in [*containers, pod, pod.parent, pod.parent.parent]:     # leaves first
            if c.exists():
                c.rmdir()


# ---- the manifest's privileges --------------------------------------------------------------------------------
MANIFEST = Path(__file__).resolve().parents[1] / "scripts/k8s/jobprobe.yaml"
SA = "/var/run/secrets/kubernetes.io/serviceaccount"


def privilege_problems(docs: list[dict]) -> list[str]:
    """What in a manifest grants more than listing pods, or lets the agent trust a peer it has not verified."""
    problems = []
    for d in docs:
        if d.get("kind") not in ("Role", "ClusterRole"):
            continue
        if d.get("aggregationRule"):
            problems.append(f"{d['metadata']['name']}: an aggregated role (it takes others' rules)")
        for rule in d.get("rules") or []:
            for key in ("apiGroups", "resources", "verbs", "nonResourceURLs"):
                if "*" in (rule.get(key) or []):
                    problems.append(f"{d['metadata']['name']}: wildcard {key}")
            if "nodes/proxy" in (rule.get("resources") or []):
                problems.append(f"{d['metadata']['name']}: nodes/proxy (exec into every container)")
            if set(rule.get("resources") or []) - {"pods"} or set(rule.get("verbs") or []) - {"list"} \
                    or rule.get("nonResourceURLs") or rule.get("apiGroups") != [""]:
                problems.append(f"{d['metadata']['name']}: more than `list pods`: {rule}")
    for d in docs:
        if d.get("kind") == "DaemonSet":
            for c in d["spec"]["template"]["spec"]["containers"]:
                if any(str(a).split("=")[0] == "--k8s-insecure" for a in c.get("args") or []):
                    problems.append(f"{c['name']}: --k8s-insecure (the token to an unverified peer)")
    return problems


def test_the_manifest_grants_only_listing_pods_and_verifies_the_api_server():
    """RBAC: `list pods` and nothing else (no nodes/proxy, which allows exec into every container; no wildcard);
    the agent asks the API server for its own node's pods, with the cluster CA, never --k8s-insecure. The checker
    is also run on broken copies, to see that it would have said something."""
    yaml = pytest.importorskip("yaml", reason="PyYAML (the test extra) is not installed")
    from jobprobe.cli import build_parser
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert privilege_problems(docs) == []
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert [r["rules"] for r in roles] == [[{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(c["args"])
    assert args.k8s == "https://kubernetes.default.svc" and not args.k8s_insecure
    assert args.k8s_node == "$(NODE_NAME)"
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}["NODE_NAME"] == "spec.nodeName"
    assert (args.k8s_token_file, args.k8s_ca) == (f"{SA}/token", f"{SA}/ca.crt")

    def broken(edit) -> list[str]:
        copy = list(yaml.safe_load_all(MANIFEST.read_text()))
        edit(copy)
        return privilege_problems(copy)

    role = next(i for i, d in enumerate(docs) if d["kind"] == "ClusterRole")
    daemonset = docs.index(ds)
    assert "nodes/proxy" in " ".join(broken(lambda d: d[role]["rules"][0]["resources"].append("nodes/proxy")))
    assert "wildcard verbs" in broken(lambda d: d[role]["rules"][0].update(verbs=["*"]))[0]
    assert "wildcard resources" in broken(lambda d: d[role]["rules"].append(
        {"apiGroups": [""], "resources": ["*"], "verbs": ["list"]}))[0]
    assert "more than" in broken(lambda d: d[role]["rules"][0]["verbs"].append("get"))[0]
    assert "--k8s-insecure" in broken(lambda d: d[daemonset]["spec"]["template"]["spec"]["containers"][0]["args"]
                                      .append("--k8s-insecure"))[0]
