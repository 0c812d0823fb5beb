"""The controller's copy of every sample in VictoriaMetrics (Debian `victoria-metrics`, started here on loopback):
what comes back from its query API equals the frames the agents wrote to their own files."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from conftest import until
from test_nats import JOBPROBE, REPO, Site, need_nats
from test_prometheus import free_port

from jobprobe.frame import StreamReader

VM = shutil.which("victoria-metrics") or "/usr/bin/victoria-metrics"
need_vm = pytest.mark.skipif(not os.path.exists(VM), reason="victoria-metrics is not installed (scripts/setup.sh)")


class Victoria:
    def __init__(self, base):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([VM, f"-httpListenAddr=127.0.0.1:{self.port}",
                                      f"-storageDataPath={base / 'vm'}", "-retentionPeriod=1y"],
                                     stdout=subprocess.DEVNULL, stderr=open(base / "vm.log", "wb"))

        def up():
            try:
                return urllib.request.urlopen(f"{self.url}/health", timeout=1).status == 200
            except OSError:
                return False
        until(up, 30, "victoria-metrics to be ready")

    def export(self, match: str) -> list[dict]:
        urllib.request.urlopen(f"{self.url}/internal/force_flush", timeout=10).read()
        q = urllib.parse.urlencode({"match[]": match})
        with urllib.request.urlopen(f"{self.url}/api/v1/export?{q}", timeout=10) as r:
            return [json.loads(line) for line in r.read().decode().splitlines() if line.strip()]

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.mark.integration
@pytest.mark.kernel
@need_nats
@need_vm
def test_the_controller_writes_every_sample_to_victoriametrics(tmp_path):
    vm = Victoria(tmp_path)
    site = Site(tmp_path)
    try:
        site.nats.start()
        site.controller = subprocess.Popen([*JOBPROBE, "controller", "--nats", site.nats.url, "--store",
                                            str(site.store), "--tsdb", f"victoriametrics://127.0.0.1:{vm.port}"],
                                           cwd=REPO, stdout=subprocess.DEVNULL,
                                           stderr=open(tmp_path / "controller.log", "ab"))
        until(lambda: "consuming" in (tmp_path / "controller.log").read_text(), 30, "the controller")
        site.start_agent("n1")
        site.start_agent("n2")
        time.sleep(4)
        site.stop_agents()
        want = {}
        for node in ("n1", "n2"):
            for path in (tmp_path / node / "out").glob("*.mpk"):
                with open(path, "rb") as f:
                    for fr in StreamReader(f):
                        if fr["kind"] == "sample" and isinstance(fr["probes"].get("cgroup"), dict):
                            want.setdefault((fr["node"], fr["job"], fr["run"]), []).append(
                                (int(fr["t"] * 1000), fr["probes"]["cgroup"]["cpu_user_ns"],
                                 fr["probes"]["cgroup"]["nprocs"]))
        assert len(want) == 2 and all(len(v) >= 10 for v in want.values())

        def got_all():
            series = vm.export('{__name__="jobprobe_cgroup_cpu_user_seconds_total"}')
            return series if sum(len(s["values"]) for s in series) >= sum(len(v) for v in want.values()) else None
        series = until(got_all, 30, "every sample in victoria-metrics")
        for s in series:
            m = s["metric"]
            rows = sorted(want[(m["node"], m["job"], m["run"])])
            total, expect = 0, []
            for _, user_ns, _ in rows:
                total += user_ns
                expect.append(total / 1e9)
            assert s["timestamps"] == [t for t, _, _ in rows]
            assert s["values"] == pytest.approx(expect, rel=1e-9, abs=1e-9)
        procs = vm.export('{__name__="jobprobe_cgroup_nprocs"}')
        assert sorted(v for s in procs for v in s["values"]) == sorted(float(n) for v in want.values()
                                                                         for _, _, n in v)
    finally:
        site.close()
        vm.close()
