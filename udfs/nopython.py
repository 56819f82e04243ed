"""The C functions nopython kernels call by symbol, as Numba external functions (every pointer
a ``uint64`` address): the kernels' mutex (``cores``) and NumPy's BLAS under tra_sql's names
(``blas``); ``native.duckdb_calls`` declares DuckDB's C API so. Only Numba code imports this
module: the rest of tra_sql runs without importing Numba."""

from __future__ import annotations

from numba import types

lock = types.ExternalFunction("pthread_mutex_lock", types.int32(types.uint64))
unlock = types.ExternalFunction("pthread_mutex_unlock", types.int32(types.uint64))


def _gemm(name: str, real: types.Type) -> types.ExternalFunction:
    """``C = alpha op(A) op(B) + beta C``: (order, transA, transB, M, N, K, alpha, A, lda, B, ldb,
    beta, C, ldc), addresses as ``uint64``."""
    i, n, p = types.int32, types.int64, types.uint64
    return types.ExternalFunction(name, types.void(i, i, i, n, n, n, real, p, n, p, n, real, p, n))


SGEMM = _gemm("tra_sgemm", types.float32)
DGEMM = _gemm("tra_dgemm", types.float64)
