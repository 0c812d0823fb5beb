# SPDX-License-Identifier: Apache-2.0
"""A job's cost from the controller's store and a price file (jobprobe/cluster/cost.py): frames of a job made here
on four
simulated nodes — one revoked mid-run (the controller's node_lost, then the job restarting on another node), one
GPU idle for 10 s, a waiting rule on another — stored in a real store; the summary equals the figures computed by
hand from those frames; a price file with an error is refused with its line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobprobe.cluster import cost
from jobprobe.cluster.store import Store
from jobprobe.core.errors import BadInput

REPO = Path(__file__).resolve().parents[1]
PRICES = """currency = "EUR"
electricity_per_kwh = 0.2
idle_gpu_util_pct = 10

[[node]]
name = "spot-a100"
label = "market=spot"
market = "spot"
per_hour = 12.0
gpus = 8

[[node]]
name = "h100"
gpu = "NVIDIA H100*"
per_hour = 36.0
gpus = 8
"""


def sample(node, run, t, seq, util=90, labels=None, gpu_name="NVIDIA H100 80GB HBM3"):
    gpus = [{"index": i, "name": gpu_name, "util_gpu_pct": util, "job_energy_mj": 100_000.0} for i in range(2)]
    f = {"v": 1, "kind": "sample", "node": node, "job": "train", "run": run, "seq": seq, "t": t, "dt": 1.0,
         "probes": {"gpu": {"gpus": gpus}, "energy": {"cpu_energy_j": 50.0, "dram_energy_j": 5.0}}}
    if labels:
        f["labels"] = labels
    return f


def event(node, t, seq, name, **body):
    return {"v": 1, "kind": "event", "node": node, "job": "train", "run": "controller", "seq": seq, "t": t, "dt": 0.0,
            "event": name, **body}


@pytest.fixture
def store(tmp_path):
    st = Store(tmp_path / "store.db")
    frames = []
    for node in ("a", "b"):
        frames += [sample(node, "r1", 1000.0 + i, i, util=5 if node == "b" and 10 <= i < 20 else 90) for i in range(60)]
    frames += [sample("c", "r1", 1000.0 + i, i, labels={"market": "spot"}, gpu_name="NVIDIA A100-SXM4-80GB")
               for i in range(30)]
    frames += [sample("d", "r2", 1040.0 + i, i) for i in range(20)]                 # the restart, elsewhere
    frames += [event("c", 1033.0, 0, "node_lost", silent_s=3.0),
               {**event("a", 1020.0, 0, "rule", rule="gpu_idle_cpu_busy"), "run": "r1x"},
               {**event("a", 1030.0, 1, "rule_end", rule="gpu_idle_cpu_busy"), "run": "r1x"}]
    st.add(frames)
    yield st
    st.close()


def test_the_summary_equals_the_figures_computed_from_the_frames(store, tmp_path):
    (tmp_path / "p.toml").write_text(PRICES)
    s = cost.summary(store, "train", cost.load(str(tmp_path / "p.toml")))
    h = 1 / 3600
    node_s = {"a": 60, "b": 60, "c": 30, "d": 20}
    assert s["node_hours"] == pytest.approx(170 * h) and s["gpu_hours"] == pytest.approx(2 * 170 * h)
    assert s["idle_gpu_hours"] == pytest.approx(2 * 10 * h)                   # node b, 10 s, both GPUs
    assert s["waiting_gpu_hours"] == pytest.approx(2 * 11 * h)                # node a, the rule's 1020…1030
    assert s["revoked_node_hours"] == pytest.approx(30 * h)                   # node c's run, then r2 went on
    joules = {n: sec * (55 + 2 * 100) for n, sec in node_s.items()}            # CPU+DRAM 55 J/s, 2 GPUs × 100 J/s
    assert s["energy_kwh"] == pytest.approx(sum(joules.values()) / 3.6e6)
    per_hour = {"a": 36.0, "b": 36.0, "c": 12.0, "d": 36.0}
    node_cost = sum(node_s[n] * h * per_hour[n] for n in node_s)
    energy_cost = sum(joules.values()) / 3.6e6 * 0.2
    assert s["node_cost"] == pytest.approx(node_cost) and s["energy_cost"] == pytest.approx(energy_cost)
    assert s["cost"] == pytest.approx(node_cost + energy_cost) and s["currency"] == "EUR"
    assert s["cost_per_hour"] == pytest.approx((node_cost + energy_cost) / (60 * h))     # the run: 999 … 1059
    assert s["idle_gpu_cost"] == pytest.approx(2 * 10 * h * 36 / 8)
    assert s["revoked_cost"] == pytest.approx(30 * h * 12.0)
    assert (s["nodes"]["c"]["price"], s["nodes"]["c"]["market"]) == ("spot-a100", "spot")
    assert s["unpriced_nodes"] == []
    print(cost.text(s))


def test_the_meter_for_prometheus_counts_the_same(store, tmp_path):
    (tmp_path / "p.toml").write_text(PRICES)
    m = cost.Meter(cost.load(str(tmp_path / "p.toml")))
    _, rows = store.sql("SELECT body FROM frames ORDER BY t")
    for (body,) in rows:
        m.add(json.loads(body))
    s = cost.summary(store, "train", m.prices)
    assert m.energy["train"] == pytest.approx(s["energy_kwh"] * 3.6e6) and m.cost["train"] == pytest.approx(s["cost"])


@pytest.mark.parametrize("body,said", [
    ('[[node]]\nname = "x"\nper_hour = -1\n', "line 3: [[node]] needs per_hour"),
    ('currency = "USD"\n\n[[node]]\nper_hour = 1\ncolour = "red"\n', "line 5: unknown key 'colour'"),
    ('[[node]]\nper_hour = 1\nmarket = "cheap"\n', "line 3: market must be spot or on_demand"),
    ('[[node]]\nper_hour = = 1\n', "line 2"),
])
def test_a_price_file_with_an_error_is_refused_with_its_line(tmp_path, body, said):
    (tmp_path / "p.toml").write_text(body)
    with pytest.raises(BadInput, match=said.replace("[", r"\[").replace("]", r"\]")):
        cost.load(str(tmp_path / "p.toml"))
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "query", "--store", str(tmp_path / "none.db"),
                        "--job", "j", "--summary", "--prices", str(tmp_path / "p.toml")], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_query_summary_and_the_report_show_the_cost(store, tmp_path):
    (tmp_path / "p.toml").write_text(PRICES)
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "query", "--store", store.path, "--job", "train",
                        "--summary", "--prices", str(tmp_path / "p.toml")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    s = cost.summary(store, "train", cost.load(str(tmp_path / "p.toml")))
    assert f"cost            {s['cost']:,.2f} EUR" in r.stdout and "revoked 0.008 node-h" in r.stdout
    pytest.importorskip("matplotlib", reason="the report's plots: installed by make test")
    out = tmp_path / "r.html"
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "report", "--store", store.path, "--job", "train",
                        "--prices", str(tmp_path / "p.toml"), "-o", str(out)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert page.index("id='cost'") < page.index('id="verdict"') and f"Cost: {s['cost']:,.2f} EUR" in page


def test_the_controllers_metrics_carry_each_jobs_cost_and_energy(store, tmp_path):
    pytest.importorskip("prometheus_client", reason="installed by make test")
    from prometheus_client import CollectorRegistry, generate_latest

    from jobprobe.cluster.controller import Controller
    from jobprobe.cluster.metrics import MetricsCollector
    (tmp_path / "p.toml").write_text(PRICES)
    ctl = Controller(Store(tmp_path / "ctl.db"), "nats://127.0.0.1:1", prices=str(tmp_path / "p.toml"))
    _, rows = store.sql("SELECT body FROM frames ORDER BY t")
    for (body,) in rows:
        ctl.meter.add(json.loads(body))
    reg = CollectorRegistry()
    reg.register(MetricsCollector(ctl))
    text = generate_latest(reg).decode()
    s = cost.summary(store, "train", ctl.meter.prices)
    got = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("jobprobe_job_")}
    assert got["jobprobe_job_cost_total"] == pytest.approx(s["cost"])
    assert got["jobprobe_job_energy_joules_total"] == pytest.approx(s["energy_kwh"] * 3.6e6)
    assert 'jobprobe_job_cost_total{currency="EUR",job="train"}' in text
