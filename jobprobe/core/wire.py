# SPDX-License-Identifier: Apache-2.0
"""The wire contract between agents, the controller and people's commands: subjects, message ids, the node name →
subject token mapping. Node side (exporters/nats.py) and cluster side (controller.py) both import it; it imports
nothing of theirs.

Subjects:
- `jobprobe.frames.<job token>.<node token>` — a node's frames of one job, to the JOBPROBE stream (the node's token
  last: the permission that lets a node publish only its own frames is `jobprobe.frames.*.<token>`; the job's token
  first: a server partitioning the controllers by job maps the subject by it, below);
- `jobprobe.beat.<node token>` — the node's heartbeat each tick, with or without jobs (to the small BEATS stream,
  which keeps each node's newest one): every controller reads them all — a node's liveness matters to each partition
  that holds one of its jobs, and to the one that owns the node itself;
- `jobprobe.part.<i>.frames.<job token>.<node token>` — the same frames on a server that partitions the controllers
  by job (`mappings(n)`: NATS's own `partition(n, 1)` of the job's token, FNV-1a 32 mod n — `partition()` here); the
  partition's stream JOBPROBE_P<i> keeps them. A frame's whole job lands on one controller, so stragglers — found by
  comparing the nodes of one job — work unchanged. The node's permission allows `jobprobe.part.*.frames.*.<token>`
  (the server checks the mapped subject); a frame on a partition that is not its job's is refused by the controller;
- `jobprobe.ctl.node.<token>` — the controller's requests to one node's agent (core request/reply);
- `jobprobe.ctl.trace` — a person's request to the controller: trace a job on all its nodes;
- `_INBOX_JP.<token>.>` — a node's own reply inbox (the JetStream acks of its frames): a node may subscribe to it
  and to nothing of another node's.

`token(node)` is injective (jobprobe/core/names.py): ASCII letters, digits and `-` stay; every other byte of the
name's UTF-8 becomes `_xx` (its
two hex digits), `_` included. So `gpu.017` → `gpu_2e017` and `gpu_017` → `gpu_5f017`: two nodes never share a
subject, and `node_of(token)` gives the name back.
"""
from __future__ import annotations

from jobprobe.core.names import SUBJECT_KEEP, escape, unescape

FRAMES = "jobprobe.frames"            # .<job token>.<node token>
BEATS = "jobprobe.beat"               # .<node token>
PARTS = "jobprobe.part"               # .<partition>.frames.<job token>.<node token>
CONTROL = "jobprobe.ctl.node"         # .<token>
CLUSTER_TRACE = "jobprobe.ctl.trace"
INBOX = "_INBOX_JP"                   # .<token>.<random>
SENT_HEADER = "Jobprobe-Sent"         # a message's header: the node's UNIX time when it published it
MAX_TOKEN = 200                       # a node name longer than this is refused (a subject is not a store)


def token(node: str) -> str:
    """A NATS subject token for a node name, injective (see the module's docstring)."""
    tok = escape(node, SUBJECT_KEEP, "node name")
    if len(tok) > MAX_TOKEN:
        raise ValueError(f"node name too long for a subject ({len(tok)} > {MAX_TOKEN} after escaping)")
    return tok


def node_of(tok: str) -> str:
    """The node name a token stands for (token's inverse); ValueError for a string token() never makes."""
    try:
        name = unescape(tok, SUBJECT_KEEP)
        if len(tok) > MAX_TOKEN:
            raise ValueError
    except ValueError:
        raise ValueError(f"not a node token: {tok!r}") from None
    return name


def job_token(job: str) -> str:
    """A NATS subject token for a job name: escaped as node names are; one longer than MAX_TOKEN keeps its first
    part and ends in `~` and its SHA-256 (`~` is never produced by escaping: a short name never meets a long one)."""
    tok = escape(job, SUBJECT_KEEP, "job name")
    if len(tok) > MAX_TOKEN:
        import hashlib
        tok = f"{tok[:MAX_TOKEN - 65]}~{hashlib.sha256(job.encode('utf-8', 'surrogatepass')).hexdigest()}"
    return tok


def frames_subject(node: str, job: str) -> str:
    return f"{FRAMES}.{job_token(job)}.{token(node)}"


def beat_subject(node: str) -> str:
    return f"{BEATS}.{token(node)}"


def subject_of(frame: dict) -> str:
    """Where a frame goes: a heartbeat to its node's beat subject, any other frame to its job's frames subject."""
    if frame.get("kind") == "heartbeat":
        return beat_subject(frame["node"])
    return frames_subject(frame["node"], frame["job"])


def partition(tok: str, n: int) -> int:
    """The partition NATS's subject mapping `{{partition(n,1)}}` gives a subject whose first wildcard token is
    `tok`: FNV-1a (32 bits) of its bytes, mod n."""
    h = 0x811C9DC5
    for b in tok.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h % n


def mappings(n: int) -> dict[str, str]:
    """The server's subject mapping that spreads frames over n partitions by job (its `mappings` block)."""
    return {f"{FRAMES}.*.*": f"{PARTS}.{{{{partition({n},1)}}}}.frames.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}"}


def mappings_conf(n: int) -> str:
    """mappings(n) as a nats-server config block (empty for one partition)."""
    if n == 1:
        return ""
    return "mappings = {\n" + "".join(f'  "{k}": "{v}"\n' for k, v in mappings(n).items()) + "}\n"


def parse_subject(subject: str) -> tuple[int | None, str | None, str]:
    """A frame's or a beat's subject → (partition or None, job token or None for a beat, node token); ValueError
    for any other subject."""
    parts = subject.split(".")
    part = None
    if subject.startswith(PARTS + ".") and len(parts) == 6 and parts[3] == "frames" and parts[2].isascii() \
            and parts[2].isdigit() and len(parts[2]) < 6:
        part, parts = int(parts[2]), ["jobprobe", "frames"] + parts[4:]
    if len(parts) == 4 and parts[:2] == ["jobprobe", "frames"]:
        return part, parts[2], parts[3]
    if len(parts) == 3 and parts[:2] == ["jobprobe", "beat"] and part is None:
        return None, None, parts[2]
    raise ValueError(f"not a frame's subject: {subject[:120]!r}")


def control_subject(node: str) -> str:
    """Where the controller asks one node's agent (core NATS request/reply, not the stream)."""
    return f"{CONTROL}.{token(node)}"


def inbox_prefix(node: str) -> str:
    """The prefix of a node's reply subjects: the only inbox its permissions let it read."""
    return f"{INBOX}.{token(node)}"


def msg_id(frame: dict) -> str:
    """The frame's unique key as JetStream's Nats-Msg-Id (a resend inside the duplicate window is dropped)."""
    return f"{frame['node']}/{frame['job']}/{frame.get('run', '')}/{frame['seq']}"


def host_port(text: str, what: str = "address") -> tuple[str, int]:
    """HOST:PORT, [IPv6]:PORT or :PORT (every address) → (host, port), the brackets taken off; a clear BadInput
    (`what` names the option) otherwise. The one parser of listen addresses (controller, its /metrics, the agent's
    Prometheus endpoint)."""
    from jobprobe.core.errors import BadInput
    host, sep, port = str(text).rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise BadInput(f"{what} {text!r}: give HOST:PORT ([::1]:PORT for IPv6)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise BadInput(f"{what} {text!r}: an IPv6 address goes in brackets, [{host}]:{port}")
    return host, int(port)
