"""rdma: the job's InfiniBand/RoCE ports from sysfs. This machine has no RDMA device and cannot make one (no
modules, no soft-RoCE), so the probe reads FIXTURE trees (tests/fixtures_rdma.py: mlx5-like IB and RoCE ports, an
irdma-like RoCE port) written tick by tick; the job is a real process whose environment chooses its ports. On this
host the probe says it is unavailable, and why."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures_rdma import cluster_node

from jobprobe.host import Host
from jobprobe.kernel import rdma
from jobprobe.probe import EVENTS_KEY
from jobprobe.probes.rdma import RdmaProbe, selected
from jobprobe.target import PidTreeTarget

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def node(tmp_path):
    return cluster_node(tmp_path / "sys")


@pytest.fixture
def job():
    made = []

    def start(**env):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, **env})
        made.append(p)
        return PidTreeTarget([p.pid])
    yield start
    for p in made:
        p.kill()
        p.wait()


def probe_on(node) -> RdmaProbe:
    return RdmaProbe(dataclasses.replace(Host(), sys=str(node.sys)))


def test_the_sysfs_reader_sees_each_kind_of_port(node):
    ports = {p.name: p for p in rdma.ports(str(node.sys))}
    assert sorted(ports) == ["irdma0/1", "mlx5_0/1", "mlx5_1/1"]
    ib, roce, irdma = ports["mlx5_0/1"], ports["mlx5_1/1"], ports["irdma0/1"]
    assert (ib.link_layer, ib.rate_gbps, ib.state, ib.phys_state, ib.netdev) == ("InfiniBand", 200.0, "ACTIVE",
                                                                                 "LinkUp", None)
    assert (roce.link_layer, roce.netdev, roce.pci) == ("Ethernet", "ens1f0", "0000:3c:00.0")
    assert (irdma.netdev, irdma.numa_node, irdma.pci) == ("ens2f0", 1, "0000:86:00.0")
    _, hw = rdma.counters(str(node.sys), "mlx5_1", 1)
    assert "lifespan" not in hw and hw["np_cnp_sent"] == 0


def test_nccl_ib_hca_chooses_ports(node):
    ports = rdma.ports(str(node.sys))
    names = lambda spec: [p.name for p in selected(ports, spec)]      # noqa: E731
    assert names(None) == ["irdma0/1", "mlx5_0/1", "mlx5_1/1"]
    assert names("mlx5") == ["mlx5_0/1", "mlx5_1/1"]
    assert names("mlx5_0:1,irdma0") == ["irdma0/1", "mlx5_0/1"]
    assert names("^mlx5_1") == ["irdma0/1", "mlx5_0/1"]
    assert names("=mlx5") == []
    assert names("mlx5_0:2") == []


def test_bytes_are_words_times_four_and_hw_counters_are_deltas(node, job):
    """port_xmit_data counts 4-byte words: 1,000,000 words sent in an interval are 4 MB; the hw_counters of both
    drivers (irdma's under mlx5's names) are per-interval deltas."""
    p = probe_on(node)
    p.start(job())
    node.add("mlx5_0", 1, port_xmit_data=1_000_000, port_rcv_data=250, port_xmit_packets=1000, port_xmit_wait=7)
    node.add("mlx5_1", 1, np_cnp_sent=5, np_ecn_marked_roce_packets=9, out_of_sequence=2)
    node.add("irdma0", 1, cnpSent=3, RxECNMrkd=4, cnpHandled=1)
    s = p.sample()
    ports = {x["name"]: x for x in s["ports"]}
    ib = ports["mlx5_0/1"]
    assert (ib["tx_bytes"], ib["rx_bytes"], ib["tx_packets"], ib["port_xmit_wait"]) == (4_000_000, 1000, 1000, 7)
    assert 0 < ib["tx_util_pct"] and ib["health"] == "ok" and s["shared"] is True and s["selected_by"] == "all"
    assert (ports["mlx5_1/1"]["np_cnp_sent"], ports["mlx5_1/1"]["np_ecn_marked_roce_packets"],
            ports["mlx5_1/1"]["out_of_sequence"], ports["mlx5_1/1"]["netdev"]) == (5, 9, 2, "ens1f0")
    assert (ports["irdma0/1"]["np_cnp_sent"], ports["irdma0/1"]["np_ecn_marked_roce_packets"],
            ports["irdma0/1"]["rp_cnp_handled"]) == (3, 4, 1)
    assert "tx_bytes" in ports["irdma0/1"] and ports["irdma0/1"]["tx_bytes"] == 0    # no IB counters: 0, said
    s2 = p.sample()
    assert all(x.get("np_cnp_sent", 0) == 0 and x["tx_bytes"] == 0 for x in s2["ports"])
    p.stop()


def test_health_verdicts_and_their_events(node, job):
    """One symbol error: degraded. 121 in the hour: fatal (NVSentinel's 120/h). link_downed rising: fatal. A port
    that leaves ACTIVE: fatal. Each change of verdict is one rdma_health event with its reason."""
    p = probe_on(node)
    p.start(job(NCCL_IB_HCA="mlx5"))
    s = p.sample()
    assert s["selected_by"] == "NCCL_IB_HCA=mlx5" and [x["name"] for x in s["ports"]] == ["mlx5_0/1", "mlx5_1/1"]
    assert s["ports_fatal"] == s["ports_degraded"] == 0 and EVENTS_KEY not in s
    node.add("mlx5_0", 1, symbol_error=1)
    s = p.sample()
    ev = s.pop(EVENTS_KEY)
    assert [(e["port"], e["health"], e["was"]) for e in ev] == [("mlx5_0/1", "degraded", "ok")]
    assert s["ports_degraded"] == 1 and "symbol_error" in s["ports"][0]["health_why"]
    node.add("mlx5_0", 1, symbol_error=120)
    s = p.sample()
    assert s["ports"][0]["health"] == "fatal" and s["ports"][0]["symbol_errors_1h"] == 121
    assert [e["health"] for e in s.pop(EVENTS_KEY)] == ["fatal"] and "121 symbol errors" in s["ports"][0]["health_why"]
    node.add("mlx5_1", 1, link_downed=1)
    s = p.sample()
    assert s["ports_fatal"] == 2 and "link went down" in s["ports"][1]["health_why"]
    node.set("mlx5_1", 1, state="1: DOWN", phys_state="3: Disabled")
    s = p.sample()
    assert "left ACTIVE (DOWN, Disabled)" in s["ports"][1]["health_why"] and EVENTS_KEY not in s   # fatal already
    p.stop()


def test_the_default_rules_turn_verdicts_into_rule_events(node, job):
    from jobprobe.probe import schema_of
    from jobprobe.rules import RuleSet, load
    p = probe_on(node)
    p.start(job())
    rs = RuleSet([r for r in load("default") if r.name.startswith("rdma_")], schema_of([p]), "j")
    fired = []
    for i in range(8):
        if i == 3:
            node.add("mlx5_0", 1, link_downed=1)
        s = p.sample()
        s.pop(EVENTS_KEY, None)
        fired += [e for e in rs.feed({"kind": "sample", "t": 100.0 + i, "dt": 1.0, "probes": {"rdma": s}})
                  if e["event"] == "rule"]
    assert [e["rule"] for e in fired] == ["rdma_port_fatal"], fired
    p.stop()


def test_on_this_host_the_probe_says_there_is_no_rdma_device():
    """A real run here: the frames carry rdma's status, unavailable with its reason, and the run goes on."""
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--probes", "cgroup,rdma", "--stdout", "json",
                        "--duration", "1", "--", "sleep", "3"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    hello = json.loads(r.stdout.splitlines()[0])
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    assert hello["probes"]["rdma"] == "unavailable: no RDMA device (/sys/class/infiniband is empty or absent)"
