# SPDX-License-Identifier: Apache-2.0
"""Unit tier: frames round-trip, streams cut short are read up to the cut, malformed input is refused."""
import io

import msgpack
import pytest

from jobprobe.core.frame import FrameBuilder, MalformedFrame, StreamReader, decode, encode, validate


def frames(n=5):
    b = FrameBuilder("node1", "job7")
    out = [b.hello(version="x", probes={"cgroup": "ok"})]
    for i in range(n):
        out.append(b.sample(1000.0 + i, 1.0, {"cgroup": {"cpu_user_ns": i * 10, "hist": [1, 2, 3]}},
                            {"cgroup": "ok"}))
    return out


def test_round_trip_keeps_every_field_and_seq_has_no_gaps():
    fs = frames()
    back = [decode(encode(f)) for f in fs]
    assert back == fs
    assert [f["seq"] for f in back] == list(range(len(fs)))
    assert back[0]["kind"] == "hello" and all(f["kind"] == "sample" for f in back[1:])
    assert all(f["v"] == 1 and f["node"] == "node1" and f["job"] == "job7" for f in back)


def test_stream_of_frames_decodes_in_order():
    fs = frames(20)
    r = StreamReader(io.BytesIO(b"".join(encode(f) for f in fs)), chunk=7)  # tiny chunks: frames span reads
    assert list(r) == fs
    assert r.truncated is None and r.count == 21


@pytest.mark.parametrize("cut", [1, 5, 30])
def test_truncated_last_frame_keeps_the_rest_and_says_where(cut):
    fs = frames(3)
    blobs = [encode(f) for f in fs]
    data = b"".join(blobs)[:-cut]
    r = StreamReader(io.BytesIO(data))
    assert list(r) == fs[:-1]
    whole = sum(len(b) for b in blobs[:-1])
    assert r.truncated == (whole, len(data) - whole)


def test_not_a_map_is_malformed_with_offset():
    good = encode(frames(1)[0])
    r = StreamReader(io.BytesIO(good + msgpack.packb([1, 2, 3])))
    with pytest.raises(MalformedFrame, match=f"byte {len(good)}"):
        list(r)
    assert r.count == 1


@pytest.mark.parametrize("bad", [
    {"v": 1, "kind": "sample", "node": "n", "job": "j", "seq": 0, "t": 1.0},            # no dt
    {"v": 1, "kind": "bogus", "node": "n", "job": "j", "seq": 0, "t": 1.0, "dt": 1.0},  # unknown kind
    {"v": 1, "kind": "sample", "node": "n", "job": "j", "seq": "0", "t": 1.0, "dt": 1.0},
])
def test_validate_rejects(bad):
    with pytest.raises(MalformedFrame):
        validate(bad)


def test_decode_rejects_garbage():
    with pytest.raises(MalformedFrame):
        decode(b"\xc1")  # 0xc1 is never used in msgpack


def test_run_is_in_every_frame_constant_within_a_run_and_new_for_the_next():
    first, second = frames(3), frames(3)
    runs = {f["run"] for f in first}
    assert len(runs) == 1 and all(decode(encode(f))["run"] == f["run"] for f in first)
    (run,) = runs
    assert isinstance(run, str) and len(run) == 16 and int(run, 16) >= 0
    assert second[0]["run"] != run                              # a restart is a new run: seq starts at 0 again,
    assert [f["seq"] for f in second] == [f["seq"] for f in first]  # (node, job, run, seq) stays unique
    keys = {(f["node"], f["job"], f["run"], f["seq"]) for f in first + second}
    assert len(keys) == len(first) + len(second)


def test_a_given_run_id_is_used():
    b = FrameBuilder("n", "j", run="00000000deadbeef")
    assert b.hello()["run"] == b.sample(1.0, 1.0, {}, {})["run"] == b.event(1.0, "x")["run"] == "00000000deadbeef"


def test_frames_from_before_the_run_id_still_validate():
    old = {"v": 1, "kind": "sample", "node": "n", "job": "j", "seq": 3, "t": 1.0, "dt": 1.0, "probes": {},
           "status": {}}
    assert decode(msgpack.packb(old)) == old
    assert list(StreamReader(io.BytesIO(msgpack.packb(old) * 2))) == [old, old]


def test_run_of_the_wrong_type_is_refused():
    with pytest.raises(MalformedFrame, match="'run' has type int"):
        validate({"v": 1, "kind": "sample", "node": "n", "job": "j", "run": 7, "seq": 0, "t": 1.0, "dt": 1.0})
