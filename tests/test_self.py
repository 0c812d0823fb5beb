# SPDX-License-Identifier: Apache-2.0
"""self probe: the collector's own cost, checked against what the test makes the process do."""
import os
import time

from jobprobe.probes.self import SelfProbe


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


def test_sink_fields_are_per_interval_deltas_of_the_injected_counters():
    # What the caller hands in: {sink: counters since the sink was made} (QueuedSink.stats()); the probe never
    # imports a sink. Here the test is the sinks, so every number is known.
    stats = {"file": {"queued": 5, "written": 3, "dropped": 2, "errors": 0, "depth": 0, "in_flight": 0,
                      "state": "ok"}}
    p = SelfProbe(sinks=lambda: {k: dict(v) for k, v in stats.items()})
    p.start(None)
    s = p.sample()                                       # the first interval counts from the sink's making
    assert (s["sink_dropped"], s["sink_errors"], s["sink_queue_max"]) == (2, 0, 0)
    assert s["sinks"] == [{"name": "file", "dropped": 2, "dropped_total": 2, "errors": 0, "depth": 0, "state": "ok"}]
    assert s["sink_dropped_total"] == 2
    stats["file"].update(dropped=9, errors=4, depth=7)
    stats["nats"] = {"queued": 1, "written": 0, "dropped": 1, "errors": 1, "depth": 30, "in_flight": 0,
                     "state": "stopped: broken pipe"}    # a sink seen for the first time: from zero
    s = p.sample()
    assert (s["sink_dropped"], s["sink_errors"], s["sink_queue_max"]) == (7 + 1, 4 + 1, 30)
    assert s["sinks"][1] == {"name": "nats", "dropped": 1, "dropped_total": 1, "errors": 1, "depth": 30,
                             "state": "stopped: broken pipe"}
    s = p.sample()                                       # nothing new happened: 0, while the queues stay deep
    assert (s["sink_dropped"], s["sink_errors"], s["sink_queue_max"]) == (0, 0, 30)
    assert s["sink_dropped_total"] == 9 + 1              # the running total stays whole in every frame


def test_without_sinks_the_sink_fields_are_absent_not_zero():
    p = SelfProbe()
    p.start(None)
    assert not any(k.startswith("sink") for k in p.sample())
