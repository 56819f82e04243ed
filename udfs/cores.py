"""Kernels that use every core take turns.

DuckDB runs the kernels of independent steps on its threads at the same time. Two BLAS products
or threaded Numba loops at once oversubscribe the cores (each starts a thread per core) and
both slow down several times: the two backward products of an MLP training step took 0.15
and 0.23 s side by side, 0.015 and 0.034 s one after the other. ``all_cores`` serializes
such kernels; single-threaded kernels keep running side by side. The lock is a pthread mutex
(``MUTEX``, its address) so that native kernels, which run without the GIL, take the same
turns (``nopython.lock``/``nopython.unlock``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager, nullcontext

import numpy as np

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)
_STORAGE = np.zeros(128, dtype=np.uint8)  # room for any platform's pthread_mutex_t
MUTEX = _STORAGE.ctypes.data
if _LIBC.pthread_mutex_init(ctypes.c_void_p(MUTEX), None) != 0:
    raise OSError("cannot initialise the kernels' mutex")
_lock_mutex, _unlock_mutex = _LIBC.pthread_mutex_lock, _LIBC.pthread_mutex_unlock
for _function in (_lock_mutex, _unlock_mutex):
    _function.argtypes = [ctypes.c_void_p]

@contextmanager
def _turn():
    _lock_mutex(MUTEX)  # ctypes releases the GIL while it waits
    try:
        yield
    finally:
        _unlock_mutex(MUTEX)


def all_cores(threaded: bool = True):
    """A context manager: held while a kernel that runs on every core (``threaded``) runs."""
    return _turn() if threaded else nullcontext()
