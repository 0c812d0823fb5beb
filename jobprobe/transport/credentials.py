# SPDX-License-Identifier: Apache-2.0
"""Who a node or the controller is to nats-server, and how they talk to it safely: credentials files (`*.creds`:
a JWT and an nkey seed; `*.nk`: a seed; else one line `user:password`), the server's nonce signed with Ed25519 by
the `nkeys` package (PyNaCl: libsodium, constant time — imported only when a seed is used), new user nkeys, the
client TLS context, the plaintext-password refusal, and the same credentials as nats-py connect options for the
controller's client. One signing path for agent and controller."""
from __future__ import annotations

import base64
import ipaddress
import os
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult


class NatsError(Exception):
    """The server refused something (its -ERR), or replied with an error."""


class PlaintextPassword(ValueError):
    """A password or token would cross the network in clear (no TLS, a host that is not loopback)."""


class Credentials:
    """What a file says: `*.creds` a JWT and an nkey seed, `*.nk` an nkey seed, else one line `user:password`."""

    def __init__(self, path: str | None = None):
        self.user = self.password = self.token = self.jwt = self.seed = self.public_key = None
        if not path:
            return
        text = Path(path).read_text()
        if path.endswith(".creds"):
            self.jwt = _armored(text, "JWT")
            self.seed = _armored(text, "SEED")
            if not self.jwt or not self.seed:
                raise ValueError(f"{path}: expected a NATS user JWT and an nkey seed")
        elif path.endswith(".nk"):
            self.seed = text.strip()
        else:
            user, sep, password = text.strip().partition(":")
            if not sep or not user:
                raise ValueError(f"{path}: expected one line user:password")
            self.user, self.password = user, password
        if self.seed:
            if not self.seed.startswith("SU"):
                raise ValueError(f"{path}: not a user nkey seed (SU…)")
            try:
                kp = _keypair(self.seed)
                self.public_key = kp.public_key.decode()
                kp.wipe()
            except Exception as err:          # nkeys' or PyNaCl's own errors: not base32, a wrong length
                raise ValueError(f"{path}: not a valid nkey seed ({err})") from None


    @property
    def secret_in_clear(self) -> bool:
        """A password sent as it is (an nkey sends only a signature of the server's nonce)."""
        return self.user is not None

    def sign(self, nonce: str) -> bytes:
        """The server's nonce signed with the seed (Ed25519, by nkeys): the raw 64-byte signature."""
        kp = _keypair(self.seed)
        try:
            return kp.sign(nonce.encode())
        finally:
            kp.wipe()

    def connect_fields(self, nonce: str | None) -> dict:
        if self.seed:
            if nonce is None:
                raise NatsError("the server sent no nonce to sign (is nkey authentication configured?)")
            fields = {"sig": base64.urlsafe_b64encode(self.sign(nonce)).rstrip(b"=").decode()}
            if self.jwt:
                fields["jwt"] = self.jwt
            else:
                fields["nkey"] = self.public_key
            return fields
        if self.user is not None:
            return {"user": self.user, "pass": self.password}
        return {}


def _keypair(seed: str):
    """nkeys' key pair of a seed, its checksum checked first (nkeys does not: a mistyped seed would be another
    key, refused by the server with no word of why)."""
    import nkeys  # PyNaCl behind it: loaded by an agent only when it authenticates with an nkey
    raw = seed.encode()
    try:
        data = base64.b32decode(raw + b"=" * (-len(raw) % 8))
    except ValueError:
        raise ValueError("not base32") from None
    if len(data) < 4 or nkeys.crc16_checksum(data[:-2]) != data[-2:]:
        raise ValueError("its checksum does not match: mistyped or cut short")
    return nkeys.from_seed(bytearray(raw))


def new_user_nkey() -> tuple[str, str]:
    """A new user nkey: (seed `SU…`, to the node's `.nk` file; public key `U…`, to the server's users)."""
    import nkeys
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    kp = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return seed, kp.public_key.decode()
    finally:
        kp.wipe()


def client_tls(ca: str | None, cert: str | None = None, key: str | None = None):
    """The TLS context of a client of the NATS server (the agent's publisher, the controller's nats-py): the server
    verified against `ca` (else the system's roots), and our certificate when the server asks for one."""
    import ssl
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or `localhost` — by the name as written, never by what a resolver answers."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_plaintext_password(url: SplitResult, creds: Credentials, tls: bool) -> None:
    """PlaintextPassword when this connection would send a password or token in clear to another host."""
    secret = creds.secret_in_clear or url.username is not None
    host = url.hostname or "127.0.0.1"
    if secret and not tls and not is_loopback(host):
        raise PlaintextPassword(
            f"{url.scheme}://{host}:{url.port or 4222}: a password or token would be sent in clear to a host that "
            "is not loopback; use TLS (tls://, a CA), an nkey (.nk/.creds), or allow it explicitly "
            "(allow_plaintext_password)")


def _armored(text: str, what: str) -> str | None:
    """The first line after a `-----BEGIN … <what> …-----` line (the format nsc writes)."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        if ln.startswith("-----BEGIN") and what in ln:
            for nxt in lines[i + 1:]:
                if nxt:
                    return None if nxt.startswith("---") else nxt
    return None


def auth_options(creds: str | None = None, ca: str | None = None, cert: str | None = None,
                 key: str | None = None) -> dict[str, Any]:
    """nats-py connect options (the controller's client) for a credentials file and TLS; the file as the agent's
    (natswire.Credentials: `*.creds`, `*.nk`, else one line `user:password`), read by the same code. Its contents
    never appear on a command line (ps). The server's nonce is signed by the `nkeys` package on both sides: for a
    `.creds` file through Credentials.sign, as the agent does; for a `.nk` seed by nats-py itself, given the seed
    Credentials read and checked (nats-py sends the public key next to the signature only that way)."""
    opts: dict[str, Any] = {}
    if creds:
        c = Credentials(creds)
        if c.jwt:
            opts["user_jwt_cb"] = lambda: bytearray(c.jwt.encode())
            opts["signature_cb"] = lambda nonce: base64.b64encode(c.sign(nonce))
        elif c.seed:
            opts["nkeys_seed_str"] = c.seed
        else:
            opts["user"], opts["password"] = c.user, c.password
    if ca or cert:
        opts["tls"] = client_tls(ca, cert, key)
    return opts
