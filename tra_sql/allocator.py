"""The process's ``malloc`` tuned for tile-sized buffers (glibc only).

DuckDB copies every tile it hands to a kernel UDF, takes back from one or returns as a result
(BLOB to Arrow and back) into newly allocated buffers. glibc maps allocations over 32 MB
afresh and serves DuckDB's worker threads from per-thread arenas that cannot hold them, so
each such copy first page-faults its whole buffer in: on the benchmark machine a 64 MB copy
into fresh pages took 116 ms, into reused ones 18 ms. ``retain_freed_memory`` has glibc serve
every allocation from one heap and keep up to ``KEEP_BYTES`` of it after ``free``, so the
next tile's buffers reuse pages already mapped. Process-wide; it costs memory returned to
the system later, not peak memory. ``TRA_SQL_MALLOC=system`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os

from tra_sql.errors import TraError

KEEP_BYTES = 1 << 30
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8

_applied = False


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
