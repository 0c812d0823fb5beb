# SPDX-License-Identifier: Apache-2.0
"""The agent's /metrics, scraped by a real Prometheus (Debian `prometheus`, started here on loopback): PromQL over
its HTTP API returns our values for a real job — CPU seconds equal the job's own cgroup accounting and the sum of
the frames the agent wrote; the GPU figures are those of the fake NVML (tests/fake_nvml, compiled here: this
machine has no GPU). Every query of the Grafana dashboard (scripts/grafana/jobprobe-job.json) returns data."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, serving_agent, until
from jobprobe.core.frame import StreamReader

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
need_prometheus = pytest.mark.skipif(not os.path.exists(PROMETHEUS),
                                     reason="prometheus is not installed (scripts/setup.sh installs it)")

JOB = r"""
import socket, sys, threading, time
end = time.time() + float(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); peer, _ = srv.accept()
def sink():
    while peer.recv(65536): pass
threading.Thread(target=sink, daemon=True).start()
while time.time() < end:
    x = 0
    for i in range(200000): x += i * i
    cli.sendall(b"x" * 65536)
    time.sleep(0.02)
"""


class Prometheus:
    def __init__(self, base: Path, targets: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = base / "prometheus.yml"
        conf.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                        "  - job_name: jobprobe\n    honor_labels: true\n    static_configs:\n"
                        f"      - targets: {json.dumps(targets)}\n")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={base / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=open(base / "prometheus.log", "wb"))
        until(self.ready, 30, "prometheus to be ready")

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        q = {"query": expr, **({"time": f"{at:.3f}"} if at else {})}
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode(q)}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.mark.integration
@pytest.mark.kernel
@need_prometheus
def test_prometheus_scrapes_a_real_jobs_values_and_every_dashboard_query_has_data(make_cgroup, tmp_path):
    from fake_nvml.state import FakeState, build
    nvml_dir = build(tmp_path).parent
    state = FakeState(tmp_path / "nvml.state").gpu(
        0, uuid="GPU-fake-0", name="Fake GPU", util="61 12", mem=f"{16 << 30} {3 << 30}", clocks="1410 1593",
        power=250000, energy=1_000_000, temp=50, pcie="1 2", throttle="0x0", ecc="0 0", remap="0 0 0 0",
        gpm=0).write()
    port = free_port()
    d = tmp_path / "agent"
    d.mkdir()
    env = {**os.environ, "LD_LIBRARY_PATH": str(nvml_dir), "FAKE_NVML_STATE": str(state.path)}
    agent = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "agent", "--socket", str(d / "s.sock"),
                              "--state", str(d / "jobs.json"), "--out", str(d / "out"), "--interval", "1",
                              "--probes", "cgroup,sched,net,nic,gpu,self", "--node", "prom-node",
                              "--prometheus", f"127.0.0.1:{port}"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(d / "agent.log", "wb"))
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    cg = make_cgroup()
    job = cg.spawn([sys.executable, "-c", JOB, "20"], env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        from jobprobe.node.control import call

        def up():
            try:
                return call(str(d / "s.sock"), {"cmd": "status"})
            except Exception:            # no socket yet (BadInput), or not accepting yet
                return None
        until(up, 60, "the agent")
        r = call(str(d / "s.sock"), {"cmd": "attach", "cgroup": str(cg.path), "job": "promjob", "from_start": True})
        assert r["ok"], r
        time.sleep(12)
        mid = time.time() - 2
        dash = json.loads((REPO / "scripts" / "grafana" / "jobprobe-job.json").read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
        assert len(exprs) >= 10
        empty = []
        for e in exprs:
            q = e.replace("$job", "promjob").replace("$__rate_interval", "10s")
            if not prom.query(q, mid):
                empty.append(q)
        assert not empty, f"dashboard queries without data: {empty}"
        gpu = prom.query('jobprobe_gpu_util_gpu_pct{job="promjob"}', mid)
        assert [(g["metric"]["gpu"], g["metric"]["node"], float(g["value"][1])) for g in gpu] == [("0", "prom-node",
                                                                                                61.0)]
        p99 = prom.query('histogram_quantile(0.99, sum by (le) (rate(jobprobe_sched_runq_lat_seconds_bucket'
                         '{job="promjob"}[10s])))', mid)
        assert p99 and 0 < float(p99[0]["value"][1]) < 1.0

        job.wait(timeout=60)
        want_ns = cg.cpu_usage_ns()             # the job's own accounting, now final
        until(lambda: not cg.pids() and call(str(d / "s.sock"), {"cmd": "status"}), 10, "the job to end")
        time.sleep(3.5)                         # a last frame, then a scrape of it
        expr = 'jobprobe_cgroup_cpu_user_seconds_total{job="promjob"} + jobprobe_cgroup_cpu_system_seconds_total'
        got = prom.query(expr + '{job="promjob"}')
        assert len(got) == 1
        got_s = float(got[0]["value"][1])
        with open(d / "out" / "promjob.mpk", "rb") as f:
            frames_ns = sum(fr["probes"]["cgroup"]["cpu_user_ns"] + fr["probes"]["cgroup"]["cpu_system_ns"]
                            for fr in StreamReader(f) if fr["kind"] == "sample" and "cgroup" in fr["probes"]
                            and isinstance(fr["probes"]["cgroup"], dict))
        print(f"prometheus: CPU {got_s:.4f} s; frames {frames_ns / 1e9:.4f} s; cgroup cpu.stat {want_ns / 1e9:.4f} s")
        assert abs(got_s - frames_ns / 1e9) < 1e-6
        assert abs(got_s - want_ns / 1e9) <= 0.02 * want_ns / 1e9
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        agent.terminate()
        agent.wait(timeout=60)
        prom.close()


def test_metrics_follow_the_declared_fields_and_cardinality_is_capped():
    """Frames written here to a PromSink; its /metrics read back with prometheus-client's own parser: counters
    summed in base units, a log2 histogram as cumulative buckets, per-GPU labels, top-N lists never labels, jobs
    over the cap counted, not exposed."""
    from prometheus_client.parser import text_string_to_metric_families

    from jobprobe.core.metrics import metric_name
    from jobprobe.exporters.prometheus import PromSink
    assert metric_name("sched", "runq_lat_us_log2", "histogram") == ("jobprobe_sched_runq_lat_seconds", 1e-6)
    assert metric_name("gpu", "gpus[].energy_mj", "counter") == ("jobprobe_gpu_energy_joules_total", 1e-3)
    port = free_port()
    sink = PromSink(f"127.0.0.1:{port}", max_jobs=2)
    schema = {"cgroup": {"cpu_user_ns": {"type": "int", "unit": "ns", "kind": "counter"},
                         "mem_bytes": {"type": "int", "unit": "bytes", "kind": "gauge"}},
              "sched": {"runq_lat_us_log2": {"type": "list[int]", "unit": "count", "kind": "histogram"}},
              "net": {"top_peers": {"type": "list[map]", "unit": "—", "kind": "info"}},
              "gpu": {"gpus": {"type": "list[map]", "unit": "—", "kind": "info"},
                      "gpus[].util_gpu_pct": {"type": "int", "unit": "%", "kind": "gauge"}}}
    try:
        for job in ("a", "b", "c"):
            handle = sink.for_job(job)
            handle.write({"kind": "hello", "node": "n", "job": job, "schema": schema}, b"")
            for i in range(3):
                handle.write({"kind": "sample", "node": "n", "job": job, "probes": {
                    "cgroup": {"cpu_user_ns": 500_000_000, "mem_bytes": 1000 + i},
                    "sched": {"runq_lat_us_log2": [1, 0, 2] if i else [1]},
                    "net": {"top_peers": [{"addr": "10.0.0.1", "port": 80, "tx_bytes": 5, "rx_bytes": 6}]},
                    "gpu": {"gpus": [{"index": 0, "util_gpu_pct": 40 + i}, {"index": 1, "util_gpu_pct": 7}]}}}, b"")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    a = (("job", "a"), ("node", "n"))
    assert samples[("jobprobe_cgroup_cpu_user_seconds_total", a)] == 1.5
    assert samples[("jobprobe_cgroup_mem_bytes", a)] == 1002
    assert samples[("jobprobe_gpu_util_gpu_pct", (("gpu", "0"), *a))] == 42
    assert samples[("jobprobe_gpu_util_gpu_pct", (("gpu", "1"), *a))] == 7
    buckets = {dict(lbl)["le"]: v for (n, lbl), v in samples.items()
               if n == "jobprobe_sched_runq_lat_seconds_bucket" and dict(lbl)["job"] == "a"}
    assert buckets == {"2e-06": 3, "4e-06": 3, "8e-06": 7, "+Inf": 7}
    assert not any("peer" in n or "addr" in dict(lbl) for n, lbl in samples)
    assert {dict(lbl)["job"] for n, lbl in samples if "job" in dict(lbl)} == {"a", "b"}
    assert samples[("jobprobe_exporter_jobs_over_cap", ())] == 1


def test_a_jobs_owner_labels_are_on_every_series_escaped_and_only_the_allowed_ones():
    """Chargeback and per-team dashboards group by owner: each series of a job carries its allow-listed labels
    (here user and account; its `secret` label is not), a value with quotes, a newline and `}` escaped (read back
    with prometheus-client's own parser), a job without them has them empty, and a name that is no label of its
    own is refused in one line."""
    from prometheus_client.parser import text_string_to_metric_families

    from jobprobe.core.errors import BadInput
    from jobprobe.exporters.prometheus import PromSink, owner_names
    port = free_port()
    sink = PromSink(f"127.0.0.1:{port}", owner=owner_names("user,account"))
    schema = {"cgroup": {"cpu_user_ns": {"type": "int", "unit": "ns", "kind": "counter"},
                         "mem_bytes": {"type": "int", "unit": "bytes", "kind": "gauge"}}}
    hostile = 'o"brien\n} x{y="z'
    try:
        for job, labels in (("a", {"user": hostile, "account": "ml-team", "secret": "s3"}), ("b", {})):
            h = sink.for_job(job)
            h.write({"kind": "hello", "node": "n", "job": job, "schema": schema,
                     **({"labels": labels} if labels else {})},
                    b"")
            h.write({"kind": "sample", "node": "n", "job": job, "probes": {"cgroup": {"cpu_user_ns": 10 ** 9,
                                                                                     "mem_bytes": 7}},
                     **({"labels": labels} if labels else {})}, b"")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    series = [s for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name.startswith("jobprobe_cgroup")]
    assert len(series) == 4
    for s in series:
        want = {"user": hostile, "account": "ml-team"} if s.labels["job"] == "a" else {"user": "", "account": ""}
        assert {k: s.labels[k] for k in ("user", "account")} == want and "secret" not in s.labels, s
    for bad in ("job", "__name", "9x", "a-b", "le"):
        with pytest.raises(BadInput):
            owner_names(bad)


@pytest.mark.kernel
def test_a_probe_switched_on_while_the_job_runs_is_in_metrics_with_help_from_its_declarations(make_cgroup, tmp_path):
    """The real agent with /metrics: a job attached with `cgroup` only, then `+pressure` asked of it at run time —
    its hello never named pressure — has its pressure series from the next ticks, and each HELP line is the field's
    declared meaning (Probe.fields), not its name."""

    from prometheus_client.parser import text_string_to_metric_families

    from jobprobe.node.config import Config
    from jobprobe.node.control import call
    from jobprobe.node.registry import all_probes
    port = free_port()
    cfg = Config(interval=0.25, probes="cgroup", socket=str(tmp_path / "a.sock"), state=str(tmp_path / "jobs.json"),
                 prometheus=f"127.0.0.1:{port}")
    cg = make_cgroup()
    job = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: (cg.path / "cgroup.procs").write_text(str(os.getpid())))

    def families():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}
    try:
        with serving_agent(cfg):
            assert call(cfg.socket, {"cmd": "attach", "cgroup": str(cg.path), "job": "j"}, timeout=60)["ok"]
            until(lambda: "jobprobe_cgroup_mem_bytes" in families(), 10, "the job's cgroup series")
            assert not any(n.startswith("jobprobe_pressure") for n in families())
            r = call(cfg.socket, {"cmd": "probes", "job": "j", "toggle": "+pressure"}, timeout=60)
            assert r["probes"]["pressure"] == "ok", r
            fams = until(lambda: (f := families()) and any(n.startswith("jobprobe_pressure") for n in f) and f, 10,
                         "the pressure series after +pressure")
    finally:
        job.kill()
        job.wait()
    meaning = all_probes()["cgroup"].fields["mem_bytes"].meaning
    assert fams["jobprobe_cgroup_mem_bytes"].documentation.startswith(meaning), fams["jobprobe_cgroup_mem_bytes"]
    pressure = [f for n, f in fams.items() if n.startswith("jobprobe_pressure")]
    declared = {f.meaning for f in all_probes()["pressure"].fields.values()}
    assert pressure and all(f.documentation.split(" [pressure.")[0] in declared for f in pressure), pressure
    assert all(s.labels["job"] == "j" for f in pressure for s in f.samples)
