# SPDX-License-Identifier: Apache-2.0
"""SHA-256 from CPython's own module where it has one: the same digest as hashlib's, without mapping OpenSSL's
libcrypto into the agent (3 MiB of its RSS) for the few names and cache keys it hashes."""
from __future__ import annotations

try:
    from _sha256 import sha256  # CPython 3.11
except ImportError:             # pragma: no cover - the interpreter's version decides
    try:
        from _sha2 import sha256  # type: ignore[no-redef]  # CPython 3.12 and later
    except ImportError:
        from hashlib import sha256  # type: ignore[no-redef]

__all__ = ["sha256"]
