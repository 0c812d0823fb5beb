"""nic: the job's interfaces, read by rtnetlink in the job's own network namespace. References: the interface's
own counters in sysfs read from inside the namespace (`ip netns exec … cat /sys/class/net/…/statistics`), and
`tc -s qdisc` for the queue."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from workloads_net import ADDR_B, result

from jobprobe.probes.nic import NicProbe, wanted
from jobprobe.target import CgroupTarget, PidTreeTarget


def test_interface_selection_follows_nccl_rules():
    names = ["eth0", "eth1", "ib0", "lo", "docker0"]
    assert wanted(names, None) == names
    assert wanted(names, "eth") == ["eth0", "eth1"]
    assert wanted(names, "^docker,lo") == ["eth0", "eth1", "ib0"]
    assert wanted(names, "=eth1,ib0") == ["eth1", "ib0"]
    assert wanted(names, "=eth") == []


def sysfs(net, dev: str) -> dict[str, int]:
    names = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
    vals = net.run(net.a, "sh", "-c", f"cd /sys/class/net/{dev}/statistics && cat {' '.join(names)}")
    return dict(zip(names, map(int, vals.split())))


def tc_stats(net, dev: str) -> dict[str, int]:
    out = net.run(net.a, "tc", "-s", "qdisc", "show", "dev", dev)
    m = re.search(r"dropped (\d+), overlimits (\d+) requeues (\d+)", out)
    return {"drops": int(m[1]), "overlimits": int(m[2]), "requeues": int(m[3])}


@pytest.mark.kernel
def test_a_job_in_its_own_namespace_sees_its_veth_and_the_queue_in_front_of_it(make_cgroup, net):
    """The job sends 4 MiB from namespace A over a veth shaped to 40 Mbit/s: the probe's interface is A's veth
    (loopback left out), its bytes and packets equal the veth's own counters, and the tbf queue's drops and
    overlimits equal `tc -s qdisc`'s, interval by interval summed."""
    net.run(net.a, "tc", "qdisc", "replace", "dev", net.va, "root", "tbf", "rate", "40mbit", "burst", "16kb",
            "latency", "20ms")
    cg = make_cgroup()
    sink = net.start(net.b, "tcp_sink", 5301, 0, ready=True)
    holder = net.start(net.a, "tcp_sink", 5399, 0, spawn=cg.spawn)      # a process of the job in namespace A
    time.sleep(0.3)
    probe = NicProbe()
    probe.start(CgroupTarget(str(cg.path)))
    s0, q0 = sysfs(net, net.va), tc_stats(net, net.va)
    sender = net.start(net.a, "tcp_send", ADDR_B, 5301, 4 << 20, spawn=cg.spawn)
    total: dict[str, int] = {}
    while True:
        done = sender.poll() is not None
        time.sleep(0.2)
        smp = probe.sample()
        assert [n["name"] for n in smp["nics"]] == [net.va], smp
        assert smp["shared"] is False and smp["netns"].startswith("netns:") and smp["selected_by"] == "all"
        nic = smp["nics"][0]
        assert nic["qdisc"] == "tbf"
        for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets", "qdisc_drops", "qdisc_overlimits"):
            total[k] = total.get(k, 0) + nic[k]
        if done:
            break
    result(sender)
    result(sink)
    s1, q1 = sysfs(net, net.va), tc_stats(net, net.va)
    holder.kill()
    probe.stop()
    print(f"nic: {total}; sysfs {({k: s1[k] - s0[k] for k in s0})}; tc {({k: q1[k] - q0[k] for k in q0})}")
    for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets"):
        assert total[k] == s1[k] - s0[k], (k, total, s0, s1)
    assert total["qdisc_drops"] == q1["drops"] - q0["drops"]
    assert total["qdisc_overlimits"] == q1["overlimits"] - q0["overlimits"] > 0
    assert total["tx_bytes"] > 4 << 20


@pytest.mark.kernel
def test_the_jobs_environment_chooses_its_interfaces(net):
    """NCCL_SOCKET_IFNAME in the job's environment: only the interfaces it names (here loopback, by its exact
    name), said in selected_by."""
    proc = subprocess.Popen(["ip", "netns", "exec", net.a, "env", "NCCL_SOCKET_IFNAME==lo", sys.executable, "-c",
                             "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        probe = NicProbe()
        probe.start(PidTreeTarget([proc.pid]))
        smp = probe.sample()
        probe.stop()
        assert [n["name"] for n in smp["nics"]] == ["lo"] and smp["selected_by"] == "NCCL_SOCKET_IFNAME==lo"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.kernel
def test_a_job_in_the_hosts_namespace_is_told_its_interfaces_are_shared():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        probe = NicProbe()
        probe.start(PidTreeTarget([proc.pid]))
        smp = probe.sample()
        probe.stop()
        assert smp["shared"] is True and smp["netns"] == "host"
        names = [n["name"] for n in smp["nics"]]
        assert "lo" not in names
        for n in smp["nics"]:
            want = open(f"/sys/class/net/{n['name']}/operstate").read().strip()
            assert want in ("up", "unknown"), (n, want)
    finally:
        proc.kill()
        proc.wait()
