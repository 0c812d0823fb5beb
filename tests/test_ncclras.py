# SPDX-License-Identifier: Apache-2.0
"""The ncclras probe against a stand-in NCCL RAS port speaking the documented text protocol (NCCL's troubleshooting
guide, "RAS"; what `ncclras` sends and the server answers): a JSON server (2.28.7+) and a text-only one (an older
NCCL answers `ERROR: Unknown command` to `SET FORMAT json`). The job is a real process whose environment names the
port (NCCL_RAS_ADDR, as an NCCL job's would); its rank is behind its peers by 3 AllReduce operations, and the probe
must say so — and only of the rank that is its. A port that lies, stalls or floods, or nothing listening: the
error field, never an exception."""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobprobe.devices import ncclras
from jobprobe.kernel.host import Host
from jobprobe.node.targets.pidtree import PidTreeTarget
from jobprobe.probes.ncclras import NcclRasProbe


class StandIn:
    """An NCCL RAS port: one status per connection, then it closes (no terminator), as NCCL's server does."""

    def __init__(self, ranks: list[tuple[int, str, int, int]], json_ok: bool = True, reply: bytes | None = None):
        self.ranks, self.json_ok, self.reply = ranks, json_ok, reply       # (rank, host, pid, AllReduce count)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.asked: list[str] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c, c.makefile("rwb", buffering=0) as f:     # (the file too: else the socket stays open)
                fmt = "text"
                for raw in f:
                    line = raw.decode().strip()
                    self.asked.append(line)
                    if line.upper().startswith("CLIENT PROTOCOL "):
                        f.write(b"SERVER PROTOCOL 2\n")
                    elif line.upper().startswith("TIMEOUT "):
                        f.write(b"OK\n")
                    elif line.upper() == "SET FORMAT JSON" and self.json_ok:
                        fmt = "json"
                        f.write(b"OK\n")
                    elif line.upper() in ("STATUS", "VERBOSE STATUS"):
                        body = self.reply if self.reply is not None else (
                            self.json() if fmt == "json" else self.text()).encode()
                        for i in range(0, len(body), 700):        # in chunks, as the server sends it
                            f.write(body[i:i + 700])
                        break
                    else:
                        f.write(f"ERROR: Unknown command {line}\n".encode())

    def json(self) -> str:
        return json.dumps({"nccl_version": "2.29.2", "communicators_count": 1, "communicators": [{
            "hash": "0x3f2a9c", "size": len(self.ranks), "ranks_count": len(self.ranks), "missing_ranks_count": 0,
            "ranks": [{"rank": r, "host": h, "pid": p, "cuda_dev": r, "nvml_dev": r,
                       "collective_counts": {"Broadcast": 1, "Reduce": 0, "AllGather": 0, "ReduceScatter": 0,
                                             "AllReduce": n}} for r, h, p, n in self.ranks],
            "missing_ranks": []}], "ras": {"collection_time_sec": 0.012, "timeouts_count": 0}}, indent=2) + "\n"

    def text(self) -> str:
        counts = sorted({n for *_, n in self.ranks}, key=lambda n: (-sum(x[3] == n for x in self.ranks), -n))
        out = ["NCCL version 2.25.1 compiled with CUDA 12.8", "CUDA runtime version 12080, driver version 12080", "",
               "Job summary", "===========", "", "  Nodes  Processes         GPUs  Processes     GPUs",
               "(total)   per node  per process    (total)  (total)", f"      2          2            1  "
               f"{len(self.ranks):9d}  {len(self.ranks):7d}", "", "Communicators... (0.01s)", "=============", "",
               "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors",
               "    #  in group  per comm  per node  per comm  in group",
               f"    0         1         2         2  {len(self.ranks):8d}  {len(self.ranks):8d}   RUNNING  MISMATCH",
               "", "Errors", "======", "", "Warnings", "========", "", "#0-0 (00000000003f2a9c) MISMATCH",
               "  Communicator ranks have different AllReduce operation counts"]
        for n in counts:
            members = [x for x in self.ranks if x[3] == n]
            if len(members) == 1:
                r, h, p, _ = members[0]
                out.append(f"  Rank {r} has launched up to operation {n} -- GPU {r} managed by process {p} on node {h}")
                continue
            out.append(f"  {len(members)} ranks have launched up to operation {n}")
            if len(members) <= 10 and len(members) < 0.5 * len(self.ranks):       # VERBOSE: under half listed
                out += [f"  Rank {r} -- GPU {r} managed by process {p} on node {h}" for r, h, p, _ in members]
        return "\n".join(out) + "\n\n"

    def close(self) -> None:
        self.sock.close()


def job(spawn, port: int) -> subprocess.Popen:
    """A real process of the job; its environment names the port, as an NCCL job's would."""
    return spawn(env={"NCCL_RAS_ADDR": f"127.0.0.1:{port}"})


def probe_on(pid: int) -> NcclRasProbe:
    p = NcclRasProbe(Host(), every=0.2)
    p.start(PidTreeTarget([pid]))
    return p


def first_polled(p: NcclRasProbe, timeout: float = 10) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = p.sample()
        if s["polled"] or s["error"]:
            return s
        time.sleep(0.1)
    raise AssertionError("the probe never polled the port")


def polled_once(pid: int, port: StandIn) -> dict:
    """The probe on the job's process: its first sample with a status or an error; then stopped, the port closed."""
    p = probe_on(pid)
    try:
        return first_polled(p)
    finally:
        p.stop()
        port.close()


@pytest.mark.parametrize("json_ok", [True, False], ids=["json", "text"])
def test_the_rank_of_this_job_behind_its_peers_is_said_by_the_port(spawn, json_ok):
    # rank 0 is the job's process here, 3 AllReduce behind; ranks 1-3 are other nodes' (their addresses are not this
    # host's; one of them has the same pid as the job, as pids repeat across nodes)
    port = StandIn([], json_ok)
    proc = job(spawn, port.port)
    port.ranks = [(0, "127.0.0.1", proc.pid, 6649), (1, "192.0.2.11", proc.pid, 6652),
                  (2, "192.0.2.12", 4242, 6652), (3, "192.0.2.13", 4343, 6652)]
    s = polled_once(proc.pid, port)
    assert s["error"] is None and s["polled"] is True, s
    assert s["format"] == ("json" if json_ok else "text") and s["comms"] == 1
    assert s["ranks_here"] == 1 and s["ranks_behind_here"] == 1 and s["ops_behind"] == 3, s
    assert s["ranks_behind"] == 1 and s["missing_ranks"] == 0
    assert port.asked[:3] == ["CLIENT PROTOCOL 2", "TIMEOUT 2", "SET FORMAT json"] and port.asked[3] == \
        "VERBOSE STATUS", port.asked


@pytest.mark.parametrize("reply", [b"SERVER PROTOCOL 2\nnot json at all {", b"\x00\xff" * 5000,
                                   json.dumps({"communicators": 5}).encode(), b"[1, 2]"],
                         ids=["garbage", "binary", "wrong-shape", "not-an-object"])
def test_a_port_that_lies_is_an_error_field_not_an_exception(spawn, reply):
    port = StandIn([], True, reply=reply)
    s = polled_once(job(spawn, port.port).pid, port)
    if s["error"] is None:      # a shape it could read: nothing was made up from it
        assert s["comms"] == 0 and s["ranks_behind"] == 0, s
    else:
        assert s["polled"] is False and s["ranks_behind"] is None, s


def test_nothing_listening_is_said_and_costs_no_tick(spawn):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    proc = job(spawn, dead)
    p = probe_on(proc.pid)
    try:
        t0 = time.monotonic()
        first = p.sample()                   # never waits for the port
        assert time.monotonic() - t0 < 0.05
        s = first_polled(p) if first["error"] is None else first
    finally:
        p.stop()
    assert "ConnectionRefused" in s["error"] and s["polled"] is False and s["comms"] is None, s


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000))
def test_any_text_parses_or_is_refused_with_a_value_error(text):
    ncclras.parse_text(text)                  # text: whatever does not match is skipped
    try:
        ncclras.parse_json(text)
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(
                        st.sampled_from(["communicators", "ranks", "rank", "pid", "host", "collective_counts",
                                         "AllReduce", "missing_ranks_count", "size", "hash"]), c, max_size=6),
                    max_leaves=30))
def test_any_json_shape_parses_or_is_refused_with_a_value_error(doc):
    try:
        st_ = ncclras.parse_json(json.dumps(doc))
    except ValueError:
        return
    for c in st_.comms:
        c.behind()
