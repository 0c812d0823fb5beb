# SPDX-License-Identifier: Apache-2.0
"""The overhead kit: statistics on synthetic series with known answers, and end to end on a tiny job."""
import contextlib
import io
import json
import math
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import workload
from jobprobe.bench.overhead import OverheadBench, config_probes, markdown
from jobprobe.bench.stats import Series, estimate, median, t975


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(30) == 2.042
    assert abs(t975(60) - 2.000) < 2e-3 and abs(t975(120) - 1.980) < 2e-3 and abs(t975(10 ** 6) - 1.96) < 1e-3


def test_estimate_known_answer():
    # slowdowns 1%, 2%, 3%: mean 2%, sd 1%, half-width t(2) * 1% / sqrt(3)
    e = estimate([0.01, 0.02, 0.03])
    half = 4.303 * 0.01 / math.sqrt(3)
    assert e.n == 3 and math.isclose(e.mean, 0.02) and math.isclose(e.lo, 0.02 - half)
    assert math.isclose(e.hi, 0.02 + half)
    assert estimate([0.05]).lo == -math.inf and math.isnan(estimate([]).mean)


def test_paired_series_recovers_a_known_slowdown_under_drift():
    """A machine that drifts slower over time, and a collector that adds exactly 2%: pairs cancel the drift."""
    rng = random.Random(7)
    s = Series("x")
    for i in range(200):
        base = 10.0 * (1 + 0.002 * i) * (1 + rng.gauss(0, 0.01))
        s.add(base, base * 1.02 * (1 + rng.gauss(0, 0.01)))
    e = s.estimate()
    assert e.lo < 0.02 < e.hi and e.hi - e.lo < 0.006


def test_interval_covers_the_truth_about_95_percent_of_the_time():
    rng = random.Random(3)
    hits = 0
    for _ in range(400):
        e = estimate([rng.gauss(0.01, 0.02) for _ in range(8)])
        hits += e.lo <= 0.01 <= e.hi
    assert 0.92 <= hits / 400 <= 0.98


def test_stop_rule_last_three_within_half_a_point():
    s = Series("x")
    for b, w in [(10, 10.5), (10, 10.0), (10, 10.1)]:
        s.add(b, w)
    # estimates: 5%, 2.5%, 2% → spread 3 pp: not settled
    assert not s.settled()
    s.add(10, 10.1)       # 1.75%: last three 2.5, 2.0, 1.75 → 0.75 pp
    assert not s.settled()
    s.add(10, 10.15)      # 1.7%: last three 2.0, 1.75, 1.7 → 0.3 pp
    assert s.settled() and not s.settled(tol=0.001)
    # the running mean holds still, but the interval is still ±several points: not precise enough
    assert not s.settled(precision=0.005) and s.settled(precision=0.2)
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5


@pytest.mark.parametrize("config,spec", [("std", None), ("std+pystacks", "+pystacks"),
                                         ("std+pystacks-perf", "+pystacks,-perf"), ("sched", "sched"),
                                         ("cgroup,perf", "cgroup,perf")])
def test_config_names(config, spec):
    assert config_probes(config) == spec


def test_markdown_tables_have_the_seed_shape():
    res = {"command": ["job"], "interval": 1.0, "runs": 4, "stopped_by": "run budget", "minutes": 1.0,
           "job_seconds_median": 10.0, "node": "n", "kernel": "k", "cpus": 2,
           "configs": {"std": {"probes": "standard", "pairs": 2, "slowdown": 0.0037, "lo": -0.0004, "hi": 0.0078,
                               "settled": False, "collector_cores": 0.0012, "collector_peak_bytes": 20 << 20,
                               "collector_written_bps": 600, "job_memory_added_bytes": 0, "network_sent_bps": 0}}}
    md = markdown(res)
    assert "| std | +0.37% | -0.04 to +0.78 | 2 | no |" in md
    assert "| std | 0.0012 cores | 0.0000 cores | 20 MiB | none | 0 B/s | 0.59 KiB/s |" in md


@pytest.mark.serial
@pytest.mark.kernel
def test_kit_end_to_end_on_a_tiny_job(tmp_path):
    """Two configs, a small budget: every run happens, pairs are counted, the collector's cost is read from its
    own frames, and the JSON and markdown outputs agree."""
    progress = io.StringIO()
    bench = OverheadBench(workload("burn", 0.3), ["std", "cgroup"], interval=0.2, max_runs=8, warmup=1, seed=5,
                          workdir=str(tmp_path), progress=progress)
    res = bench.run()
    assert res["runs"] == 8 and res["stopped_by"].startswith("run budget")
    for c in ("std", "cgroup"):
        r = res["configs"][c]
        assert r["pairs"] == 2 and len(r["seconds_with"]) == 2
        assert all(0.25 < t < 5 for t in r["seconds_with"] + r["seconds_without"])
        assert 0 <= r["collector_cores"] < 0.5 and r["collector_peak_bytes"] > 5 << 20
        assert r["collector_cores_all"] >= r["collector_cores"] * 0.5     # its own CPU (and its loaders')
        assert r["collector_written_bps"] > 0
    assert progress.getvalue().count("runs") == 4          # a progress line per pair
    assert not list(tmp_path.glob("*.mpk"))                # frame files are removed after reading


@pytest.mark.kernel
def test_cli_bench_writes_json_and_markdown(tmp_path):
    j, m = tmp_path / "r.json", tmp_path / "r.md"
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "bench", "overhead", "--config", "cgroup",
                          "--max-runs", "2", "--warmup", "0", "--interval", "0.2", "--json", j, "--markdown", m,
                          "--", *workload("burn", 0.2)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(j.read_text())
    assert data["configs"]["cgroup"]["pairs"] == 1
    assert m.read_text().strip() in res.stdout
    bad = subprocess.run([sys.executable, "-m", "jobprobe.cli", "bench", "overhead", "--config", "nope", "--",
                          "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown probe 'nope'" in bad.stderr


@pytest.mark.serial
@pytest.mark.kernel
def test_peers_measures_both_collectors_on_the_same_job(tmp_path):
    """node_exporter (the peer, a real server on loopback) is scraped once per interval while jobprobe runs."""
    from jobprobe.bench.peers import markdown as peers_md
    from jobprobe.bench.peers import run_peers
    res = run_peers(workload("burn", 1.5), 0.25, tmp_path)
    j, n = res["jobprobe"], res["node_exporter"]
    assert 1.2 < res["seconds"] < 10
    assert abs(n["scrapes"] - res["seconds"] / 0.25) <= 2          # one scrape per interval
    assert n["failed_scrapes"] == 0     # (one cut short as the peer stopped, a thread's exception, before the join)
    assert n["scraped_bps"] > 1000 and n["peak_bytes"] > 1 << 20 and n["cores"] > 0
    assert 0 <= j["cores"] < 0.5 and j["peak_bytes"] > 5 << 20 and j["written_bps"] > 0
    assert "| node_exporter, scraped every 0.25 s |" in peers_md(res)


@pytest.mark.serial
@pytest.mark.kernel
def test_events_bench_end_to_end_with_the_peer(tmp_path):
    """`bench events` on a small pingpong: our probe watching the job, watching another job, and bcc's runqlat,
    each timed and each program's runs and ns taken from the kernel's bpf_stats. The programs ran on every switch
    of the workload (its own getrusage count is the reference)."""
    from jobprobe.bench.events import bench_events
    from jobprobe.bench.events import markdown as events_markdown
    res = bench_events("sched", rounds=1, n=2000, peer=True, seed=3, workdir=tmp_path)
    print(events_markdown(res))
    assert set(res["modes"]) == {"sched", "sched, other job", "runqlat-bpfcc"}
    switches = res["events_per_run"]
    assert switches >= 2000              # a round trip blocks at least one side (mostly both: ~4 switches)
    for mode, r in res["modes"].items():
        progs = r["programs"]
        switch = next(p for name, p in progs.items() if "switch" in name)
        # (measured over one more run of the workload, whose switches vary a little from the timed ones)
        assert switch["runs"] >= 0.9 * switches and switch["ns_per_run"] > 0, (mode, progs)
        assert math.isfinite(r["added_ns"]) and r["ratio"] > 0
    text = events_markdown(res)
    assert "| sched, other job |" in text and "| runqlat-bpfcc |" in text


def test_deep_trace_configs_and_the_traced_share(tmp_path):
    from jobprobe.bench.overhead import config_options, traced_share
    from jobprobe.core.errors import BadInput
    assert config_options("std", tmp_path) == ("std", [])
    assert config_options("std@rules", tmp_path) == ("std", ["--rules", "default", "--trace-dir",
                                                             str(tmp_path / "traces")])
    base, argv = config_options("std+pystacks@fire=18", tmp_path)
    assert base == "std+pystacks" and argv[0] == "--rules" and "trace_s = 18" in open(argv[1]).read()
    assert config_options("cgroup@every=40", tmp_path)[1][:2] == ["--trace-every", "40"]
    with pytest.raises(BadInput, match="unknown option @often"):
        config_options("std@often", tmp_path)
    samples = [{"kind": "sample", "t": 100.0 + i, "dt": 1.0} for i in range(1, 101)]     # the run: 100 … 200
    windows = [{"kind": "trace", "start": 110.0, "duration_s": 25.0},
               {"kind": "trace", "start": 190.0, "duration_s": 25.0}]                  # the second cut at 200
    assert traced_share(samples + windows) == pytest.approx(35 / 100)


@pytest.mark.serial
@pytest.mark.kernel
def test_the_kit_measures_a_run_traced_on_a_schedule(tmp_path):
    """`cgroup@every=1`: a 25 s window opens 1 s into a 4 s job and is cut short at its end — about 3 s of 4
    traced, read from the run's own `trace` frames; the window's file is written."""
    bench = OverheadBench(workload("burn", 4), ["cgroup@every=1"], max_runs=2, warmup=0, seed=1,
                          workdir=str(tmp_path), progress=None)
    r = bench.run()["configs"]["cgroup@every=1"]
    assert r["options"][:2] == ["--trace-every", "1"] and 0.45 < r["traced_share"] < 0.95, r
    assert list((tmp_path / "traces").glob("*.trace.json.gz"))


# ---- scratch files: a private directory of the kit's own, removed at the end ---------------------------------------
BENCH = Path(__file__).resolve().parents[1] / "jobprobe" / "bench"


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """The temp directory for this test alone (another process's scratch at the same moment is not counted), with
    a umask that would make anything readable to all."""
    import tempfile
    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    old = os.umask(0)
    yield where
    os.umask(old)


def test_scratch_is_private_unguessable_and_removed_whatever_the_end(temp_dir, tmp_path):
    from jobprobe.bench.overhead import scratch
    names = []
    for fail in (False, True):
        with contextlib.suppress(RuntimeError), scratch(None, "jobprobe-bench-") as work:
            names.append(work.name)
            assert work.parent == temp_dir and stat.S_IMODE(work.stat().st_mode) == 0o700
            (work / "sub").mkdir()
            (work / "sub" / "run-0.mpk").write_bytes(b"x")
            if fail:
                raise RuntimeError("the kit failed half-way")
        assert list(temp_dir.iterdir()) == []
    assert names[0] != names[1] and not any(str(os.getpid()) in n for n in names)
    given = tmp_path / "mine"
    with scratch(given, "jobprobe-bench-") as work:           # the caller's directory: used, and left
        assert work == given and given.is_dir()
    assert given.is_dir()


def test_no_bench_module_builds_a_predictable_temp_path():
    """The kit runs as root: a fixed or pid-named path in a world-writable directory is a link another user
    plants first."""
    for src in sorted(BENCH.glob("*.py")):
        text = src.read_text()
        assert '"/tmp/' not in text and "f\"/tmp" not in text and "gettempdir()" not in text, src.name


@pytest.mark.kernel
def test_the_kit_leaves_nothing_in_the_temp_directory(temp_dir):
    """Without --workdir the kit's frames, logs and rule files live in a scratch directory, gone when it ends —
    after a run that worked and after a job that failed (whose output is then in the error itself)."""
    from jobprobe.core.errors import BadInput
    bench = OverheadBench(workload("burn", 0.2), ["cgroup@fire"], interval=0.2, max_runs=2, warmup=0, seed=1,
                          progress=None)
    assert bench.run()["configs"]["cgroup@fire"]["pairs"] == 1
    assert list(temp_dir.iterdir()) == []
    bad = OverheadBench([sys.executable, "-c", "import sys; print('the job broke'); sys.exit(3)"], ["cgroup"],
                        max_runs=2, warmup=1, progress=None)
    with pytest.raises(BadInput, match="exited with code 3.*the job broke"):
        bad.run()
    assert list(temp_dir.iterdir()) == []


@pytest.mark.kernel
def test_the_idle_bench_measures_the_agent_beside_node_exporter_in_the_same_windows(tmp_path):
    """`jobprobe bench idle` end to end, small: per case both processes' cores and RSS, each case in every run (the
    order alternating), and the agent's cost per added idle job; bad arguments are one line and exit 2. The figures
    themselves are the bench's to report (docs/PERFORMANCE.md), not this test's."""
    j = tmp_path / "idle.json"
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "bench", "idle", "--jobs", "1,3", "--busy", "2",
                          "--runs", "2", "--seconds", "1.5", "--settle", "1", "--json", j],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(j.read_text())
    assert [list(run) for run in data["runs"]] == [["idle 1", "idle 3", "busy 2"], ["idle 3", "idle 1", "busy 2"]]
    for run in data["runs"]:
        for w in run.values():
            assert w["agent"]["cores"] > 0 and w["node_exporter"]["cores"] > 0, w
            assert 10 << 20 < w["agent"]["rss_bytes"] < 200 << 20 and w["node_exporter"]["rss_bytes"] > 1 << 20, w
    t = data["table"]
    assert set(t) == {"idle 1", "idle 3", "busy 2", "agent_cores_per_idle_job"}
    assert t["idle 1"]["agent"]["cores_range"][0] <= t["idle 1"]["agent"]["cores"] <= \
        t["idle 1"]["agent"]["cores_range"][1]
    assert "| idle 3 |" in res.stdout and "cost per added idle job" in res.stdout
    for bad, needle in ((["--jobs", "1,x"], "--jobs"), (["--runs", "0"], "--runs"), (["--busy", "999"], "--busy")):
        r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "bench", "idle", *bad], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
