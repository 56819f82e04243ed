"""Tensor views: ``CREATE [OR REPLACE] TENSOR VIEW name AS SELECT * FROM <tensor>`` keeps the
definition (table ``tra_tensor_views``), not the tiles; every statement that reads ``name``
(as an operand, in FROM, in ``grad`` or ``TRAIN``) evaluates the definition again, on the
tensors as they are then. ``DROP TENSOR VIEW [IF EXISTS] name`` forgets it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tra_sql import catalog
from tra_sql.errors import SQLError, TensorExistsError, UnknownTensorError

if TYPE_CHECKING:
    from tra_sql.session import Session

TABLE = "tra_tensor_views"


def definitions(session: Session) -> dict[str, tuple[str, str]]:
    """Lower-case name -> (name, definition) of every tensor view (none before the first, and
    none on engines other than DuckDB)."""
    if session.engine.name != "duckdb" or session.engine.object_kind(TABLE) is None:
        return {}
    return {name.lower(): (name, text) for name, text in
            session.engine.rows(f"SELECT name, definition FROM {TABLE} ORDER BY name")}


def create(session: Session, name: str, definition: str, replace: bool) -> None:
    """Keep ``definition`` as tensor view ``name`` (a stored tensor or table of that name is an
    error; an existing view needs ``replace``)."""
    catalog.check_name(name)
    if session.engine.name != "duckdb":
        raise SQLError(f"tensor views are kept in DuckDB's catalog; the {session.engine.name} engine has none")
    views = definitions(session)
    if name.lower() in views and not replace:
        raise TensorExistsError(f"a tensor view named '{views[name.lower()][0]}' exists already; "
                                f"use CREATE OR REPLACE TENSOR VIEW")
    if name.lower() not in views and session.engine.object_kind(name) is not None:
        raise TensorExistsError(f"a table or tensor named '{name}' exists already: a tensor view needs its own name")
    engine = session.engine
    engine.rows(f"CREATE TABLE IF NOT EXISTS {TABLE} (name VARCHAR PRIMARY KEY, definition VARCHAR NOT NULL)")
    with engine.transaction():
        engine.rows(f"DELETE FROM {TABLE} WHERE lower(name) = lower(?)", [name])
        engine.rows(f"INSERT INTO {TABLE} VALUES (?, ?)", [name, definition])


def drop(session: Session, name: str, if_exists: bool) -> None:
    """Forget tensor view ``name``."""
    if name.lower() not in definitions(session):
        if if_exists:
            return
        raise UnknownTensorError(f"no tensor view named '{name}'")
    session.engine.rows(f"DELETE FROM {TABLE} WHERE lower(name) = lower(?)", [name])


def check_free(session: Session, name: str) -> None:
    """An SQLError if ``name`` is a tensor view (a tensor cannot take its name)."""
    views = definitions(session)
    if name.lower() in views:
        raise SQLError(f"'{views[name.lower()][0]}' is a tensor view: DROP TENSOR VIEW it first or use another name")
