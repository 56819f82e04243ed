"""Join expressions: SQL scalar expressions over ``x0..xn``, translated to Numba code.

The expression is parsed by sqlglot (DuckDB dialect) and rewritten node by node into a
Python expression that Numba compiles inside a loop kernel. It evaluates as DuckDB evaluates
it: ``log(x)`` is base 10, ``log(b, x)`` is base ``b``, ``ln`` is natural, ``round`` rounds
half away from zero, ``%`` and ``//`` truncate like C, ``/`` divides in floating point
(``x / 0`` is ``inf``), NaN compares above every number and equal to itself (so
``greatest(x, nan)`` is NaN and ``least(x, nan)`` is ``x``), any non-zero number is true.
Where DuckDB has no value to give, IEEE arithmetic does: ``x % 0`` and ``x // 0`` (errors in
DuckDB) and ``CASE`` without ``ELSE`` (NULL in DuckDB; a tile holds no NULLs) give NaN, inf
and 0. Each operand of a node is evaluated once (compound ones are bound by a ``lambda``).
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import sqlglot
from sqlglot import exp

from tra_sql.errors import SpecError

UNARY = {
    exp.Exp: "np.exp({})",
    exp.Ln: "np.log({})",
    exp.Sqrt: "np.sqrt({})",
    exp.Abs: "abs({})",
    exp.Tanh: "np.tanh({})",
    exp.Sin: "np.sin({})",
    exp.Cos: "np.cos({})",
    exp.Floor: "np.floor(np.float64({}))",  # a DOUBLE, as in DuckDB, for integers too
    exp.Ceil: "np.ceil(np.float64({}))",
    exp.Neg: "(-{})",
    exp.Not: "({} == 0)",
    exp.Paren: "({})",
}
BINARY = {
    exp.Add: "({} + {})",
    exp.Sub: "({} - {})",
    exp.Mul: "({} * {})",
    exp.Div: "np.divide({}, {})",
    exp.IntDiv: "np.trunc(np.divide({}, {}))",
    exp.Mod: "np.fmod(np.float64({}), np.float64({}))",  # Numba's integer fmod floors
    exp.Pow: "np.power(np.float64({}), {})",
    exp.And: "(({} != 0) and ({} != 0))",
    exp.Or: "(({} != 0) or ({} != 0))",
}
# DuckDB's order: NaN is above every number and equal to itself ({0} != {0} only for NaN)
COMPARE = {
    exp.EQ: "{0} == {1} or ({0} != {0} and {1} != {1})",
    exp.NEQ: "{0} != {1} and ({0} == {0} or {1} == {1})",
    exp.LT: "{0} < {1} or ({1} != {1} and {0} == {0})",
    exp.LTE: "{0} <= {1} or {1} != {1}",
    exp.GT: "{0} > {1} or ({0} != {0} and {1} == {1})",
    exp.GTE: "{0} >= {1} or {0} != {0}",
}
ROUND = "{0} if abs({0}) >= 4503599627370496.0 else np.copysign(np.floor(abs({0}) + 0.5), {0})"  # 2^52: integral
SIGN = "1 if {0} > 0 else (-1 if {0} < 0 else 0)"  # DuckDB's: an integer, 0 for -0.0 and NaN
ANONYMOUS = {
    "sigmoid": (1, "(1.0 / (1.0 + np.exp(-{})))"),
    "relu": (1, "np.maximum({}, 0.0)"),
    "erf": (1, "math.erf({})"),
}
# np.float64, not float(): Numba's float() keeps a float32 a float32
FLOAT_TYPES = {"DOUBLE": "np.float64({})", "FLOAT": "np.float64(np.float32({}))", "REAL": "np.float64(np.float32({}))"}
FUNCTION_NAMES = sorted(
    ["exp", "ln", "log", "sqrt", "pow", "power", "abs", "tanh", "sin", "cos", "floor", "ceil",
     "sign", "round", "greatest", "least", "pi", "cast"] + list(ANONYMOUS)
)
SIMPLE = re.compile(r"[\w.]+|\(-math\.inf\)")  # a name or a number: no cost to repeat
OPERAND = re.compile(r"x(0|[1-9][0-9]*)")
INT64 = 2**63


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


def _operand(node: exp.Column, n: int, text: str) -> str:
    match = OPERAND.fullmatch(node.name) if not node.table else None
    if match is None:
        raise SpecError(f"join expression {text!r}: unknown name {node.sql()!r}; "
                        f"operands are x0..x{n - 1}")
    if int(match.group(1)) >= n:
        raise SpecError(f"join expression {text!r} refers to {node.name} but the einsum has "
                        f"{n} operand(s): x0..x{n - 1}")
    return node.name


def _once(template: str, *args: str) -> str:
    """``template`` over ``args`` ({0}, {1}, ...), each evaluated once: a compound argument
    that the template repeats is bound by a lambda."""
    if all(SIMPLE.fullmatch(a) for a in args):
        return f"({template.format(*args)})"
    names = [f"_{chr(ord('a') + i)}" for i in range(len(args))]
    return f"((lambda {', '.join(names)}: {template.format(*names)})({', '.join(args)}))"


def _number(text: str) -> str:
    """A numeric literal as Python: an int64, else a float (``inf`` past float64's range). A
    large integer is an ``np.int64``: Numba folds literal Python ints, and fails to compile
    a product of two large ones."""
    if not any(c in text for c in ".eE") and -INT64 <= int(text) < INT64:
        return str(int(text)) if abs(int(text)) < 2**31 else f"np.int64({int(text)})"
    value = float(text)
    return "math.inf" if value == float("inf") else repr(value)


def _translate(node: exp.Expression, n: int, text: str) -> str:
    def go(child):
        return _translate(child, n, text)

    kind = type(node)
    if kind is exp.Column:
        return _operand(node, n, text)
    if kind is exp.Literal:
        if node.is_string:
            raise SpecError(f"join expression {text!r}: string {node.sql()} is not a number")
        try:
            return _number(node.this)
        except ValueError:  # sqlglot reads '1e' of '1e+-3' as a number
            raise SpecError(f"join expression {text!r}: {node.this!r} is not a number") from None
    if kind is exp.Boolean:
        return "True" if node.this else "False"
    if kind is exp.Pi:
        return "math.pi"
    if kind in UNARY:
        return UNARY[kind].format(go(node.this))
    if kind in BINARY:
        return BINARY[kind].format(go(node.this), go(node.expression))
    if kind in COMPARE:
        return _once(COMPARE[kind], go(node.this), go(node.expression))
    if kind is exp.Log:
        if node.expression is None:
            return f"np.log10({go(node.this)})"
        return f"np.divide(np.log({go(node.expression)}), np.log({go(node.this)}))"
    if kind is exp.Sign:
        return _once(SIGN, go(node.this))
    if kind is exp.Round:
        if node.args.get("decimals") is not None:
            raise SpecError(f"join expression {text!r}: round() takes one argument here")
        return _once(ROUND, go(node.this))
    if kind in (exp.Greatest, exp.Least):
        function = "np.maximum" if kind is exp.Greatest else "np.fmin"  # NaN is the largest
        result = go(node.this)
        for e in node.expressions:
            result = f"{function}({result}, {go(e)})"
        return result
    if kind is exp.Case:
        if node.this is not None:
            raise SpecError(f"join expression {text!r}: use CASE WHEN <condition>, not CASE <value>")
        result = go(node.args["default"]) if node.args.get("default") is not None else "0.0"
        for branch in reversed(node.args["ifs"]):
            result = f"({go(branch.args['true'])} if ({go(branch.this)}) != 0 else {result})"
        return result
    if kind is exp.If:
        otherwise = node.args.get("false")
        return f"({go(node.args['true'])} if ({go(node.this)}) != 0 else {go(otherwise) if otherwise else '0.0'})"
    if kind is exp.Cast:
        return _cast(node, go, text)
    if kind is exp.Anonymous:
        name = node.name.lower()
        if name not in ANONYMOUS:
            raise SpecError(f"join expression {text!r}: unknown function {node.name}(); "
                            f"known: {', '.join(FUNCTION_NAMES)}")
        arity, template = ANONYMOUS[name]
        if len(node.expressions) != arity:
            raise SpecError(f"join expression {text!r}: {name}() takes {arity} argument(s), "
                            f"got {len(node.expressions)}")
        return template.format(*(go(e) for e in node.expressions))
    if isinstance(node, exp.Func):
        raise SpecError(f"join expression {text!r}: function {node.sql_name()}() is not "
                        f"supported; known: {', '.join(FUNCTION_NAMES)}")
    raise SpecError(f"join expression {text!r}: {node.sql()!r} is not supported")


def _cast(node: exp.Cast, go, text: str) -> str:
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


@lru_cache(maxsize=256)
def join_code(text: str, n_operands: int) -> str:
    """Numba source for the join expression ``text`` over ``n_operands`` scalars."""
    tree = parse_join(text)
    try:
        return _translate(tree, n_operands, text)
    except RecursionError:
        raise SpecError(f"join expression {text!r} is nested too deeply") from None
