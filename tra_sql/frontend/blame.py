"""Naming the statement or call an error came from, and engine errors as ``TraError``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import duckdb

from tra_sql.engines.duckdb import translate
from tra_sql.errors import SQLError, TraError
from tra_sql.frontend.statements import Statement


def with_context(err: TraError, where: str, level: str) -> TraError:
    """``err`` (same class) with ``where`` in front of its message, once per ``level``
    (``call`` or ``statement``)."""
    levels = getattr(err, "tra_levels", frozenset())
    if level in levels:
        return err
    try:
        new = type(err)(f"{where}: {err}")
    except Exception:  # a subclass with another constructor
        new = SQLError(f"{where}: {err}")
    new.tra_levels = levels | {level}
    return new


def engine_error(err: duckdb.Error, where: str) -> TraError:
    """A ``TraError`` naming the statement for an engine error (tile UDF errors keep their class)."""
    if isinstance(err, duckdb.ParserException):
        error: TraError = SQLError(f"{where}: {' '.join(str(err).split())}")
    else:
        error = translate(err, where)
        if not str(error).startswith(where):
            error = type(error)(f"{where}: {error}")
    error.tra_levels = frozenset({"call", "statement"})
    return error


@contextmanager
def blamed(statement: Statement) -> Iterator[None]:
    """Name ``statement`` in any ``TraError`` raised inside; an engine error (reading the
    catalog while rewriting, say) becomes one."""
    try:
        yield
    except TraError as err:
        raise with_context(err, statement.where(), "statement") from None
    except duckdb.Error as err:
        raise engine_error(err, statement.where()) from None
