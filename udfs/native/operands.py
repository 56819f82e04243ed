"""The plan of a native per-row step and the checks of its operand tiles.

``plan`` turns a step (``protocol.EinsumStep``: a BLAS product ``contract.gemm_form`` reads as
stored, or a loop ``contract.native_loop`` accepts; with its epilogue's operands after its own)
into the int64 array a call's bind data points to (``Plan``'s layout). ``operands`` checks
every operand tile of a joined row against it before anything reads them: keys inside the
tensor's grid, not NULL, exactly as long as its extents (ragged at the boundary) and dtype
need, every index of one extent in every tile that has it. A bad tile is reported through
DuckDB's error call as a ``CorruptTileError`` naming the tensor and the tile."""

from __future__ import annotations

import numpy as np
from numba import njit

from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.memory import CORRUPT, blob, i64, put_int, put_text, u8, u64, valid
from tra_sql.udfs.native.plans import DIM, HEADER, MESSAGE, OPERAND
from tra_sql.udfs.native.sparse import csr_tile


@njit(cache=True)
def plan_length(head) -> int:
    """The words of a plan whose header is ``head``."""
    return HEADER + OPERAND * head[2] + head[11] + head[12] + DIM * head[13]


@njit(cache=True)
def dims_at(plan) -> int:
    return HEADER + OPERAND * plan[2] + plan[11] + plan[12]


@njit(cache=True)
def _put_ints(out, at, values, rank):
    """``values[:rank]`` written at ``at`` as ``a, b, c``; the position after them."""
    for d in range(rank):
        if d:
            at = put_text(out, at, np.frombuffer(b", ", np.uint8))
        at = put_int(out, at, values[d])
    return at


@njit(cache=True)
def set_error(info, aggregate, message) -> None:
    """Set the error of a scalar function's call or (``aggregate``) an aggregate's."""
    if aggregate:
        C.duckdb_aggregate_function_set_error(info, message.ctypes.data)
    else:
        C.duckdb_scalar_function_set_error(info, message.ctypes.data)


@njit(cache=True)
def _name(plan, text, m):
    at = plan[HEADER + OPERAND * m + 2]
    return text[at: at + plan[HEADER + OPERAND * m + 3]]


@njit(cache=True)
def _put_shape(out, at, plan, text, extents, rank):
    """A tile's ``extents`` and the step's dtype (``a, b) and dtype float32``); the position after."""
    at = _put_ints(out, at, extents, rank)
    at = put_text(out, at, np.frombuffer(b") and dtype ", np.uint8))
    return put_text(out, at, text[plan[15]: plan[15] + plan[16]])


@njit(cache=True)
def _report(info, aggregate, plan, which, keys, rank, what, held, need, extents, other):
    """Set the call's error: operand ``which``'s tile at ``keys`` is NULL (``what`` 0), holds
    ``held`` bytes instead of the ``need`` of its ``extents`` (1), has a key outside the
    tensor's grid (2), NULL keys (3), an extent of an index it shares with operand
    ``other``'s tile other than that tile's (4), or is not a CSR tile of its extents (5)."""
    text = u8(plan[4], plan[15] + plan[16] + 1)
    out = np.zeros(MESSAGE, np.uint8)
    at = put_text(out, 0, CORRUPT)
    if what == 3:
        at = put_text(out, at, np.frombuffer(b"a tile of tensor '", np.uint8))
    else:
        at = put_text(out, at, np.frombuffer(b"tile (", np.uint8))
        at = _put_ints(out, at, keys, rank)
        at = put_text(out, at, np.frombuffer(b") of tensor '", np.uint8))
    at = put_text(out, at, _name(plan, text, which))
    if what == 0:
        at = put_text(out, at, np.frombuffer(b"' is NULL", np.uint8))
    elif what == 2:
        at = put_text(out, at, np.frombuffer(b"' is outside the tensor's tile grid", np.uint8))
    elif what == 3:
        at = put_text(out, at, np.frombuffer(b"' has NULL keys", np.uint8))
    elif what == 4:
        at = put_text(out, at, np.frombuffer(b"' differs in a shared index's extent from the tile of '", np.uint8))
        at = put_text(out, at, _name(plan, text, other))
        at = put_text(out, at, np.frombuffer(b"' joined with it", np.uint8))
    elif what == 5:
        at = put_text(out, at, np.frombuffer(b"' is not a CSR tile of shape (", np.uint8))
        at = _put_shape(out, at, plan, text, extents, rank)
        at = put_text(out, at, np.frombuffer(b" (", np.uint8))
        at = put_int(out, at, held)
        at = put_text(out, at, np.frombuffer(b" bytes)", np.uint8))
    else:
        at = put_text(out, at, np.frombuffer(b"' holds ", np.uint8))
        at = put_int(out, at, held)
        at = put_text(out, at, np.frombuffer(b" bytes; its shape (", np.uint8))
        at = _put_shape(out, at, plan, text, extents, rank)
        at = put_text(out, at, np.frombuffer(b" need ", np.uint8))
        at = put_int(out, at, need)
    out[at] = 0
    set_error(info, aggregate, out)


@njit(cache=True)
def _keys(chunk, m, row):
    """Operand ``m``'s keys at ``row`` (a list vector's entry) and whether it is valid."""
    return list_entry(chunk, 2 + 2 * m, row)


@njit(cache=True)
def list_entry(chunk, column, row):
    """The BIGINT list at ``row`` of ``column`` and whether it and its elements are valid."""
    keys_vec = C.duckdb_data_chunk_get_vector(chunk, column)
    ok = valid(C.duckdb_vector_get_validity(keys_vec), row)
    entry = u64(C.duckdb_vector_get_data(keys_vec) + np.uint64(16) * np.uint64(row), 2)  # (offset, length)
    child = C.duckdb_list_vector_get_child(keys_vec)
    if not ok:
        return i64(C.duckdb_vector_get_data(child), 0), False
    keys = i64(C.duckdb_vector_get_data(child), entry[0] + entry[1])[entry[0]: entry[0] + entry[1]]
    for d in range(entry[1]):
        if not valid(C.duckdb_vector_get_validity(child), entry[0] + d):
            return keys, False
    return keys, True


@njit(cache=True)
def _operand(info, aggregate, plan, m, chunk, row, extents) -> np.uint64:
    """The address of operand ``m``'s tile at ``row`` after checking it (its extents into
    ``extents`` from its first dimension on), or 0 with the error set."""
    rank, first = plan[HEADER + OPERAND * m], plan[HEADER + OPERAND * m + 1]
    dims = dims_at(plan) + DIM * first
    keys, ok = _keys(chunk, m, row)
    if not ok:
        _report(info, aggregate, plan, m, keys, 0, 3, 0, 0, keys, 0)
        return np.uint64(0)
    inside = len(keys) == rank
    for d in range(rank if inside else 0):
        size, tile = plan[dims + DIM * d], plan[dims + DIM * d + 1]
        start = keys[d] * tile
        inside = inside and 0 <= keys[d] and start < size
        extents[first + d] = min(tile, size - start)
    if not inside:
        _report(info, aggregate, plan, m, keys, min(rank, len(keys)), 2, 0, 0, keys, 0)
        return np.uint64(0)
    need = plan[1]
    for d in range(rank):
        need *= extents[first + d]
    tiles_vec = C.duckdb_data_chunk_get_vector(chunk, 3 + 2 * m)
    if not valid(C.duckdb_vector_get_validity(tiles_vec), row):
        _report(info, aggregate, plan, m, keys, rank, 0, 0, need, extents[first:], 0)
        return np.uint64(0)
    at, held = blob(C.duckdb_vector_get_data(tiles_vec), row)
    if m == plan[17]:
        if not csr_tile(at, held, extents[first], extents[first + 1], plan[1]):
            _report(info, aggregate, plan, m, keys, rank, 5, held, need, extents[first:], 0)
            return np.uint64(0)
    elif held != need:
        _report(info, aggregate, plan, m, keys, rank, 1, held, need, extents[first:], 0)
        return np.uint64(0)
    return at


@njit(cache=True)
def operands(info, aggregate, plan, chunk, row, tiles, extents, seen) -> bool:
    """Every operand's tile at ``row`` checked (see ``_operand``; ``seen``: scratch, an extent
    and an operand per index), its address into ``tiles`` and its extents into ``extents``;
    False with the error set if one is bad."""
    dims = dims_at(plan)
    seen[:] = -1
    for m in range(plan[2]):
        tiles[m] = _operand(info, aggregate, plan, m, chunk, row, extents)
        if tiles[m] == 0:
            return False
        first = plan[HEADER + OPERAND * m + 1]
        for d in range(plan[HEADER + OPERAND * m]):
            index = plan[dims + DIM * (first + d) + 2]
            if seen[2 * index] < 0:
                seen[2 * index], seen[2 * index + 1] = extents[first + d], m
            elif seen[2 * index] != extents[first + d]:
                keys, _ = _keys(chunk, m, row)
                _report(info, aggregate, plan, m, keys, len(keys), 4, 0, 0, keys, seen[2 * index + 1])
                return False
    return True


@njit(cache=True)
def gemm_sizes(plan, extents, sizes) -> None:
    """``sizes`` = (batch, m, k, n) of a BLAS product's checked tiles: per operand, the product
    of its dimensions' extents per BLAS group (batch, free, contracted)."""
    dims = dims_at(plan)
    sizes[:] = 1
    for m in range(2):
        first = plan[HEADER + OPERAND * m + 1]
        for d in range(plan[HEADER + OPERAND * m]):
            fold_dim(sizes, m, plan[dims + DIM * (first + d) + 3], extents[first + d])


@njit(cache=True)
def fold_dim(sizes, operand, group, extent) -> None:
    """Fold one dimension of BLAS operand ``operand`` (0: A, 1: B), in BLAS group ``group`` (0
    batch, 1 free, 2 contracted), into ``sizes`` = (batch, m, k, n): A's dimensions give batch,
    m and k, B's free ones n."""
    if operand == 0:
        sizes[group] *= extent
    elif group == 1:
        sizes[3] *= extent


@njit(cache=True)
def out_bytes(plan, extents) -> int:
    """The bytes of the step's result tile (its extents read from its operands')."""
    at = HEADER + OPERAND * plan[2]
    nbytes = plan[1]
    for d in range(plan[11]):
        nbytes *= extents[plan[at + d]]
    return nbytes
