# SPDX-License-Identifier: Apache-2.0
"""The command line end to end: real processes, real cgroups. Bad input gets one line and exit code 2."""
import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import IS_ROOT, workload
from jobprobe.kernel.host import find_cgroup2_mount

JOBPROBE = [sys.executable, "-m", "jobprobe.cli"]


def jp(*args, **kw):
    return subprocess.run([*JOBPROBE, *map(str, args)], capture_output=True, text=True, timeout=60, **kw)


def one_line_error(res, *needles, code=2):
    assert res.returncode == code, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jobprobe: error: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args,needle", [
    (["run", "--cgroup", "/no/such/group", "--probes", "cgroup"], "does not exist"),
    (["run", "--pid", "4194303", "--probes", "cgroup"], "process 4194303 does not exist"),
    (["run", "--pid", "1", "--probes", "cgroup,bogus"], "unknown probe 'bogus'; valid probes:"),
    (["run", "--probes", "cgroup"], "no target"),
    (["run", "--pid", "1", "--interval", "0", "--probes", "cgroup"], "--interval must be positive"),
    (["run", "--pid", "notanumber"], "invalid int value"),
    (["read", "/no/such/file"], "cannot open"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    one_line_error(jp(*args), needle)


def test_a_command_that_cannot_run_exits_as_a_shell_would(tmp_path):
    """127: not found (also a script whose interpreter is missing); 126: found but not executable, a directory.
    The same codes as `env`, `timeout`, `nohup`, and distinct from a command that itself exits 2."""
    noexec = tmp_path / "noexec.sh"
    noexec.write_text("#!/bin/sh\nexit 0\n")
    noexec.chmod(0o644)
    badinterp = tmp_path / "badinterp"
    badinterp.write_text("#!/no/such/interpreter\n")
    badinterp.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    one_line_error(jp("run", "--probes", "cgroup", "--", "/no/such/cmd"), "command not found", code=127)
    one_line_error(jp("run", "--probes", "cgroup", "--", "no-such-cmd-anywhere"), "command not found", code=127)
    one_line_error(jp("run", "--probes", "cgroup", "--", str(noexec)), "permission denied", code=126)
    one_line_error(jp("run", "--probes", "cgroup", "--", "noexec.sh", env=env), "permission denied", code=126)
    one_line_error(jp("run", "--probes", "cgroup", "--", str(tmp_path)), "is a directory", code=126)
    if IS_ROOT:   # the command is started (inside a new cgroup) only as root
        one_line_error(jp("run", "--probes", "cgroup", "--", str(badinterp)), "No such file", code=127)
        # a command that runs and exits 2 itself keeps its own code, with no error line of ours
        res = jp("run", "--probes", "cgroup", "--out", tmp_path / "x.mpk", "--", "sh", "-c", "exit 2")
        assert res.returncode == 2 and "jobprobe: error" not in res.stderr, res


def test_slurm_job_that_does_not_exist(tmp_path):
    fake = tmp_path / "scontrol"   # a named fake: this test only checks the error path, not SLURM itself
    fake.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    one_line_error(jp("run", "--slurm-job", "999999", "--probes", "cgroup", env=env), "SLURM job 999999")


@contextlib.contextmanager
def searchable_by_others(path: Path):
    """The unprivileged user must reach the checkout (and its .venv): a clone made under `mktemp -d` sits in a 0700
    directory. Lend o+x to each ancestor that lacks it, and take it back after."""
    changed = []
    try:
        for d in [path, *path.parents]:
            mode = d.stat().st_mode
            if not mode & stat.S_IXOTH:
                d.chmod(mode | stat.S_IXOTH)
                changed.append((d, mode))
        yield
    finally:
        for d, mode in changed:
            d.chmod(mode)


def test_not_root_names_the_probes_that_need_it():
    if not IS_ROOT:
        pytest.skip("needs root to drop to an unprivileged user")
    root = Path(__file__).resolve().parents[1]
    with searchable_by_others(root):
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *JOBPROBE,
                              "run", "--pid", "1", "--probes", "all"], capture_output=True, text=True, timeout=60,
                             cwd=str(root))
    one_line_error(res, "not root", "need root")


def test_read_a_cut_file_keeps_frames_and_says_so(tmp_path):
    out = tmp_path / "f.mpk"
    res = jp("run", "--pid", os.getpid(), "--probes", "self", "--interval", "0.1", "--duration", "0.5", "--out", out)
    assert res.returncode == 0, res.stderr
    data = out.read_bytes()
    (tmp_path / "cut.mpk").write_bytes(data[:-3])
    res = jp("read", tmp_path / "cut.mpk")
    frames = [json.loads(x) for x in res.stdout.splitlines()]
    assert res.returncode == 0 and frames[0]["kind"] == "hello" and len(frames) >= 4
    assert "last frame cut short" in res.stderr
    table = jp("read", out, "--format", "table")
    assert table.returncode == 0 and "self.cpu_ns" in table.stdout.splitlines()[0]
    (tmp_path / "bad.mpk").write_bytes(data + b"\x93\x01\x02\x03" + data)
    res = jp("read", tmp_path / "bad.mpk")
    assert res.returncode == 2 and "not a frame" in res.stderr and len(res.stdout.splitlines()) == len(frames) + 1


def run_json(*args):
    res = jp("run", "--stdout", "json", *args)
    frames = [json.loads(x) for x in res.stdout.splitlines()]
    return res, frames


@pytest.mark.kernel
def test_command_exit_code_and_its_cgroup_is_removed():
    res, frames = run_json("--probes", "cgroup", "--interval", "0.2", "--", *workload("exit", 7))
    assert res.returncode == 7, res.stderr
    cg = frames[0]["target"]["cgroup"]
    assert cg.startswith(find_cgroup2_mount()) and not os.path.exists(cg)
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    # its last frame says how it ended, and only that one
    samples = [f for f in frames if f["kind"] == "sample"]
    assert samples[-1]["end"]["exit_code"] == 7 and samples[-1]["end"]["why"], samples[-1]
    assert samples[-1]["end"]["cause"] == "exit", samples[-1]       # its group was still there: not "removed"
    assert not any("end" in f for f in samples[:-1])
    # killed by a signal: the signal, not an exit code
    res, frames = run_json("--probes", "cgroup", "--interval", "0.2", "--", "sh", "-c", "sleep 0.5; kill -9 $$")
    assert res.returncode == 128 + 9, res.stderr
    end = [f for f in frames if f["kind"] == "sample"][-1]["end"]
    assert end["signal"] == 9 and "exit_code" not in end and end["cause"] == "signal", end


@pytest.mark.kernel
def test_command_cpu_is_attributed_and_interval_has_no_drift():
    res, frames = run_json("--probes", "cgroup,self", "--interval", "0.25", "--", *workload("burn", 2))
    assert res.returncode == 0, res.stderr
    samples = [f for f in frames if f["kind"] == "sample"]
    cpu = sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"] for f in samples)
    own = int(res.stderr.split("cpu_ns=")[1].split()[0])   # the burner's getrusage at its exit
    assert abs(cpu - own) / own < 0.03, (cpu, own)
    # ticks sit on a grid start + k*interval: no drift accumulates over the run. The grid is the loop's, which starts
    # once CMD is launched (a fork and exec after the hello: 0.14 s once beside a loaded machine), so it is measured
    # from the first tick, not from the hello.
    t1 = samples[0]["t"]
    assert len(samples) >= 6
    for k, f in enumerate(samples[1:-1], start=1):
        assert abs(f["t"] - (t1 + 0.25 * k)) < 0.1, (k, f["t"] - t1)
    assert all(f["status"] == {"cgroup": "ok", "self": "ok"} for f in samples)


@pytest.mark.serial
@pytest.mark.kernel
def test_pid_follows_children_forked_after_attach(make_cgroup):
    cg = make_cgroup()  # only so that the kernel keeps an independent CPU total for the same processes
    root = cg.spawn(workload("forktree", 3, 1.5))
    proc = subprocess.Popen([*JOBPROBE, "run", "--stdout", "json", "--pid", str(root.pid), "--probes", "cgroup",
                             "--interval", "0.2"], stdout=subprocess.PIPE, text=True)
    hello = json.loads(proc.stdout.readline())
    before = cg.cpu_usage_ns()          # the probe took its baseline just before the hello frame
    frames = [hello] + [json.loads(x) for x in proc.stdout]
    root.wait()
    assert proc.wait(timeout=30) == 0
    samples = [f for f in frames if f["kind"] == "sample"]
    assert max(f["probes"]["cgroup"]["nprocs"] for f in samples) == 3
    cpu = sum(f["probes"]["cgroup"]["cpu_user_ns"] + f["probes"]["cgroup"]["cpu_system_ns"] for f in samples)
    want = cg.cpu_usage_ns() - before
    assert abs(cpu - want) / want < 0.03, (cpu, want)   # /proc counts in clock ticks


def fd_kinds(pid):
    kinds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            kinds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return kinds


@pytest.mark.kernel
@pytest.mark.parametrize("spec,want_bpf,want_perf", [("cgroup,self", False, False), ("sched", True, None),
                                                      ("perf", False, True)])
def test_probe_off_means_detached(spec, want_bpf, want_perf):
    """A probe switched off leaves no BPF program or perf_event fd in the agent; switched on, it has them."""
    proc = subprocess.Popen([*JOBPROBE, "run", "--probes", spec, "--stdout", "json", "--", "sleep", "3"],
                            stdout=subprocess.PIPE, text=True)
    hello = json.loads(proc.stdout.readline())
    time.sleep(0.5)
    kinds = fd_kinds(proc.pid)
    proc.wait(timeout=30)
    assert all(v == "ok" for v in hello["probes"].values()), hello["probes"]
    assert any("bpf-prog" in k for k in kinds) == want_bpf, kinds
    if want_perf is not None:  # (BPF tracepoint attachments are perf_event fds too)
        assert any("perf_event" in k for k in kinds) == want_perf, kinds


@pytest.mark.kernel
def test_cgroup_removed_while_attached_ends_cleanly(make_cgroup):
    """The job ends under us: its processes exit and its group is removed. jobprobe writes the last frame, says
    why it stopped, and exits 0; every frame it wrote is there."""
    cg = make_cgroup()
    job = cg.spawn(workload("burn", 2.0))
    proc = subprocess.Popen([*JOBPROBE, "run", "--cgroup", str(cg.path), "--probes", "cgroup,perf,gpu", "--stdout",
                             "json", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hello = json.loads(proc.stdout.readline())
    before = cg.cpu_usage_ns()              # the probes took their baselines before the hello: they count at least
    job.wait()                              # what the group ran from here, and at most all it ran
    total = cg.cpu_usage_ns()
    cg.remove()
    out, err = proc.communicate(timeout=30)
    frames = [hello] + [json.loads(x) for x in out.splitlines()]
    assert proc.returncode == 0, err
    # which it sees first depends on whether a tick falls between the last exit and the rmdir (a few ms; seen in CI)
    assert err.strip() in (f"jobprobe: job ended: cgroup {cg.path} was removed",
                           f"jobprobe: job ended: every process of {cg.path.name} has exited"), err
    assert [f["seq"] for f in frames] == list(range(len(frames)))
    # every probe that started is still "ok" (gpu is "unavailable" here: no NVIDIA driver on this host)
    assert frames[-1]["status"]["perf"] == "ok" and frames[-1]["status"]["cgroup"] == "ok"
    assert not any(v.startswith("failed") for v in frames[-1]["status"].values()), frames[-1]["status"]
    cpu = sum(f["probes"]["perf"]["task_clock_ns"] for f in frames[1:])
    assert 0.98 * (total - before) <= cpu <= 1.02 * total and cpu > 0, (cpu, before, total)   # the group's cpu.stat


def test_a_reply_sent_before_the_request_was_read_still_reaches_the_client(tmp_path):
    """The agent refuses a non-root peer without reading its request, then closes: a client still writing gets
    EPIPE, and must read the refusal rather than fail on the broken pipe (a race a CI run lost once). A request too
    big for the socket's buffer makes the client's write outlast the server's close every time."""
    import socket
    import threading

    from jobprobe.node.control import call
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def answer_unread():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(b'{"ok": false, "error": "permission denied: the agent serves root only"}\n')

    t = threading.Thread(target=answer_unread)
    t.start()
    try:
        reply = call(path, {"cmd": "status", "pad": "x" * (4 << 20)})
    finally:
        t.join(10)
        srv.close()
    assert reply == {"ok": False, "error": "permission denied: the agent serves root only"}


def every_command() -> list[list[str]]:
    """Every command and sub-command the parser has, as argv prefixes."""
    import argparse

    from jobprobe.cli import build_parser

    def walk(p, prefix):
        out = [prefix]
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    out += walk(sub, prefix + [name])
        return out
    return walk(build_parser(), [])


@pytest.mark.parametrize("argv", every_command(), ids=lambda a: " ".join(a) or "jobprobe")
def test_every_commands_help_prints_and_exits_0(argv):
    from jobprobe.cli import build_parser
    with pytest.raises(SystemExit) as ex:
        build_parser().parse_args(argv + ["--help"])
    assert ex.value.code == 0
