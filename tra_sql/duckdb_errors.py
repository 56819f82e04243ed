"""DuckDB's errors as ``TraError``s: one translator for every module that runs SQL."""

from __future__ import annotations

import re

import duckdb

from tra_sql import errors
from tra_sql.errors import ExecutionError, TraError

UDF_ERROR = re.compile(r"Python exception occurred while executing the UDF: (\w+): (.*)", re.S)


def translate(err: duckdb.Error, what: str) -> TraError:
    """A ``TraError`` for an engine error; errors raised in tile UDFs keep their class."""
    match = UDF_ERROR.search(str(err))
    if match and isinstance(getattr(errors, match.group(1), None), type):
        cls = getattr(errors, match.group(1))
        if issubclass(cls, TraError):
            return cls(match.group(2).strip())
    return ExecutionError(f"{what} failed: {err}")
