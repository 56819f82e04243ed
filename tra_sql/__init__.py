"""tra_sql: tensor programs as relational SQL.

Tensors are tile relations in DuckDB; extended einsum programs are rewritten through sqlglot
into SQL that joins tiles, runs Numba/BLAS tile kernels as UDFs and aggregates with GROUP BY.

``connect``, ``Session`` and ``Tensor`` are imported on first use (module ``__getattr__``):
a process that only runs tile kernels (a Spark executor's Python worker importing
``tra_sql.udfs`` or ``tra_sql.backends.spark_udfs``) does not import the session, DuckDB or
the planner.
"""

from tra_sql.errors import (
    CatalogDriftError,
    CorruptTileError,
    DTypeError,
    ExecutionError,
    MemoryBudgetError,
    SessionClosedError,
    ShapeError,
    SpecError,
    SQLError,
    StaleTensorError,
    TensorExistsError,
    TraError,
    UnknownTensorError,
)

#: the public names imported on first use, by the module that defines them
LAZY = {"connect": "tra_sql.session", "Session": "tra_sql.session", "Tensor": "tra_sql.tensor"}

__all__ = [
    "connect", "Session", "Tensor", "TraError", "SpecError", "ShapeError", "DTypeError",
    "UnknownTensorError", "TensorExistsError", "CorruptTileError", "CatalogDriftError", "ExecutionError", "SQLError",
    "MemoryBudgetError", "SessionClosedError", "StaleTensorError",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        value = getattr(importlib.import_module(LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tra_sql' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))
