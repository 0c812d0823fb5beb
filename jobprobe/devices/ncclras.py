# SPDX-License-Identifier: Apache-2.0
"""NCCL's RAS port (NCCL 2.24 and later): every process of an NCCL job listens on NCCL_RAS_ADDR (localhost:28028 by
default; all of a node's processes share it) and answers a plain-text protocol with the whole job's view — every
communicator, every rank's process and node, and (2.26 and later) how many collectives of each kind each rank has
launched. The rank whose count is behind its communicator's is the one the others wait for.

The protocol, as NCCL's own client `ncclras` speaks it: the client speaks first, one line at a time (`\\n`); it
sends `CLIENT PROTOCOL 2` (answer `SERVER PROTOCOL <n>`), optionally `TIMEOUT <s>` and `SET FORMAT json` (2.28.7+;
an older server answers `ERROR: Unknown command …`), then `VERBOSE STATUS`: the report follows, and the server
closes the connection (no terminator; one status per connection). JSON gives every rank's counts; the text report
gives only the ranks of the groups whose counts differ (its Warnings' `#g-i (hash) MISMATCH` blocks): `N ranks have
launched up to operation X`, then `Rank r -- GPU g managed by process p on node ip`, or for a group of one `Rank r
has launched up to operation X -- GPU g managed by process p on node ip` (2.24/2.25: one total count per rank).

Everything read from the port is checked: a report over MAX_BYTES, a line or a JSON value of the wrong shape is
skipped, never trusted.
"""
from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field

PORT = 28028
MAX_BYTES = 4 << 20          # a report of a 100k-rank job in JSON is ~40 MB: past this, the view is not complete
PROTOCOL = 2


@dataclass
class Rank:
    rank: int
    host: str
    pid: int
    counts: dict[str, int] = field(default_factory=dict)     # collective kind → operations launched


@dataclass
class Comm:
    hash: str
    size: int
    ranks: list[Rank] = field(default_factory=list)          # JSON: every rank; text: those of mismatched groups
    missing: int = 0                                          # ranks no data came from
    mismatch: bool = False
    tops: dict[str, int] = field(default_factory=dict)        # kind → the furthest count seen (text: its groups')

    def behind(self) -> dict[int, int]:
        """rank → how many operations it is behind the furthest rank, per kind at most, for ranks behind."""
        out: dict[int, int] = {}
        kinds = {k for r in self.ranks for k in r.counts}
        for k in kinds:
            top = max([r.counts.get(k, 0) for r in self.ranks] + [self.tops.get(k, 0)])
            for r in self.ranks:
                lag = top - r.counts.get(k, 0)
                if lag > 0:
                    out[r.rank] = max(out.get(r.rank, 0), lag)
        return out


@dataclass
class Status:
    version: str = ""
    json: bool = False
    comms: list[Comm] = field(default_factory=list)


def poll(addr: tuple[str, int] = ("127.0.0.1", PORT), timeout: float = 10.0, collective_timeout: int = 2) -> Status:
    """One status of the job through its RAS port: JSON where the server has it, else text. OSError when nothing
    listens or it does not answer in `timeout` s; ValueError when what it says is not the RAS protocol."""
    with socket.create_connection(addr, timeout=timeout) as s:
        s.settimeout(timeout)
        f = s.makefile("rwb", buffering=0)
        answer = _ask(f, f"CLIENT PROTOCOL {PROTOCOL}")
        if not answer.upper().startswith("SERVER PROTOCOL "):
            raise ValueError(f"not an NCCL RAS port: {answer[:80]!r}")
        _ask(f, f"TIMEOUT {collective_timeout}")
        as_json = _ask(f, "SET FORMAT json") == "OK"
        f.write(b"VERBOSE STATUS\n")
        data, end = b"", time.monotonic() + timeout
        while len(data) <= MAX_BYTES and time.monotonic() < end:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        else:
            raise ValueError(f"RAS status over {MAX_BYTES} bytes or {timeout} s")
    text = data.decode("utf-8", "replace")
    return parse_json(text) if as_json else parse_text(text)


def _ask(f, line: str) -> str:
    f.write(line.encode() + b"\n")
    got = f.readline(4096)
    if not got.endswith(b"\n"):
        raise ValueError(f"no answer to {line.split()[0]}")
    return got.decode("utf-8", "replace").strip()


def _int(x, default: int = -1) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else default


def _list(x) -> list:
    return x if isinstance(x, list) else []


def parse_json(text: str) -> Status:
    """The JSON status (NCCL 2.28.7+): communicators[].ranks[] with collective_counts."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("RAS JSON status is not an object")
    st = Status(version=str(doc.get("nccl_version", ""))[:32], json=True)
    for c in _list(doc.get("communicators")):
        if not isinstance(c, dict):
            continue
        comm = Comm(hash=str(c.get("hash", ""))[:40], size=_int(c.get("size"), 0),
                    missing=_int(c.get("missing_ranks_count"), 0))
        for r in _list(c.get("ranks")):
            if not isinstance(r, dict) or _int(r.get("rank")) < 0:
                continue
            counts = r.get("collective_counts") if isinstance(r.get("collective_counts"), dict) else {}
            comm.ranks.append(Rank(r["rank"], str(r.get("host", ""))[:64], _int(r.get("pid")),
                                   {str(k)[:32]: v for k, v in counts.items() if _int(v) >= 0}))
        comm.mismatch = bool(comm.behind())
        st.comms.append(comm)
    return st


_COMM = re.compile(r"^#\d+-\d+ \(([0-9a-f]{1,16})\) (\S+)$")
_KIND = re.compile(r"^  Communicator ranks have different (\w+) operation counts$")
_OLD_KIND = "  Communicator ranks have different collective operation counts"
_GROUP = re.compile(r"^  (\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)$")
_MEMBER = re.compile(r"^  Rank (\d+)(?: has (?:launched up to operation (\d+)|not launched any operations))? -- "
                     r"(?:GPU \S+(?: \(NVML \S+\))? managed by process (\d+) on node (\S+)|\[process information not "
                     r"found\])$")
_VERSION = re.compile(r"^NCCL version (\S+)")


def parse_text(text: str) -> Status:
    """The text status: the ranks of each mismatched communicator's count groups, with their counts."""
    st, comm, kind, group = Status(), None, None, None
    for line in text.split("\n"):
        if m := _VERSION.match(line):
            st.version = m[1][:32]
        elif m := _COMM.match(line):
            comm = Comm(hash=m[1], size=0, mismatch="MISMATCH" in m[2])
            st.comms.append(comm)
            kind = group = None
        elif comm is None:
            continue
        elif m := _KIND.match(line):
            kind, group = m[1], None
        elif line == _OLD_KIND:
            kind, group = "collective", None
        elif kind and (m := _GROUP.match(line)):
            group = int(m[2] or 0)
            comm.tops[kind] = max(comm.tops.get(kind, 0), group)
        elif kind and (m := _MEMBER.match(line)):
            count = int(m[2]) if m[2] else (0 if "not launched" in line else group)
            if count is None:
                continue
            rank = next((r for r in comm.ranks if r.rank == int(m[1])), None)
            if rank is None:
                rank = Rank(int(m[1]), m[4] or "", int(m[3]) if m[3] else -1)
                comm.ranks.append(rank)
            rank.counts[kind] = count
            comm.tops[kind] = max(comm.tops.get(kind, 0), count)
        elif not line.strip():
            group = None
    return st
