# SPDX-License-Identifier: Apache-2.0
"""jobprobe.bench.accuracy: the comparison and the verdict on crafted runs, and the harness on real jobs (kernel)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobprobe.bench import accuracy
from jobprobe.bench.accuracy import Figure, Obs, RunResult, observe, row, sum_frames
from jobprobe.core.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
READ = Figure("blockio.read_bytes", "blockio", ("read_bytes",), "bytes", 0.01, lost=("read_lost_bytes",))
CPU = Figure("cgroup.cpu", "cgroup", ("cpu_user_ns", "cpu_system_ns"), "cpu_ns", 0.02, flags=("exits_uncounted",))


def run(sums: dict, ref: dict, status: dict | None = None) -> RunResult:
    return RunResult(True, sums, status or {p: "ok" for p in sums}, ref)


def test_frames_are_summed_per_probe_and_the_last_status_kept():
    frames = [{"kind": "hello", "probes": {"blockio": "ok", "cgroup": "ok"}},
              {"kind": "sample", "status": {"blockio": "ok"}, "probes": {"blockio": {"read_bytes": 3, "p50": None,
                                                                                      "hist": [1, 2]}}},
              {"kind": "sample", "status": {"blockio": "failed: x"}, "probes": {"blockio": {"read_bytes": 4}}},
              {"kind": "bye"}]
    sums, status = sum_frames(json.dumps(f) for f in frames)
    assert sums == {"blockio": {"read_bytes": 7}}
    assert status == {"blockio": "failed: x", "cgroup": "ok"}


def test_a_figure_exact_to_the_byte_passes():
    obs = observe(READ, run({"blockio": {"read_bytes": 1000, "read_lost_bytes": 0}}, {"bytes": 1000}))
    r = row("dd", READ, [obs] * 3, [])
    assert (r["pass"], r["silent_shortfalls"], r["counted_losses"], r["error_p50"]) == (True, 0, 0, 0.0)


def test_a_silent_shortfall_fails_the_row():
    """5% short, nothing counted as lost: the probe missed bytes and did not say so."""
    good = Obs(1000, 0, 0, 1000)
    short = observe(READ, run({"blockio": {"read_bytes": 950, "read_lost_bytes": 0}}, {"bytes": 1000}))
    assert short.silent(READ.bound) and not short.counted
    r = row("dd", READ, [good, short, good], [])
    assert r["silent_shortfalls"] == 1 and not r["pass"]
    assert r["worst_abs_error"] == pytest.approx(0.05)


def test_a_counted_loss_is_not_silent_and_does_not_fail_the_row():
    """The same 5% short, all of it in read_lost_bytes: missed, but said — listed, added back, not failed."""
    counted = observe(READ, run({"blockio": {"read_bytes": 950, "read_lost_bytes": 50}}, {"bytes": 1000}))
    assert counted.counted and not counted.silent(READ.bound)
    r = row("dd", READ, [Obs(1000, 0, 0, 1000), counted], [])
    assert (r["pass"], r["silent_shortfalls"], r["counted_losses"]) == (True, 0, 1)
    assert r["worst_raw_error"] == pytest.approx(-0.05) and r["worst_abs_error"] == 0.0


def test_a_counted_loss_that_does_not_cover_the_gap_is_still_silent():
    partly = Obs(900, 50, 0, 1000)
    assert partly.counted and partly.silent(0.01)
    assert not row("dd", READ, [partly], [])["pass"]


def test_an_over_count_beyond_the_bound_fails_without_being_a_shortfall():
    over = observe(CPU, run({"cgroup": {"cpu_user_ns": 900, "cpu_system_ns": 200, "exits_uncounted": 0}},
                            {"cpu_ns": 1000}))
    assert over.error == pytest.approx(0.10) and not over.silent(CPU.bound)
    r = row("cpu", CPU, [over], [])
    assert r["silent_shortfalls"] == 0 and not r["pass"]


def test_a_flag_field_counts_a_loss_without_being_added():
    """exits_uncounted is a count of threads, not ns: the run is listed as a counted loss, its figure unchanged."""
    o = observe(CPU, run({"cgroup": {"cpu_user_ns": 1000, "cpu_system_ns": 0, "exits_uncounted": 2}},
                         {"cpu_ns": 1000}))
    assert o.counted and o.error == 0.0


def test_a_probe_not_ok_or_a_field_absent_is_no_observation_and_fails_the_row():
    assert observe(READ, run({"blockio": {"read_bytes": 1}}, {"bytes": 1}, {"blockio": "unavailable: no BTF"})) \
        == "blockio: unavailable: no BTF"
    assert "sent no" in observe(CPU, run({"cgroup": {"cpu_user_ns": 1}}, {"cpu_ns": 1}))
    r = row("cpu", CPU, [Obs(1000, 0, 0, 1000)], ["cgroup sent no cpu_user_ns/cpu_system_ns"])
    assert not r["pass"] and r["missing"] == 1
    assert "runs without the figure" in accuracy.markdown({"load": "none", "runs": 1, "interval": 0.5, "cpus": 2,
                                                           "kernel": "k", "seconds": 1, "rows": [r]})


def test_the_table_has_a_row_per_figure_and_says_fail():
    rows = [row("dd", READ, [Obs(1000, 0, 0, 1000)], []), row("dd", READ, [Obs(900, 0, 0, 1000)], [])]
    md = accuracy.markdown({"load": "cpu", "runs": 1, "interval": 0.5, "cpus": 2, "kernel": "k", "seconds": 1,
                            "rows": rows})
    lines = md.splitlines()
    assert len(lines) == 6 and lines[4].endswith("| pass |") and lines[5].endswith("| FAIL |")
    assert "| -10.000% |" in lines[5]


def test_dd_reference_and_case_selection():
    ref = accuracy.dd_reference("256+0 records in\n256+0 records out\n16777216 bytes (17 MB, 16 MiB) copied, 0.07 s"
                                ", 246 MB/s\n", Path("/nonexistent"))
    assert ref == {"bytes": 16777216, "requests": 256}
    with pytest.raises(ValueError):
        accuracy.dd_reference("dd: error reading\n", Path("/nonexistent"))
    assert [c.name for c in accuracy.select(["dd-read-short,cpu-burn"])] == ["dd-read-short", "cpu-burn"]
    with pytest.raises(BadInput):
        accuracy.select(["nope"])
    with pytest.raises(BadInput):
        accuracy.Load("gpu", Path("/nonexistent"))


CI_CASES = "dd-read-short,dd-read-long,dd-write-short,dd-write-long,cpu-burn"


@pytest.mark.serial
@pytest.mark.kernel
def test_harness_beside_a_cpu_hog_has_no_silent_shortfall(tmp_path):
    """The CLI, 3 runs of the dd short/long read/write cases and the CPU burner beside stress-ng --cpu NCPU: every
    row within its bound, no silent shortfall, exit 0. ~60 s on the 2-vCPU VM."""
    out = tmp_path / "acc.json"
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "bench", "accuracy", "--runs", "3", "--load", "cpu",
                          "--only", CI_CASES, "--json", str(out)], capture_output=True, text=True, timeout=240,
                         cwd=str(ROOT))
    print(res.stdout)
    got = json.loads(out.read_text())
    assert len(got["rows"]) == 13
    for r in got["rows"]:
        assert r["runs"] == 3 and r["missing"] == 0, (r, res.stderr[-2000:])
        assert r["silent_shortfalls"] == 0, r
        assert r["worst_abs_error"] <= r["bound"], r
    assert res.returncode == 0 and got["pass"], res.stderr[-2000:]
