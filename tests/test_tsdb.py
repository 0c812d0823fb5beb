# SPDX-License-Identifier: Apache-2.0
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

from conftest import free_port, until
from jobprobe.core.frame import StreamReader
from natsite import JOBPROBE, REPO, Site, need_nats

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


@pytest.mark.integration
@need_vm
def test_hostile_names_and_labels_inject_no_series(tmp_path):
    """A frame whose job, node and device label carry newlines and braces, and whose schema declares a field named
    like a line of exposition text: no forged series appears in VictoriaMetrics; the honest series are there, their
    label values exactly as the frame said; the field whose name is no metric name is skipped and counted."""
    from jobprobe.cluster.tsdb import VictoriaMetrics
    vm = Victoria(tmp_path)
    try:
        w = VictoriaMetrics(f"victoriametrics://127.0.0.1:{vm.port}")
        job = 'j"} 1\nforged_job{a="b"} 666 1\n'
        node = 'n1\n}forged_node 1\n'
        gpu = '0"}\nforged_gpu 1\n#'
        bad_field = 'x{a="b"} 1\nforged'
        schema = {"cgroup": {"nprocs": {"kind": "gauge", "unit": ""}, bad_field: {"kind": "gauge", "unit": ""},
                             "cpu_user_ns": {"kind": "counter", "unit": "ns"}},
                  "gpu": {"gpus": {"kind": "list"}, "gpus[].util_gpu_pct": {"kind": "gauge", "unit": "%"}},
                  'evil"}\nforged_probe': {"v": {"kind": "gauge", "unit": ""}}}
        t0 = time.time() - 60
        frames = [{"kind": "hello", "node": node, "job": job, "run": "r1", "seq": 0, "t": t0, "schema": schema}]
        for i in range(1, 4):
            frames.append({"kind": "sample", "node": node, "job": job, "run": "r1", "seq": i, "t": t0 + i,
                           "probes": {"cgroup": {"nprocs": i, bad_field: 7,         # no JSON NaN, no overflow
                                                 "cpu_user_ns": [float("nan"), 10**400, float("inf")][i - 1]},
                                      "gpu": {"gpus": [{"index": gpu, "util_gpu_pct": 10 * i}]},
                                      'evil"}\nforged_probe': {"v": 1}}})
        w.add(frames)
        w.close()
        assert w.counts["errors"] == 0 and w.counts["skipped_names"] >= 2 and w.counts["skipped_values"] == 3, w.counts

        def names():
            urllib.request.urlopen(f"{vm.url}/internal/force_flush", timeout=10).read()
            with urllib.request.urlopen(f"{vm.url}/api/v1/label/__name__/values", timeout=10) as r:
                got = set(json.load(r)["data"])
            return got if {"jobprobe_cgroup_nprocs", "jobprobe_gpu_util_gpu_pct"} <= got else None
        assert until(names, 30, "the honest series") == {"jobprobe_cgroup_nprocs", "jobprobe_gpu_util_gpu_pct"}
        (nprocs,) = vm.export('{__name__="jobprobe_cgroup_nprocs"}')
        assert nprocs["metric"] == {"__name__": "jobprobe_cgroup_nprocs", "node": node, "job": job, "run": "r1"}
        assert nprocs["values"] == [1, 2, 3] and nprocs["timestamps"] == [int((t0 + i) * 1000) for i in (1, 2, 3)]
        (util,) = vm.export('{__name__="jobprobe_gpu_util_gpu_pct"}')
        assert util["metric"]["gpu"] == gpu and util["values"] == [10, 20, 30]
        q = urllib.parse.urlencode({"match[]": '{__name__=~".+"}'})
        with urllib.request.urlopen(f"{vm.url}/api/v1/series?{q}", timeout=10) as r:
            series = json.load(r)["data"]
        assert len(series) == 2 and not any("forged" in k for s in series for k in s), series
    finally:
        vm.close()
