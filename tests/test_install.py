# SPDX-License-Identifier: Apache-2.0
"""Installable as a product: `make dist` (the sdist and the wheel, one source of metadata: setup.cfg) holds the
package, the eBPF sources, the default rules and the files a site installs; scripts/install.sh puts a node's agent
(or the controller) into a throwaway prefix from that wheel — the distribution's bcc seen through one link, the
agent's dependencies and nothing else, its unit verified by systemd, its settings loadable — and the agent runs from
it: `jobprobe probes`, and a short `jobprobe run` whose frames match the group's cpu.stat. A second run changes
nothing; nothing is written outside the prefix and the directories it is given."""
from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from builds import AGENT_DISTS, dists, make, norm
from conftest import AS_NOBODY, workload

REPO = Path(__file__).resolve().parents[1]
SHIPPED = {"systemd/jobprobe-agent.service", "systemd/jobprobe-controller.service", "systemd/agent.toml",
           "systemd/controller.env", "slurm/prolog", "slurm/epilog", "k8s/jobprobe.yaml"}
HOST_PATHS = ["/usr/local/bin/jobprobe", "/etc/systemd/system/jobprobe-agent.service",
              "/etc/systemd/system/jobprobe-controller.service", "/etc/jobprobe", "/opt/jobprobe"]


def requires() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return {norm(re.split(r"[<>=!~ \[;]", r.strip())[0]) for r in cfg["options"]["install_requires"].split("\n")
            if r.strip()}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    make("dist", out, tmp_path_factory)
    return out


def test_the_wheel_and_sdist_hold_the_package_and_what_a_site_installs(dist):
    (wheel,) = dist.glob("jobprobe-*-py3-none-any.whl")
    (sdist,) = dist.glob("jobprobe-*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    for src in (*(REPO / "bpf").glob("*.[ch]"), *(REPO / "probes").glob("*.py"), *(REPO / "exporters").glob("*.py")):
        assert f"jobprobe/{src.parent.name}/{src.name}" in names, src
    assert "jobprobe/node/default_rules.toml" in names
    assert {f"jobprobe/deploy/{f}" for f in SHIPPED} <= names
    assert modes["jobprobe/deploy/slurm/prolog"] & 0o111, "the prolog stays executable"
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]
    # one source of metadata: the wheel says what setup.cfg says
    assert {norm(re.split(r"[<>=!~ ;(]", r)[0]) for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
            if "extra ==" not in r} == requires()
    assert {"controller", "report", "test", "bench"} <= set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.M))
    assert re.search(r"^Requires-Python: >=3\.11$", meta, re.M)
    assert {"nats-py", "numpy"} == {norm(re.split(r"[<>=!~ ;(]", r)[0]) for r in re.findall(
        r"^Requires-Dist: (.+); extra == \"controller\"$", meta, re.M)}
    listing = subprocess.run(["tar", "tzf", str(sdist)], capture_output=True, text=True, check=True).stdout.split()
    top = {n.split("/", 1)[1] for n in listing if "/" in n}
    assert {"Containerfile", "Makefile", "setup.cfg", "scripts/install.sh", "scripts/image-install.sh",
            "scripts/headers.sh", "docs/DEPLOY.md", "tests/test_install.py"} <= top
    assert requires() <= AGENT_DISTS and AGENT_DISTS - requires() == {"jobprobe", "pynacl", "cffi", "pycparser"}


def host_state() -> dict[str, float | None]:
    return {p: (os.lstat(p).st_mtime if os.path.lexists(p) else None) for p in HOST_PATHS}


def install(role: str, wheel: Path, base: Path, *extra: str) -> subprocess.CompletedProcess:
    res = subprocess.run(["bash", str(REPO / "scripts/install.sh"), role, "--wheel", str(wheel), "--prefix",
                          str(base / "opt"), "--bin-dir", str(base / "bin"), "--unit-dir", str(base / "units"),
                          "--etc-dir", str(base / "etc"), *extra], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return res


def tree(base: Path) -> dict[str, float]:
    return {str(p): p.lstat().st_mtime for p in base.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.kernel
def test_the_node_installer_installs_the_agent_and_nothing_else(dist, tmp_path, make_cgroup):
    (wheel,) = dist.glob("jobprobe-*-py3-none-any.whl")
    before = host_state()
    res = install("node", wheel, tmp_path)
    print(res.stderr.strip().splitlines()[-1])
    apt = [ln for ln in res.stderr.splitlines() if "apt-get install" in ln or "linux-headers" in ln]
    assert all(set(ln.split("apt-get install ", 1)[1].split()) <= {"python3-bpfcc", "python3-venv", "ca-certificates"}
               for ln in apt if "apt-get install " in ln), apt
    prefix = tmp_path / "opt"
    assert dists([str(prefix / "bin/python")]) == AGENT_DISTS | {"pip", "setuptools"}   # no nats-py, pytest, torch …
    site = next(prefix.glob("lib/python3*/site-packages"))
    assert os.readlink(site / "bcc") == "/usr/lib/python3/dist-packages/bcc"     # the distribution's bcc, only it
    unit = (tmp_path / "units/jobprobe-agent.service").read_text()
    assert f"ExecStart={tmp_path}/bin/jobprobe agent --config /etc/jobprobe/agent.toml" in unit
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "units/jobprobe-agent.service")],
                           capture_output=True, text=True, timeout=60)
        assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    from jobprobe.node.config import Config
    toml = (tmp_path / "etc/agent.toml").read_text()
    assert Config.load(str(tmp_path / "etc/agent.toml"), {}).out == "/var/lib/jobprobe/frames"
    (tmp_path / "all.toml").write_text(re.sub(r"^# (\w+ = )", r"\1", toml, flags=re.M))    # the commented keys too
    assert Config.load(str(tmp_path / "all.toml"), {}).nats == "tls://controller-host:4222"
    prolog = prefix / "share/slurm/prolog"
    assert prolog.read_bytes() == (REPO / "scripts/slurm/prolog").read_bytes() and os.access(prolog, os.X_OK)

    # the agent runs from it: its probes, and a short run against the group's own accounting
    jp = str(tmp_path / "bin/jobprobe")
    listing = subprocess.run([jp, "probes"], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and re.search(r"^sched +default on +runs here", listing.stdout, re.M), listing
    cg = make_cgroup()
    run = subprocess.Popen([jp, "run", "--cgroup", str(cg.path), "--probes", "cgroup,sched", "--interval", "0.25",
                            "--stdout", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hello = json.loads(run.stdout.readline())
    assert hello["probes"] == {"cgroup": "ok", "sched": "ok"}, hello["probes"]      # bpf/sched.c from the wheel
    usage0 = cg.cpu_usage_ns()
    assert cg.spawn(workload("burncpu", 0.3)).wait(timeout=60) == 0
    # the group's only process has exited: the run ends on its own at its next tick, with the last CPU in its frame
    # (a SIGINT sent then would race its exit)
    out, err = run.communicate(timeout=30)
    assert run.returncode == 0 and "job ended: every process of" in err, err
    usage = cg.cpu_usage_ns() - usage0
    cpu = sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"]
              for f in map(json.loads, out.splitlines()) if f["kind"] == "sample")
    assert usage > 0.25e9 and abs(cpu - usage) <= 0.02 * usage, (cpu, usage)

    # idempotent: the same wheel again changes nothing
    was = tree(tmp_path / "opt") | tree(tmp_path / "units") | tree(tmp_path / "etc") | tree(tmp_path / "bin")
    again = install("node", wheel, tmp_path, "--no-system")
    assert "pip install" not in again.stderr and "creating" not in again.stderr, again.stderr
    assert tree(tmp_path / "opt") | tree(tmp_path / "units") | tree(tmp_path / "etc") | tree(tmp_path / "bin") == was
    assert host_state() == before, "the installer wrote outside the directories it was given"


@pytest.mark.kernel
def test_the_controller_installer_brings_the_nats_client_and_not_bcc(dist, tmp_path):
    (wheel,) = dist.glob("jobprobe-*-py3-none-any.whl")
    before = host_state()
    install("controller", wheel, tmp_path, "--no-system")
    prefix = tmp_path / "opt"
    assert dists([str(prefix / "bin/python")]) == AGENT_DISTS | {"nats-py", "numpy", "pip", "setuptools"}
    assert not list(prefix.glob("lib/python3*/site-packages/bcc"))
    unit = (tmp_path / "units/jobprobe-controller.service").read_text()
    assert f"ExecStart={tmp_path}/bin/jobprobe controller --data /var/lib/jobprobe/controller" in unit
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", "--man=no",
                            str(tmp_path / "units/jobprobe-controller.service")], capture_output=True, text=True,
                           timeout=60)
        assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    env = (tmp_path / "etc/controller.env").read_text()
    (args,) = re.findall(r'^JOBPROBE_CONTROLLER_ARGS="(.*)"$', env, re.M)
    from jobprobe.cli import build_parser
    parsed = build_parser().parse_args(["controller", "--data", "/var/lib/jobprobe/controller", *args.split()])
    assert parsed.listen == "127.0.0.1:4222"          # loopback until TLS is set up (docs/SECURITY.md)
    ok = subprocess.run([str(prefix / "bin/python"), "-c", "import nats, jobprobe.cluster.controller"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert host_state() == before


def test_the_installer_refuses_what_it_does_not_know(tmp_path):
    for argv, needle in ((["agent"], "usage: scripts/install.sh node|controller"),
                         (["node", "--bogus"], "unknown option --bogus"),
                         (["node", "--wheel", str(tmp_path / "none.whl")], "no wheel at"),
                         (["node", "--no-system", "--prefix", "/proc/jobprobe"], "cannot write /proc/jobprobe")):
        res = subprocess.run(["bash", str(REPO / "scripts/install.sh"), *argv], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res
    if os.geteuid() == 0:                   # not root: said, before anything is installed
        res = subprocess.run([*AS_NOBODY, "bash", str(REPO / "scripts/install.sh"), "node"], capture_output=True,
                             text=True, timeout=60, cwd="/")
        assert res.returncode == 2 and "run it as root" in res.stderr, res
