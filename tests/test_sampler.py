# SPDX-License-Identifier: Apache-2.0
"""Unit tier: the tick loop, with named fake probes and a fake target (no kernel needed for what is tested here:
failure isolation, status reporting, scheduling without drift, the last partial interval)."""

import time

import pytest

from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.core.frame import decode, encode
from jobprobe.kernel.host import Host
from jobprobe.node.sampler import Sampler


class FakeTarget(Target):
    job = "fakejob"

    def __init__(self, ticks_alive=None):
        self.ticks_alive = ticks_alive
        self.refreshes = -1          # the sampler's start refreshes once (its probes' baseline), before any tick

    def pids(self):
        return [1]

    def refresh(self):
        self.refreshes += 1
        if self.ticks_alive is not None and self.refreshes > self.ticks_alive:
            raise TargetGone("fake job ended")


class CountingFake(Probe):
    name = "countfake"

    def start(self, target):
        self.n, self.stopped = 0, 0

    def sample(self):
        self.n += 1
        return {"n": self.n}

    def stop(self):
        self.stopped += 1


class FailsOnThirdFake(CountingFake):
    name = "failfake"

    def sample(self):
        if self.n == 2:
            raise RuntimeError("device fell off the bus\nwith detail")
        return super().sample()


class UnavailableFake(Probe):
    name = "nofake"

    def start(self, target):
        raise ProbeUnavailable("no such hardware here")


class NeedsRootFake(Probe):
    name = "rootfake"
    needs_root = True


class Recorder:
    def __init__(self):
        self.frames, self.closed = [], False

    def write(self, frame, data):
        self.frames.append(frame)

    def close(self):
        self.closed = True


class FakeClock:
    """Monotonic time that advances only when the sampler waits (plus `work` per call, to mimic slow ticks)."""

    def __init__(self, work=0.0):
        self.now, self.work = 100.0, work

    def __call__(self):
        self.now += self.work
        return self.now


def make(probes, target=None, clock=None, interval=1.0):
    rec = Recorder()
    host = Host(is_root=False, node="n1", kernel="k")
    s = Sampler(target or FakeTarget(), probes, [rec], interval=interval, host=host, clock=clock or FakeClock())
    clock = s.clock
    s.stop_event.wait = lambda timeout=None: setattr(clock, "now", clock.now + (timeout or 0)) or False
    return s, rec


def test_failing_probe_is_stopped_and_reported_while_others_go_on():
    good, bad = CountingFake(), FailsOnThirdFake()
    s, rec = make([good, bad, UnavailableFake(), NeedsRootFake()], target=FakeTarget(ticks_alive=5))
    hello = s.start()
    assert hello["probes"] == {"countfake": "ok", "failfake": "ok", "nofake": "unavailable: no such hardware here",
                               "rootfake": "unavailable: needs root"}
    assert s.run() == "fake job ended"
    s.stop()
    samples = rec.frames[1:]
    assert [f["probes"]["countfake"]["n"] for f in samples] == [1, 2, 3, 4, 5, 6]  # the last, partial tick too
    assert [f["probes"].get("failfake") for f in samples[:3]] == [{"n": 1}, {"n": 2}, None]
    assert samples[2]["status"]["failfake"] == "failed: with detail"
    assert all(f["status"]["failfake"].startswith("failed") for f in samples[2:])
    assert bad.stopped == 1 and good.stopped == 1 and rec.closed
    assert [f["seq"] for f in rec.frames] == list(range(7))


def test_ticks_stay_on_the_grid_and_skip_overruns():
    clock = FakeClock()
    s, rec = make([CountingFake()], clock=clock, interval=0.5)
    s.start()
    t0 = clock.now
    stamps = []
    orig = s.tick

    def tick():
        stamps.append(clock.now - t0)
        if len(stamps) == 3:
            clock.now += 1.2          # one slow tick: overruns two deadlines
        return orig()

    s.tick = tick
    s.run(duration=4.0)
    assert stamps[:3] == [0.5, 1.0, 1.5]
    assert stamps[3] == 3.0            # 2.0 and 2.5 were missed: skipped, not fired back to back
    assert stamps[-1] == 4.0 and all(abs(x * 2 - round(x * 2)) < 1e-9 for x in stamps)


def test_dt_is_measured_not_assumed():
    s, rec = make([CountingFake()], interval=1.0)
    s.start()
    s.run(duration=2.5)
    assert [f["dt"] for f in rec.frames[1:]] == [1.0, 1.0, 0.5]


class SlowOnSecondFake(CountingFake):
    """Its second read takes 30 ms of the (fake) clock: the probe sampled after it in that tick reads late."""
    name = "slowfake"
    clock = None

    def sample(self):
        out = super().sample()
        if self.n == 2:
            self.clock.now += 0.03
        return out


def test_each_probe_says_the_interval_its_own_counters_cover():
    """The tick's dt runs from one tick's start to the next; a probe sampled 30 ms into a tick (the one before it
    slow) has counters that cover 1.03 s there and 0.97 s in the tick after: `read_dt` says so, per probe, from its
    second read on (timeuse takes its rates over it: a one-thread job read 1.008 s of CPU and wait in a 0.975 s
    tick) — and from its first: its baseline is read as it starts (an eBPF probe beside it compiling for 0.6 s made a
    burner's first interval read 1.67 cores)."""
    slow, after = SlowOnSecondFake(), CountingFake()
    s, rec = make([slow, after], target=FakeTarget(ticks_alive=4))
    slow.clock = s.clock
    s.start()
    s.run()
    samples = rec.frames[1:]
    assert [f["dt"] for f in samples[:3]] == [1.0, 1.0, 1.0]
    assert samples[0]["read_dt"] == {"slowfake": pytest.approx(1.0), "countfake": pytest.approx(1.0)}
    assert samples[1]["read_dt"] == {"slowfake": pytest.approx(1.0), "countfake": pytest.approx(1.03)}
    assert samples[2]["read_dt"] == {"slowfake": pytest.approx(1.0), "countfake": pytest.approx(0.97)}


class EventFake(CountingFake):
    name = "eventfake"

    def sample(self):
        out = super().sample()
        if self.n == 2:
            out["_events"] = [{"event": "oom_kill", "pid": 42, "t": 123.5}, {"event": "xid", "code": 79}]
        return out


def test_probe_events_become_event_frames_after_the_sample():
    s, rec = make([EventFake()], target=FakeTarget(ticks_alive=2))
    s.start()
    s.run()
    kinds = [(f["kind"], f.get("event")) for f in rec.frames]
    assert kinds == [("hello", None), ("sample", None), ("sample", None), ("event", "oom_kill"), ("event", "xid"),
                     ("sample", None)]
    oom, xid = rec.frames[3], rec.frames[4]
    assert oom["probe"] == "eventfake" and oom["pid"] == 42 and oom["t"] == 123.5 and oom["dt"] == 0.0
    assert xid["code"] == 79 and xid["t"] == rec.frames[2]["t"]
    assert "_events" not in rec.frames[2]["probes"]["eventfake"]
    assert [f["seq"] for f in rec.frames] == list(range(6))


def test_probes_start_side_by_side():
    """Each fake's start waits at a barrier for all the others: it passes only if every start runs at once (an eBPF
    probe's start waits for its loader's compile; in a row, N of them take N times as long). Order and status stay
    as given."""
    import threading
    barrier = threading.Barrier(4, timeout=20)

    class BarrierFake(Probe):
        def start(self, target):
            barrier.wait()

    fakes = [type(f"Fake{i}", (BarrierFake,), {"name": f"fake{i}"})() for i in range(3)]
    s, rec = make([*fakes, UnavailableFake()])
    gate = threading.Thread(target=barrier.wait)     # the fourth party: this test, also at the barrier
    gate.start()
    hello = s.start()
    gate.join()
    assert list(hello["probes"]) == ["fake0", "fake1", "fake2", "nofake"]
    assert hello["probes"]["fake0"] == "ok" and hello["probes"]["nofake"] == "unavailable: no such hardware here"
    assert not barrier.broken


class DeclaredFake(CountingFake):
    name = "declfake"
    fields = {"n": Field("int", "count", "ticks sampled this interval"),
              "n_now": Field("int", "count", "ticks so far", kind="gauge"),
              "n_us_log2": Field("list[int]", "count", "a histogram")}


def test_hello_carries_the_schema_of_the_probes_that_started():
    from jobprobe.probes.self import SelfProbe
    s, rec = make([SelfProbe(), DeclaredFake(), UnavailableFake(), NeedsRootFake()])
    hello = s.start()
    s.stop()
    assert set(hello["schema"]) == {"self", "declfake"}          # only the probes that started: "ok" in `probes`
    assert hello["schema"]["declfake"] == {"n": {"type": "int", "unit": "count", "kind": "counter"},
                                           "n_now": {"type": "int", "unit": "count", "kind": "gauge"},
                                           "n_us_log2": {"type": "list[int]", "unit": "count", "kind": "histogram"}}
    assert hello["schema"]["self"] == {k: {"type": f.type, "unit": f.unit, "kind": f.kind}
                                       for k, f in SelfProbe.fields.items()}
    assert hello["schema"]["self"]["cpu_cores"]["kind"] == "gauge"
    assert decode(encode(hello)) == hello


def test_every_frame_of_a_run_carries_its_run_and_the_next_run_another():
    runs = []
    for _ in range(2):
        s, rec = make([EventFake()], target=FakeTarget(ticks_alive=2))
        s.start()
        s.run()
        assert {f["kind"] for f in rec.frames} == {"hello", "sample", "event"}
        assert len({f["run"] for f in rec.frames}) == 1
        assert [f["seq"] for f in rec.frames] == list(range(len(rec.frames)))
        runs.append(rec.frames[0]["run"])
    assert runs[0] != runs[1]


class SlowWindowFake(CountingFake):
    """A window-only probe whose start (an eBPF probe's compile) waits for `gate`; records what it is asked."""
    name = "slowfake"
    deep = True

    def __init__(self, gate):
        self.gate, self.asked, self.stopped, self.started = gate, [], 0, False

    def start(self, target):
        super().start(target)
        assert self.gate.wait(20)
        self.started = True

    def trace_on(self, on):
        self.asked.append(on)

    def trace_take(self):
        self.asked.append("take")
        return [], 0


def window_sampler(tmp_path, slow):
    rec = Recorder()
    s = Sampler(FakeTarget(), [CountingFake()], [rec], interval=1.0, host=Host(is_root=False, node="n1", kernel="k"),
                trace_dir=str(tmp_path), window_probes=[slow])
    s.start()
    r = s.open_trace("request", {}, 1.0, force_budget=True)
    assert r["ok"], r
    return s, rec


def test_a_window_only_probes_compile_never_holds_the_tick(tmp_path):
    """A deep-trace window's window-only probe starts (compiles) in a thread of its own: the tick that opens the
    window returns at once, the probe records from the end of its start, joins the window's probes and the frames
    at the next tick, and the window's end takes its records and stops it."""
    import threading
    gate = threading.Event()
    slow = SlowWindowFake(gate)
    s, rec = window_sampler(tmp_path, slow)
    t0 = time.monotonic()
    s.tick()                                     # the window's first tick: the start begins, the tick goes on
    s.tick()
    assert time.monotonic() - t0 < 0.5 and not slow.started
    assert "slowfake" not in rec.frames[-1]["status"] and "slowfake" not in s.running
    gate.set()
    assert wait_until(lambda: slow.asked == [True])   # deep mode on from its start's end, before joining
    frame = s.tick()
    assert s.running.get("slowfake") is slow and frame["status"]["slowfake"] == "ok"
    assert frame["probes"]["slowfake"] == {"n": 1}
    time.sleep(1.0)
    s.tick()                                     # past the window's end: deep mode off, records taken, stopped
    assert slow.asked == [True, False, "take"] and slow.stopped == 1     # every probe off first: one end for all
    assert "slowfake" not in s.running and "slowfake" not in s.tick()["status"]
    s.stop()
    assert slow.stopped == 1
    # the trace file says from when each probe recorded: the window-only one from its start's end (after the gate)
    import gzip
    import json
    (path,) = tmp_path.glob("*.trace.json.gz")
    other = json.loads(gzip.open(path, "rt").read())["otherData"]
    on, off = other["kernel_events_us"]
    slow_on, slow_off = other["kernel_events_us_by_probe"]["slowfake"]
    assert on < slow_on < slow_off == off


def test_a_window_only_probe_started_after_its_window_ended_is_stopped_unseen(tmp_path):
    import threading
    gate = threading.Event()
    slow = SlowWindowFake(gate)
    s, rec = window_sampler(tmp_path, slow)
    s.tick()
    time.sleep(1.0)
    s.tick()                                     # the window ends while the probe still compiles
    gate.set()
    assert wait_until(lambda: slow.asked == [True])
    s.tick()
    assert slow.stopped == 1 and "take" not in slow.asked and "slowfake" not in s.running
    assert all("slowfake" not in f.get("status", {}) for f in rec.frames)
    s.stop()
    assert slow.stopped == 1


def test_a_job_that_ends_while_its_window_probe_compiles_lets_it_go(tmp_path):
    import threading
    gate = threading.Event()
    slow = SlowWindowFake(gate)
    s, rec = window_sampler(tmp_path, slow)
    s.tick()
    threading.Timer(0.3, gate.set).start()
    s.stop()                                     # waits for the start to end, then stops the probe
    assert slow.started and slow.stopped == 1


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_tick_memo_keyed_by_an_object_never_serves_its_value_to_a_new_object():
    """Objects made and freed within one tick (a job detached and another attached) often reuse an address: a
    memo keyed by id() would hand the new object the old one's value."""
    from jobprobe.contract import tickmemo

    class Table:
        pass
    tickmemo.begin()
    try:
        got = []
        for i in range(50):
            table = Table()
            got.append(tickmemo.get(("slots", table), lambda i=i: i))
            del table
        assert got == list(range(50))
    finally:
        tickmemo.end()
