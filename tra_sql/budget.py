"""Memory budgets: what a session refuses to run because it cannot hold it.

Sizes follow from shapes and dtypes, so these checks raise ``MemoryBudgetError`` before
anything is allocated, instead of the process growing until the OOM killer ends it:

- **one dense tile**, of any step of a program that runs, must fit ``TILE_COPIES`` times in the
  session's budget, ``min(DuckDB's memory_limit, MemAvailable)``: a tile kernel holds its
  input tiles, its output tile and DuckDB's copies of them at once;
- **a generated tensor** (``tra_random(...)`` in SQL, ``db.full/zeros/ones``, and the constant
  steps a program runs, such as the zeros that complete an operand lacking tiles) must fit
  ``GENERATED_COPIES`` times, plus ``ROW_BYTES`` per tile, in the memory available
  (MemAvailable, ``/proc/meminfo``): a Python tile function fills a batch of up to a whole
  tensor's tiles and DuckDB copies them;
- **a result** that ``Tensor.numpy()`` or ``Tensor.arrow()`` brings into Python must fit
  ``RESULT_COPIES`` times in MemAvailable (DuckDB's result and its Arrow or NumPy copy).
  ``arrow()`` counts every tile of a result that has them all (a result that may lack
  tiles holds only those present, which is not known before it runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

import numpy as np

from tra_sql import allocator
from tra_sql.errors import MemoryBudgetError
from tra_sql.graph import Fill, Node, topological

if TYPE_CHECKING:
    from tra_sql.tensor import Tensor

TILE_COPIES = 4
GENERATED_COPIES = 2
RESULT_COPIES = 2
ROW_BYTES = 64  # what a tile's row costs beyond its elements (keys, BLOB header, offsets)


def available() -> int | None:
    """Bytes the machine can still give this process (MemAvailable), if it says, plus the free
    memory the process's heap keeps for reuse (``allocator.held_free``)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 + allocator.held_free()
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + allocator.held_free()
    except (ValueError, OSError):
        return None


@dataclass(frozen=True)
class Budget:
    """The bytes a session may hold: its memory_limit and MemAvailable, where known."""

    limit: int | None
    free: int | None

    @staticmethod
    def of(session) -> Budget:
        return Budget(session.engine.memory_limit(), available())

    @property
    def bytes(self) -> int | None:
        known = [b for b in (self.limit, self.free) if b is not None]
        return min(known) if known else None

    def __str__(self) -> str:
        parts = [f"memory_limit {size(self.limit)}" if self.limit is not None else "",
                 f"MemAvailable {size(self.free)}" if self.free is not None else ""]
        return f"this session's {size(self.bytes)} (" + ", ".join(p for p in parts if p) + ")"


def size(n: float) -> str:
    """``n`` bytes for people: ``32.0 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def nbytes(shape, dtype) -> int:
    return prod(shape) * np.dtype(dtype).itemsize


def check_tile(budget: Budget, what: str, tile, dtype) -> None:
    """``MemoryBudgetError`` unless ``TILE_COPIES`` tiles of shape ``tile`` fit in ``budget``."""
    need = TILE_COPIES * nbytes(tile, dtype)
    if budget.bytes is not None and need > budget.bytes:
        raise MemoryBudgetError(
            f"{what}: a tile of shape {tuple(tile)} ({np.dtype(dtype)}) holds {size(nbytes(tile, dtype))}, and a "
            f"tile kernel holds about {TILE_COPIES} tiles at once: {size(need)} does not fit in {budget}; "
            f"choose a smaller tile")


def check_generated(session, what: str, shape, tile, dtype) -> None:
    """Refuse a generated tensor (and its tile) that ``session`` cannot hold."""
    check_tile(Budget.of(session), what, tile, dtype)
    _check_constant(what, shape, tile, dtype)


def _check_constant(what: str, shape, tile, dtype) -> None:
    free = available()
    tiles = prod(-(-n // t) for n, t in zip(shape, tile))
    need = GENERATED_COPIES * nbytes(shape, dtype) + ROW_BYTES * tiles
    if free is not None and need > free:
        raise MemoryBudgetError(
            f"{what}: shape {tuple(shape)} ({np.dtype(dtype)}) is {size(nbytes(shape, dtype))} in {tiles} tile(s); "
            f"generating it needs about {size(need)}, which does not fit in MemAvailable {size(free)}")


def check_program(session, root: Node) -> None:
    """Refuse to run a program one of whose steps has a dense tile, or is a constant, that the
    session cannot hold (a CSR tile holds its entries only, which no shape tells)."""
    budget = Budget.of(session)
    for node in topological(root):
        if node.layout == "dense":
            check_tile(budget, node.label, node.tile, node.dtype)
        if isinstance(node, Fill):
            _check_constant(node.label, node.shape, node.tile, node.dtype)


def check_result(tensor: Tensor, method: str) -> None:
    """Refuse ``tensor.numpy()`` / ``arrow()`` of a result this process cannot hold."""
    free = available()
    node = tensor.node
    dense = nbytes(node.shape, node.dtype)
    need = RESULT_COPIES * dense
    if free is None or need <= free or (method == "arrow" and not _holds_every_tile(tensor)):
        return
    what = f"'{tensor.name}'" if tensor.name else node.label
    raise MemoryBudgetError(
        f"{what}.{method}(): the result, shape {node.shape} ({node.dtype}), is {size(dense)}, held "
        f"{RESULT_COPIES} times while it is brought into Python: {size(need)} does not fit in MemAvailable "
        f"{size(free)}; store it (Tensor.store) or read part of it (T[...], SQL on its tiles)")


def _holds_every_tile(tensor: Tensor) -> bool:
    if tensor.node.layout != "dense":
        return False
    return tensor.session.completeness()(tensor.node)
