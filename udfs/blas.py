"""NumPy's own BLAS for native kernels: the ILP64 ``cblas_?gemm`` of the OpenBLAS bundled in
NumPy's wheels (not Numba's ``np.dot``, which loads SciPy's second OpenBLAS and thread pool),
bound under fixed names (``tra_sgemm``, ``tra_dgemm``: ``nopython.SGEMM``, ``DGEMM``) so that
cached kernels link to whichever build is installed. ``FOUND``: whether it was."""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np
from llvmlite import binding

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
