# SPDX-License-Identifier: Apache-2.0
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
from jobprobe.contract.probe import EVENTS_KEY
from jobprobe.devices import rdma
from jobprobe.kernel.host import Host
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.rdma import RdmaProbe, selected

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def node(tmp_path):
    return cluster_node(tmp_path / "sys")


@pytest.fixture
def job():
    made = []

    def start(**env):
        # its first line once it runs: its environment is in place (Popen returns inside exec, before it is —
        # test_an_environment_not_yet_readable_is_read_again_at_the_next_tick is that case)
        p = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
                             env={**os.environ, **env}, stdout=subprocess.PIPE)
        made.append(p)
        p.stdout.readline()
        return PidTreeTarget([p.pid])
    yield start
    for p in made:
        p.kill()
        p.wait()
        p.stdout.close()


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


def test_an_environment_not_yet_readable_is_read_again_at_the_next_tick(node, job, tmp_path):
    """A process inside exec reads an empty /proc/PID/environ (its new environment is placed after its parent hears
    the exec succeeded): that is no NCCL_IB_HCA yet, not its absence for the next 10 s."""
    target = job(NCCL_IB_HCA="mlx5")
    environ = tmp_path / str(target.pids()[0]) / "environ"
    environ.parent.mkdir()
    environ.write_bytes(b"")
    p = RdmaProbe(dataclasses.replace(Host(), sys=str(node.sys), proc=str(tmp_path)))
    p.start(target)
    assert p.sample()["selected_by"] == "all"
    environ.write_bytes(b"PATH=/bin\0NCCL_IB_HCA=mlx5\0")
    s = p.sample()
    assert s["selected_by"] == "NCCL_IB_HCA=mlx5" and [x["name"] for x in s["ports"]] == ["mlx5_0/1", "mlx5_1/1"]
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
    from jobprobe.contract.probe import schema_of
    from jobprobe.node.rules import RuleSet, load
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


@pytest.fixture
def threaded_job():
    """A real process with a second thread (QPs made by a thread are counted under the thread's id)."""
    p = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                          "t = threading.Thread(target=time.sleep, args=(60,)); t.start()\n"
                          "print(t.native_id, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    tid = int(p.stdout.readline())
    other = subprocess.Popen(["sleep", "60"])
    yield p.pid, tid, other.pid
    for x in (p, other):
        x.kill()
        x.wait()


def test_the_jobs_own_qp_counters_through_rdma_netlink_FAKE(node, threaded_job, tmp_path):
    """Per-job RDMA counters through the real RdmaNetlink code (requests, multi-message dumps, nested tables) talking
    to a FAKE kernel (tests/fake_rdmanl.py: no IB core here), whose numbers come from the system's uapi header. The
    probe turns the unset port to auto mode with the PID mask and leaves an operator's manual port and a driver
    without counter binding alone, saying why; the job's counters are those of its process and of its thread, never
    another process's or a kernel consumer's; a counter born mid-interval counts whole, one freed counts nothing
    more; every figure equals what the fake's counters moved by."""
    from fake_rdmanl import Counter, Device, FakeRdmaNetlink
    from jobprobe.kernel.rdmanl import RdmaNetlink
    pid, tid, other = threaded_job
    fake = FakeRdmaNetlink(tmp_path, [
        Device("mlx5_0", 1, counters=[
            Counter(1, 1, pid, [10, 11], {"out_of_sequence": 5, "local_ack_timeout_err": 1, "rdma_tx_bytes": 1000}),
            Counter(1, 2, tid, [12], {"out_of_sequence": 2, "local_ack_timeout_err": 0, "rdma_tx_bytes": 500}),
            Counter(1, 3, other, [13], {"out_of_sequence": 100, "local_ack_timeout_err": 9, "rdma_tx_bytes": 7}),
            Counter(1, 4, None, [1], {"out_of_sequence": 50, "local_ack_timeout_err": 0, "rdma_tx_bytes": 8})]),
        Device("mlx5_1", 2, modes={1: (fake_mode := 2, 0)}),          # RDMA_COUNTER_MODE_MANUAL, by an operator
        Device("irdma0", 3, binding=False)])
    assert fake_mode == fake.u["RDMA_COUNTER_MODE_MANUAL"]
    probe = probe_on(node)
    probe.open_netlink = lambda: RdmaNetlink(fake.client())
    try:
        probe.start(PidTreeTarget([pid]))
        assert fake.sets == [("mlx5_0", 1, fake.u["RDMA_COUNTER_MODE_AUTO"], fake.u["RDMA_COUNTER_MASK_PID"])]
        dev = fake.devices[1]
        with fake.lock:
            c1, c2, c3, c4 = dev.counters
            c1.values = {"out_of_sequence": 8, "local_ack_timeout_err": 1, "rdma_tx_bytes": 1000 + 4096}
            c2.values = {"out_of_sequence": 2, "local_ack_timeout_err": 0, "rdma_tx_bytes": 500 + 1024}
            c3.values = {"out_of_sequence": 1100, "local_ack_timeout_err": 19, "rdma_tx_bytes": 7 + 10 ** 9}
            c4.values = {"out_of_sequence": 51, "local_ack_timeout_err": 0, "rdma_tx_bytes": 9}
            dev.counters.append(Counter(1, 5, pid, [14, 15, 16], {"out_of_sequence": 7, "local_ack_timeout_err": 2,
                                                                  "rdma_tx_bytes": 64}))
        s = probe.sample()
        ports = {p["name"]: p for p in s["ports"]}
        assert ports["mlx5_0/1"]["job"] == {"out_of_sequence": 3 + 0 + 7, "local_ack_timeout_err": 0 + 0 + 2,
                                           "rdma_tx_bytes": 4096 + 1024 + 64}
        assert ports["mlx5_0/1"]["job_qps"] == 2 + 1 + 3
        assert "job" not in ports["mlx5_1/1"] and "job" not in ports["irdma0/1"]
        why = s["qp_counters"]
        assert why.startswith("per process on mlx5_0/1"), why
        assert "mlx5_1/1: counter mode manual" in why and "irdma0/1: Operation not supported" in why, why
        assert s["shared"] is True                     # the port figures stay the port's
        with fake.lock:
            dev.counters.remove(c2)                    # its last QP destroyed: the kernel frees the counter
            c1.values = dict(c1.values, rdma_tx_bytes=c1.values["rdma_tx_bytes"] + 1)
        s = probe.sample()
        mine = {p["name"]: p for p in s["ports"]}["mlx5_0/1"]
        assert mine["job"] == {"out_of_sequence": 0, "local_ack_timeout_err": 0, "rdma_tx_bytes": 1}
        assert mine["job_qps"] == 2 + 3
    finally:
        probe.stop()
        fake.close()


def test_on_this_host_rdma_netlink_is_absent_and_the_probe_says_so(node, job):
    """The real NETLINK_RDMA socket here (no IB core): the port figures still flow, and qp_counters says why the
    job's own are not read."""
    probe = probe_on(node)
    try:
        probe.start(job())
        s = probe.sample()
    finally:
        probe.stop()
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has an IB core")
    assert s["qp_counters"] == "no RDMA netlink: Protocol not supported"
    assert len(s["ports"]) == 3 and all("job" not in p for p in s["ports"])
