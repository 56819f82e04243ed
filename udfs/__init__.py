"""Tile kernels run inside DuckDB as Arrow-vectorized UDFs.

Installed as ``tra_sql.udfs``. Each UDF call receives a whole Arrow batch (up to 2048 rows)
and works on zero-copy NumPy views of the tile bytes; contractions go through BLAS, every
other tile computation through Numba kernels generated per einsum and cached on disk.
"""

from tra_sql.udfs.register import register_kernels

__all__ = ["register_kernels"]
