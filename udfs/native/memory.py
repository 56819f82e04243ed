"""Memory access for native kernels (nopython code): addresses as ``uint64``, views of the
memory at an address, DuckDB's ``duckdb_string_t`` BLOB entries, and error messages written
into byte buffers (DuckDB copies the text of an error it is given)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from tra_sql.udfs.native.capi import ERROR_PREFIX


@intrinsic
def address(typingctx, pointer):
    """The ``uint64`` address of a ``voidptr`` (a callback's argument)."""
    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], context.get_value_type(types.uint64))
    return types.uint64(pointer), codegen


@intrinsic
def call2(typingctx, function, first, second):
    """``function(first, second)``: a C function at address ``function`` taking and returning
    ``uint64``s (a ctypes callback whose address is known only when the process runs)."""
    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        pointer = builder.inttoptr(args[0], ir.FunctionType(word, [word, word]).as_pointer())
        return builder.call(pointer, [args[1], args[2]])
    return types.uint64(types.uint64, types.uint64, types.uint64), codegen


@intrinsic
def call3(typingctx, function, first, second, third):
    """``function(first, second, third)``: a C function at address ``function`` taking three
    ``uint64``s and returning nothing (a ``cfunc`` compiled while the process runs)."""
    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        pointer = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [word] * 3).as_pointer())
        builder.call(pointer, list(args[1:]))
        return context.get_dummy_value()
    return types.void(types.uint64, types.uint64, types.uint64, types.uint64), codegen


def _pointer_to(item: types.Type):
    @intrinsic
    def pointer(typingctx, at):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(item)))
        return types.CPointer(item)(at), codegen
    return pointer


_BYTES = _pointer_to(types.uint8)
_INT64 = _pointer_to(types.int64)
_UINT64 = _pointer_to(types.uint64)
_UINT32 = _pointer_to(types.uint32)
_INT32 = _pointer_to(types.int32)
_FLOAT32 = _pointer_to(types.float32)
_FLOAT64 = _pointer_to(types.float64)


@njit(cache=True)
def u8(at, n):
    """``n`` bytes at address ``at``."""
    return carray(_BYTES(at), (n,))


@njit(cache=True)
def i64(at, n):
    return carray(_INT64(at), (n,))


@njit(cache=True)
def u64(at, n):
    return carray(_UINT64(at), (n,))


@njit(cache=True)
def u32(at, n):
    return carray(_UINT32(at), (n,))


@njit(cache=True)
def i32(at, n):
    return carray(_INT32(at), (n,))


@njit(cache=True)
def f32(at, n):
    return carray(_FLOAT32(at), (n,))


@njit(cache=True)
def f64(at, n):
    return carray(_FLOAT64(at), (n,))


@njit(cache=True)
def grid_tile(shape, tile, keys, extents) -> int:
    """The elements of the tile at ``keys`` of a ``shape`` tensor tiled ``tile``, its extents
    into ``extents`` (ragged at the grid's end); -1 for keys of another rank or outside the grid."""
    if len(keys) != len(shape):
        return -1
    n = 1
    for d in range(len(shape)):
        if keys[d] < 0 or keys[d] * tile[d] >= shape[d]:
            return -1
        extents[d] = min(tile[d], shape[d] - keys[d] * tile[d])
        n *= extents[d]
    return n


CORRUPT = np.frombuffer(f"{ERROR_PREFIX}CorruptTileError: ".encode(), np.uint8)  # a corrupt tile's error
STRING_T = 16  # bytes of one duckdb_string_t
INLINED = 12  # the longest string stored inside its duckdb_string_t


@njit(cache=True)
def blob(entries, row):
    """(address, length) of BLOB ``row`` of a vector whose data starts at ``entries``: a
    ``duckdb_string_t`` holds its length, then the bytes themselves when there are at most 12,
    else a 4-byte prefix and a pointer to them."""
    at = entries + np.uint64(STRING_T) * np.uint64(row)
    length = carray(_UINT32(at), (1,))[0]
    if length <= INLINED:
        return at + np.uint64(4), np.int64(length)
    return u64(at + np.uint64(8), 1)[0], np.int64(length)


@njit(cache=True)
def valid(validity, row) -> bool:
    """Whether ``row`` is valid in a validity mask (address 0: every row is)."""
    if validity == 0:
        return True
    word = u64(validity + np.uint64(8) * np.uint64(row // 64), 1)[0]
    return (word >> np.uint64(row % 64)) & np.uint64(1) == np.uint64(1)


@njit(cache=True)
def put_text(out, at, text):
    """``text`` (bytes) written into ``out`` from ``at``; the position after it."""
    n = min(len(text), len(out) - 1 - at)
    for i in range(n):
        out[at + i] = text[i]
    return at + n


@njit(cache=True)
def put_int(out, at, value):
    """The decimal digits of ``value`` written into ``out`` from ``at``; the position after."""
    digits = np.empty(20, np.uint8)
    n = 0
    v = abs(value)
    while True:
        digits[n] = 48 + v % 10
        n += 1
        v //= 10
        if v == 0:
            break
    if value < 0 and at < len(out) - 1:
        out[at] = 45
        at += 1
    for i in range(n):
        if at >= len(out) - 1:
            break
        out[at] = digits[n - 1 - i]
        at += 1
    return at

