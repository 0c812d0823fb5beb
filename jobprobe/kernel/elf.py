# SPDX-License-Identifier: Apache-2.0
"""elf — the exported functions of a shared library and their file offsets, for uprobes.

What: a uprobe is placed by (file, offset in the file); a library names its functions in .dynsym with virtual
  addresses. dynamic_functions() reads the ELF header, the program headers (PT_LOAD: virtual address ↔ file offset)
  and the .dynsym / .dynstr sections, and returns name → file offset for defined functions. Only the headers and
  those two sections are read (a real libcuda.so is ~100 MB; its .dynsym is a few hundred KB).
Hooks: none; plain file reads. Oldest kernel: any. Cost: a few reads per library, once per library file.
Limits: 64-bit ELF only (both byte orders); symbol versions are ignored (the first defined function of a name wins);
  GNU indirect functions (STT_GNU_IFUNC) are left out, since a probe there would fire in the resolver, once, at
  load time; a library whose section headers were stripped (no .dynsym section) raises ElfError.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, Iterable

ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB, ELFDATA2MSB = 1, 2
PT_LOAD = 1
SHT_DYNSYM = 11
SHN_UNDEF = 0
STT_FUNC = 2
SYM_SIZE = 24              # sizeof(Elf64_Sym)


class ElfError(ValueError):
    """Not a library this reader can place probes in; the message says why."""


def _read(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ElfError(f"truncated: wanted {size} bytes at offset {offset}")
    return data


def vaddr_to_offset(vaddr: int, loads: Iterable[tuple[int, int, int]]) -> int | None:
    """File offset of a virtual address, from PT_LOAD segments (p_offset, p_vaddr, p_filesz); None when no segment
    holds it in its file-backed part."""
    for off, va, filesz in loads:
        if va <= vaddr < va + filesz:
            return vaddr - va + off
    return None


def dynamic_functions(path: str, wanted: Iterable[str] | None = None) -> dict[str, int]:
    """name → file offset of every defined function in .dynsym (only those in `wanted` when given)."""
    want = None if wanted is None else set(wanted)
    try:
        with open(path, "rb") as f:
            return _functions(f, want)
    except OSError as err:
        raise ElfError(f"cannot read {path}: {err.strerror or err}") from err
    except struct.error as err:
        raise ElfError(f"{path}: malformed ELF: {err}") from err


def _functions(f: BinaryIO, want: set[str] | None) -> dict[str, int]:
    ident = _read(f, 0, 16)
    if ident[:4] != ELF_MAGIC:
        raise ElfError("not an ELF file")
    if ident[4] != ELFCLASS64:
        raise ElfError("not a 64-bit ELF file")
    if ident[5] not in (ELFDATA2LSB, ELFDATA2MSB):
        raise ElfError(f"unknown byte order {ident[5]}")
    e = "<" if ident[5] == ELFDATA2LSB else ">"
    # Elf64_Ehdr after e_ident: type, machine, version, entry, phoff, shoff, flags, ehsize, phentsize, phnum,
    # shentsize, shnum, shstrndx
    (_, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = struct.unpack(
        e + "HHIQQQIHHHHHH", _read(f, 16, 48))
    loads = []
    for i in range(phnum):
        # Elf64_Phdr: p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack(
            e + "IIQQQQQQ", _read(f, phoff + i * phentsize, 56))
        if p_type == PT_LOAD:
            loads.append((p_offset, p_vaddr, p_filesz))
    sections = []
    for i in range(shnum if shoff else 0):
        # Elf64_Shdr: sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign,
        # sh_entsize
        sections.append(struct.unpack(e + "IIQQQQIIQQ", _read(f, shoff + i * shentsize, 64)))
    dynsym = next((s for s in sections if s[1] == SHT_DYNSYM), None)
    if dynsym is None:
        raise ElfError("no .dynsym section (section headers stripped?)")
    link = dynsym[6]
    if link >= len(sections):
        raise ElfError(".dynsym names no string table")
    strtab = _read(f, sections[link][4], sections[link][5])
    syms = _read(f, dynsym[4], dynsym[5])
    out: dict[str, int] = {}
    for i in range(len(syms) // SYM_SIZE):
        st_name, st_info, _, st_shndx, st_value, _ = struct.unpack_from(e + "IBBHQQ", syms, i * SYM_SIZE)
        if st_info & 0xF != STT_FUNC or st_shndx == SHN_UNDEF or st_value == 0:
            continue
        end = strtab.find(b"\0", st_name)
        name = strtab[st_name:end if end >= 0 else len(strtab)].decode("utf-8", "replace")
        if (want is not None and name not in want) or name in out:
            continue
        offset = vaddr_to_offset(st_value, loads)
        if offset is not None:
            out[name] = offset
    return out
