"""Symbolic derivatives of join expressions (SQL scalar expressions over ``x0..xn``).

``diff(expr, "x1")`` returns a sqlglot expression for the partial derivative, simplified as it
is built (products and sums with 0 or 1 fold away). Conventions follow PyTorch:

- a ``CASE``/``IF`` condition carries no gradient, its branches do;
- ``floor``, ``ceil``, ``sign``, ``round``, integer division and comparisons have derivative 0;
- ``abs`` has derivative ``sign(x)`` (0 at 0); ``relu(x)`` routes to ``x`` only when ``x > 0``;
- ``greatest(a, b, ...)`` routes to an argument only where it is strictly greater than every
  later one, so ties go to the later argument: ``greatest(x, 0)`` at ``x = 0`` gives 0, as
  ReLU does (``least`` alike, with "smaller");
- ``%`` (C ``fmod``) has derivative 1 in ``a`` and ``-trunc(a / b)`` in ``b``.

A function the differentiator does not know raises ``NotDifferentiableError``.
"""

from __future__ import annotations

import math
import re

from sqlglot import exp

from tra_sql.errors import SpecError
from tra_sql.udfs.expr import parse_join

VARIABLE = re.compile(r"x(\d+)")
ZERO_DERIVATIVE = (exp.Floor, exp.Ceil, exp.Sign, exp.Round, exp.IntDiv, exp.EQ, exp.NEQ, exp.LT, exp.LTE,
                   exp.GT, exp.GTE, exp.And, exp.Or, exp.Not, exp.Boolean, exp.Literal, exp.Pi)
ATOMS = (exp.Column, exp.Paren, exp.Func)


class NotDifferentiableError(SpecError):
    """A join expression that uses a function or operator without a derivative rule."""


def parse(text: str) -> exp.Expression:
    """Parse a join expression (``SpecError`` if it does not parse)."""
    return parse_join(text)


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


def to_sql(expr: exp.Expression) -> str:
    return expr.sql(dialect="duckdb")


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


def _p(expr: exp.Expression) -> exp.Expression:
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
    return exp.Add(this=_p(a), expression=_p(b))


def neg(a: exp.Expression) -> exp.Expression:
    va = value_of(a)
    if va is not None:
        return num(-va)
    if isinstance(a, exp.Neg):
        return a.this
    return exp.Neg(this=_p(a))


def sub(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return num(va - vb)
    if vb == 0:
        return a
    if va == 0:
        return neg(b)
    return exp.Sub(this=_p(a), expression=_p(b))


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
    return exp.Mul(this=_p(a), expression=_p(b))


def div(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    va, vb = value_of(a), value_of(b)
    if va == 0:
        return num(0)
    if vb == 1:
        return a
    if va is not None and vb is not None and vb != 0:
        return num(va / vb)
    return exp.Div(this=_p(a), expression=_p(b))


def power(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    vb = value_of(b)
    if vb == 0:
        return num(1)
    if vb == 1:
        return a
    return exp.Pow(this=_p(a), expression=_p(b))


def gt(a: exp.Expression, b: exp.Expression) -> exp.Expression:
    return exp.GT(this=_p(a), expression=_p(b))


def case(condition: exp.Expression, then: exp.Expression, otherwise: exp.Expression) -> exp.Expression:
    if then == otherwise:
        return then
    return exp.Case(ifs=[exp.If(this=condition.copy(), true=then)], default=otherwise)


def _bare(expr: exp.Expression) -> exp.Expression:
    while isinstance(expr, exp.Paren):
        expr = expr.this
    return expr


def through_output(join: exp.Expression, derivative: exp.Expression, y: str) -> exp.Expression | None:
    """``derivative`` (of ``join``) over ``join``'s value alone, the variable ``y``, if it can
    be written so; else None. Occurrences of ``join`` become ``y`` (``1 - tanh(a)^2`` becomes
    ``1 - y*y``), and the condition ``a > c`` of a ``greatest(a, c)`` or ``relu(a)`` (``c > a``
    of ``least(a, c)``), with ``c`` a constant, becomes ``y > c`` (``c > y``). A backward pass
    that needs only the output spares keeping the input, as PyTorch's ReLU does."""
    core = _bare(join)
    args = [core.this, *core.expressions] if isinstance(core, (exp.Greatest, exp.Least)) else []
    if isinstance(core, exp.Anonymous) and core.name.lower() == "relu" and len(core.expressions) == 1:
        core_args, kind = [core.expressions[0], num(0)], exp.Greatest
    elif len(args) == 2 and not variables(args[1]):
        core_args, kind = args, type(core)
    else:
        core_args, kind = None, None
    out = exp.column(y)

    def swap(node: exp.Expression) -> exp.Expression:
        if _bare(node) == core:
            return out.copy()
        if core_args and isinstance(node, exp.GT):
            first, const = core_args
            left, right = _bare(node.this), _bare(node.expression)
            if kind is exp.Greatest and left == _bare(first) and right == _bare(const):
                return gt(out, const)
            if kind is exp.Least and left == _bare(const) and right == _bare(first):
                return gt(const, out)
        return node

    result = derivative.copy().transform(swap)
    return result if not variables(result) else None


# -- differentiation ------------------------------------------------------------------------
def diff(expr: exp.Expression, var: str, text: str | None = None) -> exp.Expression:
    """The partial derivative of ``expr`` with respect to variable ``var`` (e.g. ``"x0"``);
    ``text`` (the expression as the user wrote it) is for error messages."""
    return _Diff(var, text or to_sql(expr)).go(expr)


class _Diff:
    def __init__(self, var: str, text: str):
        self.var, self.text = var, text

    def fail(self, what: str) -> NotDifferentiableError:
        return NotDifferentiableError(
            f"join expression {self.text!r}: no derivative rule for {what}; write it with "
            f"differentiable functions (+ - * / pow exp ln log sqrt abs tanh sin cos sigmoid relu erf "
            f"greatest least CASE) or keep this operand out of the gradient")

    def go(self, e: exp.Expression) -> exp.Expression:  # noqa: C901 - one branch per rule
        d = self.go
        if isinstance(e, exp.Column):
            return num(1 if e.name == self.var and not e.table else 0)
        if isinstance(e, ZERO_DERIVATIVE):
            return num(0)
        if self.var not in variables(e):
            return num(0)
        if isinstance(e, exp.Paren):
            return d(e.this)
        if isinstance(e, exp.Neg):
            return neg(d(e.this))
        if isinstance(e, exp.Add):
            return add(d(e.this), d(e.expression))
        if isinstance(e, exp.Sub):
            return sub(d(e.this), d(e.expression))
        if isinstance(e, exp.Mul):
            return add(mul(d(e.this), e.expression), mul(e.this, d(e.expression)))
        if isinstance(e, exp.Div):
            a, b = e.this, e.expression
            return sub(div(d(a), b), div(mul(a, d(b)), mul(b, b)))
        if isinstance(e, exp.Pow):
            return self.pow(e.this, e.expression)
        if isinstance(e, exp.Exp):
            return mul(e.copy(), d(e.this))
        if isinstance(e, exp.Ln):
            return div(d(e.this), e.this)
        if isinstance(e, exp.Log):
            if e.expression is None:  # log10
                return div(mul(num(1 / math.log(10)), d(e.this)), e.this)
            return d(exp.Div(this=exp.Ln(this=e.expression.copy()), expression=exp.Ln(this=e.this.copy())))
        if isinstance(e, exp.Sqrt):
            return div(d(e.this), mul(num(2), e.copy()))
        if isinstance(e, exp.Abs):
            return mul(exp.Sign(this=e.this.copy()), d(e.this))
        if isinstance(e, exp.Tanh):
            return mul(sub(num(1), mul(e.copy(), e.copy())), d(e.this))
        if isinstance(e, exp.Sin):
            return mul(exp.Cos(this=e.this.copy()), d(e.this))
        if isinstance(e, exp.Cos):
            return neg(mul(exp.Sin(this=e.this.copy()), d(e.this)))
        if isinstance(e, exp.Mod):
            a, b = e.this, e.expression
            q = div(a, b)
            trunc = case(exp.GTE(this=_p(q), expression=num(0)), exp.Floor(this=q.copy()), exp.Ceil(this=q.copy()))
            return sub(d(a), mul(trunc, d(b)))
        if isinstance(e, (exp.Greatest, exp.Least)):
            return self.extremum(e, [e.this] + list(e.expressions))
        if isinstance(e, exp.Case):
            if e.this is not None:
                raise self.fail("CASE <value> WHEN (use CASE WHEN <condition>)")
            ifs = [exp.If(this=b.this.copy(), true=d(b.args["true"])) for b in e.args["ifs"]]
            default = e.args.get("default")
            dd = d(default) if default is not None else num(0)
            if all(is_zero(b.args["true"]) for b in ifs) and is_zero(dd):
                return num(0)
            return exp.Case(ifs=ifs, default=dd)
        if isinstance(e, exp.If):
            otherwise = e.args.get("false")
            return case(e.this, d(e.args["true"]), d(otherwise) if otherwise is not None else num(0))
        if isinstance(e, exp.Cast):
            return d(e.this)
        if isinstance(e, exp.Anonymous):
            return self.anonymous(e)
        raise self.fail(f"{e.sql(dialect='duckdb')!r} ({type(e).__name__})")

    def pow(self, a: exp.Expression, b: exp.Expression) -> exp.Expression:
        da, db = self.go(a), self.go(b)
        out = num(0)
        if not is_zero(da):
            vb = value_of(b)
            exponent = num(vb - 1) if vb is not None else sub(b, num(1))
            out = mul(mul(b, power(a, exponent)), da)
        if not is_zero(db):
            out = add(out, mul(mul(exp.Pow(this=_p(a), expression=_p(b)), exp.Ln(this=a.copy())), db))
        return out

    def extremum(self, e: exp.Expression, args: list[exp.Expression]) -> exp.Expression:
        """``greatest(a, rest...)``: ``CASE WHEN a > greatest(rest) THEN da ELSE d greatest(rest)``."""
        if len(args) == 1:
            return self.go(args[0])
        first, rest = args[0], args[1:]
        kind = type(e)
        others = rest[0] if len(rest) == 1 else kind(this=rest[0].copy(), expressions=[r.copy() for r in rest[1:]],
                                                      ignore_nulls=True)
        better = gt(first, others) if kind is exp.Greatest else gt(others, first)
        return case(better, self.go(first), self.extremum(e, rest))

    def anonymous(self, e: exp.Anonymous) -> exp.Expression:
        name = e.name.lower()
        if len(e.expressions) != 1:
            raise self.fail(f"{name}()")
        a = e.expressions[0]
        da = self.go(a)
        if name == "sigmoid":
            s = e.copy()
            return mul(mul(s, sub(num(1), s.copy())), da)
        if name == "relu":
            return case(gt(a, num(0)), da, num(0))
        if name == "erf":
            return mul(mul(num(2 / math.sqrt(math.pi)), exp.Exp(this=neg(mul(a, a)))), da)
        raise self.fail(f"{name}()")
