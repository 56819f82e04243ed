"""The process's ``malloc`` tuned for tile-sized buffers (glibc only).

DuckDB copies every tile it hands to a kernel UDF, takes back from one or returns as a result
(BLOB to Arrow and back) into newly allocated buffers. glibc maps allocations over 32 MB
afresh and serves DuckDB's worker threads from per-thread arenas that cannot hold them, so
each such copy first page-faults its whole buffer in: on the benchmark machine a 64 MB copy
into fresh pages took 116 ms, into reused ones 18 ms. ``retain_freed_memory`` has glibc serve
every allocation from one heap and keep up to ``KEEP_BYTES`` of it after ``free``, so the
next tile's buffers reuse pages already mapped. Process-wide; it costs memory returned to
the system later, not peak memory. ``TRA_SQL_MALLOC=system`` leaves glibc's defaults.

DuckDB itself calls ``malloc_trim`` after its tasks (at most every 100 ms), which hands every
free page of the heap back to the system (``madvise``), so the next tiles page-fault again (an
MLP training epoch: ~30-70k faults). ``keep_duckdb_heap`` points DuckDB's library's call of
``malloc_trim`` (its PLT slot) at a function that keeps the heap, while the tuning is in effect:
freed memory then stays in the process for reuse (glibc still returns what is free past
``KEEP_BYTES`` at the heap's top).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from functools import cache

import _duckdb  # the extension module holding all of DuckDB
import numpy as np

from tra_sql import elf
from tra_sql.errors import TraError

KEEP_BYTES = 1 << 30
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8

_applied = False
_kept = False  # whether DuckDB's malloc_trim keeps the heap (``keep_duckdb_heap``)


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):
        return False


def retain_freed_memory() -> bool:
    """Apply the tuning once per process (unless ``TRA_SQL_MALLOC=system`` or not glibc);
    True when it is in effect."""
    global _applied
    mode = os.environ.get("TRA_SQL_MALLOC", "retain")
    if mode not in ("retain", "system"):
        raise TraError(f"TRA_SQL_MALLOC={mode!r}: use 'retain' (the default) or 'system'")
    if not _applied and mode == "retain" and _glibc():
        libc = ctypes.CDLL(None)
        _applied = all(libc.mallopt(param, value) == 1 for param, value in
                       ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_BYTES)))
    return _applied


# ELF: the machine's PLT relocation type (x86-64 R_X86_64_JUMP_SLOT, AArch64 R_AARCH64_JUMP_SLOT)
_JUMP_SLOT = {62: 7, 183: 1026}


@cache
def _plt_slot(path: str, symbol: str) -> int | None:
    """The offset from its load address of the PLT slot (GOT entry) through which the ELF
    shared object ``path`` calls ``symbol``, or None."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            machine, headers = elf.sections(data)
            for sh in headers if machine in _JUMP_SLOT else ():
                if sh[1] != elf.SHT_RELA:
                    continue
                dynsym = elf.linked(headers, sh)
                if dynsym[1] != elf.SHT_DYNSYM:
                    continue
                symbols = elf.table(data, dynsym, elf.SYMBOL)
                names = elf.contents(data, elf.linked(headers, dynsym))
                relocations = elf.table(data, sh, elf.RELOCATION)
                # the symbols named so: their names start where the name and its NUL lie in the table
                indices = np.flatnonzero(np.isin(symbols["name"], _occurrences(names, symbol.encode() + b"\0")))
                slots = relocations[((relocations["info"] & 0xFFFFFFFF) == _JUMP_SLOT[machine])
                                    & np.isin(relocations["info"] >> 32, indices)]
                if len(slots):
                    return int(slots["offset"][0])
        except elf.ElfError:
            return None
    return None


def _occurrences(data: bytes, part: bytes) -> list[int]:
    found, at = [], data.find(part)
    while at >= 0:
        found.append(at)
        at = data.find(part, at + 1)
    return found


def _mapping(address: int) -> tuple[str, str]:
    """(permissions, path) of the process's memory mapping holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    return "", ""


def keep_duckdb_heap(replacement: int) -> bool:
    """While the tuning is in effect, point DuckDB's library's call of ``malloc_trim`` at
    ``replacement`` (a C function ``int(size_t)`` that trims nothing); True when it does.
    Where the slot cannot be found, is read-only or holds neither glibc's ``malloc_trim`` nor
    an unresolved lazy binding, nothing changes."""
    global _kept
    if not _applied:
        return False
    library = ctypes.CDLL(_duckdb.__file__)
    offset = _plt_slot(_duckdb.__file__, "malloc_trim")
    if offset is None:
        return False
    slot = ctypes.c_size_t.from_address(library._handle).value + offset  # glibc: a handle's link_map starts l_addr
    trim = ctypes.cast(ctypes.CDLL(None).malloc_trim, ctypes.c_void_p).value
    entry = ctypes.c_uint64.from_address(slot)
    if entry.value == replacement:
        return _kept
    lazy = _mapping(entry.value)[1] == os.path.realpath(_duckdb.__file__)  # not yet bound: DuckDB's own PLT
    if "w" not in _mapping(slot)[0] or entry.value != trim and not lazy:
        return False
    entry.value = replacement
    _kept = True
    return True


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def held_free() -> int:
    """Bytes free inside the process's heap that it keeps for reuse (resident: no one trims
    them) while ``keep_duckdb_heap`` is in effect, else 0: memory the process can still use
    beyond what the machine reports available."""
    if not _kept:
        return 0
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().fordblks)
