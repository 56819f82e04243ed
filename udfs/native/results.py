"""Results written once, where DuckDB holds them: ``reserve`` has DuckDB allocate a result
BLOB (copying zeros that cost no memory, ``zeros``) and answers where its bytes are, the kernel
writes its result there, and ``finish`` updates the copy of its first bytes DuckDB keeps
beside them. No result buffer, no copy of the result."""

from __future__ import annotations

import numpy as np
from numba import njit

from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.memory import INLINED, STRING_T, blob, u8, u32, u64


@njit(cache=True)
def reserve(output, row, zeros_at, nbytes):
    """The address of the ``nbytes`` DuckDB allocates for BLOB ``row`` of vector ``output``,
    for the kernel to write the result there once (no result buffer, no copy of it): DuckDB
    copies ``nbytes`` from ``zeros_at`` (``zeros``), cheap reads of one page. ``finish`` must
    follow the write."""
    C.duckdb_vector_assign_string_element_len(output, row, zeros_at, nbytes)
    return blob(C.duckdb_vector_get_data(output), row)[0]


@njit(cache=True)
def finish(output, row):
    """After the result at ``row`` is written where ``reserve`` said: a BLOB of more than 12
    bytes keeps a copy of its first 4 bytes inside its ``duckdb_string_t`` (its prefix)."""
    at = C.duckdb_vector_get_data(output) + np.uint64(STRING_T) * np.uint64(row)
    if u32(at, 1)[0] > INLINED:
        prefix, data = u8(at + np.uint64(4), 4), u8(u64(at + np.uint64(8), 1)[0], 4)
        prefix[:] = data
