"""Kernels that use every core take turns.

DuckDB runs the UDFs of independent steps on its threads at the same time. Two BLAS products
or threaded Numba loops at once oversubscribe the cores (each starts a thread per core) and
both slow down several times: the two backward products of an MLP training step took 0.15
and 0.23 s side by side, 0.015 and 0.034 s one after the other. ``all_cores`` serializes
such kernels; single-threaded kernels keep running side by side.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext

_ALL_CORES = threading.Lock()


def all_cores(threaded: bool = True):
    """A context manager: held while a kernel that runs on every core (``threaded``) runs."""
    return _ALL_CORES if threaded else nullcontext()
