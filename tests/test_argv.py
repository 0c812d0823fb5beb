# SPDX-License-Identifier: Apache-2.0
"""Unit tier: the read-side commands (`query`, `summary`, `report`, `read`) given any arguments — options in any
order with values of any kind (numbers that are not numbers, paths that are directories, devices or absent, fields
that do not exist) — end with their output, a one-line error and exit 2, or argparse's usage and exit 2; never a
traceback. In process, through `main()`, over a real store and a real frame file."""
from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import samples
from jobprobe.cli import main
from jobprobe.cluster.store import Store
from jobprobe.core.frame import encode

OPTIONS = {
    "query": ["--store", "--sql", "--job", "--top", "--field", "--node", "--level", "--last", "--format", "--prices"],
    "summary": ["--store", "--job", "--format", "--rules"],
    "report": ["--store", "--job", "--out", "--prices"],
    "read": ["--format"],
}
FLAGS = {"query": ["--summary"]}


def ends_in_output_or_one_error(argv: list[str]) -> int:
    """main(argv) in this process: exit 0, or 2 with one error line (or argparse's usage); never a traceback. Its
    exit code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:                       # argparse: its usage and the error
            code = e.code
    assert code in (0, 2), (argv, code, err.getvalue()[-400:])
    assert "Traceback" not in err.getvalue(), (argv, err.getvalue()[-600:])
    if code == 2 and err.getvalue().startswith("jobprobe: error:"):
        assert err.getvalue().count("\n") == 1, (argv, err.getvalue())
    return code


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    d = tmp_path_factory.mktemp("argv")
    st_ = Store(d / "s.db")
    st_.add([f for n in ("a", "b") for f in samples(n, "jb", 60)], received=1_790_000_100.0)
    st_.close()
    with open(d / "frames.mpk", "wb") as f:
        for fr in samples("a", "jb", 20):
            f.write(encode(fr))
    (d / "prices.toml").write_text('[[node]]\nname = "a"\nper_hour = 2.0\n')
    return d


def value(d) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([str(d / "s.db"), str(d), str(d / "frames.mpk"), str(d / "prices.toml"), str(d / "none"),
                         "/dev/null", "/", "jb", "a", "cgroup.cpu_user_ns", "sched.runq_lat_us_log2", "net.top_peers",
                         "gpu.util_pct", "x.y", "10", "60", "nan", "inf", "-inf", "-1", "1e309", "0", "table", "jsonl",
                         "csv", "json", "text", "summary", "default", "SELECT * FROM frames", "SELECT 1/0", "DROP",
                         "SELECT json_extract(body, '$[') FROM frames", ""]),
        st.text(st.characters(blacklist_characters="\x00"), max_size=8))    # (no argv holds a NUL)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_read_commands_end_in_output_or_one_error_never_a_traceback(place, data, monkeypatch):
    cmd = data.draw(st.sampled_from(sorted(OPTIONS)))
    store, frames = str(place / "s.db"), str(place / "frames.mpk")
    base = {"query": [("--store", store), ("--job", "jb"), ("--field", "cgroup.cpu_user_ns")],
            "summary": [("--store", store), ("--job", "jb")],
            "report": [("--store", store), ("--job", "jb"), ("--out", str(place / "out.html"))],
            "read": []}[cmd]
    # a command line that works, with some of its options given other values or added, or one of any options
    opts = dict(base) if data.draw(st.booleans()) else {}
    for o, v in data.draw(st.lists(st.tuples(st.sampled_from(OPTIONS[cmd]), value(place)), max_size=3)):
        opts[o] = str(place / "out.html") if o == "--out" else v
    argv = [cmd] + [x for o, v in opts.items() for x in (o, v)]
    argv += data.draw(st.lists(st.sampled_from(FLAGS.get(cmd, ["--format"])), max_size=1)) if cmd in FLAGS else []
    if cmd == "read" or cmd in ("summary", "report") and "--store" not in opts:
        argv += data.draw(st.one_of(st.just([frames]), st.lists(value(place), max_size=2)))     # FILE…
    monkeypatch.chdir(place)                          # report's default out file lands here
    event(f"{cmd} exit {ends_in_output_or_one_error(argv)}")


def test_a_path_no_file_system_name_can_hold_is_one_error():
    """A lone surrogate outside surrogateescape's range (the generator above drew '\udd00' as `read`'s FILE once:
    UnicodeEncodeError from open(), a traceback) is one error line and exit 2, for every read command."""
    for argv in (["read", "\udd00"], ["summary", "\udd00"], ["query", "--store", "\udd00", "--sql", "SELECT 1"],
                 ["report", "--store", "\udd00", "--job", "j"]):
        assert ends_in_output_or_one_error(argv) == 2, argv


# ---- the commands that ask the node's agent (attach, detach, status, probes, trace), against a real agent's control
# socket in this process (the `self` probe only; its job is this test's own process)
NODE_OPTIONS = {
    "attach": ["--pid", "--cgroup", "--slurm-job", "--k8s-pod", "--job", "--probes", "--wait", "--label"],
    "detach": [],
    "status": [],
    "probes": ["--job", "--toggle"],
    "trace": ["--job", "--duration", "--at"],
}


@pytest.fixture(scope="module")
def agent_socket(tmp_path_factory):
    import os

    from jobprobe.node.agent import Agent
    from jobprobe.node.config import Config
    from jobprobe.node.control import ControlServer
    d = tmp_path_factory.mktemp("agent")
    a = Agent(Config(interval=1.0, probes="self", out=str(d / "out"), socket=str(d / "agent.sock"),
                     state=str(d / "jobs.json"), attach_wait=0.0, trace_dir=""))
    server = ControlServer(a, str(d / "agent.sock"))
    server.start()
    a.attach_pid = os.getpid()
    yield a, str(d / "agent.sock")
    server.close()
    a.close()


def node_value() -> st.SearchStrategy[str]:
    import os
    return st.one_of(st.sampled_from([str(os.getpid()), "1", "0", "-1", "4194303", "99999999999999999999", "nan",
                                      "inf", "+5", "+nan", "+1e309", "2026-13-01T00:00:00", "9999-12-31T23:59:59",
                                      "self", "+self", "-self", "cgroup", "j", "x=y", "=y", "/", "/sys/fs/cgroup",
                                      "600", "0.001", ""]),
                     st.text(st.characters(blacklist_characters="\x00"), max_size=8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_agents_commands_end_in_output_or_one_error_never_a_traceback(agent_socket, data):
    agent, sock = agent_socket
    if "j" not in agent.jobs:
        main(["attach", "--pid", str(agent.attach_pid), "--job", "j", "--probes", "self", "--socket", sock])
    cmd = data.draw(st.sampled_from(sorted(NODE_OPTIONS)))
    opts = dict({"attach": [("--pid", str(agent.attach_pid)), ("--job", "k")], "trace": [("--job", "j")],
                 "probes": [("--job", "j"), ("--toggle", "+self")]}.get(cmd, [])) if data.draw(st.booleans()) else {}
    for o, v in data.draw(st.lists(st.tuples(st.sampled_from(NODE_OPTIONS[cmd] or ["--socket"]), node_value()),
                                   max_size=2)):
        if o == "--pid" and v.isdigit() and int(v) != agent.attach_pid:
            continue                                # another real process would be attached: not what this is about
        opts[o] = v
    opts["--socket"] = sock
    argv = [cmd] + [x for o, v in opts.items() for x in (o, v)]
    if cmd == "detach":
        argv.append(data.draw(st.one_of(st.sampled_from(["k", "nope"]), node_value())))
    event(f"{cmd} exit {ends_in_output_or_one_error(argv)}")
    for job in set(agent.jobs) - {"j"}:               # what an example attached is let go before the next one
        agent.detach(job)


def test_a_job_asked_for_twice_while_pending_is_answered_as_pending_both_times(agent_socket):
    """Found by the property test above: a second `attach` of a job still waiting for its processes (a SLURM job
    or pod not there yet, --wait) was answered without its time left, and the command line died on it
    (KeyError: 'waiting_s'). Both answers now say pending, the time left and why."""
    agent, sock = agent_socket
    argv = ["attach", "--slurm-job", "424242", "--job", "twice", "--wait", "30", "--socket", sock]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0 and main(argv) == 0
    finally:
        agent.detach("twice")
    assert out.getvalue().count("twice: pending (waiting up to") == 2, out.getvalue()


def test_a_cost_summary_of_a_file_that_is_not_a_store_is_one_error(place):
    """Found by the property test above: `query --summary` read a file that is not a store into an sqlite3
    traceback."""
    assert ends_in_output_or_one_error(["query", "--store", "/dev/null", "--job", "jb", "--summary"]) == 2
    assert ends_in_output_or_one_error(["query", "--store", str(place / "frames.mpk"), "--job", "jb", "--summary"]) == 2


def test_the_tours_probes_minus_perf_parses_as_written():
    """The README's tour writes `jobprobe run --probes -perf --pid 4242`; argparse took `-perf` for an unknown
    option (exit 2, "expected one argument"). A `--probes` value that starts with '-' is its value; a command after
    `--` is never touched, and `--probes` before another option still wants its value."""
    from jobprobe.cli.parser import build_parser, split_command, toggles_as_options
    argv, cmd = split_command(["run", "--probes", "-perf,-sched", "--pid", "4242"])
    args = build_parser().parse_args(toggles_as_options(argv))
    assert args.probes == "-perf,-sched" and args.pid == 4242 and cmd == []
    argv, cmd = split_command(["run", "--probes", "cgroup", "--", "python", "--probes", "-x"])
    assert toggles_as_options(argv) == ["run", "--probes", "cgroup"] and cmd == ["python", "--probes", "-x"]
    from jobprobe.core.errors import BadInput
    with pytest.raises(BadInput):
        build_parser().parse_args(toggles_as_options(["run", "--probes", "--pid", "1"]))


def test_the_controller_on_a_node_only_install_says_what_to_install(tmp_path):
    """A node-only install has no NumPy (the controller's extra): `jobprobe controller` ended in a traceback. One
    line, exit 2, naming the extra. (NumPy made unimportable in that process: a fake of the install, nothing else.)"""
    import subprocess
    import sys
    code = ("import sys; sys.modules['numpy'] = None; from jobprobe.cli import main; "
            f"sys.exit(main(['controller', '--store', {str(tmp_path / 's.db')!r}, '--nats', 'nats://127.0.0.1:1']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "jobprobe[controller]" in r.stderr, r.stderr
