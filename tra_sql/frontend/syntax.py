"""The sqlglot expressions of tensor SQL: reading a call's literal arguments and named
options, and building the pieces of the SQL it is rewritten into."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import sqlglot
from sqlglot import exp

from tra_sql import catalog
from tra_sql.errors import DTypeError, SpecError, SQLError

OPTIONS = {
    "einsum": ("join", "agg"),
    "grad": (),
    "tra_random": ("shape", "tile", "seed", "dtype", "dist"),
    "tra_from_elements": ("shape", "tile", "dtype", "nulls", "duplicates"),
    "tra_relation": ("keys", "value", "shape", "tile", "dtype", "layout", "sum_duplicates"),
    "tra_elements": (),
    "tra_check": ("repair",),
    "tra_plan": ("workers", "memory", "format"),
    "tensor": ("shape", "tile", "dtype", "layout"),  # CREATE TENSOR name WITH (...)
}
SQL_TYPES = {"float64": "DOUBLE", "float32": "FLOAT", "int32": "INTEGER", "int64": "BIGINT"}


def string_literal(node: exp.Expression, what: str) -> str:
    if isinstance(node, exp.Literal) and node.is_string:
        return node.this
    raise SpecError(f"{what} must be a string literal, got {node.sql(dialect='duckdb')}")


def choice(options: dict[str, exp.Expression], key: str, allowed: tuple[str, ...]) -> str:
    """The string option ``key`` (default: the first of ``allowed``), one of ``allowed``."""
    if key not in options:
        return allowed[0]
    value = string_literal(options[key], key)
    if value not in allowed:
        raise SpecError(f"{key} must be {' or '.join(repr(a) for a in allowed)}, got {value!r}")
    return value


def int_literal(node: exp.Expression, what: str) -> int:
    sign = 1
    if isinstance(node, exp.Neg):
        sign, node = -1, node.this
    if isinstance(node, exp.Literal) and not node.is_string and re.fullmatch(r"\d+", node.this):
        return sign * int(node.this)
    raise SpecError(f"{what} must be an integer, got {node.sql(dialect='duckdb')}")


def strings_literal(node: exp.Expression, what: str) -> tuple[str, ...]:
    """A string or a list of strings."""
    if isinstance(node, (exp.Array, exp.Tuple)):
        return tuple(string_literal(e, what) for e in node.expressions)
    return (string_literal(node, what),)


def value_literal(node: exp.Expression, what: str) -> Any:
    """A number, string, boolean or list of them, as Python values."""
    if isinstance(node, exp.Neg):
        inner = value_literal(node.this, what)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner
    elif isinstance(node, exp.Literal):
        if node.is_string:
            return node.this
        return int(node.this) if re.fullmatch(r"\d+", node.this) else float(node.this)
    elif isinstance(node, exp.Boolean):
        return bool(node.this)
    elif isinstance(node, (exp.Array, exp.Tuple)):
        return tuple(value_literal(e, what) for e in node.expressions)
    raise SpecError(f"{what} must be a number, string, true/false or a list of them, got {shown(node)}")


def bool_literal(node: exp.Expression, what: str) -> bool:
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    raise SpecError(f"{what} must be true or false, got {node.sql(dialect='duckdb')}")


def ints_literal(node: exp.Expression, what: str) -> tuple[int, ...]:
    if isinstance(node, (exp.Array, exp.Tuple)):
        return tuple(int_literal(e, what) for e in node.expressions)
    return (int_literal(node, what),)


def dtype_named(name: str) -> np.dtype:
    """The dtype named ``name`` (``DTypeError`` for a name NumPy does not know, too)."""
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):  # ValueError: a comma-separated record format, 'ij,jk->ik'
        raise DTypeError(f"dtype {name!r} is not one of {', '.join(SQL_TYPES)}") from None
    return catalog.check_dtype(dtype)


def function_name(call: exp.Anonymous) -> str:
    return call.name.lower()


def arguments(call: exp.Anonymous, what: str | None = None,
              allowed: tuple[str, ...] | None = None) -> tuple[list[exp.Expression], dict[str, exp.Expression]]:
    """Positional arguments and named options (``name => v`` or ``name := v``) of ``call``
    (``what`` names it in errors, ``allowed`` its options: by default the function's)."""
    fname = function_name(call)
    what = what or f"{fname}()"
    allowed = OPTIONS[fname] if allowed is None else allowed
    positional: list[exp.Expression] = []
    named: dict[str, exp.Expression] = {}
    for arg in call.expressions:
        if isinstance(arg, (exp.Kwarg, exp.PropertyEQ)):
            key = arg.this.name.lower()
            if key not in allowed:
                known = ", ".join(allowed) or "none"
                raise SpecError(f"{what} has no option {arg.this.name!r}; its options: {known}")
            if key in named:
                raise SpecError(f"{what} option {key!r} is given twice")
            named[key] = arg.expression
        elif named:
            raise SQLError(f"{what}: positional argument {arg.sql(dialect='duckdb')} after a named one")
        else:
            positional.append(arg)
    return positional, named


def options_text(text: str, what: str, allowed: tuple[str, ...]) -> dict[str, exp.Expression]:
    """The named options ``name := value, ...`` of ``text`` (the inside of ``WITH (...)``)."""
    try:
        call = sqlglot.parse_one(f"_options({text})", read="duckdb")
    except sqlglot.errors.ParseError:
        raise SQLError(f"{what}: cannot read the options ({text})") from None
    if not isinstance(call, exp.Anonymous):
        raise SQLError(f"{what}: cannot read the options ({text})")
    positional, named = arguments(call, what, allowed)
    if positional:
        raise SQLError(f"{what}: options are written name := value, got {shown(positional[0])}")
    return named


def array(items: list[exp.Expression]) -> exp.Expression:
    return exp.Array(expressions=items) if items else exp.cast(exp.Array(expressions=[]), "BIGINT[]")


def sql_call(name: str, *args: exp.Expression) -> exp.Anonymous:
    return exp.Anonymous(this=name, expressions=list(args))


def json_literal(**payload: Any) -> exp.Literal:
    return exp.Literal.string(json.dumps(payload, separators=(",", ":")))


def aliased(this: exp.Expression, name: str, columns: list[str] | None = None) -> exp.Expression:
    """``(query) AS name(columns)`` or ``table AS name(columns)``."""
    alias = exp.TableAlias(this=exp.to_identifier(name), columns=[exp.to_identifier(c) for c in columns or []])
    if isinstance(this, exp.Query):
        return exp.Subquery(this=this, alias=alias)
    this.set("alias", alias)
    return this


def shown(node: exp.Expression) -> str:
    return node.sql(dialect="duckdb", normalize_functions=False)


def tile_position(d: int, extents: list[exp.Column]) -> exp.Expression:
    """Index ``d`` inside a tile of shape ``extents`` at flat (C order) position ``_p``."""
    position: exp.Expression = exp.column("_p")
    if d + 1 < len(extents):
        stride: exp.Expression = extents[d + 1].copy()
        for e in extents[d + 2 :]:
            stride = exp.Mul(this=stride, expression=e.copy())
        position = exp.paren(exp.IntDiv(this=position, expression=exp.paren(stride)))
    return exp.Mod(this=position, expression=extents[d].copy())

