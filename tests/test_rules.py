# SPDX-License-Identifier: Apache-2.0
"""Rules over a job's frames (jobprobe/node/rules.py): the expression language on frames made here, firing with hold,
clear and cooldown, refusal of a bad file with its line; and on a real job — a burner whose cgroup CPU limit
throttles it fires `cpu_throttled` with evidence equal to the kernel's own cpu.stat (that a healthy job fires no
default rule is tests/test_trace.py's steady training job)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import v1_cpu_group, workload
from jobprobe.core.errors import BadInput
from jobprobe.node.rules import RuleSet, compile_expr, load

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {"cgroup": {"cpu_user_ns": {"kind": "counter"}, "cpu_throttled_ns": {"kind": "counter"},
                     "mem_bytes": {"kind": "gauge"}},
          "sched": {"runq_lat_us_log2": {"kind": "histogram"}},
          "gpu": {"gpus": {"kind": "info"}, "gpus[].util_gpu_pct": {"kind": "gauge"},
                  "gpus[].clock_event_reasons": {"kind": "info"}}}


def frames(n: int, t0: float = 1000.0, **over):
    for i in range(n):
        t = t0 + i
        p = {"cgroup": {"cpu_user_ns": 900_000_000, "cpu_throttled_ns": 0, "mem_bytes": 100 + i},
             "sched": {"runq_lat_us_log2": [0, 0, 0, 10]},
             "gpu": {"gpus": [{"util_gpu_pct": 90, "clock_event_reasons": 0}, {"util_gpu_pct": 70,
                                                                                "clock_event_reasons": 0}]}}
        for k, fn in over.items():
            fn(t, p)
        yield {"kind": "sample", "t": t, "dt": 1.0, "probes": p}


def rules_file(tmp_path, body: str) -> str:
    f = tmp_path / "r.toml"
    f.write_text(body)
    return str(f)


def test_expressions_read_the_window_by_each_fields_kind(tmp_path):
    path = rules_file(tmp_path, '''
[[rule]]
name = "all"
when = "rate(cgroup.cpu_user_ns) / 1e9 > 0.89 and cgroup.mem_bytes >= 104.5 and gpu.gpus.util_gpu_pct == 80 and \
p99(sched.runq_lat_us_log2) > 8 and not share(cgroup.cpu_throttled_ns) > 0"
window = 10
hold = 0
''')
    (r,) = load(path)
    rs = RuleSet([r], SCHEMA, "j")
    out = [e for f in frames(12) for e in rs.feed(f)]
    assert [e["event"] for e in out] == ["rule"]
    ev = out[0]["evidence"]
    assert ev["rate(cgroup.cpu_user_ns)"] == 9e8 and ev["cgroup.mem_bytes"] == 104.5   # mean of 100..109
    assert ev["gpu.gpus.util_gpu_pct"] == 80 and 8 < ev["p99(sched.runq_lat_us_log2)"] <= 16


def test_hold_clear_and_cooldown(tmp_path):
    path = rules_file(tmp_path, '''
[[rule]]
name = "thr"
when = "share(cgroup.cpu_throttled_ns) > 0.10"
clear = "share(cgroup.cpu_throttled_ns) < 0.05"
window = 5
hold = 5
clear_after = 3
cooldown = 30
''')
    def throttle(t, p):
        if 1020 <= t < 1040 or 1050 <= t < 1060 or t >= 1100:
            p["cgroup"]["cpu_throttled_ns"] = 600_000_000
    rs = RuleSet(load(path), SCHEMA, "j")
    out = [e for f in frames(140, throttle=throttle) for e in rs.feed(f)]
    got = [(e["event"], e["t"]) for e in out]
    # fires 5 s after the window first holds; ends once the share stayed under 0.05 for 3 s; the burst at 1050
    # falls in the cooldown; the one from 1100 fires again
    assert got[0][0] == "rule" and 1020 + 5 <= got[0][1] <= 1020 + 5 + 1, got
    assert got[1][0] == "rule_end" and 1040 + 3 <= got[1][1] <= 1040 + 5 + 3, got
    assert [g[0] for g in got] == ["rule", "rule_end", "rule"] and got[2][1] >= 1100 + 5, got
    assert out[0]["evidence"]["share(cgroup.cpu_throttled_ns)"] >= 0.1


def test_a_field_the_job_does_not_carry_never_fires():
    (r,) = [x for x in load("default") if x.name == "memory_pressure"]
    rs = RuleSet([r], SCHEMA, "j")
    assert [e for f in frames(30) for e in rs.feed(f)] == []


@pytest.mark.parametrize("body,said", [
    ('[[rule]]\nname = "a"\nwhen = "cgroup.cpu_user_ns >"\n', "line 2: rule 'a': not an expression"),
    ('[[rule]]\nname = "a"\nwhen = "x > 1"\n', "'x' alone is not a field"),
    ('[[rule]]\nname = "a"\nwhen = "__import__(1)"\n', "unknown function"),
    ('[[rule]]\nname = "a"\nwhen = "cgroup.a.b.c > 1"\n', "is not probe.field"),
    ('\n\n[[rule]]\nname = "b"\nwhen = "cgroup.cpu_user_ns > 1"\nwindw = 3\n', "line 4: rule 'b': unknown key 'windw'"),
    ('[[rule]]\nname = "a"\nwhen = "cgroup.x > 1"\naction = "page"\n', "action must be one of"),
    ('[[rule]\nname = "a"\n', "line 1"),
])
def test_a_bad_rule_file_is_refused_with_its_line(tmp_path, body, said):
    with pytest.raises(BadInput, match=said.replace("(", r"\(").replace(")", r"\)")):
        load(rules_file(tmp_path, body))


def test_the_default_rules_compile_and_say_what_they_are():
    rules = load("default")
    assert {r.name for r in rules} >= {"cpu_throttled", "runq_saturation", "memory_pressure", "gpu_idle_cpu_busy",
                                       "input_bound", "gpu_throttled", "gpu_xid"}
    assert all(r.summary and compile_expr(r.when) for r in rules)
    doc = (REPO / "docs" / "RULES.md").read_text()
    assert all(f"`{r.name}`" in doc for r in rules)


def test_the_cli_refuses_a_bad_rules_file_in_one_line(tmp_path):
    bad = rules_file(tmp_path, '[[rule]]\nname = "a"\nwhen = "1 +"\n')
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--rules", bad, "--probes", "self", "--",
                        "true"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "line 2" in r.stderr, r.stderr


@pytest.mark.kernel
@pytest.mark.serial      # its job must get its 0.2-core quota to be throttled half the time: a share of the machine
def test_a_throttled_job_fires_cpu_throttled_with_the_kernels_figures(make_cgroup):
    """(A healthy job under the default rules fires nothing: tests/test_trace.py, the steady training job.)"""
    cg = make_cgroup()
    v1 = v1_cpu_group("rules")
    limit_dir = v1
    try:
        (v1 / "cpu.cfs_period_us").write_text("100000\n")
        (v1 / "cpu.cfs_quota_us").write_text("20000\n")

        def enter():
            (cg.path / "cgroup.procs").write_text(str(os.getpid()))
            (v1 / "cgroup.procs").write_text(str(os.getpid()))
        job = subprocess.Popen(workload("burn", 30), preexec_fn=enter)

        def throttled_ns():
            kv = dict(ln.split() for ln in (limit_dir / "cpu.stat").read_text().splitlines())
            return int(kv.get("throttled_time", 0))
        before, t0 = throttled_ns(), time.time()
        # up to 22 s (the rule's window, then its hold), stopped (SIGINT: its last frame written) once it fired
        run = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "run", "--cgroup", str(cg.path), "--rules",
                                "default", "--probes", "cgroup,sched", "--stdout", "json", "--duration", "22"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        out = []
        for line in run.stdout:
            out.append(json.loads(line))
            if out[-1]["kind"] == "event" and out[-1].get("rule") == "cpu_throttled":
                run.send_signal(signal.SIGINT)
        err = run.stderr.read()
        rc = run.wait(timeout=60)
        wall, after = time.time() - t0, throttled_ns()
        job.kill()
        job.wait()
        assert rc == 0, err
        fired = [f for f in out if f["kind"] == "event" and f["event"] == "rule"]
        thr = [f for f in fired if f["rule"] == "cpu_throttled"]
        assert thr, [f["rule"] for f in fired]
        share = thr[0]["evidence"]["share(cgroup.cpu_throttled_ns)"]
        kernel_share = (after - before) / 1e9 / wall
        print(f"rules: cpu_throttled fired at +{thr[0]['t'] - out[0]['t']:.1f} s, share {share:.3f}; the kernel's "
              f"cpu.stat over the run {kernel_share:.3f}")
        assert share > 0.5 and abs(share - kernel_share) < 0.1
        assert 10 <= thr[0]["t"] - out[0]["t"] <= 22        # a whole window, then the hold
    finally:
        for pid in (v1 / "cgroup.procs").read_text().split():
            os.kill(int(pid), 9)
        time.sleep(0.1)
        v1.rmdir()
