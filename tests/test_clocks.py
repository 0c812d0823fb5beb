# SPDX-License-Identifier: Apache-2.0
"""A node's clock against the stream's (jobprobe/cluster/clocks.py): the offset from the agent's publish stamp and
the stream's own time of the message, whatever the frame's own time says; named once past the bound, ended once
back within half of it; headers that are no time ignored. The real path (agents, nats-server, a controller):
tests/test_nats.py, a node eight days behind."""
from __future__ import annotations

import zlib
from datetime import datetime, timezone
from types import SimpleNamespace

from jobprobe.cluster.clocks import SKEW_S, Clocks, sent_at
from jobprobe.cluster.controller import Controller
from jobprobe.cluster.store import Store
from jobprobe.core.frame import encode
from jobprobe.core.wire import SENT_HEADER, frames_subject

T0 = 1_790_000_000.0


def frame(node: str, seq: int, t: float) -> dict:
    return {"v": 1, "kind": "sample", "node": node, "job": "j", "run": "r1", "seq": seq, "t": t, "dt": 1.0,
            "probes": {"cgroup": {"cpu_user_ns": 1000 + seq}}, "status": {"cgroup": "ok"}}


def msg(f: dict, sent: float | str | None, stored: float) -> SimpleNamespace:
    """A JetStream message as nats-py gives it: headers, and metadata with the stream's timestamp."""
    return SimpleNamespace(subject=frames_subject(f["node"], f["job"]), data=zlib.compress(encode(f)),
                           headers=None if sent is None else {SENT_HEADER: str(sent)},
                           metadata=SimpleNamespace(timestamp=datetime.fromtimestamp(stored, timezone.utc)))


def test_a_node_behind_is_named_once_and_a_backlog_on_time_is_not(tmp_path):
    ctl = Controller(Store(tmp_path / "s.db"), "nats://unused")
    # a backlog from a node on time: frames an hour old, sent and stored now — its clock is right
    late = [msg(frame("ontime", i, T0 - 3600 + i), T0 + 0.01, T0) for i in range(5)]
    # a node 8 days behind: its frames' times and its stamp both 8 days back
    behind = [msg(frame("behind", i, T0 - 8 * 86400 + i), T0 - 8 * 86400 + 0.02, T0) for i in range(5)]
    ctl.ingest(late + behind, T0 + 0.5)
    ctl.ingest([msg(frame("behind", 5, T0 - 8 * 86400 + 5), T0 - 8 * 86400 + 1, T0 + 1)], T0 + 1.5)
    ev = ctl.store.sql("SELECT node, json_extract(body, '$.offset_s'), json_extract(body, '$.reason') FROM events "
                       "WHERE event LIKE 'clock_skew%'")[1]
    assert [(n, off) for n, off, _ in ev] == [("behind", -8 * 86400 + 0.02)], ev
    assert "691200 s behind" in ev[0][2]
    assert ctl.clocks.offset == {"ontime": 0.01, "behind": -8 * 86400}      # its newest message's
    # back on time: ended once; still near the bound: nothing
    ctl.ingest([msg(frame("behind", 6, T0 + 2), T0 + 2 + SKEW_S * 0.4, T0 + 2)], T0 + 2.5)
    ctl.ingest([msg(frame("behind", 7, T0 + 3), T0 + 3 + SKEW_S * 0.45, T0 + 3)], T0 + 3.5)
    names = [e for (e,) in ctl.store.sql("SELECT event FROM events WHERE event LIKE 'clock_skew%' ORDER BY t")[1]]
    assert names == ["clock_skew", "clock_skew_end"]
    # a clock ahead: named too
    ctl.ingest([msg(frame("ahead", 0, T0 + 600), T0 + 600, T0 + 4)], T0 + 4.5)
    assert ctl.clocks.skewed == {"ahead"}


def test_a_header_that_is_no_time_is_ignored():
    for bad in ("nan", "inf", "-1", "1e300", "x" * 40, "", "12:00"):
        assert sent_at(SimpleNamespace(headers={SENT_HEADER: bad})) is None, bad
    assert sent_at(SimpleNamespace(headers=None)) is None and sent_at(SimpleNamespace()) is None
    c = Clocks()
    assert c.feed([(SimpleNamespace(headers={SENT_HEADER: "nan"}), frame("n", 0, T0))], T0) == [] and not c.offset


def test_a_heartbeat_has_no_stream_time_and_is_taken_at_its_arrival():
    c = Clocks()
    beat = SimpleNamespace(headers={SENT_HEADER: str(T0 - 300)})        # a plain subscription: no metadata
    (ev,) = c.feed([(beat, frame("n", 0, T0 - 300))], T0)
    assert ev[2] == "clock_skew" and c.offset["n"] == -300.0
    c.forget(set())
    assert not c.offset and not c.skewed
