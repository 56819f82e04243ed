"""CSR bodies for the native per-row kernel (``contract.KERNEL``): the sparse-dense product of
one CSR tile and one dense tile (``sparse.native_product``: ``vu,uf->vf`` and ``vu,vf->uf``,
message passing and its gradient) as a loop body ``body(out, tiles, extents)`` like
``loops``' (the result zeroed, then the Numba kernel the Arrow UDF runs, ``sparse_kernels``,
over the tile's entries, on DuckDB's thread). ``csr_tile`` is the check ``operands`` makes of a
CSR operand's bytes before any body reads them: the layout ``udfs.sparse`` documents, its
row pointers ascending, every column number inside the tile."""

from __future__ import annotations

import threading
from functools import cache

import numpy as np
from numba import njit

from tra_sql.udfs.codegen import load_module
from tra_sql.udfs.native.memory import i32, i64

_compiling = threading.Lock()


@njit(cache=True)
def padded(nnz) -> int:
    """The bytes of a CSR tile's column numbers (``sparse._padded``)."""
    return (4 * nnz + 7) // 8 * 8


@njit(cache=True)
def csr_tile(at, held, rows, cols, itemsize) -> bool:
    """Whether the ``held`` bytes at ``at`` are a CSR tile of ``rows`` x ``cols`` entries of
    ``itemsize`` bytes (read only as far as the length allows)."""
    head = 8 * (rows + 1)
    if held < head:
        return False
    indptr = i64(at, rows + 1)
    nnz = indptr[rows]
    if indptr[0] != 0 or nnz < 0 or nnz > held or held != head + padded(nnz) + itemsize * nnz:
        return False
    for r in range(rows):
        if indptr[r + 1] < indptr[r]:
            return False
    indices = i32(at + np.uint64(head), nnz)
    for q in range(nnz):
        if indices[q] < 0 or indices[q] >= cols:
            return False
    return True


def body_source(position: int, transposed: bool, rank: int, dtype: str) -> str:
    """Python source of the body of a product whose CSR operand is operand ``position``
    (``transposed``: its column index is kept) and whose dense operand has ``rank`` dimensions."""
    view = {"float32": "f32", "float64": "f64"}[dtype]
    csr, dense = position, 1 - position
    at = 0 if position == 0 else rank  # the CSR operand's extents
    dense_at = 2 if position == 0 else 0
    width = " * ".join(f"e[{dense_at + d}]" for d in range(1, rank)) or "1"
    kernel = "csr_t_dense(indptr, indices, data, dense, o)" if transposed \
        else "csr_rows(indptr, indices, data, dense, o, 0, rows)"
    kept = f"e[{at + 1}]" if transposed else f"e[{at}]"
    return "\n".join([
        "import numpy as np",
        "from numba import types",
        "",
        "from tra_sql.udfs.native.images import native",
        f"from tra_sql.udfs.native.memory import {view}, i32, i64, u64",
        "from tra_sql.udfs.native.sparse import padded",
        f"from tra_sql.udfs.sparse_kernels import {kernel.split('(')[0]}",
        "",
        "",
        "@native(types.void(types.uint64, types.uint64, types.uint64))",
        "def body(out, tiles, extents):",
        "    t = u64(tiles, 2)",
        f"    e = i64(extents, {rank + 2})",
        f"    rows, width = e[{at}], {width}",
        f"    indptr = i64(t[{csr}], rows + 1)",
        "    nnz = indptr[rows]",
        f"    entries = t[{csr}] + np.uint64(8 * (rows + 1))",
        "    indices = i32(entries, nnz)",
        f"    data = {view}(entries + np.uint64(padded(nnz)), nnz)",
        f"    dense = {view}(t[{dense}], e[{dense_at}] * width).reshape((e[{dense_at}], width))",
        f"    o = {view}(out, {kept} * width).reshape(({kept}, width))",
        "    o[:] = 0",
        f"    {kernel}",
    ]) + "\n"


def body(position: int, transposed: bool, rank: int, dtype: str) -> int:
    """The C address of that body (compiled once, cached on disk by Numba). Thread-safe."""
    with _compiling:
        return _compiled(position, transposed, rank, dtype)


@cache
def _compiled(position: int, transposed: bool, rank: int, dtype: str) -> int:
    return load_module(body_source(position, transposed, rank, dtype), "tra_native_csr").body.address
