# SPDX-License-Identifier: Apache-2.0
"""The README's five-minute tour runs as written: every command of its node part (probes, run, read, summary, report,
doctor — not the agent, controller, cluster or bench lines, which other tests run) is taken from README.md and run,
with only its placeholders made real — PID 4242 a live process, `system.slice/my.scope` a group holding one, the
report's frame file the one the tour wrote — and the jobs made shorter (`--steps 30` → 3, `--seconds 5` → 1: the
same commands, less of them). Each must succeed (the doctor: pass or warn, its documented codes)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import IS_ROOT

REPO = Path(__file__).resolve().parents[1]
NOT_HERE = {"agent", "attach", "status", "detach", "controller", "query", "trace", "bench", "jobs"}
CLUSTER = ("--slurm-job", "--k8s-pod", "--store", "--job", "--controller")


def tour() -> list[str]:
    """The tour's command lines that run on one node, in order (comments and continuations dropped)."""
    text = REPO.joinpath("README.md").read_text()
    block = text.split("## A five-minute tour", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    out, inside = [], False
    for line in block.splitlines():
        # a command continued on the next lines (a backslash, an open quote): none of the node part's
        continued = line.split("  #")[0].rstrip().endswith("\\") or line.count('"') % 2 == 1
        if inside or continued or not line.startswith("jobprobe "):
            inside = (inside or continued) and not (inside and (line.count('"') % 2 == 1 or
                                                               not line.rstrip().endswith("\\")))
            continue
        words = shlex.split(line, comments=True)
        if len(words) < 2 or words[1] in NOT_HERE or any(w in CLUSTER for w in words) or words[-1] == "&":
            continue
        out.append(" ".join(shlex.quote(w) for w in words))
    return out


def test_the_tour_lists_the_node_commands():
    lines = tour()
    assert lines[0] == "jobprobe probes" and len(lines) >= 14, lines
    assert any("--probes -perf --pid 4242" in ln for ln in lines) and \
        any(ln.startswith("jobprobe report") for ln in lines)


@pytest.mark.kernel
@pytest.mark.skipif(not IS_ROOT, reason="the tour runs as root (`sudo -s`)")
def test_the_tours_node_commands_run_as_written(tmp_path, make_cgroup):
    (tmp_path / "scripts").symlink_to(REPO / "scripts")          # the tour runs in the checkout
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    cg = make_cgroup("tour")
    mount = str(cg.path).split("/jobprobe-test/")[0]
    ran = []
    for line in tour():
        held = []
        if "4242" in line:
            held.append(subprocess.Popen(["sleep", "2"]))
            line = line.replace("4242", str(held[-1].pid))
        if "system.slice/my.scope" in line:
            held.append(subprocess.Popen(["sleep", "2"], preexec_fn=lambda: (cg.path / "cgroup.procs").write_text(
                str(os.getpid()))))
            line = line.replace("system.slice/my.scope", os.path.relpath(cg.path, mount))
        line = line.replace("/var/lib/jobprobe/train-7.mpk", "job.mpk").replace("--steps 30", "--steps 3") \
            .replace("--seconds 5", "--seconds 1")
        try:
            res = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=240, stdin=subprocess.DEVNULL)
        finally:
            for p in held:
                p.kill()
                p.wait()
        ok = res.returncode in (0, 1) and "worst:" in res.stdout if line.startswith("jobprobe doctor") else \
            res.returncode == 0
        assert ok, (line, res.returncode, res.stderr[-1500:])
        ran.append(line)
    assert re.search(r"--probes all --pid \d+", " ".join(ran)) and (tmp_path / "job.mpk").stat().st_size > 0
    assert (tmp_path / "train-7.html").read_text().startswith("<!DOCTYPE html>") or \
        "<html" in (tmp_path / "train-7.html").read_text()[:500]
