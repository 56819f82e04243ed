"""How a program's SQL is written for one engine: a ``Dialect`` renders the compiled query,
giving each kernel call a chance to take the engine's form (``call``). DuckDB's is the base;
an engine with quirks subclasses it (Spark: ``tra_sql.backends.spark_sql.SparkDialect``)."""

from __future__ import annotations

from sqlglot import exp

from tra_sql.compile.blocks import kernels_called
from tra_sql.udfs.protocol import Kernel


class Dialect:
    """DuckDB: every step a ``MATERIALIZED`` CTE, kernel calls as compiled."""

    name = "duckdb"
    materialized = True  # whether CTEs are written ``AS MATERIALIZED``

    def call(self, node: exp.Anonymous) -> exp.Expression:
        """The engine's form of a kernel call (``blocks.call``)."""
        return node

    def render(self, query: exp.Expression, pretty: bool = False) -> tuple[str, set[Kernel]]:
        """``query``'s text in this dialect, with its kernel calls in their engine's form, and
        the kernels it calls (``query`` is rewritten in place: pass a copy of your own)."""
        query = query.transform(lambda node: self.call(node)
                                if isinstance(node, exp.Anonymous) and "kernel" in node.meta else node, copy=False)
        return query.sql(dialect=self.name, pretty=pretty), kernels_called(query)


DUCKDB = Dialect()
