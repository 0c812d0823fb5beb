# SPDX-License-Identifier: Apache-2.0
"""Unit tier: the file exporter (append-safe, rotation with a hello at the top of each file, private modes, one file
per job) and stdout lines."""
import io
import json
import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobprobe.core.frame import FrameBuilder, StreamReader, encode
from jobprobe.core.names import MAX_FILE_NAME as MAX_NAME
from jobprobe.core.names import job_filename
from jobprobe.exporters.file import FileSink, job_path
from jobprobe.exporters.stdout import StdoutSink, human_line


def stream(n):
    b = FrameBuilder("n", "j")
    yield b.hello(version="t", probes={"cgroup": "ok", "sched": "unavailable: needs root"})
    for i in range(n):
        yield b.sample(1e9 + i, 1.0, {"cgroup": {"cpu_user_ns": 2_500_000_000, "mem_bytes": 3 << 20,
                                                 "runq_lat_us_log2": [0, 1], "ipc": 1.25, "io_read_bytes": 0},
                                      "net": {"tcp_tx_bytes": 0, "bpf_missed": 0}}, {"cgroup": "ok", "net": "ok"})


def read_all(path):
    with open(path, "rb") as fp:
        return list(StreamReader(fp))


def test_append_keeps_earlier_frames(tmp_path):
    out = tmp_path / "f.mpk"
    for _ in range(2):
        exp = FileSink(str(out))
        for f in stream(3):
            exp.write(f, encode(f))
        exp.close()
    got = read_all(out)
    assert len(got) == 8 and [f["seq"] for f in got] == [0, 1, 2, 3] * 2


def test_rotation_by_size_starts_each_file_with_hello(tmp_path):
    out = tmp_path / "f.mpk"
    exp = FileSink(str(out), max_mb=0.002, keep=3)   # ~2 KiB per file
    frames = list(stream(60))
    for f in frames:
        exp.write(f, encode(f))
    exp.close()
    files = [out, tmp_path / "f.mpk.1", tmp_path / "f.mpk.2", tmp_path / "f.mpk.3"]
    assert all(p.exists() for p in files) and not (tmp_path / "f.mpk.4").exists()
    for p in files:
        got = read_all(p)
        assert got[0]["kind"] == "hello"
        assert p.stat().st_size <= 2100
        seqs = [f["seq"] for f in got[1:]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive inside each file
    assert read_all(out)[-1]["seq"] == 60                          # the newest frames are in FILE


def test_stdout_human_and_json():
    buf = io.StringIO()
    exp = StdoutSink("json", buf)
    frames = list(stream(1))
    for f in frames:
        exp.write(f, encode(f))
    lines = buf.getvalue().splitlines()
    assert [json.loads(x) for x in lines] == frames
    line = human_line(frames[1])
    assert "cpu_user_ns=2.50s" in line and "mem_bytes=3.0MiB" in line and "ipc=1.25" in line
    assert "runq_lat_us_log2" not in line
    assert "io_read_bytes" not in line and "net[" not in line       # only what is not zero: compact
    assert "sched=off" in human_line(frames[0])
    from jobprobe.exporters.stdout import human_value
    assert [human_value("x_ns", v) for v in (7, 858_000, 12_340_000, 1_500_000_000)] == ["7ns", "858us", "12.3ms",
                                                                                          "1.50s"]


# ---- files and directories: private, and one file per job ---------------------------------------------------------
def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_frames_are_0600_in_0700_dirs_whatever_the_umask(tmp_path, open_umask):
    """Frames hold other users' command lines and stacks: a permissive umask must not make them readable."""
    out = tmp_path / "a" / "b" / "frames"               # --out DIR, three levels missing
    path = job_path(str(out), "slurm/42")
    assert os.path.dirname(path) == str(out)
    assert [mode(d) for d in (tmp_path / "a", tmp_path / "a" / "b", out)] == [0o700] * 3
    exp = FileSink(path, max_mb=0.002, keep=2)      # rotation makes new files: they are private too
    for f in stream(60):
        exp.write(f, encode(f))
    exp.close()
    files = sorted(os.listdir(out))
    assert len(files) == 3 and all(mode(out / name) == 0o600 for name in files)


def test_an_existing_file_is_narrowed_an_existing_dir_left_alone(tmp_path, open_umask):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    old = shared / "f.mpk"
    old.write_bytes(b"")
    os.chmod(old, 0o644)                                # written by an older version
    job_path(str(shared), "j")                          # --out /tmp is not ours to close
    FileSink(str(old)).close()
    assert mode(shared) == 0o755 and mode(old) == 0o600


def test_distinct_jobs_named_alike_write_distinct_files():
    names = ["a/b", "a_b", "a.b", "a-b", "a b", "a\x00b", "a_2fb", ".", "..", ".x", "_2ex", "é", "_c3_a9"]
    assert len({job_filename(n) for n in names}) == len(names)
    assert job_filename("a/b") == "a_2fb" and job_filename("a_b") == "a_5fb" and job_filename("1234.0") == "1234.0"
    with pytest.raises(ValueError):
        job_filename("")


@settings(max_examples=500, deadline=None)
@given(st.text(min_size=1, max_size=300), st.text(min_size=1, max_size=300))
def test_job_filename_is_injective_and_safe(a, b):
    fa, fb = job_filename(a), job_filename(b)
    if a != b:
        assert fa != fb
    for f in (fa, fb):
        assert "/" not in f and "\x00" not in f and not f.startswith(".") and f not in (".", "..")
        assert len(f) <= MAX_NAME and f.isascii()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "_", "/", ".", "2", "f", "e", "5"]), min_size=1, max_size=12), st.data())
def test_job_filename_injective_on_near_misses(chars, data):
    """Names drawn from the escape's own alphabet: the pairs a random text almost never hits (`a_2f` vs `a/`)."""
    a = "".join(chars)
    b = "".join(data.draw(st.lists(st.sampled_from(["a", "_", "/", ".", "2", "f", "e", "5"]), min_size=1,
                                   max_size=12)))
    assert (job_filename(a) == job_filename(b)) == (a == b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=300))
def test_no_job_name_puts_its_frames_outside_out(tmp_path, job):
    """Any job name (`..`, `/etc/x`, NULs, any script): its frames land in one regular file directly in --out."""
    out = tmp_path / "out"
    path = job_path(str(out), job)
    exp = FileSink(path)
    for f in stream(0):
        exp.write(f, encode(f))
    exp.close()
    assert os.path.dirname(path) == str(out) and os.path.isfile(path) and not os.path.islink(path)
    assert all(p.parent == out and p.is_file() for p in tmp_path.rglob("*") if p != out), job

