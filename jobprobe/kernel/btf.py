# SPDX-License-Identifier: Apache-2.0
"""BTF: the running kernel's own type information (/sys/kernel/btf/vmlinux; include/uapi/linux/btf.h), read
without libbpf — struct member offsets and raw tracepoint prototypes (Btf), enum values (enum_values).

Why: kernel headers may not match the running kernel (this project's hosts run 6.18 with 6.12 headers), so offsets
a program reads through a raw tracepoint's pointers, and enum numberings that depend on the kernel's config, come
from the kernel's BTF. Oldest kernel: 5.2 (vmlinux BTF). Cost: one pass over the ~130k types (~70 ms).
"""
from __future__ import annotations

import array
import struct
from pathlib import Path
from typing import Iterable


class Btf:
    """The type information of the running kernel (/sys/kernel/btf/vmlinux; include/uapi/linux/btf.h): struct
    member offsets and tracepoint prototypes. One pass indexes the ~130k types (~70 ms)."""
    FIXED = {1: 4, 3: 12, 14: 4, 17: 4}                       # bytes after a btf_type, per kind
    PER_MEMBER = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # ... and per vlen item
    INT, PTR, STRUCT, UNION, ENUM, TYPEDEF, FUNC_PROTO, ENUM64 = 1, 2, 4, 5, 6, 8, 13, 19
    QUALIFIERS = {9, 10, 11, 18}                              # volatile, const, restrict, type_tag: see through

    def __init__(self, data: bytes, names: Iterable[str] | None = None):
        """names: the only type names find() will be asked for (an index of those alone: the agent's heap then
        grows by ~1 MB for the pass, not ~12 MB for a dict of every name)."""
        magic, _, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data, 0)
        if magic != 0xEB9F:
            raise ValueError("not BTF")
        self.data, self.strs = data, data[hdr_len + str_off:hdr_len + str_off + str_len]
        self.pos = array.array("I", [0])                      # type id -> offset of its btf_type; 0 is void
        self.ids: dict[tuple[int, int], int] = {}             # (kind, name offset) -> first such type
        wanted = None if names is None else {off + 1 for off in map(self._name_at, names) if off >= 0}
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len
        head = struct.Struct("<II").unpack_from
        while pos < end:
            name_off, info = head(data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if name_off and (wanted is None or name_off in wanted):
                self.ids.setdefault((kind, name_off), len(self.pos))
            self.pos.append(pos)
            pos += 12 + self.FIXED.get(kind, 0) + vlen * self.PER_MEMBER.get(kind, 0)

    def _type(self, tid: int) -> tuple[str, int, int, int, int]:
        """(name, kind, vlen, size_or_type, offset of what follows the btf_type)."""
        name_off, info, size = struct.unpack_from("<III", self.data, self.pos[tid])
        name = self.strs[name_off:self.strs.find(b"\0", name_off)].decode(errors="replace")
        return name, (info >> 24) & 0x1F, info & 0xFFFF, size, self.pos[tid] + 12

    def _name_at(self, name: str) -> int:
        return self.strs.find(b"\0" + name.encode() + b"\0")   # the string section holds each string once

    def find(self, kind: int, name: str) -> int | None:
        off = self._name_at(name)
        return None if off < 0 else self.ids.get((kind, off + 1))

    def describe(self, tid: int) -> str:
        """A type as C spells it, qualifiers dropped: "struct request *", "blk_status_t", "unsigned int"."""
        if tid == 0:
            return "void"
        name, kind, _, ref, _ = self._type(tid)
        if kind == self.PTR:
            return self.describe(ref) + " *"
        if kind in self.QUALIFIERS:
            return self.describe(ref)
        return {self.STRUCT: "struct ", self.UNION: "union ", self.ENUM: "enum ", self.ENUM64: "enum "}.get(kind, "") \
            + name

    def size(self, tid: int) -> int:
        _, kind, _, ref, _ = self._type(tid)
        if kind == self.PTR:
            return 8 if struct.calcsize("P") == 8 else 4
        return self.size(ref) if kind in self.QUALIFIERS or kind == self.TYPEDEF else ref

    def member(self, tid: int, name: str) -> tuple[int, int] | None:
        """(byte offset, type id) of a member of a struct/union, looking into anonymous members as C does."""
        _, kind, vlen, ref, at = self._type(tid)
        while kind in self.QUALIFIERS or kind == self.TYPEDEF:
            tid = ref
            _, kind, vlen, ref, at = self._type(tid)
        kind_flag = self.data[self.pos[tid] + 7] & 0x80   # then a bitfield's size is kept in the top byte
        for j in range(vlen):
            name_off, mtype, moff = struct.unpack_from("<III", self.data, at + 12 * j)
            bits = moff & 0xFFFFFF if kind_flag else moff
            mname = self.strs[name_off:self.strs.find(b"\0", name_off)].decode(errors="replace")
            if mname == name:
                return bits // 8, mtype
            if not name_off:
                inner = self.member(mtype, name)
                if inner:
                    return bits // 8 + inner[0], inner[1]
        return None

    def offset(self, struct_name: str, path: str) -> tuple[int, int]:
        """(byte offset, size) of struct_name.path ("bi_iter.bi_sector"); KeyError naming what is missing."""
        tid = self.find(self.STRUCT, struct_name)
        if tid is None:
            raise KeyError(f"struct {struct_name}")
        total = 0
        for part in path.split("."):
            got = self.member(tid, part)
            if got is None:
                raise KeyError(f"struct {struct_name} member {path}")
            total, tid = total + got[0], got[1]
        return total, self.size(tid)

    def tracepoint_args(self, event: str) -> tuple[str, ...] | None:
        """The C argument types of a raw tracepoint (after its leading void *), from btf_trace_<event>."""
        tid = self.find(self.TYPEDEF, f"btf_trace_{event}")
        if tid is None:
            return None
        _, _, _, ref, _ = self._type(tid)
        _, kind, _, proto, _ = self._type(ref)
        _, kind2, vlen, _, at = self._type(proto) if kind == self.PTR else ("", 0, 0, 0, 0)
        if kind2 != self.FUNC_PROTO:
            return None
        params = [struct.unpack_from("<II", self.data, at + 8 * j)[1] for j in range(vlen)]
        return tuple(self.describe(p) for p in params[1:])


def enum_values(path: str | Path, names: tuple[str, ...]) -> dict[str, int]:
    """Values of enum members `names`, all taken from the one enum that has them all (vmlinux BTF: the running
    kernel's own numbering, which depends on its config, unlike the headers'). {} if no enum has them all."""
    data = Path(path).read_bytes()
    magic, _, _, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data, 0)
    if magic != 0xEB9F:
        raise ValueError(f"{path}: not BTF")
    strs = data[hdr_len + str_off:hdr_len + str_off + str_len]
    if not all(b"\0" + n.encode() + b"\0" in strs for n in names):
        return {}

    def name_at(off: int) -> str:
        return strs[off:strs.find(b"\0", off)].decode(errors="replace")

    # Bytes after the 12-byte btf_type: fixed per kind, or per member (vlen) — include/uapi/linux/btf.h.
    fixed, member = {1: 4, 3: 12, 14: 4, 17: 4}, {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
    pos, end = hdr_len + type_off, hdr_len + type_off + type_len
    while pos < end:
        info = struct.unpack_from("<I", data, pos + 4)[0]
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        pos += 12
        if kind in (6, 19):   # ENUM (name_off, s32) / ENUM64 (name_off, lo32, hi32)
            found = {}
            for j in range(vlen):
                name_off, lo = struct.unpack_from("<Ii", data, pos + member[kind] * j)
                name = name_at(name_off)
                if name in names:
                    hi = struct.unpack_from("<i", data, pos + 12 * j + 8)[0] if kind == 19 else None
                    found[name] = lo if hi is None else (hi << 32) | (lo & 0xFFFFFFFF)
            if len(found) == len(names):
                return found
        pos += fixed.get(kind, 0) + vlen * member.get(kind, 0)
    return {}
