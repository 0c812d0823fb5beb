"""Ed25519 signatures (RFC 8032) and NATS nkeys — enough to answer a NATS server's nonce with a user's nkey.

One signature per connection: pure Python (a few ms) rather than a native dependency on every node. The
arithmetic follows RFC 8032 §5.1 on extended coordinates; tests check it against the RFC's test vectors and
against a real nats-server verifying it.

An nkey is base32 (no padding) of a prefix, the 32-byte key and a CRC-16/XMODEM (little-endian): a user's seed
starts `SU`, its public key `U`.
"""
from __future__ import annotations

import base64
import hashlib

P = 2 ** 255 - 19
L = 2 ** 252 + 27742317777372353535851937790883648493
D = -121665 * pow(121666, P - 2, P) % P
SQRT_M1 = pow(2, (P - 1) // 4, P)

PREFIX_SEED = 18 << 3
PREFIX_USER = 20 << 3


def _add(a, b):
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    A = (y1 - x1) * (y2 - x2) % P
    B = (y1 + x1) * (y2 + x2) % P
    C = 2 * t1 * t2 * D % P
    E = 2 * z1 * z2 % P
    e, f, g, h = B - A, E - C, E + C, B + A
    return e * f % P, g * h % P, f * g % P, e * h % P


def _mul(s: int, pt):
    q = (0, 1, 1, 0)
    while s:
        if s & 1:
            q = _add(q, pt)
        pt = _add(pt, pt)
        s >>= 1
    return q


def _x_of(y: int, sign: int) -> int:
    x2 = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * SQRT_M1 % P
    if x & 1 != sign:
        x = P - x
    return x


_GY = 4 * pow(5, P - 2, P) % P
_GX = _x_of(_GY, 0)
G = (_GX, _GY, 1, _GX * _GY % P)


def _encode(pt) -> bytes:
    zi = pow(pt[2], P - 2, P)
    x, y = pt[0] * zi % P, pt[1] * zi % P
    return (y | (x & 1) << 255).to_bytes(32, "little")


def _expand(seed: bytes) -> tuple[int, bytes]:
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little") & ((1 << 254) - 8) | (1 << 254)
    return a, h[32:]


def public_key(seed: bytes) -> bytes:
    return _encode(_mul(_expand(seed)[0], G))


def sign(seed: bytes, msg: bytes) -> bytes:
    a, prefix = _expand(seed)
    pub = _encode(_mul(a, G))
    r = int.from_bytes(hashlib.sha512(prefix + msg).digest(), "little") % L
    R = _encode(_mul(r, G))
    k = int.from_bytes(hashlib.sha512(R + pub + msg).digest(), "little") % L
    return R + ((r + k * a) % L).to_bytes(32, "little")


# ---- nkeys ------------------------------------------------------------------------------------------------
def crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = (crc << 1 ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc


def _b32(raw: bytes) -> str:
    raw += crc16(raw).to_bytes(2, "little")
    return base64.b32encode(raw).decode().rstrip("=")


def nkey_from_seed(text: str) -> tuple[bytes, str]:
    """A user seed (`SU…`) → (the 32-byte Ed25519 seed, the public nkey `U…`). Raises ValueError when it is not
    one (bad base32, checksum, or kind)."""
    text = text.strip()
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except Exception:
        raise ValueError("an nkey seed is base32") from None
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if len(body) != 34 or crc16(body) != crc:
        raise ValueError("not an nkey seed (its checksum does not match)")
    kind = (body[0] & 7) << 5 | (body[1] & 0xF8) >> 3
    if body[0] & 0xF8 != PREFIX_SEED or kind != PREFIX_USER:
        raise ValueError("not a user nkey seed")
    seed = body[2:]
    return seed, _b32(bytes([PREFIX_USER]) + public_key(seed))


def user_seed(seed: bytes) -> str:
    """The `SU…` text of a 32-byte seed (what `nk -gen user` writes)."""
    return _b32(bytes([PREFIX_SEED | PREFIX_USER >> 5, (PREFIX_USER & 31) << 3]) + seed)
