# SPDX-License-Identifier: Apache-2.0
"""jobprobe doctor. On this machine it runs for real and must tell the truth (no GPU, no RDMA device: those checks
are absent, not failed). Every other verdict is shown on FIXTURE trees of broken nodes (tests/fixtures_rdma.py: a
sysfs with PCI functions, GPUs, RDMA ports, RoCE netdevs; a /proc with its mountinfo), each check failing for its own
reason, with the fake libnvidia-ml (tests/fake_nvml) standing in for a GPU driver."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AS_NOBODY
from fake_nvml.state import FakeState
from fake_nvml.state import build as build_nvml
from fixtures_rdma import IB_COUNTERS, RdmaTree
from jobprobe.node import doctor

REPO = Path(__file__).resolve().parents[1]
GPU_CLS, NV = 0x030200, 0x10DE


@pytest.fixture(scope="module")
def nvml_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nvml")
    build_nvml(d)
    return d


class Node:
    """A fixture node: <root>/sys, <root>/proc, <root>/lib/modules; GPUs and NICs placed by PCI chain."""

    def __init__(self, root: Path):
        self.root = root
        self.t = RdmaTree(root / "sys")
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/pressure").mkdir()
        (root / "proc/pressure/cpu").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        (root / "proc/self/mountinfo").write_text(
            "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
        (root / "sys/fs/cgroup").mkdir(parents=True)
        (root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
        (root / "sys/bus/event_source/devices/cpu").mkdir(parents=True)
        (root / "sys/kernel/btf").mkdir(parents=True)
        (root / "sys/kernel/btf/vmlinux").write_bytes(b"")
        import platform
        (root / f"lib/modules/{platform.release()}/build").mkdir(parents=True)
        self.state = FakeState(root / "nvml-state")

    def gpu(self, chain: list[str], numa: int = 0, hb: str = "pci0000:00", acs: int | None = None) -> "Node":
        self.t.pci(chain, NV, GPU_CLS, numa, hb, acs)
        i = self.state.count
        self.state.gpu(i, uuid=f"GPU-{i:08d}-0000-4000-8000-000000000000", name="NVIDIA H100 80GB HBM3",
                       minor=i, accounting=1).write()
        return self

    def nic(self, name: str, chain: list[str], numa: int = 0, hb: str = "pci0000:00", acs: int | None = None,
            rate: str = "400 Gb/sec (4X NDR)", state: str = "4: ACTIVE", roce: str | None = None) -> "Node":
        self.t.device(name, chain[-1], numa, chain=chain, host_bridge=hb, acs=acs)
        self.t.port(name, 1, layer="Ethernet" if roce else "InfiniBand", rate=rate, state=state, ndev=roce,
                    counters=IB_COUNTERS)
        if roce:
            (self.root / "sys/class/net" / roce).mkdir(parents=True, exist_ok=True)
            (self.root / "sys/class/net" / roce / "mtu").write_text("9000\n")
        return self

    def peermem(self) -> "Node":
        (self.root / "sys/module/nvidia_peermem").mkdir(parents=True)
        return self

    def run(self, nvml_dir: Path | None, *extra: str) -> tuple[int, dict]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML", "LD_LIBRARY_PATH"))}
        if nvml_dir is not None:
            env.update(LD_LIBRARY_PATH=str(nvml_dir), FAKE_NVML_STATE=str(self.state.path))
        r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "doctor", "--json", "--root", str(self.root),
                            *extra], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
        assert r.returncode in (0, 1, 3), r.stderr
        return r.returncode, {c["name"]: c for c in json.loads(r.stdout)["checks"]}


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path / "node")
    n.state.write()
    return n


# A switch under root port 0000:00:01.0 (upstream 0000:01:00.0, downstream ports 0000:02:0X.0) with a GPU and a NIC
SWITCH = ["0000:00:01.0", "0000:01:00.0"]


def good_node(node: Node, acs: int | None = 0) -> Node:
    node.gpu(SWITCH + ["0000:02:01.0", "0000:03:00.0"], acs=acs)
    node.nic("mlx5_0", SWITCH + ["0000:02:02.0", "0000:04:00.0"], acs=acs)
    node.nic("mlx5_1", SWITCH + ["0000:02:03.0", "0000:05:00.0"], acs=acs)
    return node.peermem()


def test_a_healthy_fixture_node_passes_every_check_it_can(node, nvml_dir):
    code, c = good_node(node).run(nvml_dir)
    assert c["nvml"]["status"] == "pass" and "550.54.15" in c["nvml"]["detail"] and "1 GPU" in c["nvml"]["detail"]
    for name in ("btf_or_headers", "pmu", "cgroup_v2", "psi", "persistence", "accounting", "gpudirect",
                 "gpu_nic_affinity", "acs", "rdma_links", "rails"):
        assert c[name]["status"] == "pass", c[name]
    assert "PIX" in c["gpu_nic_affinity"]["detail"]
    assert c["roce_qos"]["status"] == "absent"        # InfiniBand ports only


@pytest.mark.parametrize("breakage,check,status,said", [
    ("no_peermem", "gpudirect", "fail", "nvidia_peermem is not loaded"),
    ("far_nic", "gpu_nic_affinity", "fail", "SYS"),
    ("host_bridge", "gpu_nic_affinity", "warn", "PHB"),
    ("acs", "acs", "fail", "0000:02:01.0 (ACS control 0x001d), 0000:02:02.0 (ACS control 0x001d)"),
    ("port_down", "rdma_links", "fail", "mlx5_1/1 DOWN"),
    ("slow_rail", "rails", "warn", "200 Gb/s"),
    ("no_persistence", "persistence", "warn", "GPU 0"),
    ("no_accounting", "accounting", "warn", "GPU 0"),
    ("old_driver", "nvml", "warn", "470.57.02"),
    ("no_driver", "nvml", "fail", "no NVIDIA driver"),
    ("no_headers", "btf_or_headers", "fail", "no kernel headers"),
    ("btf_only", "btf_or_headers", "warn", "no headers"),
    ("no_pmu", "pmu", "warn", "no hardware PMU"),
    ("hybrid", "cgroup_v2", "warn", "hybrid"),
    ("no_cgroup2", "cgroup_v2", "fail", "no cgroup2"),
    ("no_psi", "psi", "warn", "no /proc/pressure"),
])
def test_each_check_fails_for_its_own_reason(node, nvml_dir, breakage, check, status, said):
    lib = nvml_dir
    if breakage == "far_nic":
        node.gpu(SWITCH + ["0000:02:01.0", "0000:03:00.0"], numa=0).peermem()
        node.nic("mlx5_0", ["0000:80:01.0", "0000:81:00.0"], numa=1, hb="pci0000:80")
    elif breakage == "host_bridge":
        node.gpu(SWITCH + ["0000:02:01.0", "0000:03:00.0"]).peermem()
        node.nic("mlx5_0", ["0000:00:03.0", "0000:06:00.0"])
    else:
        good_node(node, acs=0x1D if breakage == "acs" else 0)
    if breakage == "no_peermem":
        shutil.rmtree(node.root / "sys/module/nvidia_peermem")
    elif breakage == "port_down":
        node.t.set("mlx5_1", 1, state="1: DOWN", phys_state="3: Disabled")
    elif breakage == "slow_rail":
        (node.root / "sys/class/infiniband/mlx5_1/ports/1/rate").write_text("200 Gb/sec (4X HDR)\n")
    elif breakage == "no_persistence":
        node.state.gpu(0, persistence=0).write()
    elif breakage == "no_accounting":
        node.state.gpu(0, accounting=0).write()
    elif breakage == "old_driver":
        node.state.driver = "470.57.02"
        node.state.write()
    elif breakage == "no_driver":
        lib = None
    elif breakage in ("no_headers", "btf_only"):
        shutil.rmtree(node.root / "lib")
        if breakage == "no_headers":
            shutil.rmtree(node.root / "sys/kernel/btf")
    elif breakage == "no_pmu":
        shutil.rmtree(node.root / "sys/bus/event_source")
    elif breakage == "hybrid":
        (node.root / "proc/self/mountinfo").write_text(
            "30 1 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n31 1 0:27 / /sys/fs/cgroup/cpu rw - cgroup "
            "cgroup rw,cpu\n")
    elif breakage == "no_cgroup2":
        (node.root / "proc/self/mountinfo").write_text("31 1 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    elif breakage == "no_psi":
        shutil.rmtree(node.root / "proc/pressure")
    code, c = node.run(lib)
    assert c[check]["status"] == status and said in c[check]["detail"], c[check]
    assert c[check]["fix"]
    assert code == (3 if status == "fail" else code) and code >= doctor.ORDER[status]
    others = {k: v["status"] for k, v in c.items() if k not in (check, "root", "bpf", "clock", "roce_qos")
              and not (check == "nvml" and k in ("persistence", "accounting"))
              and not (breakage in ("far_nic", "host_bridge") and k in ("acs", "rails"))
              and not (breakage == "port_down" and k == "rails")}      # (one active port left: no rails to compare)
    assert set(others.values()) == {"pass"}, others      # one breakage, one verdict


def test_roce_ecn_pfc_and_trust_where_the_driver_shows_them(node, nvml_dir):
    node.nic("mlx5_0", SWITCH + ["0000:02:02.0", "0000:04:00.0"], roce="ens1f0")
    net = node.root / "sys/class/net/ens1f0"
    for side in ("roce_np", "roce_rp"):
        (net / "ecn" / side / "enable").mkdir(parents=True)
        for i in range(8):
            (net / "ecn" / side / "enable" / str(i)).write_text("1\n" if i == 3 else "0\n")
    (net / "qos").mkdir()
    (net / "qos/pfc").write_text("0,0,0,1,0,0,0,0\n")
    (net / "qos/trust").write_text("dscp\n")
    _, c = node.run(nvml_dir)
    assert c["roce_qos"]["status"] == "pass", c["roce_qos"]
    (net / "ecn/roce_np/enable/3").write_text("0\n")
    (net / "qos/pfc").write_text("0,0,0,0,0,0,0,0\n")
    (net / "qos/trust").write_text("pcp\n")
    _, c = node.run(nvml_dir)
    d = c["roce_qos"]["detail"]
    assert c["roce_qos"]["status"] == "warn" and "ECN (DCQCN) off" in d and "PFC off" in d and "trust pcp" in d


def test_the_clock_verdicts():
    assert doctor.clock_verdict(0x40, 16_000_000, 16_000_000).status == "warn"          # STA_UNSYNC
    assert doctor.clock_verdict(0x2001, 250_000, 100).status == "warn"                  # synced, 250 ms bound
    ok = doctor.clock_verdict(0x2001, 5_000, 120)
    assert ok.status == "pass" and "120 µs" in ok.detail


def test_bpf_fails_for_a_user_without_the_right():
    r = subprocess.run([*AS_NOBODY, sys.executable, "-m", "jobprobe.cli", "doctor", "--json"], capture_output=True,
                       text=True, cwd=REPO, timeout=60,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    c = {x["name"]: x for x in json.loads(r.stdout)["checks"]}
    assert r.returncode == 3 and c["root"]["status"] == "fail" and c["bpf"]["status"] == "fail"
    assert "not permitted" in c["bpf"]["detail"]


def test_on_this_machine_the_doctor_tells_the_truth():
    """Root here: root and BPF pass; no GPU and no RDMA device, so their checks are absent, never failed; PMU and
    PSI as the machine's own sysfs and procfs say."""
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "doctor", "--json"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    res = json.loads(r.stdout)
    c = {x["name"]: x["status"] for x in res["checks"]}
    print("doctor here:", c)
    assert r.returncode == doctor.ORDER[res["worst"]] and c["root"] == c["bpf"] == "pass"
    gpus = any(Path(p, "vendor").read_text().strip() == "0x10de" for p in Path("/sys/bus/pci/devices").iterdir())
    rdma_here = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    if not gpus:
        assert c["nvml"] == c["persistence"] == c["accounting"] == "absent"
    if not (gpus and rdma_here):
        assert c["gpudirect"] == c["gpu_nic_affinity"] == c["acs"] == "absent"
    if not rdma_here:
        assert c["rdma_links"] == c["roce_qos"] == c["rails"] == "absent"
    pmu = any(n in ("cpu", "cpu_core") for n in os.listdir("/sys/bus/event_source/devices"))
    assert c["pmu"] == ("pass" if pmu else "warn")
    assert c["psi"] == ("pass" if os.path.exists("/proc/pressure/cpu") else "warn")
    assert "fail" not in c.values()


@pytest.mark.integration
def test_the_controller_lists_a_node_that_is_not_ready(node, nvml_dir, tmp_path):
    """Two nodes send their doctor's result through NATS: the controller stores each as a `doctor` event and
    `controller stats` names the failing one as not ready, with the check that failed."""
    import time

    from natsite import NATS, NatsServer
    if not os.path.exists(NATS):
        pytest.skip("nats-server is installed by make test (scripts/setup.sh)")
    nats = NatsServer(tmp_path)
    nats.start()
    store = tmp_path / "store.db"
    ctl = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "controller", "--nats", nats.url, "--store",
                            str(store)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "ctl.log", "ab"))
    try:
        deadline = time.monotonic() + 30
        while "consuming" not in (tmp_path / "ctl.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "ctl.log").read_text()
            time.sleep(0.1)
        good_node(node)
        assert node.run(nvml_dir, "--controller", nats.url, "--node", "good-1")[0] in (0, 1)
        shutil.rmtree(node.root / "sys/module/nvidia_peermem")
        assert node.run(nvml_dir, "--controller", nats.url, "--node", "bad-2")[0] == 3
        for _ in range(100):
            r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "controller", "stats", "--store", str(store),
                                "--json"], capture_output=True, text=True, cwd=REPO, timeout=30)
            st = json.loads(r.stdout) if r.returncode == 0 else {}
            if {"good-1", "bad-2"} <= set((st.get("nodes") or {})):
                break
            time.sleep(0.2)
        assert st["unready_nodes"] == ["bad-2"], st
        assert "gpudirect" in st["nodes"]["bad-2"]["doctor"]["not_pass"]
        r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "controller", "stats", "--store", str(store)],
                           capture_output=True, text=True, cwd=REPO, timeout=30)
        assert "bad-2: doctor fail" in r.stdout and "NOT READY" in r.stdout
    finally:
        ctl.terminate()
        ctl.wait(timeout=30)
        nats.stop()
