"""The tensor SQL of ``tra_sql.frontend`` on a Spark session.

``einsum(...)``, ``grad(...)``, ``tra_random(...)``, ``tra_from_elements(...)`` and
``tra_elements(...)`` table functions (nested as on DuckDB), ``CREATE [OR REPLACE] TENSOR
[IF NOT EXISTS] name AS SELECT * FROM <tensor> [WHERE <keys>]``, ``DROP TENSOR [IF EXISTS]
name`` and ``EXPLAIN <statement>``. A statement with tensor syntax is read in DuckDB's
dialect (the syntax is the same on both engines) and rendered in Spark's by sqlglot. Each
tensor function in FROM is computed when the statement runs (its program's steps as
``SparkEngine.frame`` runs them, the result kept as a local checkpoint) and read through
a temporary view, dropped once Spark has analyzed the statement; the rest of a SELECT stays
lazy: the result is a Spark DataFrame. The tiles of ``tra_random`` and
``tra_from_elements`` are temporary views too (lazy: read by the program that uses them).
Statements without tensor syntax go to Spark unchanged.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from sqlglot import exp

from tra_sql.backends import spark_udfs
from tra_sql.catalog import TensorInfo
from tra_sql.frontend.blame import blamed
from tra_sql.frontend.ddl import CreateTensor
from tra_sql.frontend.rewrite import Rewriter
from tra_sql.frontend.runner import Frontend
from tra_sql.frontend.statements import Statement, explained, split_statements
from tra_sql.graph import Source, topological
from tra_sql.tensor import Tensor
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session

DIALECT = "spark"
LITERAL_UDFS = [protocol.RANDOM_TILE, protocol.PACK_TILE]  # what tra_random(...) and tra_from_elements(...) call


class SparkRewriter(Rewriter):
    """Rewrites a statement's tensor functions into temporary views of their computed tile
    relations (with ``explain``: views named but not computed, their scripts kept)."""

    def __init__(self, session: Session, explain: bool = False):
        super().__init__(session)
        self.explain = explain
        self.views: dict[str, str] = {}  # view name -> the Spark script computing it (kept with explain)
        self.checkpoints: list = []  # the computed tensors' checkpointed RDDs (JVM objects)

    def query(self, tensor: Tensor) -> exp.Select:
        name = f"_tra_sql_{uuid.uuid4().hex[:12]}"
        program = tensor.program()
        literals = {n.table: self.literals[n.table] for n in topological(tensor.node)
                    if isinstance(n, Source) and n.table in self.literals}
        if self.explain:
            self.views |= {table: select.sql(dialect=DIALECT) for table, select in literals.items()}
            self.views[name] = self.session.engine.sql_text(program)
            return exp.select("*").from_(exp.to_table(name))
        for table, select in literals.items():  # tra_random(...), tra_from_elements(...): views first
            self.session.engine.ensure_kernels(LITERAL_UDFS)
            plain(self.session, select.sql(dialect=DIALECT)).createOrReplaceTempView(table)
            self.views[table] = ""
        with self.session.engine.frame(program) as frame:
            try:
                checkpoint = frame.localCheckpoint(eager=True)
            except Exception as err:
                raise spark_udfs.translate(err, f"computing {tensor.node.label}") from None
        checkpoint.createOrReplaceTempView(name)
        self.checkpoints.append(checkpoint._jdf.queryExecution().logical().rdd())
        self.views[name] = ""
        return exp.select("*").from_(exp.to_table(name))

    def elements(self, call: exp.Anonymous) -> exp.Select:
        """``tra_elements(t)`` as on DuckDB, its two ``unnest`` (values, positions) one
        ``posexplode`` on Spark."""
        self.session.engine.ensure_kernels([protocol.TILE_VALUES, protocol.TILE_INTS])

        def unnest(e: exp.Expression) -> bool:
            return isinstance(e, exp.Alias) and isinstance(e.this, exp.Anonymous) and e.this.name.lower() == "unnest"

        def explode(node: exp.Expression) -> exp.Expression:
            if not isinstance(node, exp.Select) or not any(unnest(e) for e in node.expressions):
                return node
            kept = [e for e in node.expressions if not unnest(e)]
            pairs = exp.Aliases(this=exp.Posexplode(this=exp.column("_v")),
                                expressions=[exp.to_identifier("_p"), exp.to_identifier("value")])
            return node.select(*kept, pairs, append=False)

        return super().elements(call).transform(explode)

    def drop_views(self, free: bool = False) -> None:
        """Drop the views made for the statement (Spark has analyzed it: its plan keeps them);
        with ``free``, also the checkpoints' blocks (the statement is done with them)."""
        if not self.explain:
            for name in self.views:
                self.session.engine.drop_view(name)
        if free:
            for rdd in self.checkpoints:
                rdd.unpersist(False)


def plain(session: Session, text: str, params=None):
    """Spark SQL as it is; a DataFrame."""
    try:
        return session.engine.spark.sql(text, args=params)
    except Exception as err:
        raise spark_udfs.translate(err, "SQL") from None


class SparkFrontend(Frontend):
    """``Frontend`` on Spark: queries through temporary views of computed tensors, tensors
    stored by the session's warehouse, EXPLAIN as each tensor function's script."""

    session: Session

    def prepare(self) -> None:
        """Nothing: a statement registers the tile functions it calls."""

    def plain(self, sql: str, params, cursor: bool, where: str):
        return plain(self.session, sql, params)

    def select(self, statement: Statement, params, cursor: bool):
        """Through temporary views of the computed tensors, dropped once Spark has analyzed it."""
        rewriter = SparkRewriter(self.session)
        try:
            return plain(self.session, rewriter.rewrite(rewriter.parse(statement.text)).sql(dialect=DIALECT), params)
        finally:
            rewriter.drop_views()

    def create(self, statement: Statement) -> None:
        create = CreateTensor.of(statement)
        if create.skipped(self.session, self.session.engine.warehouse.exists(create.name)):
            return
        rewriter = SparkRewriter(self.session)
        try:
            tensor, query = rewriter.source(rewriter.parse(create.select))
            info = TensorInfo(create.name, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
            self.session.store_query(info, query, create.replace)
        finally:
            rewriter.drop_views(free=True)

    def describe(self, statement: Statement) -> str:
        """What ``statement`` runs as: each tensor function's Spark script, then the statement."""
        if statement.kind == "explain":
            return self.describe(explained(statement))
        if statement.kind == "plain":
            return statement.text + ";"
        if statement.kind == "drop":
            return f"{statement.text};  -- its Parquet table and catalog row"
        rewriter = SparkRewriter(self.session, explain=True)
        if statement.kind == "create":
            create = CreateTensor.of(statement)
            _, query = rewriter.source(rewriter.parse(create.select))
            main = f"-- stored as tensor {create.name}\n{query.sql(dialect=DIALECT, pretty=True)};"
        else:
            main = rewriter.rewrite(rewriter.parse(statement.text)).sql(dialect=DIALECT, pretty=True) + ";"
        return "".join(f"-- {name}, computed first:\n{script};\n\n" for name, script in rewriter.views.items()) + main

    def explained(self, statement: Statement, inner: Statement, params, cursor: bool):
        """The rewritten statement as one row (EXPLAIN ANALYZE too)."""
        return self.session.engine.spark.createDataFrame([(self.describe(statement),)], "rewritten_sql string")

    def explain(self, text: str) -> str:
        """The Spark SQL that ``run`` would run for each statement of ``text``."""
        out = []
        for statement in split_statements(text):
            with blamed(statement):
                out.append(self.describe(statement))
        return "\n\n".join(out)


def run(session: Session, text: str, params=None):
    """Run every statement of ``text``; the last one's result (a DataFrame, or ``None`` for
    CREATE/DROP TENSOR)."""
    return SparkFrontend(session).run(text, params)


def explain(session: Session, text: str) -> str:
    """The Spark SQL that ``run`` would run for each statement of ``text``."""
    return SparkFrontend(session).explain(text)
