# SPDX-License-Identifier: Apache-2.0
"""Unit tier: `jobprobe bench stragglers`' arithmetic (the runs themselves need the real DDP job: the same harness
tests/test_stragglers.py runs in CI) — percentiles, precision and recall over made trials, and its bad input."""
import subprocess
import sys

from jobprobe.bench.stragglers import markdown, percentile, summarize


def t(fault, detected, latency=None, cause=True, false=0):
    return {"fault": fault, "detected": detected, "latency_s": latency, "right_cause": detected and cause,
            "false_names": false}


def test_percentiles_interpolate_and_an_empty_list_has_none():
    assert percentile([], 50) is None
    assert percentile([4.0], 90) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.1
    assert percentile([10.0, 1.0, 5.0], 50) == 5.0


def test_precision_counts_false_names_and_recall_leaves_the_balanced_job_out():
    trials = [t("cpu", True, 9.0), t("cpu", True, 11.0), t("cpu", False), t("loss", True, 13.0, cause=False),
              t("balanced", False, false=1), t("balanced", False)]
    trials[1]["flaps"] = 1                                 # named again within its fault (ended too soon)
    res = summarize(trials, 3)
    assert res["recall"] == 3 / 4                         # 4 faulty trials, 3 named
    assert res["precision"] == 3 / 4                      # 3 right names, 1 false (on the balanced job)
    assert res["rows"]["cpu"]["detected"] == 2 and res["rows"]["cpu"]["p50_s"] == 10.0
    assert res["rows"]["loss"]["right_cause"] == 0 and res["rows"]["balanced"]["false_names"] == 1
    md = markdown(res)
    assert "| cpu: CPU limit" in md and "| 3 | 2 | 2 | 10.0 / 10.8 s | 0 | 1 |" in md and "recall 0.75" in md


def test_an_unknown_fault_is_a_one_line_error_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "jobprobe.cli", "bench", "stragglers", "--only", "cpu,meteor"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "unknown fault 'meteor'" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p
