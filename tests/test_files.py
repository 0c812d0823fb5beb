# SPDX-License-Identifier: Apache-2.0
"""Every file a person hands jobprobe — the agent's config, a rules file, a price file — is read, or refused with
BadInput (one line: the CLI's exit 2, the agent's logged refusal), never another exception: any bytes, and any TOML
document over the keys each one knows (and some it does not) with values of any TOML type. And every file the agent
writes where another local user may reach is its own: what user nobody plants there is refused in one line."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import as_nobody, needs_root_to_be_nobody, nobody_uid
from jobprobe.cluster import cost
from jobprobe.core import efficiency
from jobprobe.core.errors import BadInput, UnsafeFile
from jobprobe.node import rules
from jobprobe.node.config import Config

SCALAR = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=12), st.sampled_from(["default", "event", "trace", "spot", "on_demand", "a=b",
                                                          "cgroup.cpu_user_ns > 1", "127.0.0.1:9000", "0.5"]))
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                     max_leaves=6)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)     # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_doc(top: dict, tables: dict[str, list[dict]]) -> str:
    lines = [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in top.items()]
    for name, items in tables.items():
        for item in items:
            lines += [f"[[{name}]]"] + [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}"
                                        for k, v in item.items()]
    return "\n".join(lines) + "\n"


def keyed(keys) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.one_of(st.sampled_from(sorted(keys)), st.text(max_size=4)), VALUE, max_size=5)


CONFIG = keyed(Config.__dataclass_fields__).map(lambda top: toml_doc(top, {}))
# each table a valid one with some of its keys given any value (a wholly random one is refused at its first key)
RULE = st.builds(lambda name, rest: {"name": name, "when": "cgroup.cpu_user_ns > 1", **rest},
                 st.text(min_size=1, max_size=4), keyed(rules.KEYS))
NODE = st.builds(lambda rest: {"per_hour": 1.5, **rest}, keyed(cost.NODE_KEYS))
RULES = st.builds(lambda top, items: toml_doc(top, {"rule": items}),
                  st.one_of(st.just({}), st.dictionaries(st.sampled_from(["efficiency", "x"]), VALUE, max_size=1)),
                  st.lists(st.one_of(RULE, RULE, keyed(rules.KEYS)), min_size=1, max_size=3))
PRICES = st.builds(lambda top, items: toml_doc(top, {"node": items}), keyed(cost.TOP_KEYS - {"node"}),
                   st.lists(st.one_of(NODE, keyed(cost.NODE_KEYS)), max_size=3))
ANY = dict(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def handed(tmp_path, name: str, body, load):
    """`body` written as the file `name`, and what `load` made of it (None: refused in one line)."""
    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return path, read_or_refuse(load, path)


def read_or_refuse(load, path):
    try:
        return load(str(path))
    except BadInput as err:
        assert "\n" not in str(err) and str(err)
        return None


@settings(**ANY)
@given(body=st.one_of(CONFIG, st.binary(max_size=40).map(bytes.hex), st.binary(max_size=40)))
def test_any_agent_config_is_read_or_refused_in_one_line(tmp_path, body):
    _, cfg = handed(tmp_path, "agent.toml", body, lambda p: Config.load(p, {}))
    if cfg is not None:     # what is read is what the agent can use: every setting of its declared type
        assert isinstance(cfg.interval, (int, float)) and not isinstance(cfg.interval, bool) and cfg.interval > 0
        assert math.isfinite(cfg.interval)
        for name, f in Config.__dataclass_fields__.items():
            v = getattr(cfg, name)
            assert v is None or type(v).__name__ in str(f.type) or (isinstance(v, int) and "float" in str(f.type)), \
                (name, v, f.type)


@settings(**ANY)
@given(body=st.one_of(RULES, st.binary(max_size=40)))
def test_any_rules_file_is_read_or_refused_in_one_line(tmp_path, body):
    path, got = handed(tmp_path, "rules.toml", body, rules.load)
    if got is not None:
        for r in got:        # what is read is what a RuleSet can run: strings and finite seconds
            assert all(isinstance(getattr(r, k), str) for k in ("name", "when", "summary", "action"))
            assert r.clear is None or isinstance(r.clear, str) and r.action in rules.ACTIONS
            assert all(isinstance(getattr(r, k), (int, float)) and not isinstance(getattr(r, k), bool)
                       and math.isfinite(getattr(r, k)) for k in ("window", "hold", "cooldown", "clear_after",
                                                                  "trace_s")), r
    read_or_refuse(efficiency.load, path)          # the summary reads the same file's [efficiency] table


@settings(**ANY)
@given(body=st.one_of(PRICES, st.binary(max_size=40)))
def test_any_price_file_is_read_or_refused_in_one_line(tmp_path, body):
    _, got = handed(tmp_path, "prices.toml", body, cost.load)
    if got is not None:
        assert all(math.isfinite(n.per_hour) and n.per_hour >= 0 and n.market in ("spot", "on_demand")
                   for n in got.nodes)
        assert all(isinstance(v, str) for n in got.nodes for v in (n.name, n.hostname, n.gpu, n.label)
                   if v is not None)
        assert math.isfinite(got.idle_gpu_util_pct) and isinstance(got.currency, str)


@pytest.mark.parametrize("body", [b"interval = 'fast'\n", b"\xff\xfe", b"socket = 5\n", b"interval = nan\n"])
def test_named_bad_configs_are_refused(tmp_path, body):
    path = tmp_path / "agent.toml"
    path.write_bytes(body)
    with pytest.raises(BadInput):
        Config.load(str(path), {})


RULE_TOP = '[[rule]]\nname = "r"\nwhen = "cgroup.cpu_user_ns > 1"\n'
PRICE_TOP = '[[node]]\nname = "n"\nper_hour = 1.5\n'


@pytest.mark.parametrize("load,body", [
    *((rules.load, RULE_TOP + f"{k} = {v}\n") for k in ("window", "hold", "cooldown", "clear_after", "trace_s")
      for v in ("true", "false", "inf", "nan", "-1")),
    (efficiency.load, "[efficiency]\ncpu_used_min = true\n"),
    (efficiency.load, "[efficiency]\ngpu_used_min = nan\n"),
    *((cost.load, PRICE_TOP.replace("1.5", v)) for v in ("true", "inf", "nan", "-2")),
    *((cost.load, PRICE_TOP + f"gpus = {v}\n") for v in ("true", "inf", "-1")),
    *((cost.load, f"{k} = {v}\n" + PRICE_TOP) for k in ("idle_gpu_util_pct", "electricity_per_kwh")
      for v in ("true", "false", "nan", "inf", "-1")),
], ids=lambda x: x if isinstance(x, str) else x.__module__.rsplit(".", 1)[-1])
def test_named_bad_rules_and_prices_are_refused(tmp_path, load, body):
    """A bool is an int in Python: `hold = true` read as 1 s, `per_hour = true` as 1/h, unless refused by name."""
    path = tmp_path / "file.toml"
    path.write_text(body)
    with pytest.raises(BadInput):
        load(str(path))


# ---- frame files (`jobprobe summary FILE…`, `report`, `read`): frames of the right shape with values of any kind,
# and byte streams cut, flipped or spliced anywhere
PROBE_VALUES = st.dictionaries(st.sampled_from(["cpu_user_ns", "cpu_system_ns", "runq_lat_ns", "offcpu_io_ns",
                                                "io_write_bytes", "gpus", "cpu_limit_cores", "tcp_tx_bytes",
                                                "helper_cpu_user_ns", "mem_some_ns"]), VALUE, max_size=4)
FRAME = st.fixed_dictionaries(
    {"v": st.just(1), "kind": st.sampled_from(["hello", "sample", "event", "heartbeat"]),
     "node": st.sampled_from(["a", "b"]), "job": st.sampled_from(["j", ""]), "seq": st.integers(0, 10),
     "t": st.one_of(st.floats(0, 1e4), st.floats()), "dt": st.one_of(st.floats(0, 5), st.floats())},
    optional={"probes": st.dictionaries(st.sampled_from(["cgroup", "sched", "gpu", "net", "pressure"]),
                                        st.one_of(PROBE_VALUES, VALUE), max_size=3),
              "event": st.sampled_from(["straggler", "straggler_end", "rule", "summary"]), "straggler": VALUE,
              "waited_by": VALUE, "reason": VALUE, "since": VALUE, "run": st.text(max_size=3), "labels": VALUE,
              "from_start": VALUE, "interval": VALUE})
EDIT = st.tuples(st.sampled_from(["cut", "flip", "splice"]), st.integers(0, 4000), st.binary(min_size=1, max_size=8))


def edited(data: bytes, edits) -> bytes:
    for how, at, junk in edits:
        at = at % (len(data) + 1)
        data = data[:at] if how == "cut" else data[:at] + junk + data[at + (len(junk) if how == "flip" else 0):]
    return data


@settings(**{**ANY, "max_examples": 200})
@given(frames=st.lists(FRAME, max_size=12), edits=st.lists(EDIT, max_size=2))
def test_any_frame_file_is_summed_and_drawn_or_refused_in_one_line(tmp_path, frames, edits):
    import msgpack

    from jobprobe.cluster import report, summary
    from jobprobe.core.errors import JobprobeError
    path = tmp_path / "job.mpk"
    path.write_bytes(edited(b"".join(msgpack.packb(f, use_bin_type=True) for f in frames), edits))
    try:
        got = report.frames_of_files([str(path)])
    except JobprobeError as err:          # the CLI's one line (exit 2)
        assert str(err) and "\n" not in str(err)
        return
    s = summary.summarize(got, "j")
    assert sum(s["buckets"].values()) == pytest.approx(s["wall_s"], rel=1e-6, abs=1e-3 * len(got) + 1e-6)
    summary.text(s)
    job = report.Job("j")
    job.take(got)
    job.sort()
    page = read_or_refuse(lambda _: report.render(job, None, summary.html_table(s)), path)
    assert page is None and not job.nodes or page.lstrip().lower().startswith("<!doctype html>")


# ---- files the agent writes where another local user may reach (issue 48): a link, a FIFO or a file of theirs
# planted where the agent will write is refused in one line, and nothing outside is written
PLANTS = {"symlink": lambda name: os.symlink("../victim", name),    # from the shared directory to tmp_path/victim
          "fifo": lambda name: os.mkfifo(name, 0o666),
          "their file": lambda name: Path(name).write_bytes(b"theirs")}


def victim(tmp_path: Path) -> Path:
    """A file of root's outside every directory the agent writes: it must stay as it is."""
    v = tmp_path / "victim"
    v.write_bytes(b"root's own\n")
    v.chmod(0o644)
    return v


def untouched(v: Path) -> bool:
    return v.read_bytes() == b"root's own\n" and stat.S_IMODE(v.stat().st_mode) == 0o644


def shared_dir(tmp_path: Path) -> Path:
    d = tmp_path / "shared"                     # like /tmp: anyone may add a name, no one may move another's
    d.mkdir()
    d.chmod(0o1777)
    return d


def nobodys_dir(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name                         # a directory another user owns (their home, a path they made first)
    d.mkdir()
    os.chown(d, nobody_uid(), -1)
    return d


@contextlib.contextmanager
def alarm(seconds: int):
    """A blocked open (a FIFO with no reader) fails the test instead of hanging it."""
    def ring(*_):
        raise TimeoutError(f"blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def refused_in_one_line(err: pytest.ExceptionInfo, path) -> None:
    assert "\n" not in str(err.value) and str(path) in str(err.value), str(err.value)


@needs_root_to_be_nobody
@pytest.mark.parametrize("plant", [*PLANTS, "hard link"])
def test_what_another_user_planted_as_a_jobs_file_in_a_shared_out_is_refused(tmp_path, plant):
    """--out /tmp: user nobody makes the name the job's frame file will have first. A hard link to root's file
    is made by root here: what nobody can do on a host with fs.protected_hardlinks=0."""
    from jobprobe.exporters.file import FileSink, job_path
    v, out = victim(tmp_path), shared_dir(tmp_path)
    path = job_path(str(out), "train/7")
    if plant == "hard link":
        os.link(v, path)
    else:
        as_nobody(out, lambda: PLANTS[plant](os.path.basename(path)))
    with alarm(5), pytest.raises(UnsafeFile) as err:
        FileSink(path).close()
    refused_in_one_line(err, path)
    assert untouched(v)
    if plant == "their file":
        assert Path(path).read_bytes() == b"theirs" and Path(path).stat().st_uid == nobody_uid()


@needs_root_to_be_nobody
def test_a_private_dir_another_user_owns_or_may_write_is_refused(tmp_path):
    """The spool's and the traces' directories are the agent's alone: one of nobody's, with a link where a
    segment will be, is refused — neither read nor written; so is a directory of ours that others may write."""
    from jobprobe.core.safefile import Dir
    from jobprobe.exporters.spool import Spool
    v, spool = victim(tmp_path), nobodys_dir(tmp_path, "spool")
    as_nobody(spool, lambda: (os.symlink("../victim", "seg-0"), os.symlink("../victim", "cursor")))
    with pytest.raises(UnsafeFile) as err:
        Spool(spool).close()
    refused_in_one_line(err, spool)
    assert "uid" in str(err.value) and untouched(v)
    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o777)
    with pytest.raises(UnsafeFile, match="writable by group or others"):
        Dir(str(wide))
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        Dir(str(link))


@needs_root_to_be_nobody
def test_a_trace_window_in_another_users_dir_is_refused_and_says_why(tmp_path):
    from jobprobe.node.tracewin import Tracer
    traces = nobodys_dir(tmp_path, "traces")
    t = Tracer("j", str(traces), lambda: [], lambda p: "", lambda p: False, None)
    got = t.open("request", duration=1.0)
    assert got["ok"] is False and str(traces) in got["why"] and "\n" not in got["why"], got
    assert os.listdir(traces) == [] and stat.S_IMODE(traces.stat().st_mode) == 0o755   # not narrowed: not ours


@needs_root_to_be_nobody
def test_the_state_file_is_0600_and_never_written_through_a_link(tmp_path, caplog):
    from jobprobe.node.adopt import StateFile
    old = os.umask(0o022)
    try:
        StateFile(str(tmp_path / "run" / "jobs.json")).save([])      # the agent's job table, empty
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "run" / "jobs.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    v, state = victim(tmp_path), nobodys_dir(tmp_path, "state")
    as_nobody(state, lambda: (os.symlink("../victim", "jobs.tmp"), os.symlink("../victim", "jobs.json")))
    StateFile(str(state / "jobs.json")).save([])    # said in one line, the agent goes on
    assert untouched(v) and [r.getMessage() for r in caplog.records if str(state) in r.getMessage()]


@needs_root_to_be_nobody
def test_the_cli_refuses_a_planted_out_file_and_another_users_out_dir_in_one_line(tmp_path):
    v, out = victim(tmp_path), shared_dir(tmp_path)
    as_nobody(out, lambda: os.symlink("../victim", "frames.mpk"))
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "run", "--pid", str(os.getpid()), "--probes", "self",
                          "--duration", "1", "--out", str(out / "frames.mpk")], capture_output=True, text=True,
                         timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and str(out / "frames.mpk") in lines[0], res
    assert untouched(v)
    theirs = nobodys_dir(tmp_path, "theirs")
    res = subprocess.run([sys.executable, "-m", "jobprobe.cli", "agent", "--out", str(theirs),
                          "--socket", str(tmp_path / "a.sock"), "--state", str(tmp_path / "jobs.json"),
                          "--probes", "self"], capture_output=True, text=True, timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and str(theirs) in lines[0] and "uid" in lines[0], res
