# SPDX-License-Identifier: Apache-2.0
"""Deployment files: the systemd unit passes `systemd-analyze verify` with nothing to say (the tool exits 0 on a
misspelled key or a bad value and only warns, so the test also wants no output — and checks on a broken copy that
it would have said something)."""
from __future__ import annotations

import re
import shlex
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


# ---- docs/DEPLOY.md: no step that does not exist ----------------------------------------------------------------
# Commands of other tools the guide may name (run by the operator; their files are checked, not the tools)
OTHER_TOOLS = {"systemctl", "systemd-analyze", "kubectl", "podman", "docker", "sbatch", "ls", "scp", "sed", "cp",
               "head"}
SHARE = "/opt/jobprobe/share/"


def guide_commands(text: str) -> list[str]:
    """Every command line of the guide's ```sh blocks, continuation lines joined."""
    out, block = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block == "sh":
            if out and out[-1].endswith("\\"):
                out[-1] = out[-1][:-1] + " " + line.strip()
            else:
                out.append(line.strip())
    return [c for c in out if c and not c.startswith("#")]


def guide_problems(text: str) -> list[str]:
    from jobprobe import __version__
    from jobprobe.cli import build_parser
    from jobprobe.core.errors import BadInput
    from jobprobe.deploy import files
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    installer = (REPO / "scripts/install.sh").read_text()
    bad = []
    for line in (part.strip() for cmd in guide_commands(text) for part in cmd.split(" | ")):
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        paths = [a for a in argv[1:] if a.startswith(("scripts/", SHARE, "Containerfile", "dist/"))]
        for a in paths:
            if a.startswith("dist/"):
                if a.endswith(".whl") and a != f"dist/jobprobe-{__version__}-py3-none-any.whl":
                    bad.append(f"{line}: the wheel of this version is dist/jobprobe-{__version__}-py3-none-any.whl")
            elif not ((REPO / a).exists() or a.removeprefix(SHARE) in files()):
                bad.append(f"{line}: no {a}")
        if argv[0] == "jobprobe":
            try:
                build_parser().parse_args(argv[1:])
            except (SystemExit, BadInput):
                bad.append(f"{line}: jobprobe does not take these arguments")
        elif argv[0] == "make":
            bad += [f"{line}: no make target {t}" for t in argv[1:] if t not in targets]
        elif argv[0] == "bash" and argv[1] == "scripts/install.sh":
            if argv[2] not in ("node", "controller"):
                bad.append(f"{line}: install.sh installs a node or a controller")
            bad += [f"{line}: install.sh takes no {o}" for o in argv[3:] if o.startswith("--") and
                    f"    {o})" not in installer]
        elif argv[0] not in OTHER_TOOLS:
            bad.append(f"{line}: {argv[0]} is no command of this guide")
    for path in re.findall(r"=(/opt/jobprobe/share/\S+)", text):          # slurm.conf's Prolog= and Epilog=
        if path.removeprefix(SHARE) not in files():
            bad.append(f"{path}: not installed")
    return bad


def test_every_command_in_the_deploy_guide_exists():
    text = (REPO / "docs/DEPLOY.md").read_text()
    assert len(guide_commands(text)) >= 20
    assert guide_problems(text) == []
    # and the checker sees a step that does not exist
    broken = text.replace("jobprobe status", "jobprobe statuz").replace("make dist ", "make dists ") \
        .replace("--no-start", "--no-star").replace("slurm/epilog", "slurm/epilogue") + \
        "\n```sh\nbash scripts/install.sh node --wheel dist/jobprobe-0.0.9-py3-none-any.whl --fast\n" \
        "helm install x\n```\n"
    got = "\n".join(guide_problems(broken))
    for needle in ("statuz", "target dists", "takes no --fast", "0.0.9", "helm", "slurm/epilogue: not installed"):
        assert needle in got, (needle, got)
