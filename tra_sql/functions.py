"""The scalar functions and operators of a join expression, one definition each: its SQL
name(s), its Numba template (read by ``udfs.expr``, the translator) and its derivative rule
(read by ``tra_sql.derivative``, the differentiator).

The templates evaluate as DuckDB evaluates (see ``udfs.expr``); the derivatives follow
PyTorch's conventions (see ``tra_sql.derivative``). A template is ``numba(node, go, text)``:
Python source for ``node`` given ``go`` (the source of a child) and ``text`` (the expression
as written, for error messages). A derivative rule is ``derivative(e, d)``: ``d(child)``
differentiates a child, ``d.fail(what)`` is the error for a construct without a rule.
Adding a function is adding its entry here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np
from sqlglot import exp

from tra_sql.errors import SpecError
from tra_sql.expressions import add, case, div, gt, mul, neg, num, paren, power, sub, value_of


class Differentiator(Protocol):
    def __call__(self, e: exp.Expression) -> exp.Expression: ...

    def fail(self, what: str) -> Exception: ...


Numba = Callable[[exp.Expression, Callable[[exp.Expression], str], str], str]
Derivative = Callable[[exp.Expression, Differentiator], exp.Expression]


@dataclass(frozen=True)
class Function:
    """One scalar function or operator: ``names`` are its SQL spellings (none for an
    operator), ``arity`` its argument count where a call checks it (anonymous functions)."""

    names: tuple[str, ...]
    numba: Numba
    derivative: Derivative
    arity: int = 1


SIMPLE = re.compile(r"[\w.]+|\(-math\.inf\)")  # a name or a number: no cost to repeat
# np.float64, not float(): Numba's float() keeps a float32 a float32
FLOAT_TYPES = {"DOUBLE": "np.float64({})", "FLOAT": "np.float64(np.float32({}))", "REAL": "np.float64(np.float32({}))"}


def once(template: str, *args: str) -> str:
    """``template`` over ``args`` ({0}, {1}, ...), each evaluated once: a compound argument
    that the template repeats is bound by a lambda."""
    if all(SIMPLE.fullmatch(a) for a in args):
        return f"({template.format(*args)})"
    names = [f"_{chr(ord('a') + i)}" for i in range(len(args))]
    return f"((lambda {', '.join(names)}: {template.format(*names)})({', '.join(args)}))"


# -- template builders ----------------------------------------------------------------------
def unary(template: str) -> Numba:
    return lambda node, go, text: template.format(go(node.this))


def binary(template: str) -> Numba:
    return lambda node, go, text: template.format(go(node.this), go(node.expression))


def binary_once(template: str) -> Numba:
    return lambda node, go, text: once(template, go(node.this), go(node.expression))


def call(template: str) -> Numba:
    """An anonymous function's template over its arguments."""
    return lambda node, go, text: template.format(*(go(e) for e in node.expressions))


def _log(node, go, text) -> str:
    if node.expression is None:
        return f"np.log10({go(node.this)})"
    return f"np.divide(np.log({go(node.expression)}), np.log({go(node.this)}))"


def _round(node, go, text) -> str:
    if node.args.get("decimals") is not None:
        raise SpecError(f"join expression {text!r}: round() takes one argument here")
    return once(ROUND, go(node.this))


def _extreme(function: str) -> Numba:
    def numba(node, go, text) -> str:
        result = go(node.this)
        for e in node.expressions:
            result = f"{function}({result}, {go(e)})"
        return result
    return numba


def _case(node, go, text) -> str:
    if node.this is not None:
        raise SpecError(f"join expression {text!r}: use CASE WHEN <condition>, not CASE <value>")
    result = go(node.args["default"]) if node.args.get("default") is not None else "0.0"
    for branch in reversed(node.args["ifs"]):
        result = f"({go(branch.args['true'])} if ({go(branch.this)}) != 0 else {result})"
    return result


def _if(node, go, text) -> str:
    otherwise = node.args.get("false")
    return f"({go(node.args['true'])} if ({go(node.this)}) != 0 else {go(otherwise) if otherwise else '0.0'})"


def _cast(node, go, text) -> str:
    """``CAST(e AS DOUBLE)`` or ``AS FLOAT`` (rounded to float32, as DuckDB's FLOAT is, then
    computed on in float64), and constants such as ``'inf'::DOUBLE``, ``'-inf'``, ``'nan'``."""
    target = node.to.this.name if hasattr(node.to.this, "name") else str(node.to.this)
    if target not in FLOAT_TYPES:
        raise SpecError(f"join expression {text!r}: only casts to DOUBLE/FLOAT are supported")
    convert, inner = FLOAT_TYPES[target], node.this
    if not (isinstance(inner, exp.Literal) and inner.is_string):
        return convert.format(go(inner))
    try:
        value = float(inner.this)
    except ValueError:
        raise SpecError(f"join expression {text!r}: {inner.sql()} is not a number") from None
    if value != value or abs(value) == float("inf"):
        return "math.nan" if value != value else "math.inf" if value > 0 else "(-math.inf)"
    return repr(float(np.float32(value)) if target != "DOUBLE" else value)


# -- derivative rules -----------------------------------------------------------------------
def zero(e, d) -> exp.Expression:
    """Piecewise constant (rounding, comparisons, logic): derivative 0, as in PyTorch."""
    return num(0)


def _through(e, d) -> exp.Expression:
    return d(e.this)


def _d_log(e, d) -> exp.Expression:
    if e.expression is None:  # log10
        return div(mul(num(1 / math.log(10)), d(e.this)), e.this)
    return d(exp.Div(this=exp.Ln(this=e.expression.copy()), expression=exp.Ln(this=e.this.copy())))


def _d_pow(e, d) -> exp.Expression:
    a, b = e.this, e.expression
    da, db = d(a), d(b)
    out = num(0)
    if value_of(da) != 0:
        vb = value_of(b)
        exponent = num(vb - 1) if vb is not None else sub(b, num(1))
        out = mul(mul(b, power(a, exponent)), da)
    if value_of(db) != 0:
        out = add(out, mul(mul(exp.Pow(this=paren(a), expression=paren(b)), exp.Ln(this=a.copy())), db))
    return out


def _d_mod(e, d) -> exp.Expression:
    """``%`` (C ``fmod``): 1 in ``a``, ``-trunc(a / b)`` in ``b``."""
    a, b = e.this, e.expression
    q = div(a, b)
    trunc = case(exp.GTE(this=paren(q), expression=num(0)), exp.Floor(this=q.copy()), exp.Ceil(this=q.copy()))
    return sub(d(a), mul(trunc, d(b)))


def _d_extremum(e, d) -> exp.Expression:
    """``greatest(a, rest...)``: ``CASE WHEN a > greatest(rest) THEN da ELSE d greatest(rest)``
    (ties go to the later argument; ``least`` alike, with "smaller")."""
    kind = type(e)

    def go(args: list[exp.Expression]) -> exp.Expression:
        if len(args) == 1:
            return d(args[0])
        first, rest = args[0], args[1:]
        others = rest[0] if len(rest) == 1 else kind(this=rest[0].copy(), expressions=[r.copy() for r in rest[1:]],
                                                      ignore_nulls=True)
        better = gt(first, others) if kind is exp.Greatest else gt(others, first)
        return case(better, d(first), go(rest))

    return go([e.this] + list(e.expressions))


def _d_case(e, d) -> exp.Expression:
    """A condition carries no gradient, the branches do."""
    if e.this is not None:
        raise d.fail("CASE <value> WHEN (use CASE WHEN <condition>)")
    ifs = [exp.If(this=b.this.copy(), true=d(b.args["true"])) for b in e.args["ifs"]]
    default = e.args.get("default")
    dd = d(default) if default is not None else num(0)
    if all(value_of(b.args["true"]) == 0 for b in ifs) and value_of(dd) == 0:
        return num(0)
    return exp.Case(ifs=ifs, default=dd)


def _d_if(e, d) -> exp.Expression:
    otherwise = e.args.get("false")
    return case(e.this, d(e.args["true"]), d(otherwise) if otherwise is not None else num(0))


def _d_sigmoid(e, d) -> exp.Expression:
    s = e.copy()
    return mul(mul(s, sub(num(1), s.copy())), d(e.expressions[0]))


def _d_relu(e, d) -> exp.Expression:
    a = e.expressions[0]
    return case(gt(a, num(0)), d(a), num(0))


def _d_erf(e, d) -> exp.Expression:
    a = e.expressions[0]
    return mul(mul(num(2 / math.sqrt(math.pi)), exp.Exp(this=neg(mul(a, a)))), d(a))


def _tanh_series(terms: int) -> list[float]:
    """The first ``terms`` coefficients of tanh's Taylor series (of x, x^3, x^5, ...):
    ``2^2n (2^2n - 1) B_2n / (2n)!`` from the Bernoulli numbers ``B``."""
    bernoulli = [Fraction(1)]
    for m in range(1, 2 * terms + 1):
        bernoulli.append(-sum(math.comb(m + 1, k) * bernoulli[k] for k in range(m)) / (m + 1))
    return [float(4**n * (4**n - 1) * bernoulli[2 * n] / math.factorial(2 * n)) for n in range(1, terms + 1)]


def _horner(coefficients: list[float], variable: str) -> str:
    text = repr(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        text = f"{c!r} + {variable} * ({text})"
    return text


# tanh in float64 as DuckDB computes it (libm's tanh of a DOUBLE), within 4 ulp, without libm's
# tanh, which costs about three exp calls: ``1 - 2 / (exp(2|x|) + 1)`` (exact in sign, 1 at
# large |x|, NaN for NaN), and below |x| = 0.3, where that loses digits, the first 12 terms of
# the Taylor series (|error| < 1e-17 there); both are computed and one selected, without a branch.
# ``exp64`` and ``np.divide`` (no zero-division check) keep a loop over it vectorizable.
TANH_SMALL = 0.3
TANH = (f"np.copysign((lambda _y, _p, _f: _p if _y < {TANH_SMALL!r} else _f)(abs({{0}}), "
        f"(lambda _q: _q * ({_horner(_tanh_series(12), '(_q * _q)')}))(min(abs({{0}}), {TANH_SMALL!r})), "
        f"1.0 - np.divide(2.0, exp64(2.0 * abs({{0}})) + 1.0)), {{0}})")
ROUND = "{0} if abs({0}) >= 4503599627370496.0 else np.copysign(np.floor(abs({0}) + 0.5), {0})"  # 2^52: integral
SIGN = "1 if {0} > 0 else (-1 if {0} < 0 else 0)"  # DuckDB's: an integer, 0 for -0.0 and NaN

#: Functions and operators by sqlglot class: the translator matches the class exactly, the
#: differentiator the nearest base class.
FUNCTIONS: dict[type[exp.Expression], Function] = {
    exp.Exp: Function(("exp",), unary("exp64({})"), lambda e, d: mul(e.copy(), d(e.this))),
    exp.Ln: Function(("ln",), unary("np.log({})"), lambda e, d: div(d(e.this), e.this)),
    exp.Log: Function(("log",), _log, _d_log),  # log(x) is base 10, log(b, x) base b
    exp.Sqrt: Function(("sqrt",), unary("np.sqrt({})"), lambda e, d: div(d(e.this), mul(num(2), e.copy()))),
    exp.Abs: Function(("abs",), unary("abs({})"), lambda e, d: mul(exp.Sign(this=e.this.copy()), d(e.this))),
    exp.Tanh: Function(("tanh",), lambda node, go, text: once(TANH, go(node.this)),
                       lambda e, d: mul(sub(num(1), mul(e.copy(), e.copy())), d(e.this))),
    exp.Sin: Function(("sin",), unary("np.sin({})"), lambda e, d: mul(exp.Cos(this=e.this.copy()), d(e.this))),
    exp.Cos: Function(("cos",), unary("np.cos({})"), lambda e, d: neg(mul(exp.Sin(this=e.this.copy()), d(e.this)))),
    exp.Floor: Function(("floor",), unary("np.floor(np.float64({}))"), zero),  # a DOUBLE, as in DuckDB
    exp.Ceil: Function(("ceil",), unary("np.ceil(np.float64({}))"), zero),
    exp.Sign: Function(("sign",), lambda node, go, text: once(SIGN, go(node.this)), zero),
    exp.Round: Function(("round",), _round, zero),  # half away from zero
    exp.Greatest: Function(("greatest",), _extreme("np.maximum"), _d_extremum),
    exp.Least: Function(("least",), _extreme("np.fmin"), _d_extremum),  # NaN is the largest
    exp.Pi: Function(("pi",), lambda node, go, text: "math.pi", zero),
    exp.Cast: Function(("cast",), _cast, _through),
    exp.Pow: Function(("pow", "power"), binary("np.power(np.float64({}), {})"), _d_pow),
    exp.Neg: Function((), unary("(-{})"), lambda e, d: neg(d(e.this))),
    exp.Not: Function((), unary("({} == 0)"), zero),
    exp.Paren: Function((), unary("({})"), _through),
    exp.Add: Function((), binary("({} + {})"), lambda e, d: add(d(e.this), d(e.expression))),
    exp.Sub: Function((), binary("({} - {})"), lambda e, d: sub(d(e.this), d(e.expression))),
    exp.Mul: Function((), binary("({} * {})"),
                      lambda e, d: add(mul(d(e.this), e.expression), mul(e.this, d(e.expression)))),
    exp.Div: Function((), binary("np.divide({}, {})"),  # floating point: x / 0 is inf
                      lambda e, d: sub(div(d(e.this), e.expression),
                                       div(mul(e.this, d(e.expression)), mul(e.expression, e.expression)))),
    exp.IntDiv: Function((), binary("np.trunc(np.divide({}, {}))"), zero),  # truncates like C
    # C's fmod (Numba's integer fmod floors); ``+ 0 * a`` makes an integer zero +0 as DuckDB's
    # integer % gives, and keeps a float result's sign (0 * a has a's; NaN only where fmod is NaN)
    exp.Mod: Function((), binary_once("np.fmod(np.float64({0}), np.float64({1})) + 0 * {0}"), _d_mod),
    exp.And: Function((), binary("(({} != 0) and ({} != 0))"), zero),
    exp.Or: Function((), binary("(({} != 0) or ({} != 0))"), zero),
    # DuckDB's order: NaN is above every number and equal to itself ({0} != {0} only for NaN)
    exp.EQ: Function((), binary_once("{0} == {1} or ({0} != {0} and {1} != {1})"), zero),
    exp.NEQ: Function((), binary_once("{0} != {1} and ({0} == {0} or {1} == {1})"), zero),
    exp.LT: Function((), binary_once("{0} < {1} or ({1} != {1} and {0} == {0})"), zero),
    exp.LTE: Function((), binary_once("{0} <= {1} or {1} != {1}"), zero),
    exp.GT: Function((), binary_once("{0} > {1} or ({0} != {0} and {1} == {1})"), zero),
    exp.GTE: Function((), binary_once("{0} >= {1} or {0} != {0}"), zero),
    exp.Boolean: Function((), lambda node, go, text: "True" if node.this else "False", zero),
    exp.Case: Function((), _case, _d_case),  # without ELSE: 0 (NULL in DuckDB; a tile holds no NULLs)
    exp.If: Function((), _if, _d_if),
}

#: Functions sqlglot does not know (``exp.Anonymous``), by lower-case name.
ANONYMOUS: dict[str, Function] = {
    "sigmoid": Function(("sigmoid",), call("np.divide(1.0, 1.0 + exp64(-{}))"), _d_sigmoid),
    "relu": Function(("relu",), call("np.maximum({}, 0.0)"), _d_relu),
    "erf": Function(("erf",), call("math.erf({})"), _d_erf),
}

FUNCTION_NAMES = sorted(name for f in [*FUNCTIONS.values(), *ANONYMOUS.values()] for name in f.names)


def rule_of(e: exp.Expression) -> Function | None:
    """The function ``e`` applies for the differentiator: its anonymous function by name, or
    the entry of its nearest base class."""
    if isinstance(e, exp.Anonymous):
        return ANONYMOUS.get(e.name.lower())
    for kind in type(e).__mro__:
        if kind in FUNCTIONS:
            return FUNCTIONS[kind]
    return None
