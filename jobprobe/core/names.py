# SPDX-License-Identifier: Apache-2.0
"""Names that come from outside (node names, job names) made into one file name or one NATS subject token —
injectively, so that two names never share a file or a subject.

`escape(name, keep)`: every character in `keep` stays; every other byte of the name's UTF-8 becomes `_xx` (two hex
digits), `_` included (`_` is never in `keep`). Escaping is reversible (`unescape`), hence injective: `a/b` → `a_2fb`,
`a_b` → `a_5fb`. Subjects keep ASCII letters, digits and `-` (`.` separates a subject's tokens); file names keep
`.` too, except as the first character (a name is never hidden, `.` or `..`).
"""
from __future__ import annotations

import string

from jobprobe.core.digest import sha256

SUBJECT_KEEP = frozenset(string.ascii_letters + string.digits + "-")
FILE_KEEP = SUBJECT_KEEP | {"."}
MAX_FILE_NAME = 200   # escaped names longer than this are shortened with a hash (a file name is ≤ 255 bytes, and
                      # the suffixes ".mpk", ".N" come on top)


def escape(name: str, keep: frozenset[str], what: str = "name") -> str:
    """`name` with every character outside `keep` written as its UTF-8 bytes `_xx`; ValueError for an empty or
    non-string name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what} is a non-empty string")
    return "".join(ch if ch in keep else "".join(f"_{b:02x}" for b in ch.encode("utf-8", "surrogatepass"))
                   for ch in name)


def unescape(text: str, keep: frozenset[str]) -> str:
    """escape's inverse; ValueError for a string escape() never makes."""
    raw, i = bytearray(), 0
    while i < len(text):
        ch = text[i]
        if ch == "_":
            h = text[i + 1:i + 3]
            if len(h) != 2 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError(f"not an escaped name: {text!r}")
            raw.append(int(h, 16))
            i += 3
        elif ch in keep:
            raw += ch.encode()
            i += 1
        else:
            raise ValueError(f"not an escaped name: {text!r}")
    name = raw.decode("utf-8", "surrogatepass")
    if not name or escape(name, keep) != text:
        raise ValueError(f"not an escaped name: {text!r}")
    return name


def job_filename(job: str) -> str:
    """A file name (no suffix) for a job, injective: escape() with FILE_KEEP, and a leading `.` escaped too (`_2e`).
    A name that escapes to more than MAX_FILE_NAME characters keeps its first part and ends in `~` and the SHA-256
    of the whole name: `~` is never produced by escaping, so such a name meets no short one, and two long ones meet
    only if SHA-256 collides."""
    name = escape(job, FILE_KEEP, "job name")
    if name.startswith("."):
        name = "_2e" + name[1:]
    if len(name) > MAX_FILE_NAME:
        digest = sha256(job.encode("utf-8", "surrogatepass")).hexdigest()
        name = f"{name[:MAX_FILE_NAME - len(digest) - 1]}~{digest}"
    return name
