"""tra_sql: tensor programs as relational SQL.

Tensors are tile relations in DuckDB; extended einsum programs are rewritten through sqlglot
into SQL that joins tiles, runs Numba/BLAS tile kernels as UDFs and aggregates with GROUP BY.
"""

from tra_sql.errors import (
    CatalogDriftError,
    CorruptTileError,
    DTypeError,
    ExecutionError,
    MemoryBudgetError,
    ShapeError,
    SpecError,
    SQLError,
    TensorExistsError,
    TraError,
    UnknownTensorError,
)
from tra_sql.session import Session, connect
from tra_sql.tensor import Tensor

__all__ = [
    "connect", "Session", "Tensor", "TraError", "SpecError", "ShapeError", "DTypeError",
    "UnknownTensorError", "TensorExistsError", "CorruptTileError", "CatalogDriftError", "ExecutionError", "SQLError",
    "MemoryBudgetError",
]
__version__ = "0.1.0"
