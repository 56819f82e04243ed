"""The tensor SQL of ``tra_sql.frontend`` on a Spark session.

``einsum(...)``, ``grad(...)``, ``tra_random(...)``, ``tra_from_elements(...)`` and
``tra_elements(...)`` table functions (nested as on DuckDB), ``CREATE [OR REPLACE] TENSOR
[IF NOT EXISTS] name AS SELECT * FROM <tensor> [WHERE <keys>]``, ``DROP TENSOR [IF EXISTS]
name`` and ``EXPLAIN <statement>``. A statement with tensor syntax is read in DuckDB's
dialect (the syntax is the same on both engines) and rendered in Spark's by sqlglot. Each
tensor function in FROM is computed when the statement runs (its program's steps as
``SparkTraSession.frame`` runs them, the result kept as a local checkpoint) and read through
a temporary view, dropped once Spark has analyzed the statement; the rest of a SELECT stays
lazy: the result is a Spark DataFrame. The tiles of ``tra_random`` and
``tra_from_elements`` are temporary views too (lazy: read by the program that uses them).
Statements without tensor syntax go to Spark unchanged.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from sqlglot import exp

from tra_sql import frontend
from tra_sql.backends import spark_udfs
from tra_sql.catalog import TensorInfo
from tra_sql.errors import SQLError, TraError
from tra_sql.frontend import CreateTensor, Statement
from tra_sql.graph import Source, topological
from tra_sql.tensor import Tensor
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.backends.spark import SparkTraSession

DIALECT = "spark"
LITERAL_UDFS = [protocol.RANDOM_TILE, protocol.PACK_TILE]  # what tra_random(...) and tra_from_elements(...) call


class SparkRewriter(frontend.Rewriter):
    """Rewrites a statement's tensor functions into temporary views of their computed tile
    relations (with ``explain``: views named but not computed, their scripts kept)."""

    def __init__(self, session: SparkTraSession, explain: bool = False):
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
            self.views[name] = self.session.sql_text(program)
            return exp.select("*").from_(exp.to_table(name))
        for table, select in literals.items():  # tra_random(...), tra_from_elements(...): views first
            self.session.ensure_udfs(LITERAL_UDFS)
            plain(self.session, select.sql(dialect=DIALECT)).createOrReplaceTempView(table)
            self.views[table] = ""
        with self.session.frame(program) as frame:
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
        self.session.ensure_udfs([protocol.TILE_VALUES, protocol.TILE_INTS])

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
                self.session.spark.catalog.dropTempView(name)
        if free:
            for rdd in self.checkpoints:
                rdd.unpersist(False)


def plain(session: SparkTraSession, text: str, params=None):
    """Spark SQL as it is; a DataFrame."""
    try:
        return session.spark.sql(text, args=params)
    except Exception as err:
        raise spark_udfs.translate(err, "SQL") from None


def _select(session: SparkTraSession, statement: Statement, params):
    rewriter = SparkRewriter(session)
    try:
        return plain(session, rewriter.rewrite(rewriter.parse(statement.text)).sql(dialect=DIALECT), params)
    finally:
        rewriter.drop_views()


def _create(session: SparkTraSession, statement: Statement) -> None:
    create = CreateTensor.of(statement)
    if session.warehouse.exists(create.name):
        if create.if_not_exists and create.name.lower() in (n.lower() for n in session.tensors()):
            return
        if not create.replace:
            raise SQLError(f"a table named '{create.name}' exists already; use CREATE OR REPLACE TENSOR")
    rewriter = SparkRewriter(session)
    try:
        tensor, query = rewriter.source(rewriter.parse(create.select))
        info = TensorInfo(create.name, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
        session.store_query(info, query, create.replace)
    finally:
        rewriter.drop_views(free=True)


def rewritten(session: SparkTraSession, statement: Statement) -> str:
    """What ``statement`` runs as: each tensor function's Spark script, then the statement."""
    if statement.kind == "explain":
        return rewritten(session, frontend.explained(statement))
    if statement.kind == "plain":
        return statement.text + ";"
    if statement.kind == "drop":
        return f"{statement.text};  -- its Parquet table and catalog row"
    rewriter = SparkRewriter(session, explain=True)
    if statement.kind == "create":
        create = CreateTensor.of(statement)
        _, query = rewriter.source(rewriter.parse(create.select))
        main = f"-- stored as tensor {create.name}\n{query.sql(dialect=DIALECT, pretty=True)};"
    else:
        main = rewriter.rewrite(rewriter.parse(statement.text)).sql(dialect=DIALECT, pretty=True) + ";"
    return "".join(f"-- {name}, computed first:\n{script};\n\n" for name, script in rewriter.views.items()) + main


def _run_one(session: SparkTraSession, statement: Statement, params):
    kind = statement.kind
    if kind == "plain":
        return plain(session, statement.text, params)
    if kind == "explain":
        if frontend.explained(statement).kind == "plain":
            return plain(session, statement.text, params)
        return session.spark.createDataFrame([(rewritten(session, statement),)], "rewritten_sql string")
    if kind == "create":
        return _create(session, statement)
    if kind == "drop":
        return frontend.drop_tensor(session, statement, run=True)
    return _select(session, statement, params)


def run(session: SparkTraSession, text: str, params=None):
    """Run every statement of ``text``; the last one's result (a DataFrame, or ``None`` for
    CREATE/DROP TENSOR)."""
    if not frontend.is_extended(text):
        return plain(session, text, params)
    statements = frontend.split_statements(text)
    result = None
    for n, statement in enumerate(statements):
        try:
            result = _run_one(session, statement, params if n == len(statements) - 1 else None)
        except TraError as err:
            raise frontend.with_context(err, statement.where(), "statement") from None
    return result


def explain(session: SparkTraSession, text: str) -> str:
    """The Spark SQL that ``run`` would run for each statement of ``text``."""
    out = []
    for statement in frontend.split_statements(text):
        try:
            out.append(rewritten(session, statement))
        except TraError as err:
            raise frontend.with_context(err, statement.where(), "statement") from None
    return "\n\n".join(out)
