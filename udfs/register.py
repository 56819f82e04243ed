"""Registering kernels on a DuckDB connection as Arrow UDFs: a ``protocol.Kernel`` gives the
SQL name and the parameter and result types, ``python_kernels`` the function (the kernel
modules imported here declare every built-in kind's)."""

from __future__ import annotations

from collections.abc import Callable

import duckdb

from tra_sql.udfs import attention, einsum_kernels, elements, pack, placement, sparse  # noqa: F401  (their kinds)
from tra_sql.udfs.protocol import ATTENTIONS, CONTRACT, CONTRACTIONS, PLACE, PLACEMENTS, REDUCTIONS, Kernel
from tra_sql.udfs.python_kernels import IMPLEMENTATIONS


def implementation(kernel: Kernel) -> Callable:
    """The Python function computing ``kernel``."""
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
    """Register ``kernels`` (``protocol.Kernel``s) on ``con``; a whole-tile reduction as a macro
    over ``tra_reduce`` and ``ARRAY_AGG``, a fused contraction aggregate as one over
    ``tra_reduce`` and ``ARRAY_AGG`` of ``tra_contract_2`` (registered with them), a native
    attention aggregate as one over ``tra_attention_<n>`` and ``ARRAY_AGG`` of its rows, a
    placement aggregate as one over ``tra_place`` and ``ARRAY_AGG`` of its pieces."""
    for kernel in kernels:
        if kernel in PLACEMENTS:
            piece = "{'origin': origin, 'shape': shape, 'part': part, 'tile': tile}"
            con.execute(f"CREATE OR REPLACE TEMP MACRO {kernel.name}(meta, keys, origin, shape, part, tile) AS "
                        f"{PLACE.name}(meta, keys, ARRAY_AGG({piece}))").fetchall()
            continue
        if kernel in REDUCTIONS:
            con.execute(f"CREATE OR REPLACE TEMP MACRO {kernel.name}(meta, keys, tile) AS "
                        f"{Kernel('reduce').name}(meta, keys, ARRAY_AGG(tile))").fetchall()
            continue
        if kernel in CONTRACTIONS:
            operands = "keys0, tile0, keys1, tile1"
            con.execute(f"CREATE OR REPLACE TEMP MACRO {kernel.name}(meta, keys, {operands}) AS "
                        f"{Kernel('reduce').name}(meta, keys, ARRAY_AGG({CONTRACT.name}(meta, keys, {operands})))"
                        ).fetchall()
            continue
        if kernel.kind in ATTENTIONS:
            operands = ", ".join(f"keys{m}, tile{m}" for m in range(kernel.arity))
            rows = ", ".join(f"'keys{m}': keys{m}, 'tile{m}': tile{m}" for m in range(kernel.arity))
            con.execute(f"CREATE OR REPLACE TEMP MACRO {kernel.name}(meta, keys, {operands}) AS "
                        f"{Kernel('attention', kernel.arity).name}(meta, keys, ARRAY_AGG({{{rows}}}))").fetchall()
            continue
        params = kernel.params
        con.create_function(
            kernel.name, _with_arity(implementation(kernel), len(params)), [con.sqltype(p) for p in params],
            con.sqltype(kernel.result), type="arrow", null_handling="special", exception_handling="default",
        )
