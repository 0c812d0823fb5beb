# SPDX-License-Identifier: Apache-2.0
"""bpfmap — a loaded program's maps read and written with plain bpf(2) syscalls (jobprobe.kernel.bpf): no bcc in
the agent.

What: Map, one map by fd: lookup / update / delete, iteration, per-CPU values (one per possible CPU, each padded
  to 8 bytes), batch lookups, and per-CPU u64 columns summed for the agent's per-tick reads. RingBuffer, the
  user-space side of a BPF ring buffer map, read through mmap without libbpf.
Hooks: none of its own; bpf(2) commands MAP_*_ELEM, MAP_GET_NEXT_KEY, MAP_LOOKUP_BATCH, MAP_CREATE (to ask whether
  ring buffers exist).
Oldest kernel: 4.12 (GET_NEXT_KEY with no key for the first one). Batch lookups need 5.6 (hash maps) / 5.7 (arrays)
  and fall back to one lookup per key; ring buffers need 5.8.
Cost: a map read is one syscall per element, or per batch of up to 1024 (per key on kernels without batch ops).
"""
from __future__ import annotations

import array
import ctypes as ct
import errno
import mmap
import operator
import os
import struct
from pathlib import Path
from typing import Any, Iterator

from jobprobe.kernel.bpf import (
    ANY,
    MAP_DELETE_ELEM,
    MAP_GET_NEXT_KEY,
    MAP_LOOKUP_BATCH,
    MAP_LOOKUP_ELEM,
    MAP_UPDATE_ELEM,
    BatchAttr,
    ElemAttr,
    map_create,
    sys_bpf,
)
from jobprobe.kernel.host import parse_cpu_list

PERCPU_TYPES = {5, 6, 10, 21}   # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH, PERCPU_CGROUP_STORAGE
ENOTSUPP = 524                  # the kernel-internal errno that batch ops return for unsupported map types
BATCH = 1024                    # elements per batch call
MAP_RINGBUF = 27
RINGBUF_BUSY, RINGBUF_DISCARD, RINGBUF_HDR = 1 << 31, 1 << 30, 8   # include/uapi/linux/bpf.h BPF_RINGBUF_*


def addr(buf: Any) -> int:
    return ct.addressof(buf) if buf is not None else 0


def possible_cpus(sys_root: str = "/sys") -> int:
    """How many CPUs a per-CPU map holds a value for: the kernel copies one per possible CPU (not online)."""
    return len(parse_cpu_list(Path(sys_root, "devices/system/cpu/possible").read_text()))


def percpu_stride(value_size: int) -> int:
    """Each CPU's value in a per-CPU map buffer is padded to 8 bytes (kernel: round_up(value_size, 8))."""
    return (value_size + 7) & ~7


def ringbuf_supported() -> bool:
    """Can this kernel make a BPF ring buffer (Linux 5.8)? Asked by making one of one page and closing it."""
    try:
        fd = map_create(MAP_RINGBUF, 0, 0, mmap.PAGESIZE)
    except OSError:
        return False
    os.close(fd)
    return True


class RingBuffer:
    """The user-space side of a BPF ring buffer map (BPF_MAP_TYPE_RINGBUF), read without libbpf: its consumer page
    mapped read-write, its producer page and data area read-only (the kernel maps the data twice in a row, so a
    record that wraps reads as one piece). drain() returns the records committed so far and frees their space.
    One reader at a time (the caller's lock)."""

    def __init__(self, fd: int, size: int):
        if size <= 0 or size & (size - 1):
            raise ValueError(f"ring buffer size {size} is not a power of two")
        page = mmap.PAGESIZE
        self.size, self.page = size, page
        self.cons = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.prod = mmap.mmap(fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)

    def drain(self) -> list[bytes]:
        out = []
        cons = struct.unpack_from("<Q", self.cons, 0)[0]
        prod = struct.unpack_from("<Q", self.prod, 0)[0]
        while cons < prod:
            at = self.page + (cons & (self.size - 1))
            head = struct.unpack_from("<I", self.prod, at)[0]
            if head & RINGBUF_BUSY:
                break                       # reserved, not yet committed: the rest waits for the next drain
            length = head & ~(RINGBUF_BUSY | RINGBUF_DISCARD)
            if not head & RINGBUF_DISCARD:
                out.append(self.prod[at + RINGBUF_HDR:at + RINGBUF_HDR + length])
            cons += (length + RINGBUF_HDR + 7) & ~7
            struct.pack_into("<Q", self.cons, 0, cons)
        return out

    def close(self) -> None:
        self.cons.close()
        self.prod.close()


class Map:
    """One BPF map, by fd. Keys and values are bytes unless typed() gave ctypes types: then ints (simple types)
    or ctypes structs go in and come out. Per-CPU maps take and give a list with one value per possible CPU."""

    def __init__(self, fd: int, name: str, type: int, key_size: int, value_size: int, max_entries: int,
                 ncpus: int = 1):
        self.fd, self.name, self.type = fd, name, type
        self.key_size, self.value_size, self.max_entries = key_size, value_size, max_entries
        self.percpu = type in PERCPU_TYPES
        self.ncpus = ncpus if self.percpu else 1
        self.stride = percpu_stride(value_size) if self.percpu else value_size
        self.key_type: Any = None    # ctypes types, from typed()
        self.value_type: Any = None
        self._batch_ok = True        # until the kernel says this map (or kernel) has no batch lookup
        self._sums: dict[int, tuple[bytes, list[int]]] = {}   # sums_at's last answer per index, with its bytes

    def typed(self, key: Any = None, value: Any = None) -> Map:
        """Set the ctypes key/value types, checking their sizes against the kernel's: a layout mismatch between
        Python and C is caught at start, not read as garbage."""
        for what, t, size in (("key", key, self.key_size), ("value", value, self.value_size)):
            if t is not None and ct.sizeof(t) != size:
                raise ValueError(f"map {self.name}: {what} type {t.__name__} is {ct.sizeof(t)} bytes, the map's "
                                 f"{what} is {size}")
        self.key_type, self.value_type = key, value
        return self

    # -- conversions
    def _raw(self, obj: Any, t: Any, size: int) -> bytes:
        if isinstance(obj, (bytes, bytearray, ct.Structure, ct.Union, ct.Array, ct._SimpleCData)):
            raw = bytes(obj)
        elif t is not None:
            raw = bytes(t(obj))
        else:
            raise TypeError(f"map {self.name}: give bytes or a ctypes object, or call typed() first")
        if len(raw) != size:
            raise ValueError(f"map {self.name}: {len(raw)} bytes given, {size} expected")
        return raw

    def _decode(self, raw: bytes, t: Any) -> Any:
        if t is None:
            return raw
        obj = t.from_buffer_copy(raw)
        return obj.value if isinstance(obj, ct._SimpleCData) else obj

    def _key_buf(self, key: Any) -> Any:
        return ct.create_string_buffer(self._raw(key, self.key_type, self.key_size), self.key_size)

    def _values(self, buf: Any, offset: int = 0) -> Any:
        """One element's value from a buffer: the value, or a list of per-CPU values."""
        raw = bytes(buf[offset:offset + self.stride * self.ncpus])
        if not self.percpu:
            return self._decode(raw, self.value_type)
        return [self._decode(raw[i * self.stride:i * self.stride + self.value_size], self.value_type)
                for i in range(self.ncpus)]

    # -- element operations
    def lookup(self, key: Any) -> Any:
        """The value (list of per-CPU values for a per-CPU map), or None when the key is absent."""
        raw = self._lookup_raw(key)
        return None if raw is None else self._values(raw)

    def _lookup_raw(self, key: Any) -> bytes | None:
        """One element's value as the kernel copies it (every CPU's, padded to stride), or None when absent."""
        kb, vb = self._key_buf(key), ct.create_string_buffer(self.stride * self.ncpus)
        try:
            sys_bpf(MAP_LOOKUP_ELEM, ElemAttr(map_fd=self.fd, key=addr(kb), value=addr(vb)))
        except FileNotFoundError:
            return None
        return vb.raw

    def _column_sums(self, raw: bytes) -> list[int]:
        """One element's per-CPU values of u64 fields, summed over CPUs as flat columns."""
        words, per, n = array.array("Q", raw), self.stride // 8, self.value_size // 8
        if self.ncpus <= 4:         # a few CPUs: pairwise adds in C are quickest (2 CPUs: 5 µs vs 11 for 80 fields)
            acc = words[0:n].tolist()
            for c in range(1, self.ncpus):
                acc = list(map(operator.add, acc, words[c * per:c * per + n]))
            return acc
        return [sum(col) for col in zip(*(words[c * per:c * per + n] for c in range(self.ncpus)))]

    def lookup_sums(self, key: Any) -> list[int] | None:
        """A per-CPU value made of u64 fields, summed over CPUs as flat u64 columns (no ctypes decode: the
        agent reads one such value per job and probe every tick); None when the key is absent."""
        raw = self._lookup_raw(key)
        return None if raw is None else self._column_sums(raw)

    def array_raw(self) -> bytes:
        """An array map's every value, raw, in key order (0 … max_entries-1; per-CPU maps: each key's CPUs in turn):
        batch lookups where the kernel has them (5.6), else a lookup per key. For sums_at()."""
        size = self.stride * self.ncpus
        raw = self._batch_or_none(lambda: b"".join(vals[:n * size] for _, vals, n in self._batches()))
        if raw is not None and len(raw) == self.max_entries * size:
            return raw
        out = []
        for i in range(self.max_entries):
            raw = self._lookup_raw(i)
            if raw is None:
                raise FileNotFoundError(errno.ENOENT, f"map {self.name}: no element {i}")
            out.append(raw)
        return b"".join(out)

    def sums_at(self, raw: bytes, index: int) -> list[int]:
        """lookup_sums() of key `index` from array_raw()'s bytes. An element whose bytes are those of the last
        call for that index (an idle job's slot) is not summed again: one compare instead of ncpus × fields adds."""
        size = self.stride * self.ncpus
        chunk = raw[index * size:(index + 1) * size]
        last = self._sums.get(index)
        if last is not None and last[0] == chunk:
            return list(last[1])
        sums = self._column_sums(chunk)
        self._sums[index] = (chunk, sums)
        return list(sums)

    def update(self, key: Any, value: Any, flags: int = ANY) -> None:
        if self.percpu and not isinstance(value, (bytes, bytearray)):
            if len(value) != self.ncpus:
                raise ValueError(f"map {self.name}: {len(value)} per-CPU values given, {self.ncpus} CPUs")
            pad = bytes(self.stride - self.value_size)
            raw = b"".join(self._raw(v, self.value_type, self.value_size) + pad for v in value)
        else:
            raw = self._raw(value, self.value_type, self.stride * self.ncpus)
        kb, vb = self._key_buf(key), ct.create_string_buffer(raw, len(raw))
        sys_bpf(MAP_UPDATE_ELEM, ElemAttr(map_fd=self.fd, key=addr(kb), value=addr(vb), flags=flags))

    def delete(self, key: Any) -> bool:
        """False when the key was not there (arrays cannot delete: EINVAL is raised)."""
        kb = self._key_buf(key)
        try:
            sys_bpf(MAP_DELETE_ELEM, ElemAttr(map_fd=self.fd, key=addr(kb)))
        except FileNotFoundError:
            return False
        return True

    def __contains__(self, key: Any) -> bool:
        return self.lookup(key) is not None

    def keys(self) -> list[Any]:
        """Every key, by GET_NEXT_KEY. A list, not a generator: deleting the current key while walking a hash map
        restarts the walk from the first bucket."""
        out, prev = [], None
        nxt = ct.create_string_buffer(self.key_size)
        while True:
            try:
                sys_bpf(MAP_GET_NEXT_KEY, ElemAttr(map_fd=self.fd, key=addr(prev), value=addr(nxt)))
            except FileNotFoundError:
                return out
            out.append(self._decode(nxt.raw, self.key_type))
            prev, nxt = nxt, ct.create_string_buffer(self.key_size)
            if len(out) > self.max_entries:   # a map churning faster than we walk it: stop, never loop forever
                return out

    def items(self) -> list[tuple[Any, Any]]:
        """Every (key, value): batch lookups where the kernel has them, else one lookup per key."""
        got = self._batch_or_none(self._items_batch)
        if got is not None:
            return got
        out = []
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:            # deleted between the walk and the lookup
                out.append((k, v))
        return out

    def _batch_or_none(self, fn: Any) -> Any:
        """fn() (batch lookups), or None where the kernel has none for this map: kernel < 5.6, or a map type
        without batch ops — asked once, then not again."""
        if not self._batch_ok:
            return None
        try:
            return fn()
        except OSError as err:
            if err.errno not in (errno.EINVAL, ENOTSUPP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            self._batch_ok = False
            return None

    def _items_batch(self) -> list[tuple[Any, Any]]:
        out = []
        for keys, vals, n in self._batches():
            for i in range(n):
                key = self._decode(keys[i * self.key_size:(i + 1) * self.key_size], self.key_type)
                out.append((key, self._values(vals, i * self.stride * self.ncpus)))
        return out

    def _batches(self) -> Iterator[tuple[bytes, bytes, int]]:
        """The map in MAP_LOOKUP_BATCH chunks: (keys, values, how many came back) each."""
        count = min(BATCH, max(self.max_entries, 1))
        # The batch token is a bucket index (u32) for hash maps and a key for the others.
        token_in, token_out = (ct.create_string_buffer(max(self.key_size, 8)) for _ in range(2))
        first = True
        while True:
            keys = ct.create_string_buffer(count * self.key_size)
            vals = ct.create_string_buffer(count * self.stride * self.ncpus)
            attr = BatchAttr(in_batch=0 if first else addr(token_in), out_batch=addr(token_out), keys=addr(keys),
                             values=addr(vals), count=count, map_fd=self.fd)
            done = False
            try:
                sys_bpf(MAP_LOOKUP_BATCH, attr)
            except FileNotFoundError:
                done = True              # the last chunk: attr.count still says how many came back
            except OSError as err:
                if err.errno == errno.ENOSPC and count < self.max_entries:
                    count *= 2           # a hash bucket longer than count: retry with room for it
                    continue
                raise
            yield keys.raw, vals.raw, attr.count
            if done:
                return
            ct.memmove(token_in, token_out, len(token_out))
            first = False
