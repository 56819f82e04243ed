"""How a program's SQL is written for one engine: a ``Dialect`` renders the compiled query,
giving each kernel call a chance to take the engine's form (``call``). DuckDB's is the base;
an engine with quirks subclasses it (Spark: ``tra_sql.backends.spark_sql.SparkDialect``)."""

from __future__ import annotations

from sqlglot import exp

from tra_sql.compile.blocks import call, kernels_called
from tra_sql.udfs.protocol import Kernel, tile_reduction


class Dialect:
    """DuckDB: every step a ``MATERIALIZED`` CTE; a split aggregation's partial results
    aggregated by a whole-tile reduction where there is one (``call``)."""

    name = "duckdb"
    materialized = True  # whether CTEs are written ``AS MATERIALIZED``

    def call(self, node: exp.Anonymous) -> exp.Expression:
        """The engine's form of a kernel call (``blocks.call``): ``tra_reduce(meta, keys,
        ARRAY_AGG(tile))`` without epilogue, over dense tiles, becomes the aggregate
        ``tra_reduce_<agg>_<dtype>(meta, keys, tile)`` (``protocol.TILE_REDUCTIONS``; native
        on DuckDB: one tile of state per group, no list)."""
        kernel, step = node.meta["kernel"], node.meta["step"]
        args = node.expressions
        if kernel.kind != "reduce" or kernel.epilogue or step.epilogue is not None or len(args) != 3 \
                or not isinstance(args[2], exp.ArrayAgg) or step.out_layout != "dense":
            return node
        reduction = tile_reduction(step.agg, step.out_dtype)
        return node if reduction is None else call(reduction, step, [args[1].copy(), args[2].this.copy()])

    def render(self, query: exp.Expression, pretty: bool = False) -> tuple[str, set[Kernel]]:
        """``query``'s text in this dialect, with its kernel calls in their engine's form, and
        the kernels it calls (``query`` is rewritten in place: pass a copy of your own)."""
        query = query.transform(lambda node: self.call(node)
                                if isinstance(node, exp.Anonymous) and "kernel" in node.meta else node, copy=False)
        return query.sql(dialect=self.name, pretty=pretty), kernels_called(query)


DUCKDB = Dialect()
