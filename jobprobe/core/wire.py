"""The wire contract between agents, the controller and people's commands: subjects, message ids, the node name →
subject token mapping. Node side (exporters/nats.py) and cluster side (controller.py) both import it; it imports
nothing of theirs.

Subjects:
- `jobprobe.frames.<token>` — a node's frames, to the JOBPROBE stream (one subject per node: the permission that
  lets a node publish only its own frames is a literal subject);
- `jobprobe.ctl.node.<token>` — the controller's requests to one node's agent (core request/reply);
- `jobprobe.ctl.trace` — a person's request to the controller: trace a job on all its nodes;
- `_INBOX_JP.<token>.>` — a node's own reply inbox (the JetStream acks of its frames): a node may subscribe to it
  and to nothing of another node's.

`token(node)` is injective (jobprobe/core/names.py): ASCII letters, digits and `-` stay; every other byte of the name's UTF-8 becomes `_xx` (its
two hex digits), `_` included. So `gpu.017` → `gpu_2e017` and `gpu_017` → `gpu_5f017`: two nodes never share a
subject, and `node_of(token)` gives the name back.
"""
from __future__ import annotations

from jobprobe.core.names import SUBJECT_KEEP, escape, unescape

FRAMES = "jobprobe.frames"            # .<token>
CONTROL = "jobprobe.ctl.node"         # .<token>
CLUSTER_TRACE = "jobprobe.ctl.trace"
INBOX = "_INBOX_JP"                   # .<token>.<random>
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


def frames_subject(node: str) -> str:
    return f"{FRAMES}.{token(node)}"


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
