"""The native dtype conversion kernel (kind ``cast``, ``tra_cast(step, keys, tile)``): each
row's tile converted to the step's dtype as the Arrow UDF ``udfs.cast.cast`` converts it
(NumPy's unsafe cast: floats to integers truncate toward zero, integers wrap, float64 to
float32 rounds to nearest), read where DuckDB holds it and written once, in the BLOB DuckDB
allocates (``results.reserve``).

Before a byte is read, the row's keys are checked against the tensor's grid and its tile's
length against the extents they give; a float tile with an element that truncates to no value
of the integer dtype (NaN, an infinity, out of range) raises ``DTypeError`` naming the tensor
and the tile, as the Arrow UDF does."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs.cast import CastStep
from tra_sql.udfs.native.capi import ERROR_PREFIX
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import (
    CORRUPT,
    address,
    blob,
    f32,
    f64,
    grid_tile,
    i32,
    i64,
    put_int,
    put_text,
    u8,
    valid,
)
from tra_sql.udfs.native.operands import list_entry, set_error
from tra_sql.udfs.native.plans import MESSAGE, zeros
from tra_sql.udfs.native.results import finish, reserve

DTYPES = ("float32", "float64", "int32", "int64")  # a dtype's code is its place here
# plan: the source's dtype code and itemsize, the target's, the rank, the address of the text
# (the tensor's name, then the target dtype's), the name's length, the target name's length,
# the address of zeros as long as the largest result tile (``plans.zeros``); then shape and
# tile per dimension
HEADER = 9
NOT_INTEGRAL = np.frombuffer(f"{ERROR_PREFIX}DTypeError: ".encode(), np.uint8)


def plan(text: str) -> tuple[np.ndarray, ...]:
    """The bind data of step ``text`` (a ``CastStep``) and the text it points to."""
    step = CastStep.decode(text)
    if step.source not in DTYPES or step.dtype not in DTYPES:
        raise ValueError(f"no native conversion from {step.source} to {step.dtype}")
    name, target = step.name.encode(), step.dtype.encode()
    chars = np.frombuffer(name + target + b"\x00", np.uint8).copy()
    largest = np.dtype(step.dtype).itemsize * int(np.prod(np.minimum(step.tile, step.shape), dtype=np.int64))
    head = [DTYPES.index(step.source), np.dtype(step.source).itemsize, DTYPES.index(step.dtype),
            np.dtype(step.dtype).itemsize, len(step.shape), chars.ctypes.data, len(name), len(target),
            zeros(largest)]
    return np.array([*head, *step.shape, *step.tile], dtype=np.int64), chars


@njit(cache=True)
def _integral(values, lowest) -> bool:
    """Whether every float in ``values`` truncates to a value in [lowest, -lowest)."""
    for v in values:
        t = np.trunc(v)
        if not (t >= lowest and t < -lowest):  # NaN fails both
            return False
    return True


@njit(cache=True)
def _into(values, out) -> None:
    for i in range(len(values)):
        out[i] = values[i]


@njit(cache=True)
def _to(values, floating, target, at, n) -> bool:
    """``values`` (``floating``: floats) converted into dtype ``target`` at address ``at``;
    False if a float has no value of the integer ``target``."""
    if target == 0:
        _into(values, f32(at, n))
    elif target == 1:
        _into(values, f64(at, n))
    elif target == 2:
        if floating and not _integral(values, -2.0**31):
            return False
        _into(values, i32(at, n))
    else:
        if floating and not _integral(values, -2.0**63):
            return False
        _into(values, i64(at, n))
    return True


@njit(cache=True)
def _convert(plan, tile, out, n) -> bool:
    """The ``n`` elements at address ``tile`` converted from the plan's source dtype into ``out``."""
    source, target = plan[0], plan[2]
    if source == 0:
        return _to(f32(tile, n), True, target, out, n)
    if source == 1:
        return _to(f64(tile, n), True, target, out, n)
    if source == 2:
        return _to(i32(tile, n), False, target, out, n)
    return _to(i64(tile, n), False, target, out, n)


@njit(cache=True)
def _report(info, plan, keys, what, held, need) -> None:
    """Set the call's error: the row's keys are NULL or outside the grid (``what`` 0), its tile
    is NULL (1), holds ``held`` bytes instead of ``need`` (2), or has a float without a value
    of the integer dtype (3)."""
    text = u8(plan[5], plan[6] + plan[7])
    out = np.zeros(MESSAGE, np.uint8)
    at = put_text(out, 0, NOT_INTEGRAL if what == 3 else CORRUPT)
    if what == 0:
        at = put_text(out, at, np.frombuffer(b"a tile of tensor '", np.uint8))
    else:
        at = put_text(out, at, np.frombuffer(b"tile (", np.uint8))
        for d in range(len(keys)):
            at = put_text(out, at, np.frombuffer(b", " if d else b"", np.uint8))
            at = put_int(out, at, keys[d])
        at = put_text(out, at, np.frombuffer(b",) of tensor '" if len(keys) == 1 else b") of tensor '", np.uint8))
    at = put_text(out, at, text[: plan[6]])
    if what == 0:
        at = put_text(out, at, np.frombuffer(b"' has NULL keys or keys outside its tile grid", np.uint8))
    elif what == 1:
        at = put_text(out, at, np.frombuffer(b"' is NULL", np.uint8))
    elif what == 2:
        at = put_text(out, at, np.frombuffer(b"' holds ", np.uint8))
        at = put_int(out, at, held)
        at = put_text(out, at, np.frombuffer(b" bytes; its shape needs ", np.uint8))
        at = put_int(out, at, need)
    else:
        at = put_text(out, at, np.frombuffer(b"' holds NaN, an infinity or a value outside ", np.uint8))
        at = put_text(out, at, text[plan[6]:])
        at = put_text(out, at, np.frombuffer(b"'s range: it cannot be cast to ", np.uint8))
        at = put_text(out, at, text[plan[6]:])
    out[at] = 0
    set_error(info, False, out)


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def KERNEL(info_ptr, chunk_ptr, output_ptr):
    info, chunk, output = address(info_ptr), address(chunk_ptr), address(output_ptr)
    plan = i64(C.duckdb_scalar_function_get_bind_data(info), HEADER)
    plan = i64(C.duckdb_scalar_function_get_bind_data(info), HEADER + 2 * plan[4])
    tiles = C.duckdb_data_chunk_get_vector(chunk, 2)
    tile_at, tile_valid = C.duckdb_vector_get_data(tiles), C.duckdb_vector_get_validity(tiles)
    extents = np.empty(max(plan[4], 1), np.int64)
    shape, tiling = plan[HEADER: HEADER + plan[4]], plan[HEADER + plan[4]:]
    for row in range(C.duckdb_data_chunk_get_size(chunk)):
        keys, ok = list_entry(chunk, 1, row)
        n = grid_tile(shape, tiling, keys, extents) if ok else -1
        if n < 0:
            _report(info, plan, keys, 0, 0, 0)
            return
        if not valid(tile_valid, row):
            _report(info, plan, keys, 1, 0, 0)
            return
        tile, held = blob(tile_at, row)
        if held != n * plan[1]:
            _report(info, plan, keys, 2, held, n * plan[1])
            return
        out = reserve(output, row, np.uint64(plan[8]), n * plan[3])  # the result is written there, once
        if not _convert(plan, tile, out, n):
            _report(info, plan, keys, 3, 0, 0)
            return
        finish(output, row)
