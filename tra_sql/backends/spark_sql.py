"""A program's SQL for Spark: the shared sqlglot query, plain CTEs, Spark's dialect, and one
rewrite for memory.

A fused join + aggregate step, ``tra_einsum_agg_<n>(meta, keys, ARRAY_AGG(STRUCT(...)))``,
and an aggregate of per-row partial results, ``tra_reduce(meta, keys, ARRAY_AGG(tile))``,
hold each group's list of tiles in one row; Spark copies such rows whole (aggregation
buffers, the projection around a Python UDF) and runs out of heap once a group holds
MB-sized tiles. Where a group's tiles exceed ``group_bytes``, the step becomes a grouped
aggregate UDF instead, ``tra_einsum_group_<n>(meta, keys, keys0, tile0, ...)`` or
``tra_reduce_group(meta, tile)``, which Spark feeds a group's rows in bounded batches after
sorting by the group keys (see ``spark_udfs``). Small tiles keep the list, which batches
many groups into one kernel call.
"""

from __future__ import annotations

import json
import re
from math import ceil, prod

import numpy as np
from sqlglot import exp

from tra_sql.sqlgen import Program

DIALECT = "spark"
#: Groups whose tiles exceed this many bytes go through the grouped aggregate UDF.
GROUP_BYTES = 32 << 20
FUSED = re.compile(r"tra_einsum_agg_(\d+)")
REDUCE = "tra_reduce"


def group_bytes(meta: dict) -> int:
    """Bytes of input tiles in one group of a fused step (interior tiles)."""
    tiles, sizes = meta["tiles"], meta["sizes"]
    per_row = sum(prod(tiles[c] for c in sub) * np.dtype(dtype).itemsize
                  for sub, dtype in zip(meta["inputs"], meta["dtypes"]))
    aggregated = {c for sub in meta["inputs"] for c in sub} - set(meta["output"])
    return per_row * prod(ceil(sizes[c] / tiles[c]) for c in aggregated)


def partial_bytes(meta: dict) -> int:
    """Bytes of partial results in one group of a ``tra_reduce`` step (interior tiles)."""
    tiles, sizes = meta["tiles"], meta["sizes"]
    aggregated = {c for sub in meta["inputs"] for c in sub} - set(meta["output"])
    return prod(tiles[c] for c in meta["output"]) * np.dtype(meta["out_dtype"]).itemsize * \
        prod(ceil(sizes[c] / tiles[c]) for c in aggregated)


def ungroup(call: exp.Anonymous, limit: int) -> exp.Expression:
    """``call`` as a grouped aggregate UDF call if its groups exceed ``limit`` bytes."""
    if call.name.lower() == REDUCE and len(call.expressions) == 3 and isinstance(call.expressions[2], exp.ArrayAgg):
        meta, _, partials = call.expressions
        info = json.loads(meta.name)
        if "out_layout" in info or partial_bytes(info) <= limit:  # CSR partials stay a list
            return call
        return exp.Anonymous(this=f"{REDUCE}_group", expressions=[meta.copy(), partials.this.copy()])
    match = FUSED.fullmatch(call.name.lower())
    if not match or len(call.expressions) != 3 or not isinstance(call.expressions[2], exp.ArrayAgg):
        return call
    meta, keys, rows = call.expressions
    if group_bytes(json.loads(meta.name)) <= limit:
        return call
    fields = [f.expression.copy() for f in rows.this.expressions]
    return exp.Anonymous(this=f"tra_einsum_group_{match.group(1)}", expressions=[meta.copy(), keys.copy(), *fields])


def spark_query(program: Program, limit: int = GROUP_BYTES) -> tuple[str, set[str]]:
    """The Spark SQL text of ``program`` and the tile UDFs it calls."""
    return _render(program.query(materialized=False), limit)


def spark_union_query(program: Program, results: dict, limit: int = GROUP_BYTES) -> tuple[str, set[str]]:
    """``Program.union_query(results)`` for Spark (plain CTEs, INT keys): the rows
    ``target, k0, ..., tile`` of several results in one query, and the UDFs it calls."""
    query = program.union_query(results)
    for cte in query.find_all(exp.CTE):
        cte.set("materialized", None)
    rank = max((len(node.shape) for node in results.values()), default=0)
    keys = [exp.alias_(exp.cast(exp.column(f"k{d}"), "INT"), f"k{d}") for d in range(rank)]
    return _render(exp.select("target", *keys, "tile").from_(query.subquery("u")), limit)


def _render(query: exp.Expression, limit: int) -> tuple[str, set[str]]:
    query = query.transform(lambda node: ungroup(node, limit) if isinstance(node, exp.Anonymous) else node)
    udfs = {call.name.lower() for call in query.find_all(exp.Anonymous) if call.name.lower().startswith("tra_")}
    return query.sql(dialect=DIALECT), udfs
