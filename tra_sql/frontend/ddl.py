"""``CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name AS ...`` and ``DROP TENSOR [IF EXISTS]
name``: done, or described (the SQL they stand for) when only shown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import duckdb
from sqlglot import exp
from sqlglot.tokens import TokenType

from tra_sql import catalog
from tra_sql.catalog import TensorInfo
from tra_sql.compile.dialect import DUCKDB
from tra_sql.errors import SQLError, UnknownTensorError
from tra_sql.frontend import query_tensor, tensor_views
from tra_sql.frontend.blame import engine_error
from tra_sql.frontend.rewrite import Rewriter
from tra_sql.frontend.statements import Statement
from tra_sql.frontend.syntax import OPTIONS, shown

if TYPE_CHECKING:
    from tra_sql.session import Session


USAGE = "write CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name [WITH (shape := [...], ...)] AS <query>"


@dataclass(frozen=True)
class CreateTensor:
    """What a ``CREATE [OR REPLACE] TENSOR [IF NOT EXISTS] name [WITH (options)] AS <query>``
    asks for."""

    name: str
    replace: bool
    if_not_exists: bool
    select: str
    options: dict = field(default_factory=dict)

    @staticmethod
    def of(statement: Statement) -> CreateTensor:
        tokens, i = statement.tokens, 2 if statement.words(1, 1) == ["TENSOR"] else 4
        replace = i == 4
        exists = statement.words(i, 3) == ["IF", "NOT", "EXISTS"]
        i += 3 if exists else 0
        if i + 1 >= len(tokens) or tokens[i].token_type not in (TokenType.VAR, TokenType.IDENTIFIER):
            raise SQLError(USAGE)
        name, options, at = catalog.check_name(tokens[i].text), {}, i + 1
        if statement.words(at, 1) == ["WITH"] and statement.words(at + 1, 1) == ["("]:
            options, at = statement.options(at + 1, "CREATE TENSOR", OPTIONS["tensor"])
        if statement.words(at, 1) != ["AS"]:
            raise SQLError(USAGE)
        return CreateTensor(name, replace, exists, statement.rest(at), options)

    def skipped(self, session: Session, table_exists: bool) -> bool:
        """Whether there is nothing to do (IF NOT EXISTS, and the tensor is there), given
        whether a table of that name exists; an SQLError if one does and is not replaced."""
        if not table_exists:
            return False
        if self.if_not_exists and self.name.lower() in (n.lower() for n in session.tensors()):
            return True
        if not self.replace:
            raise SQLError(f"a table named '{self.name}' exists already; use CREATE OR REPLACE TENSOR")
        return False


def create_tensor(session: Session, statement: Statement, run: bool) -> str | None:
    """Create the tensor (``run``) or give the SQL that would: ``SELECT * FROM <tensor>
    [WHERE <keys>]`` (without options) stores the tensor's tiles; any other query is checked
    (``query_tensor``)."""
    create = CreateTensor.of(statement)
    name, replace = create.name, create.replace
    tensor_views.check_free(session, name)
    rewriter = Rewriter(session, run)
    tree = rewriter.parse(create.select)
    found = None if create.options else rewriter.narrow(tree)
    if found is None:
        return _create_checked(session, statement, create, rewriter, tree, run)
    tensor, query = found
    info = TensorInfo(name, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
    sql = DUCKDB.render(query, pretty=not run)[0]
    if not run:
        return (f"-- tensor {name}: shape {info.shape}, tile {info.tile}, dtype {info.dtype}\n"
                f'CREATE {"OR REPLACE " if replace else ""}TABLE "{name}" AS\n{sql}')
    if create.skipped(session, session.engine.object_kind(name) == "TABLE"):
        return None
    try:
        if any(t.name.lower() == name.lower() for t in query.find_all(exp.Table)):
            _create_via_temp(session, info, sql, replace)
        else:
            session.engine.create_table(info, sql, replace)
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from err
    return None


def _create_checked(session: Session, statement: Statement, create: CreateTensor, rewriter: Rewriter,
                    tree: exp.Expression, run: bool) -> str | None:
    """CREATE TENSOR over any query of tiles: geometry from the options and the tensors read,
    rows checked before they are stored."""
    if not isinstance(tree, exp.Query):
        raise SQLError(f"CREATE TENSOR {create.name}: AS needs a query, got {shown(tree)}")
    query = rewriter.rewrite(tree)
    info = query_tensor.geometry(create.name, create.options, query_tensor.lineage(rewriter, tree))
    select = query_tensor.tiles_query(session, info, query)
    if not run:
        return (f"-- tensor {info.name}: shape {info.shape}, tile {info.tile}, dtype {info.dtype}, layout "
                f"{info.layout}; rows checked (keys in the grid and unique, tile sizes) before they are stored\n"
                f'CREATE {"OR REPLACE " if create.replace else ""}TABLE "{info.name}" AS\n'
                f"{DUCKDB.render(select, pretty=True)[0]}")
    if create.skipped(session, session.engine.object_kind(info.name) == "TABLE"):
        return None
    try:
        query_tensor.store_checked(session, info, select, create.replace)
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from err
    return None


def _create_via_temp(session: Session, info: TensorInfo, sql: str, replace: bool) -> None:
    """Create a tensor whose query reads the table it replaces: compute it first."""
    temp = exp.table_(exp.to_identifier(f"_tra_new_{info.name}", quoted=True), db="main", catalog="temp")
    engine = session.engine
    engine.rows(f"CREATE OR REPLACE TEMP TABLE {temp.sql(dialect='duckdb')} AS {sql}")
    try:
        engine.create_table(info, exp.select("*").from_(temp).sql(dialect="duckdb"), replace)
    finally:
        engine.rows(f"DROP TABLE IF EXISTS {temp.sql(dialect='duckdb')}")


def drop_tensor(session: Session, statement: Statement, run: bool) -> str | None:
    """Drop the tensor (``run``) or give the SQL that would."""
    exists = statement.words(2, 2) == ["IF", "EXISTS"]
    at = 4 if exists else 2
    tokens = statement.tokens
    if len(tokens) != at + 1 or tokens[at].token_type not in (TokenType.VAR, TokenType.IDENTIFIER):
        raise SQLError("write DROP TENSOR [IF EXISTS] name")
    name = tokens[at].text
    match = [n for n in session.tensors() if n.lower() == name.lower()]
    if not match:
        if exists:
            return None
        raise UnknownTensorError(f"no tensor named '{name}' in the catalog")
    if not run:
        return f'DROP TABLE "{match[0]}";\nDELETE FROM {catalog.CATALOG_TABLE} WHERE name = \'{match[0]}\''
    session.drop(match[0])
    return None

