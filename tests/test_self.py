"""self probe: the collector's own cost, checked against what the test makes the process do."""
import os
import time

from probes.self import SelfProbe


def test_self_counts_its_own_cpu_memory_and_writes(tmp_path):
    p = SelfProbe()
    w0 = time.monotonic()
    p.start(None)
    w1 = time.monotonic()
    t0 = time.process_time()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    buf = bytearray(64 << 20)             # touch 64 MiB: RSS and its peak must show it
    buf[::4096] = b"x" * len(buf[::4096])
    with open(tmp_path / "w", "wb") as f:
        f.write(b"y" * 300_000)
        f.flush()
        os.fsync(f.fileno())
    used = time.process_time() - t0
    w2 = time.monotonic()
    s = p.sample()
    w3 = time.monotonic()
    cpu = s["cpu_ns"] / 1e9
    assert abs(cpu - used) < 0.05
    # cores = CPU over the interval, whose ends the test brackets (the share a busy host leaves it varies)
    assert cpu / (w3 - w0) - 0.01 <= s["cpu_cores"] <= min(cpu / (w2 - w1), 1.0) + 0.05
    assert s["rss_bytes"] >= 64 << 20 and s["rss_peak_bytes"] >= s["rss_bytes"]
    assert 300_000 <= s["written_bytes"] < 400_000
    del buf
    s2 = p.sample()
    assert s2["written_bytes"] < 10_000 and s2["rss_peak_bytes"] >= 64 << 20
