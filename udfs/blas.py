"""NumPy's own BLAS for native kernels: the ILP64 ``cblas_?gemm`` of the OpenBLAS bundled in
NumPy's wheels (not Numba's ``np.dot``, which loads SciPy's second OpenBLAS and thread pool),
bound under fixed names (``tra_sgemm``, ``tra_dgemm``) so that cached kernels link to
whichever build is installed. ``FOUND``: whether it was."""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
from llvmlite import binding
from numba import types

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS enum values

# symbol prefix, suffix of NumPy's ILP64 OpenBLAS builds (NumPy >= 2, then 1.x)
_SYMBOLS = (("scipy_cblas_", "64_"), ("cblas_", "64_"))


def _libraries() -> list[str]:
    root = os.path.dirname(np.__file__)
    patterns = [os.path.join(root, os.pardir, "numpy.libs", "*openblas*"), os.path.join(root, ".dylibs", "*openblas*")]
    return sorted(path for pattern in patterns for path in glob.glob(pattern))


def _bind() -> bool:
    for path in _libraries():
        lib = ctypes.CDLL(path)
        for prefix, suffix in _SYMBOLS:
            names = [f"{prefix}{kind}gemm{suffix}" for kind in "sd"]
            if all(hasattr(lib, name) for name in names):
                for ours, name in zip(("tra_sgemm", "tra_dgemm"), names):
                    binding.add_symbol(ours, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
                return True
    return False


FOUND = _bind()


def _gemm(name: str, real: types.Type) -> types.ExternalFunction:
    """``C = alpha op(A) op(B) + beta C``: (order, transA, transB, M, N, K, alpha, A, lda, B, ldb,
    beta, C, ldc), addresses as ``uint64``."""
    i, n, p = types.int32, types.int64, types.uint64
    return types.ExternalFunction(name, types.void(i, i, i, n, n, n, real, p, n, p, n, real, p, n))


SGEMM = _gemm("tra_sgemm", types.float32)
DGEMM = _gemm("tra_dgemm", types.float64)
