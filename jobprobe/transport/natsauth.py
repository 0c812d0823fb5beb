# SPDX-License-Identifier: Apache-2.0
"""Who may do what on the controller's NATS server: one nkey per node, one for the controller, the server's
authorization generated from them (docs/SECURITY.md).

A data directory (`jobprobe controller --data DIR`) holds:
- `auth/controller.nk` — the controller's user nkey seed (made at its first start, 0600): full permissions; what
  `jobprobe trace --nats` is given (`--nats-creds`) on the controller's host;
- `auth/nodes.json` — node name → public nkey of every enrolled node;
- `creds/<token>.nk` — the seed `jobprobe controller enroll NODE` made for a node, to copy to it (0600); the
  agent takes it as `--nats-creds`. Enrolling a node again makes a new key: the old one stops working at the
  server's next reload (the enroll itself sends it SIGHUP) — how a node's credentials are rotated.

A node's permissions (`node_permissions`): publish only its own frames subject; subscribe only to its own control
subject and its own reply inbox (`_INBOX_JP.<token>.>`, the JetStream acks of its frames); answer the requests it
receives (`allow_responses`: one reply each, within a minute). It cannot read another node's frames (the
controller's pull deliveries come to the controller's own inbox), publish as another node, send control
requests, or touch the JetStream API. A client with no key is refused: there is no anonymous user.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from jobprobe.core.errors import BadInput
from jobprobe.core.wire import BEATS, CONTROL, FRAMES, PARTS, inbox_prefix, token
from jobprobe.transport.credentials import new_user_nkey


def write_secret(path: Path, text: str) -> None:
    """A file only its owner reads, in a directory only its owner enters; written whole (a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def public_of_seed(seed: str) -> str:
    """The public key `U…` of a user seed `SU…`."""
    import nkeys
    kp = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


class Auth:
    """The data directory's keys (see the module's docstring)."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        self.auth = self.dir / "auth"
        self.controller_seed_path = self.auth / "controller.nk"
        self.nodes_path = self.auth / "nodes.json"

    def controller_seed(self) -> Path:
        """The controller's seed file, made on first use."""
        if not self.controller_seed_path.exists():
            seed, _ = new_user_nkey()
            write_secret(self.controller_seed_path, seed + "\n")
        return self.controller_seed_path

    def controller_public(self) -> str:
        return public_of_seed(self.controller_seed().read_text().strip())

    def nodes(self) -> dict[str, str]:
        try:
            data = json.loads(self.nodes_path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as err:
            raise BadInput(f"{self.nodes_path}: not JSON ({err}); re-enroll the nodes") from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise BadInput(f"{self.nodes_path}: expected a map of node name → public nkey")
        return data

    def enroll(self, node: str) -> Path:
        """A new key for `node` (replacing any it had): its seed file, to copy to the node."""
        try:
            tok = token(node)
        except ValueError as err:
            raise BadInput(f"enroll {node!r}: {err}") from None
        seed, public = new_user_nkey()
        path = self.dir / "creds" / f"{tok}.nk"
        write_secret(path, seed + "\n")
        nodes = self.nodes()
        nodes[node] = public
        write_secret(self.nodes_path, json.dumps(nodes, indent=1, sort_keys=True) + "\n")
        return path

    def server_config(self) -> str:
        """The nats-server `authorization` block: the controller, then every enrolled node."""
        users = [f'    {{ nkey: "{self.controller_public()}", permissions: {{ publish: ">", subscribe: ">" }} }}']
        for node, public in sorted(self.nodes().items()):
            users.append(f"    {{ nkey: \"{public}\", permissions: {json.dumps(node_permissions(node))} }}")
        return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"


def node_permissions(node: str) -> dict:
    """What one node's identity may do (the module's docstring says why each)."""
    tok = token(node)
    return {"publish": {"allow": [f"{FRAMES}.*.{tok}", f"{PARTS}.*.frames.*.{tok}", f"{BEATS}.{tok}"]},
            "subscribe": {"allow": [f"{CONTROL}.{tok}", f"{inbox_prefix(node)}.>"]},
            "allow_responses": {"max": 1, "expires": "1m"}}


def server_pid(data_dir: str | Path, conf: str | Path | None = None) -> int | None:
    """The pid in the data directory's pid file when it is a running nats-server (started with `conf`, when given);
    else None — a stale pid file naming another program is never taken for ours."""
    try:
        pid = int(Path(data_dir, "nats-server.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if not cmdline or not cmdline[0].endswith(b"nats-server"):
        return None
    if conf is not None and str(conf).encode() not in cmdline:
        return None
    return pid


def reload_server(data_dir: str | Path) -> int | None:
    """SIGHUP to the data directory's running nats-server, so that it reads its new config; the pid, or None when
    none runs."""
    pid = server_pid(data_dir)
    if pid is not None:
        os.kill(pid, signal.SIGHUP)
    return pid
