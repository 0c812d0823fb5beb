# SPDX-License-Identifier: Apache-2.0
"""The compact form of a run's samples: one block per node, job, run and span of time, column by column — lossless.

A block holds n samples of one (node, job, run). Each leaf of the frames (a path of map keys: `probes`, `cgroup`,
`cpu_user_ns`) is a column of n values, stored by what they all are:
- `i` integers (never bool): delta-encoded along time (a counter's per-interval values differ little), msgpack;
- `f` floats: their IEEE-754 doubles, byte-transposed (the bytes of equal weight together: exponents and high
  mantissa bytes repeat) so that deflate finds the repeats;
- `l` lists of integers of one length: the matrix delta-encoded along time per index (histograms);
- `v` anything else (strings, maps left whole, lists of maps, mixed types): the values as they are, msgpack;
each with a mask of which samples lack the key (`missing`) or hold None — then deflate (raw, level 6), a column at
a time, so that reading one field inflates only its column. decode(block) gives back frames equal to the ones
encoded (dict equality: the same keys, values and types; key order may differ).

A block is msgpack [FORMAT, n, columns]: its first element says its format, so that a later change of it is read
by what it says, not guessed (a block of before formats had begun, [n, columns], is format 0 and reads the same).
A block of a format newer than this code's is refused (ValueError), never misread.

Why not one deflate stream per block: a field over an hour of 8 nodes is then ~500 whole blocks to inflate; by
column it is 500 small columns (docs/PERFORMANCE.md, "The store"). Why this and not Parquet or DuckDB: measured on
real frames (scripts/store_formats.py), and it needs nothing the standard library and msgpack do not give.
"""
from __future__ import annotations

import struct
import zlib
from typing import Any, Iterable

import msgpack

from jobprobe.core.numbers import is_finite, is_int

FORMAT = 1          # the block format this code writes (0: the [n, columns] blocks written before formats began)
MISSING, NONE, PRESENT = 0, 1, 2
_I64 = (-(1 << 63), (1 << 63) - 1)


def _deflate(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def _inflate(data: bytes) -> bytes:
    return zlib.decompress(data, -15)


LEN = -1        # a path's last element for a list of maps' length (its elements' paths go on with their index)


def _map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in v)


def leaves(obj: dict, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    """(path, value) of every leaf of a map: a non-empty map is walked into, and a non-empty list of maps too —
    its length at path + (LEN,), each element's leaves under path + (index,) (one GPU's fields, one peer's, a
    column each); anything else is a leaf. Map keys are strings, so a number in a path is a list's."""
    for k, v in obj.items():
        p = path + (k,)
        if v and _map(v):
            yield from leaves(v, p)
        elif isinstance(v, list) and v and all(_map(e) for e in v):
            yield p + (LEN,), len(v)
            for i, e in enumerate(v):
                yield from leaves(e, p + (i,))
        else:
            yield p, v


def _is_int(v: Any) -> bool:
    return is_int(v) and _I64[0] <= v <= _I64[1]


def _kind(values: list) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "v"
    if all(_is_int(v) for v in present):
        deltas = [b - a for a, b in zip(present, present[1:])]
        return "i" if all(_I64[0] <= d <= _I64[1] for d in deltas) else "v"
    if all(isinstance(v, float) for v in present):
        return "f"
    if all(isinstance(v, list) and v and all(_is_int(x) for x in v) for v in present) and \
            len({len(v) for v in present}) == 1:
        return "l"
    return "v"


def _delta(rows: list[list[int]]) -> list[list[int]]:
    prev = [0] * len(rows[0]) if rows else []
    out = []
    for r in rows:
        out.append([x - p for x, p in zip(r, prev)])
        prev = r
    return out


def _undelta(rows: list[list[int]]) -> list[list[int]]:
    out, prev = [], None
    for r in rows:
        prev = r if prev is None else [x + p for x, p in zip(r, prev)]
        out.append(prev)
    return out


def _column(values: list, mask: list[int]) -> tuple[str, bytes]:
    present = [v for v, m in zip(values, mask) if m == PRESENT]
    kind = _kind(present)
    if kind == "i":
        body = msgpack.packb([r[0] for r in _delta([[v] for v in present])])
    elif kind == "l":
        body = msgpack.packb(_delta(present))
    elif kind == "f":
        raw = struct.pack(f"<{len(present)}d", *present)
        body = b"".join(raw[b::8] for b in range(8))       # byte b of every value, then b + 1: zlib finds runs
    else:
        body = msgpack.packb(present, use_bin_type=True)
    return kind, _deflate(bytes(mask) + body)


def _values(kind: str, data: bytes, n: int) -> tuple[list, list[int]]:
    raw = _inflate(data)
    mask, body = list(raw[:n]), raw[n:]
    k = mask.count(PRESENT)
    if kind == "i":
        present = [r[0] for r in _undelta([[d] for d in msgpack.unpackb(body)])]
    elif kind == "l":
        present = _undelta(msgpack.unpackb(body))
    elif kind == "f":
        raw8 = bytearray(8 * k)
        for b in range(8):
            raw8[b::8] = body[b * k:(b + 1) * k]
        present = list(struct.unpack(f"<{k}d", raw8))
    else:
        present = msgpack.unpackb(body, raw=False, strict_map_key=False)
    it = iter(present)
    return [next(it) if m == PRESENT else None for m in mask], mask


def encode(frames: list[dict], ids: Any = None) -> bytes:
    """A block of frames (one node, job and run, in seq order): msgpack [n, [[path, kind, column], …]]. `ids`, a
    path → int function (the store's codebook of paths), writes each path as its number instead."""
    n = len(frames)
    paths: dict[tuple, None] = {}
    flat = []
    for f in frames:
        d = dict(leaves(f))
        flat.append(d)
        for p in d:
            paths.setdefault(p, None)
    cols = []
    for p in paths:
        mask = [MISSING if p not in d else NONE if d[p] is None else PRESENT for d in flat]
        kind, data = _column([d.get(p) for d in flat], mask)
        cols.append([ids(p) if ids else list(p), kind, data])
    return pack(n, cols)


def pack(n: int, cols: list) -> bytes:
    """A block of n samples made of its columns ([path, kind, data] each), in this code's FORMAT."""
    return msgpack.packb([FORMAT, n, cols], use_bin_type=True)


def parts(block: bytes) -> tuple[int, list]:
    """(n, columns) of a block of any format this code reads; ValueError for one it does not (newer, or no block)."""
    head = msgpack.unpackb(block, raw=False, use_list=True)
    if isinstance(head, list) and len(head) == 2:            # format 0: [n, columns]
        n, cols = head
    elif isinstance(head, list) and len(head) == 3 and isinstance(head[0], int) and 1 <= head[0] <= FORMAT:
        _, n, cols = head
    else:
        what = f"format {head[0]}" if isinstance(head, list) and len(head) == 3 else "not a block"
        raise ValueError(f"a block of {what}: this jobprobe reads formats 0 to {FORMAT} (upgrade it)")
    return n, cols


def decode(block: bytes, only: Iterable[tuple] | None = None, paths: Any = None) -> list[dict]:
    """The frames of a block (only the leaves under the paths in `only`, when given); `paths`: the codebook's
    int → path, for a block encoded with one."""
    n, cols = parts(block)
    want = None if only is None else [tuple(p) for p in only]
    out: list[dict] = [{} for _ in range(n)]
    for path, kind, data in cols:
        path = paths(path) if paths else tuple(path)
        if want is not None and not any(path[:len(w)] == w for w in want):
            continue
        values, mask = _values(kind, data, n)
        for f, v, m in zip(out, values, mask):
            if m == MISSING:
                continue
            node = f
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = v
    return [_lists(f) for f in out]


def _lists(d: dict) -> Any:
    """A decoded map with the lists of maps made lists again (a map holding LEN: its elements by index)."""
    for k, v in d.items():
        if isinstance(v, dict):
            d[k] = _lists(v)
    if LEN in d:
        return [d.get(i, {}) for i in range(d[LEN])]
    return d


def column(block: bytes, key: Any) -> list:
    """One leaf's n values (None where missing or None) — the fast path of a field over time. `key`: its path
    (a list), or its number in the codebook the block was encoded with."""
    return columns(block, [key])[0]


def columns(block: bytes, keys: list) -> list[list]:
    """Several leaves' values (column() of each), the block read once."""
    n, cols = parts(block)
    found = {}
    for p, kind, data in cols:
        if p in keys:
            found[p if not isinstance(p, list) else tuple(p)] = _values(kind, data, n)[0]
    return [found.get(k if not isinstance(k, list) else tuple(k), [None] * n) for k in keys]


def finite(v: Any) -> bool:
    return is_finite(v)
