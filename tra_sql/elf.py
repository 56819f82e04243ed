"""Reading ELF64 little-endian files (shared objects, relocatable objects) without trusting them:
section headers and tables, every read checked against the data's length (``ElfError``)."""

from __future__ import annotations

import struct

import numpy as np

SHT_SYMTAB, SHT_RELA, SHT_DYNSYM = 2, 4, 11
#: Elf64_Sym and Elf64_Rela
SYMBOL = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("section", "<u2"), ("value", "<u8"),
                   ("size", "<u8")])
RELOCATION = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])
_SECTION = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, align, entsize


class ElfError(ValueError):
    """Data that is not a well-formed ELF64 little-endian file."""


def sections(data) -> tuple[int, list[tuple[int, ...]]]:
    """(the machine, the section headers) of ELF ``data`` (bytes, or a read-only mmap)."""
    if bytes(data[:6]) != b"\x7fELF\x02\x01":
        raise ElfError("not a 64-bit little-endian ELF file")
    try:
        machine, = struct.unpack_from("<H", data, 18)
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        if shentsize < _SECTION.size:
            raise ElfError("section headers too short")
        return machine, [_SECTION.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    except (struct.error, OverflowError):
        raise ElfError("section headers outside the file") from None


def table(data, section: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The entries of ``section`` as an array of ``dtype`` (a copy: ``data`` may be closed)."""
    offset, size = section[4], section[5]
    if offset + size > len(data) or size % dtype.itemsize:
        raise ElfError("a section lies outside the file")
    return np.frombuffer(data, dtype, size // dtype.itemsize, offset).copy()


def contents(data, section: tuple[int, ...]) -> bytes:
    """The bytes of ``section``."""
    offset, size = section[4], section[5]
    if offset + size > len(data):
        raise ElfError("a section lies outside the file")
    return bytes(data[offset:offset + size])


def linked(all_sections: list[tuple[int, ...]], section: tuple[int, ...]) -> tuple[int, ...]:
    """The section ``section`` links to (a symbol table's strings, a relocation table's symbols)."""
    if section[6] >= len(all_sections):
        raise ElfError("a section links to one that does not exist")
    return all_sections[section[6]]


def name(strings: bytes, at: int) -> bytes:
    """The NUL-terminated name at offset ``at`` of a string table."""
    end = strings.find(b"\0", at)
    if at >= len(strings) or end < 0:
        raise ElfError("a name lies outside its string table")
    return strings[at:end]
