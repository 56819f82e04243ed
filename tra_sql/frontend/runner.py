"""One statement of a script: the SQL it is rewritten into, run, or explained."""

from __future__ import annotations

from typing import TYPE_CHECKING

import duckdb
from sqlglot import exp

from tra_sql.frontend.blame import blamed, engine_error
from tra_sql.frontend.ddl import create_tensor, drop_tensor
from tra_sql.frontend.rewrite import Rewriter
from tra_sql.frontend.statements import Statement, explained

if TYPE_CHECKING:
    from tra_sql.session import Session


def ensure_functions(session: Session) -> None:
    """Register the element-level tile functions (``tra_sql.udfs.elements``)."""
    session.ensure_udfs(["tra_tile_values", "tra_tile_ints", "tra_random_tile", "tra_pack_tile"])


def rewrite_statement(session: Session, statement: Statement, run: bool = False) -> str | None:
    """The SQL DuckDB runs for ``statement``; with ``run``, CREATE/DROP TENSOR are done
    (and give ``None``) instead of described."""
    kind = statement.kind
    if kind == "create":
        return create_tensor(session, statement, run)
    if kind == "drop":
        return drop_tensor(session, statement, run)
    if kind == "explain":
        return rewrite_statement(session, explained(statement))
    if kind == "plain":
        return statement.text
    rewriter = Rewriter(session, run)
    return rewriter.rewrite(rewriter.parse(statement.text)).sql(dialect="duckdb", pretty=not run)


def _run_one(session: Session, statement: Statement, params, cursor: bool):
    if statement.kind == "explain":
        inner = explained(statement)
        if inner.kind == "plain":
            sql: str | None = statement.text
        elif statement.analyze and inner.kind == "tensor":
            sql = "EXPLAIN ANALYZE " + str(rewrite_statement(session, inner, run=True))
        else:
            text = rewrite_statement(session, inner)
            sql = exp.select(exp.alias_(exp.Literal.string(text or ""), "rewritten_sql")).sql(dialect="duckdb")
    else:
        sql = rewrite_statement(session, statement, run=True)
    if sql is None:
        return None
    try:
        return session.con.execute(sql, params) if cursor else session.con.sql(sql, params=params)
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from err



def run_statement(session: Session, statement: Statement, params=None, *, cursor: bool = False):
    """Run one statement; its result as DuckDB gives it (``None`` for CREATE/DROP TENSOR)."""
    ensure_functions(session)
    with blamed(statement):
        return _run_one(session, statement, params, cursor)


def explain_statement(session: Session, statement: Statement) -> str | None:
    """For ``EXPLAIN <statement with tensor syntax>``, the SQL it is rewritten into; else ``None``."""
    if statement.kind != "explain" or statement.analyze:
        return None
    with blamed(statement):
        inner = explained(statement)
        return None if inner.kind == "plain" else f"{rewrite_statement(session, inner)};"


