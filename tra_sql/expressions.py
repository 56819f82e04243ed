"""Join expressions as sqlglot trees (SQL scalar expressions over ``x0..xn``): parsing,
their variables, renaming, and constructors that fold constants as they build (products and
sums with 0 or 1 fold away), which the differentiator and the gradient rules build with."""

from __future__ import annotations

import re

import sqlglot
from sqlglot import exp

from tra_sql.errors import SpecError

VARIABLE = re.compile(r"x(\d+)")
ATOMS = (exp.Column, exp.Paren, exp.Func)


def parse_join(text: str) -> exp.Expression:
    """Parse a join expression, raising ``SpecError`` with the parser's message."""
    try:
        return sqlglot.parse_one(text, read="duckdb")
    except sqlglot.errors.ParseError as err:  # its message underlines the token with ANSI codes
        first = err.errors[0] if err.errors else {}
        raise SpecError(f"join expression {text!r} does not parse: {first.get('description', err)} "
                        f"(column {first.get('col', '?')})") from None
    except sqlglot.errors.SqlglotError as err:
        raise SpecError(f"join expression {text!r} does not parse: {err}") from None
    except RecursionError:
        raise SpecError(f"join expression {text!r} is nested too deeply") from None


def to_sql(expr: exp.Expression) -> str:
    return expr.sql(dialect="duckdb")


def product(n: int) -> exp.Expression:
    """The default join ``x0 * x1 * ... * x(n-1)``."""
    out: exp.Expression = exp.column("x0")
    for m in range(1, n):
        out = exp.Mul(this=out, expression=exp.column(f"x{m}"))
    return out


def variables(expr: exp.Expression) -> set[str]:
    """Names of the operand variables ``x<k>`` that ``expr`` refers to."""
    return {c.name for c in expr.find_all(exp.Column) if VARIABLE.fullmatch(c.name) and not c.table}


def rename(expr: exp.Expression, mapping: dict[str, str]) -> exp.Expression:
    """``expr`` with variables renamed by ``mapping`` (a copy)."""
    def swap(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Column) and node.name in mapping and not node.table:
            return exp.column(mapping[node.name])
        return node
    return expr.copy().transform(swap)


def shift(expr: exp.Expression, n: int, by: int) -> exp.Expression:
    """``expr`` over ``x0..x(n-1)`` with each ``x<k>`` renamed ``x<k+by>``."""
    return rename(expr, {f"x{k}": f"x{k + by}" for k in range(n)})


def bare(expr: exp.Expression) -> exp.Expression:
    """``expr`` without the parentheses around it."""
    while isinstance(expr, exp.Paren):
        expr = expr.this
    return expr


# -- construction with folding ------------------------------------------------------------
def num(value: float) -> exp.Expression:
    value = float(value)
    text = str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return exp.Literal.number(text)


def value_of(expr: exp.Expression) -> float | None:
    """The number ``expr`` is, if it is a numeric literal (possibly negated or in parens)."""
    if isinstance(expr, exp.Paren):
        return value_of(expr.this)
    if isinstance(expr, exp.Neg):
        inner = value_of(expr.this)
        return None if inner is None else -inner
    if isinstance(expr, exp.Literal) and not expr.is_string:
        return float(expr.this)
    return None


def is_zero(expr: exp.Expression) -> bool:
    return value_of(expr) == 0


def paren(expr: exp.Expression) -> exp.Expression:
    """``expr`` wrapped in parentheses unless it is atomic."""
    if isinstance(expr, ATOMS) or (isinstance(expr, exp.Literal) and not expr.this.startswith("-")):
        return expr.copy()
    return exp.Paren(this=expr.copy())


def add(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return num(va + vb)
    if va == 0:
        return b
    if vb == 0:
        return a
    return exp.Add(this=paren(a), expression=paren(b))


def neg(a: exp.Expression) -> exp.Expression:
    va = value_of(a)
    if va is not None:
        return num(-va)
    if isinstance(a, exp.Neg):
        return a.this
    return exp.Neg(this=paren(a))


def sub(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return num(va - vb)
    if vb == 0:
        return a
    if va == 0:
        return neg(b)
    return exp.Sub(this=paren(a), expression=paren(b))


def mul(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return num(va * vb)
    if va == 0 or vb == 0:
        return num(0)
    if va == 1:
        return b
    if vb == 1:
        return a
    if va == -1:
        return neg(b)
    if vb == -1:
        return neg(a)
    return exp.Mul(this=paren(a), expression=paren(b))


def div(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    va, vb = value_of(a), value_of(b)
    if va == 0:
        return num(0)
    if vb == 1:
        return a
    if va is not None and vb is not None and vb != 0:
        return num(va / vb)
    return exp.Div(this=paren(a), expression=paren(b))


def power(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    vb = value_of(b)
    if vb == 0:
        return num(1)
    if vb == 1:
        return a
    return exp.Pow(this=paren(a), expression=paren(b))


def gt(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    return exp.GT(this=paren(a), expression=paren(b))


def case(condition: exp.Expression, then: exp.Expression, otherwise: exp.Expression) -> exp.Expression:
    if then == otherwise:
        return then
    return exp.Case(ifs=[exp.If(this=condition.copy(), true=then)], default=otherwise)
