"""Unit tier: the file exporter (append-safe, rotation with a hello at the top of each file) and stdout lines."""
import io
import json

from jobprobe.exporters.file import FileExporter
from jobprobe.exporters.stdout import StdoutExporter, human_line
from jobprobe.frame import FrameBuilder, StreamReader, encode


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
        exp = FileExporter(str(out))
        for f in stream(3):
            exp.write(f, encode(f))
        exp.close()
    got = read_all(out)
    assert len(got) == 8 and [f["seq"] for f in got] == [0, 1, 2, 3] * 2


def test_rotation_by_size_starts_each_file_with_hello(tmp_path):
    out = tmp_path / "f.mpk"
    exp = FileExporter(str(out), max_mb=0.002, keep=3)   # ~2 KiB per file
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
    exp = StdoutExporter("json", buf)
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
