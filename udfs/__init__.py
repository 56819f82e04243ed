"""Tile kernels run inside DuckDB as Arrow-vectorized UDFs.

Installed as ``tra_sql.udfs``. Each UDF call receives a whole Arrow batch (up to 2048 rows)
and works on zero-copy NumPy views of the tile bytes; contractions go through BLAS, every
other tile computation through Numba kernels generated per einsum and cached on disk.
``register_kernels`` (and with it DuckDB) is imported on first use, so that a Spark Python
worker importing a kernel module imports no DuckDB.
"""

__all__ = ["register_kernels"]


def __getattr__(name: str):
    if name == "register_kernels":
        from tra_sql.udfs.register import register_kernels

        return register_kernels
    raise AttributeError(f"module 'tra_sql.udfs' has no attribute {name!r}")
