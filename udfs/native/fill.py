"""The native constant-tile kernel (kind ``fill``, ``tra_fill(step, keys)``): one tile of a
constant tensor per row of output keys, as the Arrow UDF ``udfs.placement.fill`` computes it
(the same bytes: the value converted to the dtype by NumPy when the call is bound).

A chunk's tiles share one buffer, filled once with the element's bytes as far as its largest
tile needs (a tile is a prefix of it); each row's keys are checked against the tensor's grid
before its tile is written."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs.native.aggregate import memcpy
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import CORRUPT, address, grid_tile, i64, put_text, u8
from tra_sql.udfs.native.operands import list_entry, set_error
from tra_sql.udfs.native.plans import MESSAGE
from tra_sql.udfs.protocol import FillStep

# plan: itemsize, rank, the address of the element's bytes; then shape and tile per dimension
HEADER = 3
KEYS_OUTSIDE = np.frombuffer(b"a constant tensor's output keys are NULL or outside its tile grid", np.uint8)


def plan(text: str) -> tuple[np.ndarray, ...]:
    """The bind data of step ``text`` (a ``FillStep``) and the element's bytes it points to."""
    step = FillStep.decode(text)
    element = np.frombuffer(np.array(step.value, dtype=np.dtype(step.dtype)).tobytes(), np.uint8).copy()
    head = [element.size, len(step.shape), element.ctypes.data]
    return np.array([*head, *step.shape, *step.tile], dtype=np.int64), element


@njit(cache=True)
def _fill(buffer, element) -> None:
    """``buffer`` filled with repeats of ``element`` (whose length divides the buffer's)."""
    buffer[: len(element)] = element
    filled = len(element)
    while filled < len(buffer):  # doubling copies of what is written
        n = min(filled, len(buffer) - filled)
        memcpy(buffer.ctypes.data + np.uint64(filled), buffer.ctypes.data, np.uint64(n))
        filled += n


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def KERNEL(info_ptr, chunk_ptr, output_ptr):
    info, chunk, output = address(info_ptr), address(chunk_ptr), address(output_ptr)
    plan = i64(C.duckdb_scalar_function_get_bind_data(info), HEADER)
    plan = i64(C.duckdb_scalar_function_get_bind_data(info), HEADER + 2 * plan[1])
    element = u8(plan[2], plan[0])
    shape, tile = plan[HEADER: HEADER + plan[1]], plan[HEADER + plan[1]:]
    extents = np.empty(max(plan[1], 1), np.int64)
    buffer, filled = np.empty(0, np.uint8), 0
    for row in range(C.duckdb_data_chunk_get_size(chunk)):
        keys, ok = list_entry(chunk, 1, row)
        nbytes = plan[0] * grid_tile(shape, tile, keys, extents) if ok else -1
        if nbytes < 0:
            message = np.zeros(MESSAGE, np.uint8)
            put_text(message, put_text(message, 0, CORRUPT), KEYS_OUTSIDE)
            set_error(info, False, message)
            return
        if nbytes > filled:
            buffer, filled = np.empty(nbytes, np.uint8), nbytes
            _fill(buffer, element)
        C.duckdb_vector_assign_string_element_len(output, row, buffer.ctypes.data, nbytes)
