"""Scripts of tensor SQL on a session, statement by statement: run, or explained as the SQL
they are rewritten into. ``Frontend`` runs them on DuckDB; ``backends.spark_frontend``
subclasses it with Spark's ways of running a query, storing a tensor and explaining."""

from __future__ import annotations

from typing import TYPE_CHECKING

import duckdb
from sqlglot import exp

from tra_sql.compile.dialect import DUCKDB
from tra_sql.frontend import tensor_views, training
from tra_sql.frontend.blame import blamed, engine_error
from tra_sql.frontend.ddl import create_tensor, drop_tensor
from tra_sql.frontend.rewrite import Rewriter
from tra_sql.frontend.statements import Statement, explained, is_extended, split_statements
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session

#: statement kind -> its function (session, statement, run): done when run, else described
TRAINING = {"view": training.create_view, "drop view": training.drop_view,
            "parameter": training.create_parameter, "train": training.train}


class Frontend:
    """Runs and explains the statements of scripts on ``session``."""

    def __init__(self, session: Session):
        self.session = session
        self._views: set[str] | None = None  # lower-case tensor view names, read once (a view statement resets)

    # -- scripts and statements -----------------------------------------------------------
    def run(self, text: str, params=None, *, cursor: bool = False):
        """Run every statement of ``text``; the last one's result (see ``Session.sql``)."""
        self.prepare()
        if not is_extended(text) and not self.views():
            return self.plain(text, params, cursor, "statement")
        statements = split_statements(text)
        result = None
        for n, statement in enumerate(statements):
            last = n == len(statements) - 1
            result = self.run_statement(statement, params if last else None, cursor=cursor and last)
        return result

    def run_statement(self, statement: Statement, params=None, *, cursor: bool = False):
        """Run one statement; its result as the engine gives it (``None`` for CREATE/DROP TENSOR)."""
        self.prepare()
        with blamed(statement):
            return self._run_one(statement, params, cursor)

    def views(self) -> set[str]:
        """The lower-case names of the tensor views."""
        if self._views is None:
            self._views = set(tensor_views.definitions(self.session))
        return self._views

    def kind(self, statement: Statement) -> str:
        """``statement.kind``, where a statement that names a tensor view is ``tensor``."""
        kind = statement.kind
        if kind == "plain" and statement.names(self.views()):
            return "tensor"
        return kind

    def _run_one(self, statement: Statement, params, cursor: bool):
        kind = self.kind(statement)
        if kind == "explain":
            inner = explained(statement)
            if self.kind(inner) == "plain":
                return self.plain(statement.text, params, cursor, statement.where())
            return self.explained(statement, inner, params, cursor)
        if kind == "create":
            return self.create(statement)
        if kind == "drop":
            return drop_tensor(self.session, statement, run=True)
        if kind in TRAINING:
            self._views = None
            return TRAINING[kind](self.session, statement, True)
        if kind == "plain":
            return self.plain(statement.text, params, cursor, statement.where())
        return self.select(statement, params, cursor)

    def explain(self, text: str) -> str:
        """The SQL that ``run`` would hand DuckDB for each statement of ``text``."""
        self.prepare()
        out = []
        for statement in split_statements(text):
            with blamed(statement):
                out.append(self.describe(statement))
        return ";\n\n".join(s for s in out if s) + ";"

    def explain_statement(self, statement: Statement) -> str | None:
        """For ``EXPLAIN <statement with tensor syntax>``, the SQL it is rewritten into; else ``None``."""
        if statement.kind != "explain" or statement.analyze:
            return None
        with blamed(statement):
            inner = explained(statement)
            return None if self.kind(inner) == "plain" else f"{self.describe(inner)};"

    # -- what the engine does (DuckDB here) -----------------------------------------------
    def prepare(self) -> None:
        """Register the element-level tile functions (``tra_sql.udfs.elements``)."""
        self.session.engine.ensure_kernels(
            [protocol.TILE_VALUES, protocol.TILE_INTS, protocol.RANDOM_TILE, protocol.PACK_TILE])

    def plain(self, sql: str, params, cursor: bool, where: str):
        """Run ``sql`` as it is (its errors name ``where``): DuckDB's relation, or with
        ``cursor`` the connection, ready for ``fetchall()``."""
        try:
            return self.session.engine.execute(sql, params) if cursor else self.session.engine.query(sql, params)
        except duckdb.Error as err:
            raise engine_error(err, where) from err

    def rewritten(self, statement: Statement, run: bool = False) -> str:
        """The SQL of a statement that calls tensor functions (``run``: it runs now)."""
        rewriter = Rewriter(self.session, run)
        return DUCKDB.render(rewriter.rewrite(rewriter.parse(statement.text)), pretty=not run)[0]

    def select(self, statement: Statement, params, cursor: bool):
        """Run a statement that calls tensor functions."""
        return self.plain(self.rewritten(statement, run=True), params, cursor, statement.where())

    def create(self, statement: Statement) -> None:
        """Do a CREATE TENSOR statement."""
        create_tensor(self.session, statement, run=True)

    def describe(self, statement: Statement) -> str | None:
        """The SQL DuckDB runs for ``statement`` (CREATE/DROP TENSOR: the SQL they stand for)."""
        kind = self.kind(statement)
        if kind == "create":
            return create_tensor(self.session, statement, run=False)
        if kind == "drop":
            return drop_tensor(self.session, statement, run=False)
        if kind in TRAINING:
            return TRAINING[kind](self.session, statement, False)
        if kind == "explain":
            return self.describe(explained(statement))
        if kind == "plain":
            return statement.text
        return self.rewritten(statement)

    def explained(self, statement: Statement, inner: Statement, params, cursor: bool):
        """The result of ``EXPLAIN [ANALYZE] inner`` for an ``inner`` with tensor syntax:
        DuckDB's EXPLAIN ANALYZE of the rewrite, else the rewritten SQL as one row."""
        if statement.analyze and self.kind(inner) == "tensor":
            return self.plain("EXPLAIN ANALYZE " + self.rewritten(inner, run=True), params, cursor,
                              statement.where())
        text = self.describe(inner)
        sql = exp.select(exp.alias_(exp.Literal.string(text or ""), "rewritten_sql")).sql(dialect="duckdb")
        return self.plain(sql, params, cursor, statement.where())
