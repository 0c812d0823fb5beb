# SPDX-License-Identifier: Apache-2.0
"""A small synchronous NATS client: connect, publish to JetStream, read the acks — what the agent's sink needs.

The agent publishes from one thread, a window of frames at a time, and waits for their acks; an event loop and a
general client would cost it memory and a loop wake-up per tick for that (docs/ARCHITECTURE.md, the agent's
memory). This speaks the protocol itself
(https://docs.nats.io/reference/reference-protocols/nats-protocol) over one socket:

    server: INFO {json}                       client: CONNECT {json} / PING, expects PONG (or -ERR '…')
    client: SUB _INBOX.<id>.> 1               the replies (JetStream's PubAcks) come back on it
    client: HPUB <subject> <reply> <hdr> <total>\\r\\nNATS/1.0\\r\\nNats-Msg-Id: <key>\\r\\n
                 Jobprobe-Sent: <t>\\r\\n\\r\\n<payload>\\r\\n
    server: MSG <reply> 1 <n>\\r\\n{"stream":…,"seq":…}   — the frame is in the stream (or {"error":…})
            HMSG … NATS/1.0 503                          — no stream listens on the subject (no responders)
            PING → PONG; -ERR '…' (a permission refused) noted and said with the failure it causes

            INFO {json} at any time: a new `max_payload`, or `ldm` — the server is going away (lame duck)

Authentication: user and password, a token, or an nkey (a `.nk` seed, or a `.creds` file's JWT and seed) — the
server's nonce signed with Ed25519 by the `nkeys` package (PyNaCl, libsodium: constant time), the library nats-py
signs with for the controller, imported only when a seed is used. A password or token is never sent in clear to
another host: without TLS it is refused unless the host is loopback or `allow_plaintext_password` says so (a
signature of the server's nonce reveals nothing and may travel in clear). TLS: upgraded after INFO, as the server
expects, when the URL says tls:// or a CA/certificate is given or the server requires it.

The server's limits are honoured: a message larger than its `max_payload` would make it close the connection, so
`fits()` tells the caller before it sends (the sink skips such a frame, counted lost). An INFO received later
updates them; one saying `ldm` sets `lame_duck`, so that the caller moves to another server of its list now rather
than when this one closes the connection. Servers an INFO names (`connect_urls`) are not added to the list: the
credentials go only to servers the configuration names.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Callable
from urllib.parse import SplitResult, urlsplit

from jobprobe.core.wire import SENT_HEADER
from jobprobe.transport.credentials import Credentials, NatsError, client_tls, refuse_plaintext_password

log = logging.getLogger("jobprobe.nats")
MAX_LINE = 64 << 10
DEFAULT_MAX_PAYLOAD = 1 << 20        # the server's default, until its INFO says otherwise
# JetStream refusals (PubAck err_code) that no retry can change for that message: it is skipped, not sent forever
PERMANENT_REFUSALS = {
    10054,     # message size exceeds the stream's maximum (max_msg_size)
    10097,     # header size exceeds the maximum allowed
}


class NoResponders(NatsError):
    pass


class TooLarge(NatsError):
    """A message larger than the server's max_payload: sending it would end the connection."""


class Wire:
    """One connection to one of `servers` (tried in turn, from the one after the last that failed)."""

    def __init__(self, url: str, creds: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, name: str = "jobprobe", timeout: float = 2.0,
                 allow_plaintext_password: bool = False, inbox: str = "_INBOX"):
        self.servers = [u.strip() for u in url.split(",") if u.strip()]
        self.creds = Credentials(creds)
        self.tls_files = (tls_ca, tls_cert, tls_key)
        if not allow_plaintext_password:     # refused now, on the command line, not at the first connection
            for server in self.servers:
                u = _split(server)
                refuse_plaintext_password(u, self.creds, u.scheme == "tls" or any(self.tls_files))
        self.max_payload = DEFAULT_MAX_PAYLOAD
        self.lame_duck = False                   # the server said it is going away (INFO ldm)
        self.server_url: str | None = None       # the one connected to
        self.name, self.timeout = name, timeout
        self.sock: socket.socket | None = None
        self.buf = bytearray()
        # replies (PubAcks, answers) come under `inbox`: a node's own prefix (jobprobe.core.wire.inbox_prefix), the only
        # one its permissions let it read
        self.inbox = f"{inbox}.{os.urandom(8).hex()}"
        self.batch_no = 0
        self.server_said: str | None = None      # the last -ERR: said with the failure it explains
        self.refused_subs: set[str] = set()      # subscriptions the server refused (said once each)
        self._next = 0
        self.subs: dict[str, str] = {}           # sid → subject: requests to this node (subscribe())
        self.requests: list[tuple[str, str | None, bytes]] = []   # (subject, reply to, payload) received

    # ---- connecting ---------------------------------------------------------------------------------------
    def connect(self) -> None:
        errors = []
        for i in range(len(self.servers)):
            url = self.servers[(self._next + i) % len(self.servers)]
            try:
                self._connect(url)
                self._next = (self._next + i) % len(self.servers)
                return
            except (OSError, NatsError, ValueError) as err:
                self.close()
                errors.append(err)
        self._next = (self._next + 1) % len(self.servers)
        raise errors[-1] if len(errors) == 1 else ConnectionError("; ".join(f"{type(e).__name__}: {e}" for e in errors))

    def _connect(self, url: str) -> None:
        u = _split(url)
        host, port = u.hostname or "127.0.0.1", u.port or 4222
        self.sock = socket.create_connection((host, port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf.clear()
        self.lame_duck, self.server_url = False, url
        deadline = time.monotonic() + self.timeout
        op, rest = self._line(deadline).partition(b" ")[::2]
        if op != b"INFO":
            raise NatsError(f"{host}:{port} is not a NATS server (it said {op[:40]!r})")
        info = json.loads(rest)
        self._info(info)
        tls = u.scheme == "tls" or any(self.tls_files) or info.get("tls_required", False)
        if tls:
            self.sock = client_tls(*self.tls_files).wrap_socket(self.sock, server_hostname=host)
        fields = {"verbose": False, "pedantic": False, "tls_required": bool(tls), "name": self.name,
                  "lang": "python-jobprobe", "version": "1", "protocol": 1, "headers": True, "no_responders": True,
                  "echo": False}
        if u.username:                          # nats://user:pass@host or nats://token@host
            fields.update({"user": u.username, "pass": u.password} if u.password is not None
                          else {"auth_token": u.username})
        fields.update(self.creds.connect_fields(info.get("nonce")))
        self._send(b"CONNECT " + json.dumps(fields, separators=(",", ":")).encode() + b"\r\nPING\r\n")
        while True:
            line = self._line(deadline)
            if line == b"PONG":
                break
            if line.startswith(b"-ERR"):
                raise NatsError(_err_text(line))
            if line == b"PING":
                self._send(b"PONG\r\n")
        self._send(f"SUB {self.inbox}.> 1\r\n".encode()
                   + b"".join(f"SUB {subj} {sid}\r\n".encode() for sid, subj in self.subs.items()))

    def leave(self) -> None:
        """Close, and connect next to the server after this one (this one is going away)."""
        self.close()
        if len(self.servers) > 1:
            self._next = (self._next + 1) % len(self.servers)

    def subscribe(self, subject: str) -> None:
        """Messages on `subject` go to `requests` (from every connection from now on); answer with reply()."""
        sid = str(len(self.subs) + 2)
        self.subs[sid] = subject
        if self.sock is not None:
            self._send(f"SUB {subject} {sid}\r\n".encode())

    def reply(self, subject: str, data: bytes) -> None:
        self._send(f"PUB {subject} {len(data)}\r\n".encode() + data + b"\r\n")

    def request(self, subject: str, data: bytes, timeout: float = 10.0) -> bytes:
        """A core NATS request: publish with a reply subject of our inbox, wait for the one answer."""
        self.batch_no += 1
        inbox = f"{self.inbox}.req.{self.batch_no}"
        self._send(f"PUB {subject} {inbox} {len(data)}\r\n".encode() + data + b"\r\n")
        deadline = time.monotonic() + timeout
        while True:
            got = self._message(deadline)
            if got is not None and got[0] == inbox:
                if got[1] == "503":
                    raise NoResponders(f"nobody answers on {subject} (no responders)")
                return got[2]

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    # ---- publishing ---------------------------------------------------------------------------------------
    def fits(self, mid: str, data: bytes) -> bool:
        """Whether the server takes this message (its headers and payload within the server's max_payload)."""
        return len(_headers(mid, time.time())) + len(data) <= self.max_payload

    def publish(self, msgs: list[tuple[str, str, bytes]], timeout: float = 5.0,
                optional: Callable[[str], bool] | None = None) -> list[dict]:
        """Publish (subject, msg id, payload)s to JetStream and wait for every ack; returns the PubAcks in order.
        A refusal that no retry can change (PERMANENT_REFUSALS: the message is too large for the stream) is
        returned in its message's place as the PubAck it is ({"error": …}); any other refusal raises, as does an
        ack not back within `timeout`. A message on a subject `optional` says yes to that no stream takes (no
        responders) is returned as {"dropped": "no responders"} rather than raising: worth sending only now.
        Every message must fit (fits()): a larger one would end the connection."""
        big = [mid for _, mid, data in msgs if not self.fits(mid, data)]
        if big:
            raise TooLarge(f"{len(big)} messages exceed the server's max_payload ({self.max_payload}), {big[0]} "
                             "first")
        self.batch_no += 1
        prefix = f"{self.inbox}.{self.batch_no}."
        out = bytearray()
        sent = time.time()
        for i, (subject, mid, data) in enumerate(msgs):
            hdr = _headers(mid, sent)
            out += f"HPUB {subject} {prefix}{i} {len(hdr)} {len(hdr) + len(data)}\r\n".encode()
            out += hdr
            out += data
            out += b"\r\n"
        self._send(bytes(out))
        acks: list[dict | None] = [None] * len(msgs)
        left = len(msgs)
        deadline = time.monotonic() + timeout
        while left:
            got = self._message(deadline)
            if got is None:
                continue
            reply, status, payload = got
            if not reply.startswith(prefix):
                continue                          # a late ack of an earlier batch that timed out
            i = int(reply[len(prefix):])
            if status == "503" and optional is not None and optional(msgs[i][0]):
                if acks[i] is None:
                    acks[i] = {"dropped": "no responders"}
                    left -= 1
                continue
            if status == "503":
                raise NoResponders(f"no stream takes {msgs[i][0]} (no responders)")
            ack = json.loads(payload) if payload else {}
            if "error" in ack and _err_code(ack) not in PERMANENT_REFUSALS:
                e = ack["error"]
                raise NatsError(f"JetStream: {e.get('description', e)} (code {e.get('err_code', e.get('code'))})")
            if acks[i] is None:
                acks[i] = ack
                left -= 1
        return acks  # type: ignore[return-value]

    def service(self) -> None:
        """While idle: answer the server's PINGs and notice a closed connection (raises), without blocking."""
        self.sock.settimeout(0.0)
        try:
            chunk = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            if type(err).__name__ in ("SSLWantReadError", "SSLWantWriteError"):
                return
            raise
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk
        while b"\r\n" in self.buf:
            self._message(time.monotonic() + self.timeout)

    # ---- the wire -----------------------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout)
        self.sock.sendall(data)

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no reply from the server in time"
                               + (f" (the server said {self.server_said})" if self.server_said else ""))
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(1 << 16)
        except socket.timeout:
            raise TimeoutError("no reply from the server in time"
                               + (f" (the server said {self.server_said})" if self.server_said else "")) from None
        if not chunk:
            raise ConnectionError("the server closed the connection"
                                  + (f" (it said {self.server_said})" if self.server_said else ""))
        self.buf += chunk

    def _line(self, deadline: float) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[:i + 2]
                return line
            if len(self.buf) > MAX_LINE:
                raise NatsError("a protocol line too long")
            self._fill(deadline)

    def _exact(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n + 2:
            self._fill(deadline)
        data = bytes(self.buf[:n])
        del self.buf[:n + 2]
        return data

    def _info(self, info: dict) -> None:
        """What an INFO says that this client acts on: the largest message taken, and lame-duck mode."""
        mp = info.get("max_payload")
        if isinstance(mp, int) and not isinstance(mp, bool) and mp > 0:
            self.max_payload = mp
        if info.get("ldm") is True:
            self.lame_duck = True

    def _message(self, deadline: float) -> tuple[str, str | None, bytes] | None:
        """One protocol message: a delivered message as (reply subject it was sent to, header status, payload);
        None for anything else (PING answered, +OK, INFO taken in, -ERR noted)."""
        line = self._line(deadline)
        op, _, rest = line.partition(b" ")
        if op == b"MSG":
            parts = rest.split()
            data = self._exact(int(parts[-1]), deadline)
            if len(parts) > 1 and parts[1].decode() in self.subs:      # MSG subject sid [reply-to] size
                self.requests.append((parts[0].decode(), parts[2].decode() if len(parts) == 4 else None, data))
                return None
            return parts[0].decode(), None, data
        if op == b"HMSG":
            parts = rest.split()
            hlen, total = int(parts[-2]), int(parts[-1])
            data = self._exact(total, deadline)
            head = data[:hlen].split(b"\r\n", 1)[0].split()      # NATS/1.0 [status [description]]
            status = head[1].decode() if len(head) > 1 else None
            return parts[0].decode(), status, data[hlen:]
        if op == b"PING":
            self._send(b"PONG\r\n")
        elif op == b"INFO":                       # sent at any time: a cluster's change, lame-duck mode
            try:
                info = json.loads(rest)
            except ValueError:
                raise NatsError(f"the server sent an INFO that is not JSON: {rest[:60]!r}") from None
            if isinstance(info, dict):
                self._info(info)
        elif op == b"-ERR":
            self.server_said = _err_text(line)
            if "ermission" not in self.server_said:      # anything but a refused publish ends the connection
                raise NatsError(self.server_said)
            if "Subscription" in self.server_said and self.server_said not in self.refused_subs:
                # a refused subscription fails nothing we wait for: said here, once per subject
                # (the controller's trace requests to this node never arrive until the permissions allow it)
                self.refused_subs.add(self.server_said)
                log.warning("nats: the server refused a subscription: %s", self.server_said)
        return None


def _split(url: str) -> SplitResult:
    return urlsplit(url if "://" in url else f"nats://{url}")


def _headers(mid: str, sent: float = 0.0) -> bytes:
    """Nats-Msg-Id (the frame's key: duplicates dropped) and SENT_HEADER, this node's clock when it was published
    (the controller compares it with the stream's own time of it: the node's clock offset, docs/FRAMES.md)."""
    return f"NATS/1.0\r\nNats-Msg-Id: {mid}\r\n{SENT_HEADER}: {sent:.3f}\r\n\r\n".encode()


def _err_code(ack: dict) -> int | None:
    e = ack.get("error")
    return e.get("err_code") if isinstance(e, dict) else None


def _err_text(line: bytes) -> str:
    return line[4:].decode(errors="replace").strip().strip("'")
