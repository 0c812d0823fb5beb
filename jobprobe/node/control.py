# SPDX-License-Identifier: Apache-2.0
"""The agent's control socket: one JSON request per connection, one JSON reply.

A UNIX stream socket (default /run/jobprobe/agent.sock), mode 0600 in a 0700 directory, and each peer's uid checked
with SO_PEERCRED: only root (or the agent's own user) is served; anyone else is refused and logged. Requests:
  {"cmd": "attach", "cgroup"|"pid"|"slurm_job"|"k8s_pod": …, "job": NAME?, "probes": SPEC?, "wait": S?}
  {"cmd": "detach", "job": NAME}
  {"cmd": "status"}
  {"cmd": "probes", "job": NAME, "toggle": "+x,-y"}
  {"cmd": "trace", "job": NAME, "duration": S?, "at": T?}   a deep-trace window now, or at UNIX time T
                                                          (jobprobe/node/tracewin.py)
Replies: {"ok": true, …} or {"ok": false, "error": "one line"}. A malformed request (not JSON, too long, an unknown
command, a bad field) is rejected with a reply and a log line; the agent goes on.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from jobprobe.core.errors import BadInput, JobprobeError
from jobprobe.node.jobspec import JobSpec

log = logging.getLogger("jobprobe.node.control")
MAX_REQUEST = 64 << 10
TIMEOUT = 10.0


def peer_uid(conn: socket.socket) -> int:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class ControlServer:
    """Serves an Agent's attach/detach/status/probes on a UNIX socket, one thread per connection."""

    def __init__(self, agent: Any, path: str):
        self.agent, self.path = agent, path
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.allowed = {0, os.geteuid()}

    def start(self) -> None:
        d = Path(self.path).parent
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        if os.path.exists(self.path):
            # An agent that was killed leaves its socket file; one still serving must not be stolen from.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)
            else:
                probe.close()
                raise BadInput(f"another agent is serving {self.path}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)          # the socket file is created 0600, never briefly wider
        try:
            sock.bind(self.path)
        except OSError as err:
            sock.close()
            raise BadInput(f"cannot listen on {self.path}: {err.strerror}") from err
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        self.sock = sock
        self.thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.sock is not None:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return                 # closed
            threading.Thread(target=self._one, args=(conn,), name="control-conn", daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT)
            try:
                uid = peer_uid(conn)
                if uid not in self.allowed:
                    log.warning("refused a control request from uid %d (root only)", uid)
                    reply: dict[str, Any] = {"ok": False, "error": "permission denied: the agent serves root only"}
                else:
                    reply = self.handle(read_request(conn))
            except BadInput as err:
                log.warning("rejected a control request: %s", err)
                reply = {"ok": False, "error": str(err)}
            except OSError as err:
                log.warning("control connection: %s", err)
                return
            except Exception as err:   # a bug must not take the agent down
                log.exception("control request failed")
                reply = {"ok": False, "error": f"internal error: {type(err).__name__}: {err}"}
            try:
                conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
            except OSError:
                pass

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        if not self.agent.ready.wait(TIMEOUT - 1):
            raise BadInput("the agent is still starting (loading its programs); try again")
        cmd = req.get("cmd")
        try:
            if cmd == "attach":
                wait = req.get("wait")
                if wait is not None and not isinstance(wait, (int, float)):
                    raise BadInput(f"wait must be a number of seconds, got {wait!r}")
                return {"ok": True, **self.agent.attach(JobSpec.from_dict(req), wait=wait,
                                                        defer=bool(req.get("defer")))}
            if cmd == "detach":
                return {"ok": True, **self.agent.detach(str(need(req, "job")))}
            if cmd == "status":
                return {"ok": True, **self.agent.status()}
            if cmd == "probes":
                return {"ok": True, **self.agent.set_probes(str(need(req, "job")), str(need(req, "toggle")))}
            if cmd == "trace":
                return {"ok": True, **self.agent.trace(str(need(req, "job")), req.get("duration", 25.0),
                                                       req.get("at"))}
        except TypeError as err:       # a field of the wrong shape for JobSpec
            raise BadInput(f"bad request: {err}") from err
        raise BadInput(f"unknown command {cmd!r}; known: attach, detach, status, probes, trace")

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


def need(req: dict[str, Any], key: str) -> Any:
    if req.get(key) in (None, ""):
        raise BadInput(f"{req.get('cmd')}: {key} is missing")
    return req[key]


def read_request(conn: socket.socket) -> dict[str, Any]:
    buf = b""
    while b"\n" not in buf:
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST:
            raise BadInput(f"request longer than {MAX_REQUEST} bytes")
    try:
        req = json.loads(buf.split(b"\n", 1)[0] or b"null")
    except ValueError as err:
        raise BadInput(f"malformed request (not JSON): {err}") from err
    if not isinstance(req, dict):
        raise BadInput("malformed request: not a JSON object")
    return req


def call(path: str, req: dict[str, Any], timeout: float = TIMEOUT) -> dict[str, Any]:
    """Send one request to the agent at `path`; its reply. BadInput when no agent answers there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise BadInput(f"no agent is running (no socket at {path}; start one with `jobprobe agent`)") from None
        except PermissionError:
            raise BadInput(f"permission denied on {path}: the agent serves root only") from None
        except OSError as err:
            raise BadInput(f"cannot reach the agent at {path}: {err.strerror or err}") from None
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass     # the agent answered and closed before reading (a refused peer): its reply is still there
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        raise JobprobeError(f"the agent at {path} did not answer within {timeout:.0f} s") from None
    finally:
        sock.close()
    try:
        return json.loads(data)
    except ValueError:
        raise JobprobeError(f"the agent at {path} sent no valid reply") from None
