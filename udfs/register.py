"""The tile kernels' registration: which Python function implements each kind of
``protocol.Kernel``, and registering kernels on a DuckDB connection as Arrow UDFs (the
parameter and result types come from the kernel reference)."""

from __future__ import annotations

import duckdb

from tra_sql.udfs import elements, pack, sparse
from tra_sql.udfs.attention import attention_groups
from tra_sql.udfs.einsum_kernels import chain_rows, einsum_groups, einsum_rows, reduce_partials
from tra_sql.udfs.placement import fill, place
from tra_sql.udfs.protocol import Kernel

#: kind -> the function computing a batch of calls (Arrow arrays in, an Arrow array out)
IMPLEMENTATIONS = {
    "einsum": einsum_rows,
    "einsum_agg": einsum_groups,
    "reduce": reduce_partials,
    "attention": attention_groups,
    "chain": chain_rows,
    "place": place,
    "fill": fill,
    "tile_values": elements.tile_values,
    "tile_ints": elements.tile_ints,
    "random_tile": elements.random_tiles,
    "pack_tile": elements.pack_tiles,
    "pack_csr": sparse.pack_csr,
    "pack": pack.pack,
    "pack_f32": pack.pack_f32,
}


def implementation(kernel: Kernel):
    """The Python function of ``kernel``."""
    if kernel.kind not in IMPLEMENTATIONS:
        raise ValueError(f"no tile UDF implements {kernel.name!r}")
    return IMPLEMENTATIONS[kernel.kind]


def _with_arity(function, arity: int):
    """``function`` behind a wrapper with exactly ``arity`` named parameters, since DuckDB
    counts a UDF's parameters and does not accept ``*args``."""
    params = ", ".join(f"a{i}" for i in range(arity))
    scope = {"function": function, "__name__": __name__}
    exec(f"def udf({params}):\n    return function({params})\n", scope)
    return scope["udf"]


def register_kernels(con: duckdb.DuckDBPyConnection, kernels) -> None:
    """Register ``kernels`` (``protocol.Kernel``s) on ``con``."""
    for kernel in kernels:
        params = kernel.params
        con.create_function(
            kernel.name, _with_arity(implementation(kernel), len(params)), [duckdb.sqltype(p) for p in params],
            duckdb.sqltype(kernel.result), type="arrow", null_handling="special", exception_handling="default",
        )
