"""Deep-trace windows (jobprobe/tracewin.py): a rule with `action = "trace"` and a request both write one
Chrome/Perfetto trace (Trace Event Format, gzipped JSON) — checked here as a viewer would read it: every event well
formed, begin/end balanced per thread, the job's own processes (by the PIDs the job itself reports) with the
functions the job is known to run, the kernel's counters beside them, the rule's evidence as an instant event.
The budget — one window at a time, cooldown, the duty cap — on a clock driven by the test."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import until

from jobprobe.frame import StreamReader
from jobprobe.tracewin import Tracer

REPO = Path(__file__).resolve().parents[1]

JOB = r'''
import multiprocessing as mp, os, sys, time

def stalling_worker(seconds):
    end = time.time() + seconds
    while time.time() < end:
        x = sum(i * i for i in range(20000))
        time.sleep(0.01)

def busy_main_loop(seconds):
    end = time.time() + seconds
    x = 0
    while time.time() < end:
        x += 1

if __name__ == "__main__":
    mp.set_start_method("fork")
    w = mp.Process(target=stalling_worker, args=(float(sys.argv[2]),))
    w.start()
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {w.pid}")
    busy_main_loop(float(sys.argv[2]))
    w.join()
'''


def check_trace(path: str, pids: set[int], functions: set[str]) -> dict:
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    assert events and doc["otherData"]["tool"] == "jobprobe"
    depth: dict[tuple, int] = {}
    for e in sorted(events, key=lambda e: e.get("ts", -1)):      # as a viewer orders them
        assert e["ph"] in ("B", "E", "X", "i", "C", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] in ("B", "E"):
            k = (e["pid"], e["tid"])
            depth[k] = depth.get(k, 0) + (1 if e["ph"] == "B" else -1)
            assert depth[k] >= 0, ("an end before its begin", e)
    seen_pids = {e["pid"] for e in events if e["ph"] in ("B", "E")}
    names = {e["name"] for e in events if e["ph"] == "B"}
    assert seen_pids and seen_pids <= pids, (seen_pids, pids)
    assert functions <= names, (functions, sorted(names)[:20])
    assert any(e["ph"] == "C" and e["name"] == "CPU cores" for e in events)
    assert [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    return doc


@pytest.mark.kernel
def test_a_rule_opens_a_window_and_its_trace_shows_the_jobs_python(tmp_path):
    rules = tmp_path / "r.toml"
    rules.write_text('[[rule]]\nname = "busy"\nsummary = "the job is busy"\n'
                     'when = "rate(cgroup.cpu_user_ns) / 1e9 > 0.3"\nwindow = 2\nhold = 0\ncooldown = 100\n'
                     'action = "trace"\ntrace_s = 3\n')
    (tmp_path / "job.py").write_text(JOB)
    pids_file = tmp_path / "pids"
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--rules", str(rules), "--trace-dir",
                        str(tmp_path / "traces"), "--probes", "cgroup,sched", "--stdout", "json", "--",
                        sys.executable, str(tmp_path / "job.py"), str(pids_file), "9"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(x) for x in r.stdout.splitlines()]
    fired = [f for f in frames if f["kind"] == "event" and f["event"] == "rule"]
    traces = [f for f in frames if f["kind"] == "trace"]
    assert len(fired) == 1 and fired[0]["trace"].endswith(".trace.json.gz"), fired
    assert len(traces) == 1 and traces[0]["path"] == fired[0]["trace"], traces
    pids = set(map(int, pids_file.read_text().split()))
    doc = check_trace(traces[0]["path"], pids, {"busy_main_loop", "stalling_worker"})
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert marks[0]["args"]["reason"] == "rule busy" and "rate(cgroup.cpu_user_ns)" in marks[0]["args"]["evidence"]
    print(f"trace: {traces[0]['path']}: {traces[0]['events']} events of pids {traces[0]['processes']}")


def test_cooldown_and_the_duty_cap_bound_the_time_traced(tmp_path):
    """A rule that would fire every second for 10 minutes: 25 s windows, no cooldown, 30% duty — the windows
    opened add up to at most 30% of the run (+ one window); with a 60 s cooldown, fewer still."""
    for cooldown in (0, 60):
        now = [0.0]
        tr = Tracer("j", str(tmp_path / f"t{cooldown}"), lambda: [], lambda p: "", lambda p: False, None,
                    cooldown=cooldown, duty=0.30, clock=lambda: now[0])
        opened = 0
        for s in range(600):
            now[0] = float(s)
            opened += tr.open("rule x", {}, 25.0)["ok"] is True
            tr.feed({"kind": "sample", "t": time.time() + 30 if tr.window else 0, "dt": 1.0, "probes": {}})
        tr.close()
        traced = opened * 25
        print(f"trace budget (cooldown {cooldown} s): {opened} windows, {traced} s of 600")
        assert opened >= 2 and traced <= 0.30 * 600 + 25
        if cooldown:
            assert opened <= 600 // (25 + 60) + 1
        refused = tr.open("rule x", {}, 25.0)
        assert refused["ok"] is False and refused["why"]


@pytest.mark.kernel
def test_a_trace_on_request_through_the_agent(tmp_path, make_cgroup):
    from jobprobe.agent import Agent, Config
    from jobprobe.control import ControlServer, call
    cfg = Config(interval=0.5, probes="cgroup,self", out=str(tmp_path / "out"), trace_dir=str(tmp_path / "traces"),
                 socket=str(tmp_path / "run" / "agent.sock"), state=str(tmp_path / "run" / "jobs.json"))
    agent = Agent(cfg)
    server = ControlServer(agent, cfg.socket)
    server.start()
    loop = threading.Thread(target=agent.run, daemon=True)
    loop.start()
    (tmp_path / "job.py").write_text(JOB)
    cg = make_cgroup()
    job = cg.spawn([sys.executable, str(tmp_path / "job.py"), str(tmp_path / "pids"), "12"])
    try:
        until(lambda: (tmp_path / "pids").exists(), 10, "the job to start")
        assert call(cfg.socket, {"cmd": "attach", "cgroup": str(cg.path), "job": "req"})["ok"]
        r = call(cfg.socket, {"cmd": "trace", "job": "req", "duration": 3})
        assert r["ok"] and r["state"] == "tracing", r
        again = call(cfg.socket, {"cmd": "trace", "job": "req", "duration": 3})
        assert again["ok"] is False and "open already" in again["why"]
        bad = call(cfg.socket, {"cmd": "trace", "job": "nosuch"})
        assert not bad["ok"] and "nosuch" in bad["error"]

        def traced():
            with open(Path(cfg.out, "req.mpk"), "rb") as f:
                return [fr for fr in StreamReader(f) if fr["kind"] == "trace"]
        (tr,) = until(traced, 20, "the trace frame")
        pids = set(map(int, (tmp_path / "pids").read_text().split()))
        check_trace(tr["path"], pids, {"busy_main_loop"})
        assert tr["reason"] == "request" and os.path.getsize(tr["path"]) > 0
    finally:
        job.kill()
        job.wait()
        agent.stop_event.set()
        loop.join(timeout=10)
        server.close()
        agent.close()


@pytest.mark.kernel
@pytest.mark.parametrize("stall", [True, False], ids=["stalling", "steady"])
def test_an_input_bound_training_job_fires_input_bound_and_its_trace_shows_where_it_waits(tmp_path, stall):
    """`jobprobe run --rules default` on the reference PyTorch job fed by a DataLoader with two workers. Stalling
    (every 4th batch waits 1.5 s in `slow_storage_read`): input_bound fires and its deep-trace window — cut short
    by the job's end, and written anyway — has the workers waiting in that function. Steady: no rule fires."""
    pytest.importorskip("torch", reason="PyTorch is installed by make test (scripts/setup.sh --torch)")
    args = ["--steps", "56" if stall else "100000", "--batch", "16", "--size", "32", "--width", "16", "--blocks", "2",
            "--threads", "1", "--loader-workers", "2"] + (["--stall-every", "4", "--stall-s", "1.5"] if stall else
                                                             ["--seconds", "19"])
    r = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--rules", "default", "--trace-dir",
                        str(tmp_path / "traces"), "--probes", "cgroup,sched", "--stdout", "json", "--",
                        sys.executable, str(REPO / "scripts" / "train_cpu.py"), *args],
                       capture_output=True, text=True, cwd=REPO, timeout=240)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]    # (the job prints too)
    fired = [f for f in frames if f["kind"] == "event" and f["event"] == "rule"]
    samples = [f for f in frames if f["kind"] == "sample"]
    print(f"input-bound ({'stalling' if stall else 'steady'}): {len(samples)} s, fired "
          f"{[(f['rule'], f['evidence']) for f in fired]}")
    if not stall:
        assert len(samples) >= 16 and fired == []      # longer than input_bound's window + hold: it could have
        return
    (ib,) = [f for f in fired if f["rule"] == "input_bound"]
    (tr,) = [f for f in frames if f["kind"] == "trace"]
    assert tr["path"] == ib["trace"]
    with gzip.open(tr["path"], "rt") as f:
        doc = json.load(f)
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "B"}
    assert "slow_storage_read" in names, sorted(names)[:30]
    workers = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "B" and e["name"] == "slow_storage_read"}
    assert workers and all(p in tr["processes"] for p in workers)
