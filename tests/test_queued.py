# SPDX-License-Identifier: Apache-2.0
"""Unit tier: a sink behind its bounded queue (exporters/queued.py). Real threads, real files read back with
StreamReader: a slow or stuck sink never holds up write(); what it drops is counted exactly; errors are counted and
logged once per kind; a dead pipe stops the sink; the self probe reports it all per interval."""
import errno
import logging
import os
import threading
import time

from jobprobe.core.frame import FrameBuilder, StreamReader, encode
from jobprobe.exporters.file import FileSink
from jobprobe.exporters.queued import QueuedSink, SinkWorker, sink_stats
from jobprobe.exporters.stdout import StdoutSink
from jobprobe.probes.self import SelfProbe


def frames(n, hello=True):
    b = FrameBuilder("n", "j")
    if hello:
        yield b.hello(version="t", probes={"self": "ok"})
    for i in range(n):
        yield b.sample(1e9 + i, 1.0, {"self": {"cpu_ns": i}}, {"self": "ok"})


def read_seqs(path):
    with open(path, "rb") as fp:
        return [(f["kind"], f["seq"]) for f in StreamReader(fp)]


def balanced(st):
    """Every frame handed to write() is in exactly one place."""
    return st["queued"] == st["written"] + st["errors"] + st["dropped"] + st["depth"] + st["in_flight"]


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


class Slow(FileSink):
    """A file that takes `first` s for its first frame, `each` s for every later one."""

    def __init__(self, path, first, each):
        super().__init__(path)
        self.delays = [first]
        self.each = each

    def write(self, frame, data):
        time.sleep(self.delays.pop() if self.delays else self.each)
        super().write(frame, data)


class Gated(FileSink):
    """A file whose writes block until `gate` is set (forever, if nobody sets it)."""

    def __init__(self, path):
        super().__init__(path)
        self.gate = threading.Event()
        self.closed_by = None

    def write(self, frame, data):
        self.gate.wait()
        super().write(frame, data)

    def close(self):
        self.closed_by = threading.current_thread().name
        super().close()


def test_slow_sink_does_not_delay_writes_and_close_flushes_all(tmp_path):
    out = tmp_path / "f.mpk"
    sink = QueuedSink(Slow(str(out), first=0.5, each=0.01), "file")   # written inline: ~1 s for 51 frames
    fs = list(frames(50))
    t0 = time.perf_counter()
    for f in fs:
        sink.write(f, encode(f))
    spent = time.perf_counter() - t0
    assert spent < 0.05, spent
    assert sink.stats()["written"] == 0            # the sink is still in its first, slow write
    sink.close(timeout=30)
    st = sink.stats()
    assert st == {"queued": 51, "written": 51, "dropped": 0, "errors": 0, "depth": 0, "in_flight": 0,
                  "state": "closed"}
    assert read_seqs(out) == [("hello", 0)] + [("sample", i) for i in range(1, 51)]


def test_stuck_sink_drops_the_oldest_counted_exactly(tmp_path):
    out = tmp_path / "f.mpk"
    inner = Gated(str(out))
    sink = QueuedSink(inner, "file", maxsize=10)
    fs = list(frames(100))
    sink.write(fs[0], encode(fs[0]))
    wait_for(lambda: sink.stats()["in_flight"] == 1)   # the hello is in the worker's hands, stuck
    t0 = time.perf_counter()
    for f in fs[1:]:
        sink.write(f, encode(f))
    assert time.perf_counter() - t0 < 0.05
    st = sink.stats()
    assert (st["queued"], st["in_flight"], st["depth"], st["dropped"], st["written"]) == (101, 1, 10, 90, 0)
    assert balanced(st)
    inner.gate.set()                                   # the sink recovers: it delivers the newest frames
    sink.close(timeout=10)
    st = sink.stats()
    assert (st["written"], st["dropped"], st["errors"]) == (11, 90, 0) and balanced(st)
    assert read_seqs(out) == [("hello", 0)] + [("sample", i) for i in range(91, 101)]


def test_a_queued_hello_is_never_the_one_dropped(tmp_path):
    out = tmp_path / "f.mpk"
    inner = Gated(str(out))
    sink = QueuedSink(inner, "file", maxsize=10)
    b = FrameBuilder("n", "j")
    first = b.sample(1e9, 1.0, {}, {})                 # seq 0: stuck in flight
    sink.write(first, encode(first))
    wait_for(lambda: sink.stats()["in_flight"] == 1)
    hello = b.hello(version="t", probes={})            # seq 1: queued first, so the oldest
    sink.write(hello, encode(hello))
    for i in range(20):                                # seq 2..21: the 11 oldest of them go
        f = b.sample(1e9 + i, 1.0, {}, {})
        sink.write(f, encode(f))
    assert sink.stats()["dropped"] == 11
    inner.gate.set()
    sink.close(timeout=10)
    assert read_seqs(out) == [("sample", 0), ("hello", 1)] + [("sample", i) for i in range(13, 22)]


def test_close_gives_up_on_a_stuck_sink_in_time_and_counts_what_it_could_not_flush(tmp_path):
    inner = Gated(str(tmp_path / "f.mpk"))
    sink = QueuedSink(inner, "file", maxsize=10)
    fs = list(frames(30))
    sink.write(fs[0], encode(fs[0]))
    wait_for(lambda: sink.stats()["in_flight"] == 1)
    for f in fs[1:]:
        sink.write(f, encode(f))
    t0 = time.monotonic()
    sink.close(timeout=0.2)
    assert 0.19 <= time.monotonic() - t0 < 1.0
    st = sink.stats()
    assert st == {"queued": 31, "written": 0, "dropped": 31, "errors": 0, "depth": 0, "in_flight": 0,
                  "state": "closed"}
    assert inner.closed_by is None                     # never closed under a write still running
    sink.write(fs[1], encode(fs[1]))                   # after close: dropped, counted
    assert sink.stats()["dropped"] == 32 and balanced(sink.stats())
    sink.close(timeout=0.2)                            # idempotent
    inner.gate.set()                                   # the stuck write returns: the worker closes the file
    wait_for(lambda: inner.closed_by is not None)
    assert inner.closed_by == "sink-file"
    assert sink.stats()["written"] == 0 and sink.stats()["dropped"] == 32   # counted once, as dropped


def test_sinks_sharing_one_worker_take_turns_and_one_stuck_sink_holds_up_only_its_worker(tmp_path):
    """The agent's per-job files share one SinkWorker: frames of busy sinks are taken in turn, every frame is
    written in order to its own file, and the thread ends with the last sink. A stuck sink holds up its worker's
    other sinks (never write()): closing one of them gives up in time, counts its queue, and closes its file at
    once (the worker is busy elsewhere); the stuck sink's file is closed by the worker when its write returns."""
    worker = SinkWorker("files")
    order = []

    class Logged(FileSink):
        def write(self, frame, data):
            order.append(self.path)
            super().write(frame, data)

    paths = [str(tmp_path / f"{i}.mpk") for i in range(3)]
    sinks = [QueuedSink(Logged(p), f"file:{p}", maxsize=100, worker=worker) for p in paths]
    assert worker.thread is not None and worker.thread.name == "sink-files"
    first = worker.thread
    with worker.cond:                         # queue every frame before the worker takes one
        for s in sinks:
            for f in frames(20):
                s.write(f, encode(f))
    for s in sinks:
        s.close(timeout=10)
    assert [read_seqs(p) for p in paths] == [[("hello", 0)] + [("sample", i) for i in range(1, 21)]] * 3
    assert order[:6] == paths * 2             # in turn, not one sink's backlog after another's
    assert all(s.stats() == {"queued": 21, "written": 21, "dropped": 0, "errors": 0, "depth": 0, "in_flight": 0,
                             "state": "closed"} for s in sinks)
    first.join(5)
    assert not first.is_alive() and worker.thread is None       # no sink left: no thread

    stuck = Gated(str(tmp_path / "stuck.mpk"))
    free = Logged(str(tmp_path / "free.mpk"))
    s_stuck = QueuedSink(stuck, "stuck", maxsize=10, worker=worker)
    s_free = QueuedSink(free, "free", maxsize=10, worker=worker)
    fs = list(frames(15))
    s_stuck.write(fs[0], encode(fs[0]))
    wait_for(lambda: s_stuck.stats()["in_flight"] == 1)
    t0 = time.monotonic()
    for f in fs:
        s_free.write(f, encode(f))            # never blocks, though its worker is stuck
    assert time.monotonic() - t0 < 0.5
    st = s_free.stats()
    assert st["depth"] == 10 and st["dropped"] == 6 and balanced(st)
    s_free.close(timeout=0.2)
    st = s_free.stats()
    assert st == {"queued": 16, "written": 0, "dropped": 16, "errors": 0, "depth": 0, "in_flight": 0,
                  "state": "closed"}
    assert free._fd == -1                     # closed by close() itself: the worker is in another sink's write
    stuck.gate.set()
    s_stuck.close(timeout=5)
    assert s_stuck.stats()["written"] == 1 and read_seqs(stuck.path) == [("hello", 0)]


class Failing(FileSink):
    """A file that raises on the frames whose seq is in `fail` (err(seq) says what), and writes the rest."""

    def __init__(self, path, fail):
        super().__init__(path)
        self.fail = fail

    def write(self, frame, data):
        if frame["seq"] in self.fail:
            raise self.fail[frame["seq"]]
        super().write(frame, data)


def test_errors_are_counted_logged_once_per_kind_and_the_sink_goes_on(tmp_path, caplog):
    out = tmp_path / "f.mpk"
    fail = {s: OSError(errno.ENOSPC, "No space left on device") for s in (3, 4, 5, 9, 12)}
    fail[7] = RuntimeError("sink bug")
    fail[8] = RuntimeError("sink bug again")
    sink = QueuedSink(Failing(str(out), fail), "file")
    with caplog.at_level(logging.ERROR, logger="jobprobe.sink"):
        for f in frames(19):
            sink.write(f, encode(f))
        sink.close(timeout=10)
    st = sink.stats()
    assert (st["queued"], st["written"], st["errors"], st["dropped"], st["state"]) == (20, 13, 7, 0, "closed")
    assert read_seqs(out) == [("hello", 0)] + [("sample", i) for i in range(1, 20) if i not in fail]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors                    # one per kind: ENOSPC, RuntimeError
    assert "OSError" in errors[0] and "No space left" in errors[0] and "RuntimeError" in errors[1]


def test_a_broken_pipe_stops_the_sink_and_every_later_frame_is_counted_dropped(caplog):
    r, w = os.pipe()
    os.close(r)                                        # the reader is gone: `jobprobe run | head` after head exits
    stream = os.fdopen(w, "w")
    sink = QueuedSink(StdoutSink("json", stream), "stdout")
    fs = list(frames(9))
    with caplog.at_level(logging.ERROR, logger="jobprobe.sink"):
        for f in fs[:5]:
            sink.write(f, encode(f))
        wait_for(lambda: sink.stats()["state"] != "ok")
        for f in fs[5:]:
            sink.write(f, encode(f))
        sink.close(timeout=1)
    st = sink.stats()
    assert st == {"queued": 10, "written": 0, "errors": 1, "dropped": 9, "depth": 0, "in_flight": 0,
                  "state": "stopped: broken pipe"}
    assert len([r for r in caplog.records if "stopped" in r.getMessage()]) == 1
    try:
        stream.close()
    except BrokenPipeError:
        pass


def test_self_probe_reports_what_real_sinks_dropped_per_interval(tmp_path):
    good = QueuedSink(FileSink(str(tmp_path / "a.mpk")), "file")
    stuck_inner = Gated(str(tmp_path / "b.mpk"))
    stuck = QueuedSink(stuck_inner, "slow", maxsize=4)
    sinks = [good, stuck]
    probe = SelfProbe(sinks=lambda: sink_stats(sinks))
    probe.start(None)
    fs = list(frames(20))
    for s in sinks:
        s.write(fs[0], encode(fs[0]))
    wait_for(lambda: stuck.stats()["in_flight"] == 1)
    for f in fs[1:10]:                                 # slow: 1 in flight, 4 queued, 5 dropped
        for s in sinks:
            s.write(f, encode(f))
    wait_for(lambda: good.stats()["written"] == 10)
    s1 = probe.sample()
    assert (s1["sink_dropped"], s1["sink_errors"], s1["sink_queue_max"]) == (5, 0, 4)
    assert s1["sinks"] == [{"name": "file", "dropped": 0, "dropped_total": 0, "errors": 0, "depth": 0, "state": "ok"},
                           {"name": "slow", "dropped": 5, "dropped_total": 5, "errors": 0, "depth": 4, "state": "ok"}]
    s2 = probe.sample()                                # nothing new: deltas are 0, the queue is still deep
    assert (s2["sink_dropped"], s2["sink_queue_max"]) == (0, 4)
    for f in fs[10:]:
        for s in sinks:
            s.write(f, encode(f))
    wait_for(lambda: good.stats()["written"] == 21)
    s3 = probe.sample()
    assert (s3["sink_dropped"], s3["sink_queue_max"]) == (11, 4)
    assert s3["sink_dropped_total"] == 5 + 11             # the running total: whole in every frame
    stuck_inner.gate.set()
    for s in sinks:
        s.close(timeout=10)
    s4 = probe.sample()
    assert (s4["sink_dropped"], s4["sink_queue_max"]) == (0, 0)
    assert [p["state"] for p in s4["sinks"]] == ["closed", "closed"]
    assert len(read_seqs(tmp_path / "b.mpk")) == 5 and len(read_seqs(tmp_path / "a.mpk")) == 21


def test_frames_written_while_the_worker_is_held_wait_for_the_end_of_the_hold_then_all_go(tmp_path):
    """The agent's tick holds the files' worker while it writes a frame per job: nothing is taken before the hold
    ends (no wake-up per job), then everything is written, in order; writes outside a hold wake the worker at once."""
    worker = SinkWorker("files")
    paths = [str(tmp_path / f"{i}.mpk") for i in range(4)]
    sinks = [QueuedSink(FileSink(p), f"file:{p}", maxsize=100, worker=worker) for p in paths]
    fs = list(frames(3))
    with worker.hold():
        for s in sinks:
            s.write(fs[0], encode(fs[0]))
        with worker.hold():                      # nested: only the outermost end wakes the worker
            for s in sinks:
                s.write(fs[1], encode(fs[1]))
        time.sleep(0.3)
        assert [s.stats()["written"] for s in sinks] == [0] * 4
        assert [s.stats()["depth"] for s in sinks] == [2] * 4
    wait_for(lambda: all(s.stats()["written"] == 2 for s in sinks))
    sinks[0].write(fs[2], encode(fs[2]))         # no hold: taken at once
    wait_for(lambda: sinks[0].stats()["written"] == 3)
    with worker.hold():                          # a job that ends inside the tick: its sink closes, flushed now
        sinks[1].write(fs[2], encode(fs[2]))
        t0 = time.monotonic()
        sinks[1].close(timeout=5)
        assert time.monotonic() - t0 < 2 and sinks[1].stats()["written"] == 3
    for s in sinks:
        s.close(timeout=5)
    assert read_seqs(paths[1]) == [("hello", 0), ("sample", 1), ("sample", 2)]
    del paths[1]
    assert read_seqs(paths[0]) == [("hello", 0), ("sample", 1), ("sample", 2)]
    assert [read_seqs(p) for p in paths[1:]] == [[("hello", 0), ("sample", 1)]] * 2
    assert all(balanced(s.stats()) and s.stats()["dropped"] == 0 for s in sinks)
