"""Numba kernels over CSR tiles (see ``tra_sql.udfs.sparse``); all add into ``out``. The Arrow
UDFs run them, and the native kernel's CSR bodies (``native.sparse``) run ``csr_rows`` and
``csr_t_dense`` on DuckDB's threads."""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True)
def csr_rows(indptr, indices, data, dense, out, start, stop):
    """``out[r, :] += sum over entries (r, c, w) of w * dense[c, :]`` for rows ``start`` to
    ``stop``."""
    width = dense.shape[1]
    for r in range(start, stop):
        target = out[r]
        for q in range(indptr[r], indptr[r + 1]):
            row = dense[indices[q]]
            w = data[q]
            for j in range(width):
                target[j] += w * row[j]


@numba.njit(nogil=True, cache=True, parallel=True)
def csr_dense(indptr, indices, data, dense, out):
    """``csr_rows`` over all rows, rows over threads."""
    for r in numba.prange(len(indptr) - 1):
        csr_rows(indptr, indices, data, dense, out, r, r + 1)


@numba.njit(nogil=True, cache=True)
def csr_t_dense(indptr, indices, data, dense, out):
    """``out[c, :] += sum over entries (r, c, w) of w * dense[r, :]`` (the transposed product;
    one thread: it scatters, and is memory-bound like scipy's)."""
    width = dense.shape[1]
    for r in range(len(indptr) - 1):
        row = dense[r]
        for q in range(indptr[r], indptr[r + 1]):
            target = out[indices[q]]
            w = data[q]
            for j in range(width):
                target[j] += w * row[j]
