"""--k8s-pod: a pod's cgroup2 group found by UID in the kubelet's two layouts (fixture trees), and a real group laid
out as the kubelet's systemd driver makes it, with a burner in one of its containers, attached from the command line.
(No kubelet runs here: the groups are made by the test, named as the kubelet names them.)"""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import workload
from jobprobe.errors import BadInput
from jobprobe.target import k8s_pod_cgroup, k8s_pod_target

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
            procs.append(subprocess.Popen(workload("burn", 1.0), stderr=subprocess.PIPE, text=True,
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
        # both containers burned (1 s of wall time each: less CPU on a busy host), and the pod holds them both
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
