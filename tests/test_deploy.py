"""Deployment files: the systemd unit passes `systemd-analyze verify` with nothing to say (the tool exits 0 on a
misspelled key or a bad value and only warns, so the test also wants no output — and checks on a broken copy that
it would have said something)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "scripts/systemd/jobprobe-agent.service"


def verify(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    unit = tmp_path / "jobprobe-agent.service"
    # ExecStart must name an executable that exists: the one this checkout installed, where the docs put a link
    unit.write_text(text.replace("/usr/local/bin/jobprobe", str(Path(sys.executable).parent / "jobprobe")))
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze (systemd) on this host")
def test_the_systemd_unit_verifies_without_a_word(tmp_path):
    text = UNIT.read_text()
    assert (Path(sys.executable).parent / "jobprobe").exists()
    res = verify(text, tmp_path)
    assert res.returncode == 0 and res.stderr.strip() == "" and res.stdout.strip() == "", res
    for key in ("MemoryMax=", "CPUQuota=", "Restart=always", "CapabilityBoundingSet=", "RuntimeDirectoryPreserve=yes"):
        assert f"\n{key}" in text, key
    broken = verify(text.replace("CPUQuota=50%", "CPUQuota=half").replace("Nice=-5", "Niceness=-5"), tmp_path)
    assert "Invalid CPU quota" in broken.stderr and "Unknown key 'Niceness'" in broken.stderr, broken


def test_the_daemonset_manifest_runs_the_agent_with_what_it_needs():
    yaml = pytest.importorskip("yaml", reason="PyYAML (the test extra) is not installed")
    from jobprobe.cli import build_parser
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "scripts/k8s/jobprobe.yaml").read_text())}
    assert set(docs) == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"}
    rules = docs["ClusterRole"]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]     # the API server's pod list
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    assert c["resources"]["limits"]["memory"] and c["resources"]["limits"]["cpu"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"NODE_NAME": "spec.nodeName", "NODE_IP": "status.hostIP"}      # the downward API
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/sys", "/lib/modules", "/run/jobprobe"} <= mounts
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert all(hostpaths[m["name"]] == m["mountPath"] for m in c["volumeMounts"])
    # every argument is one `jobprobe agent` takes (the manifest cannot drift from the command line)
    args = build_parser().parse_args(c["args"])
    assert args.cmd == "agent" and args.k8s == "https://kubernetes.default.svc" and not args.k8s_insecure
    assert args.k8s_node == "$(NODE_NAME)"
    assert args.k8s_token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
