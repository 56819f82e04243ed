"""The native BLAS tile product (kind ``contract``, ``tra_contract_2``): one output tile per
joined row, computed by NumPy's ``cblas_?gemm`` from the operand tiles where DuckDB holds them.

``plan`` turns a step (``protocol.EinsumStep`` with a ``contract.GemmForm``) into the int64
array a call's bind data points to; ``KERNEL`` is the DuckDB scalar function callback
(function info, input chunk, output vector) that reads it. Every tile is checked against the
step's geometry before it is read (``operands``, which the fused aggregate of ``fused`` shares):
a NULL, a wrong length, a key outside the grid or two tiles whose shared indices differ in
extent is reported through DuckDB's error call as a ``CorruptTileError`` naming the tensor and
the tile."""

from __future__ import annotations

import numpy as np
from numba import cfunc, njit, types

from tra_sql.udfs import cores
from tra_sql.udfs.contract import gemm_form
from tra_sql.udfs.cores import lock, unlock
from tra_sql.udfs.native.blas import DGEMM, NO_TRANS, ROW_MAJOR, SGEMM, TRANS
from tra_sql.udfs.native.capi import NATIVE as C
from tra_sql.udfs.native.memory import CORRUPT, address, blob, i64, put_int, put_text, u8, u64, valid
from tra_sql.udfs.protocol import EinsumStep

# plan header: dtype (0 float32, 1 float64), itemsize, ranks of a and b, trans_a, trans_b, swap,
# the address of its text (operand names, then the dtype's name) and (offset, length) of each
# of the three texts, the address of the kernels' mutex (``cores``); then (size, tile, group)
# per dimension of a, then of b
HEADER = 15
MESSAGE = 512


def plan(step: EinsumStep) -> tuple[np.ndarray, np.ndarray]:
    """(the plan, the text it points to) of a step ``gemm_form`` accepts."""
    form = gemm_form(step)
    if form is None:
        raise ValueError(f"{step.inputs}->{step.output} is not a native BLAS product")
    words = [name.encode() for name in step.names] + [step.out_dtype.encode()]
    text = np.frombuffer(b"".join(words) + b"\x00", dtype=np.uint8).copy()
    starts = np.cumsum([0] + [len(w) for w in words])
    dims = [(step.sizes[c], step.tiles[c], g) for sub, groups in zip(step.inputs, form.groups)
            for c, g in zip(sub, groups)]
    header = [0 if step.out_dtype == "float32" else 1, np.dtype(step.out_dtype).itemsize,
              len(step.inputs[0]), len(step.inputs[1]), form.trans_a, form.trans_b, form.swap, text.ctypes.data]
    for w in range(3):
        header += [int(starts[w]), len(words[w])]
    header.append(cores.MUTEX)
    return np.array(header + [v for dim in dims for v in dim], dtype=np.int64), text


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
def _report(info, aggregate, plan, which, keys, rank, what, held, need, extents):
    """Set the call's error: operand ``which``'s tile at ``keys`` is NULL (``what`` 0), holds
    ``held`` bytes instead of the ``need`` of its ``extents`` (1), has a key outside the
    tensor's grid (2), NULL keys (3), or an extent of an index it shares with the other
    operand's tile other than that tile's (4)."""
    text = u8(plan[7], plan[8 + 2 * 2] + plan[9 + 2 * 2] + 1)
    out = np.zeros(MESSAGE, np.uint8)
    at = put_text(out, 0, CORRUPT)
    if what == 3:
        at = put_text(out, at, np.frombuffer(b"a tile of tensor '", np.uint8))
    else:
        at = put_text(out, at, np.frombuffer(b"tile (", np.uint8))
        at = _put_ints(out, at, keys, rank)
        at = put_text(out, at, np.frombuffer(b") of tensor '", np.uint8))
    at = put_text(out, at, text[plan[8 + 2 * which]: plan[8 + 2 * which] + plan[9 + 2 * which]])
    if what == 0:
        at = put_text(out, at, np.frombuffer(b"' is NULL", np.uint8))
    elif what == 2:
        at = put_text(out, at, np.frombuffer(b"' is outside the tensor's tile grid", np.uint8))
    elif what == 3:
        at = put_text(out, at, np.frombuffer(b"' has NULL keys", np.uint8))
    elif what == 4:
        at = put_text(out, at, np.frombuffer(b"' differs in a shared index's extent from the tile of '", np.uint8))
        at = put_text(out, at, text[plan[10]: plan[10] + plan[11]])
        at = put_text(out, at, np.frombuffer(b"' joined with it", np.uint8))
    else:
        at = put_text(out, at, np.frombuffer(b"' holds ", np.uint8))
        at = put_int(out, at, held)
        at = put_text(out, at, np.frombuffer(b" bytes; its shape (", np.uint8))
        at = _put_ints(out, at, extents, rank)
        at = put_text(out, at, np.frombuffer(b") and dtype ", np.uint8))
        at = put_text(out, at, text[plan[12]: plan[12] + plan[13]])
        at = put_text(out, at, np.frombuffer(b" need ", np.uint8))
        at = put_int(out, at, need)
    out[at] = 0
    set_error(info, aggregate, out)


@njit(cache=True)
def _extents(plan, first, rank, keys, extents) -> bool:
    """The tile's extents per dimension (ragged at the boundary) into ``extents``; False if a
    key lies outside the grid."""
    for d in range(rank):
        size, tile = plan[first + 3 * d], plan[first + 3 * d + 1]
        start = keys[d] * tile
        if keys[d] < 0 or start >= size:
            return False
        extents[d] = min(tile, size - start)
    return True


@njit(cache=True)
def _operand(info, aggregate, plan, which, chunk, row, extents, sizes) -> np.uint64:
    """The address of operand ``which``'s tile at ``row`` after checking it (its extents into
    ``extents``, its (batch, free, contracted) sizes into ``sizes``), or 0 with the error set."""
    rank = plan[2 + which]
    first = HEADER + 3 * plan[2] * which
    keys_vec = C.duckdb_data_chunk_get_vector(chunk, 2 + 2 * which)
    tiles_vec = C.duckdb_data_chunk_get_vector(chunk, 3 + 2 * which)
    if not valid(C.duckdb_vector_get_validity(keys_vec), row):
        _report(info, aggregate, plan, which, extents, 0, 3, 0, 0, extents)
        return np.uint64(0)
    entry = u64(C.duckdb_vector_get_data(keys_vec) + np.uint64(16) * np.uint64(row), 2)  # (offset, length)
    child = C.duckdb_list_vector_get_child(keys_vec)
    keys = i64(C.duckdb_vector_get_data(child), entry[0] + entry[1])[entry[0]: entry[0] + entry[1]]
    for d in range(entry[1]):
        if not valid(C.duckdb_vector_get_validity(child), entry[0] + d):
            _report(info, aggregate, plan, which, extents, 0, 3, 0, 0, extents)
            return np.uint64(0)
    if entry[1] != rank or not _extents(plan, first, rank, keys, extents):
        _report(info, aggregate, plan, which, keys, min(rank, entry[1]), 2, 0, 0, extents)
        return np.uint64(0)
    sizes[:] = 1
    need = plan[1]
    for d in range(rank):
        sizes[plan[first + 3 * d + 2]] *= extents[d]
        need *= extents[d]
    if not valid(C.duckdb_vector_get_validity(tiles_vec), row):
        _report(info, aggregate, plan, which, keys, rank, 0, 0, need, extents)
        return np.uint64(0)
    at, held = blob(C.duckdb_vector_get_data(tiles_vec), row)
    if held != need:
        _report(info, aggregate, plan, which, keys, rank, 1, held, need, extents)
        return np.uint64(0)
    return at


@njit(cache=True)
def operands(info, aggregate, plan, chunk, row, extents_a, extents_b, sizes_a, sizes_b):
    """The addresses of both operands' tiles at ``row`` after checking them (see ``_operand``;
    the indices they share must have one extent), or (0, 0) with the error set."""
    a = _operand(info, aggregate, plan, 0, chunk, row, extents_a, sizes_a)
    if a == 0:
        return np.uint64(0), np.uint64(0)
    b = _operand(info, aggregate, plan, 1, chunk, row, extents_b, sizes_b)
    if b == 0:
        return np.uint64(0), np.uint64(0)
    if sizes_a[0] != sizes_b[0] or sizes_a[2] != sizes_b[2]:
        keys_vec = C.duckdb_data_chunk_get_vector(chunk, 2)
        entry = u64(C.duckdb_vector_get_data(keys_vec) + np.uint64(16) * np.uint64(row), 2)
        keys = i64(C.duckdb_vector_get_data(C.duckdb_list_vector_get_child(keys_vec)), entry[0] + entry[1])
        _report(info, aggregate, plan, 0, keys[entry[0]:], plan[2], 4, 0, 0, extents_a)
        return np.uint64(0), np.uint64(0)
    return a, b


@njit(cache=True)
def gemm(plan, a, b, out, batch, m, n, k, beta) -> None:
    """``out`` = the batched product of tiles at ``a`` and ``b`` (addresses) plus ``beta``
    times ``out``."""
    trans_a, trans_b, swap, item = plan[4], plan[5], plan[6], np.uint64(plan[1])
    lda = m if trans_a else k
    ldb = k if trans_b else n
    for z in range(batch):
        az = a + item * np.uint64(z * m * k)
        bz = b + item * np.uint64(z * k * n)
        cz = out + item * np.uint64(z * m * n)
        if swap:  # out = (a b)^T = b^T a^T, (n, m)
            ta, tb = (NO_TRANS if trans_b else TRANS), (NO_TRANS if trans_a else TRANS)
            if plan[0] == 0:
                SGEMM(ROW_MAJOR, ta, tb, n, m, k, np.float32(1), bz, ldb, az, lda, np.float32(beta), cz, m)
            else:
                DGEMM(ROW_MAJOR, ta, tb, n, m, k, 1.0, bz, ldb, az, lda, np.float64(beta), cz, m)
        else:
            ta, tb = (TRANS if trans_a else NO_TRANS), (TRANS if trans_b else NO_TRANS)
            if plan[0] == 0:
                SGEMM(ROW_MAJOR, ta, tb, m, n, k, np.float32(1), az, lda, bz, ldb, np.float32(beta), cz, n)
            else:
                DGEMM(ROW_MAJOR, ta, tb, m, n, k, 1.0, az, lda, bz, ldb, np.float64(beta), cz, n)


@cfunc(types.void(types.voidptr, types.voidptr, types.voidptr), cache=True)
def KERNEL(info_ptr, chunk_ptr, output_ptr):
    info, chunk, output = address(info_ptr), address(chunk_ptr), address(output_ptr)
    bind = C.duckdb_scalar_function_get_bind_data(info)
    head = i64(bind, HEADER)
    plan = i64(bind, HEADER + 3 * (head[2] + head[3]))
    extents_a, extents_b = np.empty(head[2], np.int64), np.empty(head[3], np.int64)
    sizes_a, sizes_b = np.empty(3, np.int64), np.empty(3, np.int64)
    scratch = np.empty(0, np.uint8)
    for row in range(C.duckdb_data_chunk_get_size(chunk)):
        a, b = operands(info, False, plan, chunk, row, extents_a, extents_b, sizes_a, sizes_b)
        if a == 0:
            return
        batch, m, k, n = sizes_a[0], sizes_a[1], sizes_a[2], sizes_b[1]
        nbytes = batch * m * n * plan[1]
        if nbytes > len(scratch):
            scratch = np.empty(nbytes, np.uint8)
        out = scratch.ctypes.data
        if nbytes:
            lock(np.uint64(plan[14]))  # BLAS uses every core: one product at a time
            gemm(plan, a, b, out, batch, m, n, k, 0.0)
            unlock(np.uint64(plan[14]))
        C.duckdb_vector_assign_string_element_len(output, row, out, nbytes)
