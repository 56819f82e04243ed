"""A program's SQL for Spark: the shared sqlglot query in Spark's dialect, as steps, and one
rewrite for memory.

Spark inlines a CTE wherever it is read, so a training step's ~40 CTEs, shared between the
forward pass, the gradients and the optimizer, expanded into a plan ~30 times the program
(one GCN step: 1437 Python UDF evaluations for 49 calls in the text). ``spark_steps`` makes
every CTE a temporary view instead; the session makes the views read more than once local
checkpoints, so each step runs once per query.

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
import uuid
from collections import Counter
from dataclasses import dataclass
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


@dataclass
class Steps:
    """A query as Spark runs it: temporary ``views`` in order (name, SQL, how many later
    steps read it), then the ``final`` SQL over them; and the tile UDFs they call."""

    views: list[tuple[str, str, int]]
    final: str
    udfs: set[str]

    def text(self) -> str:
        """All of it as one script, for reading."""
        return "".join(f"CREATE TEMPORARY VIEW {name} AS {sql};\n" for name, sql, _ in self.views) + self.final


def spark_steps(program: Program, limit: int = GROUP_BYTES) -> Steps:
    """``program`` as steps (see ``Steps``) whose final query returns ``k0.. (INT), tile``."""
    query = program.query(materialized=False)
    keys = [exp.alias_(exp.cast(exp.column(f"k{d}"), "INT"), f"k{d}") for d in range(len(program.root.shape))]
    return _steps(query, lambda body: exp.select(*keys, "tile").from_(body.subquery("r")), limit)


def spark_union_steps(program: Program, results: dict, limit: int = GROUP_BYTES) -> Steps:
    """``Program.union_query(results)`` as steps: the final query returns the rows
    ``target, k0, ..., tile`` (INT keys) of several results."""
    rank = max((len(node.shape) for node in results.values()), default=0)
    keys = [exp.alias_(exp.cast(exp.column(f"k{d}"), "INT"), f"k{d}") for d in range(rank)]
    return _steps(program.union_query(results),
                  lambda body: exp.select("target", *keys, "tile").from_(body.subquery("u")), limit)


def _steps(query: exp.Expression, finish, limit: int) -> Steps:
    """``query``'s CTEs as views named uniquely (the same program may run twice at once)."""
    key = "with_" if "with_" in query.arg_types else "with"  # sqlglot renamed the argument
    ctes = [(cte.alias, cte.this) for cte in query.args[key].expressions] if query.args.get(key) else []
    body = query.copy()
    body.set(key, None)
    prefix = f"_tra_{uuid.uuid4().hex[:12]}"
    names = {name: f"{prefix}{name}" for name, _ in ctes}

    def renamed(select: exp.Expression) -> exp.Expression:
        select = select.copy()
        for table in select.find_all(exp.Table):
            if table.name in names and not table.db:
                table.set("this", exp.to_identifier(names[table.name], quoted=True))
        return select

    parts = [renamed(select) for _, select in ctes] + [renamed(finish(body))]
    reads = Counter(table.name for part in parts for table in part.find_all(exp.Table))
    rendered = [_render(part, limit) for part in parts]
    views = [(names[name], sql, reads[names[name]]) for (name, _), (sql, _) in zip(ctes, rendered)]
    return Steps(views, rendered[-1][0], set().union(*(udfs for _, udfs in rendered)))


def _render(query: exp.Expression, limit: int) -> tuple[str, set[str]]:
    query = query.transform(lambda node: ungroup(node, limit) if isinstance(node, exp.Anonymous) else node)
    udfs = {call.name.lower() for call in query.find_all(exp.Anonymous) if call.name.lower().startswith("tra_")}
    return query.sql(dialect=DIALECT), udfs
