"""The native per-row kernel (kinds ``contract``, ``tra_contract_2``, and ``loop``,
``tra_loop_<n>``): one output tile per joined row, computed from the operand tiles where
DuckDB holds them, written once. ``KERNEL`` is the DuckDB scalar function callback (function
info, input chunk, output vector); the call's bind data is its step's plan (``plans.plan``).
Every tile is checked first (``operands.operands``); the result is NumPy's ``cblas_?gemm``
of the first two (a product ``contract.gemm_form`` reads as stored) or the step's generated
loop body (``loops``), then, with an epilogue, the epilogue's loop body over it and the
epilogue's other tiles (the call's trailing arguments), in place; all of it in the result BLOB
DuckDB allocated (``results.reserve``), so the result is written once."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs.blas import NO_TRANS, ROW_MAJOR, TRANS
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import address, call3, i64
from tra_sql.udfs.native.operands import gemm_sizes, operands, out_bytes, plan_length
from tra_sql.udfs.native.plans import HEADER, OPERAND
from tra_sql.udfs.native.results import finish, reserve
from tra_sql.udfs.nopython import DGEMM, SGEMM, lock, unlock


@njit(cache=True)
def gemm(plan, blas, a, b, out, batch, m, n, k, beta) -> None:
    """``out`` = the batched product of tiles at ``a`` and ``b`` (addresses) plus ``beta``
    times ``out``: the dtype and itemsize are ``plan``'s first words, ``blas`` holds trans_a,
    trans_b and swap (``contract.GemmForm``)."""
    trans_a, trans_b, swap, item = blas[0], blas[1], blas[2], np.uint64(plan[1])
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


@njit(cache=True)
def _epilogue(plan, out, tiles, extents, epi_tiles, epi_extents) -> None:
    """The epilogue's loop body over the result at ``out`` and its other operands' tiles."""
    slots = HEADER + OPERAND * plan[2] + plan[11]
    at = 0
    for j in range(plan[12]):
        m = plan[slots + j]
        if m < 0:
            epi_tiles[j] = out
            for d in range(plan[11]):
                epi_extents[at] = extents[plan[HEADER + OPERAND * plan[2] + d]]
                at += 1
        else:
            epi_tiles[j] = tiles[m]
            first = plan[HEADER + OPERAND * m + 1]
            for d in range(plan[HEADER + OPERAND * m]):
                epi_extents[at] = extents[first + d]
                at += 1
    call3(np.uint64(plan[10]), out, epi_tiles.ctypes.data, epi_extents.ctypes.data)


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def KERNEL(info_ptr, chunk_ptr, output_ptr):
    info, chunk, output = address(info_ptr), address(chunk_ptr), address(output_ptr)
    bind = C.duckdb_scalar_function_get_bind_data(info)
    plan = i64(bind, plan_length(i64(bind, HEADER)))
    tiles, extents = np.empty(plan[2], np.uint64), np.empty(max(plan[13], 1), np.int64)
    seen, sizes = np.empty(2 * plan[14], np.int64), np.empty(4, np.int64)
    epi_tiles, epi_extents = np.empty(plan[12], np.uint64), np.empty(plan[11] + plan[13], np.int64)
    for row in range(C.duckdb_data_chunk_get_size(chunk)):
        if not operands(info, False, plan, chunk, row, tiles, extents, seen):
            return
        nbytes = out_bytes(plan, extents)
        out = reserve(output, row, np.uint64(plan[18]), nbytes)  # the result is written there, once
        if nbytes and plan[9] == 0:
            gemm_sizes(plan, extents, sizes)
            lock(np.uint64(plan[5]))  # BLAS uses every core: one product at a time
            gemm(plan, plan[6:9], tiles[0], tiles[1], out, sizes[0], sizes[1], sizes[3], sizes[2], 0.0)
            unlock(np.uint64(plan[5]))
        elif nbytes:
            call3(np.uint64(plan[9]), out, tiles.ctypes.data, extents.ctypes.data)
        if nbytes and plan[10]:
            _epilogue(plan, out, tiles, extents, epi_tiles, epi_extents)
        finish(output, row)
