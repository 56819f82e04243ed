"""Join expressions: SQL scalar expressions over ``x0..xn``, translated to Numba code.

The expression is parsed by sqlglot (DuckDB dialect) and rewritten node by node into a
Python expression that Numba compiles inside a loop kernel. SQL semantics are kept where
they differ from Python's: ``log(x)`` is base 10, ``log(b, x)`` is base ``b``, ``ln`` is
natural, ``round`` rounds half away from zero, ``%`` truncates like C.
"""

from __future__ import annotations

import re
from functools import lru_cache

import sqlglot
from sqlglot import exp

from tra_sql.errors import SpecError

UNARY = {
    exp.Exp: "math.exp({})",
    exp.Ln: "math.log({})",
    exp.Sqrt: "math.sqrt({})",
    exp.Abs: "abs({})",
    exp.Tanh: "math.tanh({})",
    exp.Sin: "math.sin({})",
    exp.Cos: "math.cos({})",
    exp.Floor: "math.floor({})",
    exp.Ceil: "math.ceil({})",
    exp.Sign: "np.sign({})",
    exp.Neg: "(-{})",
    exp.Not: "(not {})",
    exp.Paren: "({})",
}
BINARY = {
    exp.Add: "({} + {})",
    exp.Sub: "({} - {})",
    exp.Mul: "({} * {})",
    exp.Div: "({} / {})",
    exp.IntDiv: "({} // {})",
    exp.Mod: "math.fmod({}, {})",
    exp.Pow: "({} ** {})",
    exp.EQ: "({} == {})",
    exp.NEQ: "({} != {})",
    exp.LT: "({} < {})",
    exp.LTE: "({} <= {})",
    exp.GT: "({} > {})",
    exp.GTE: "({} >= {})",
    exp.And: "({} and {})",
    exp.Or: "({} or {})",
}
ANONYMOUS = {
    "sigmoid": (1, "(1.0 / (1.0 + math.exp(-{})))"),
    "relu": (1, "max({}, 0.0)"),
    "erf": (1, "math.erf({})"),
}
FLOAT_TYPES = {"DOUBLE", "FLOAT", "REAL"}
FUNCTION_NAMES = sorted(
    ["exp", "ln", "log", "sqrt", "pow", "power", "abs", "tanh", "sin", "cos", "floor", "ceil",
     "sign", "round", "greatest", "least", "pi", "cast"] + list(ANONYMOUS)
)


def parse_join(text: str) -> exp.Expression:
    """Parse a join expression, raising ``SpecError`` with the parser's message."""
    try:
        return sqlglot.parse_one(text, read="duckdb")
    except sqlglot.errors.ParseError as err:
        raise SpecError(f"join expression {text!r} does not parse: {err}") from None


def _operand(node: exp.Column, n: int, text: str) -> str:
    match = re.fullmatch(r"x(\d+)", node.name) if not node.table else None
    if match is None:
        raise SpecError(f"join expression {text!r}: unknown name {node.sql()!r}; "
                        f"operands are x0..x{n - 1}")
    if int(match.group(1)) >= n:
        raise SpecError(f"join expression {text!r} refers to {node.name} but the einsum has "
                        f"{n} operand(s): x0..x{n - 1}")
    return node.name


def _translate(node: exp.Expression, n: int, text: str) -> str:
    def go(child):
        return _translate(child, n, text)

    kind = type(node)
    if kind is exp.Column:
        return _operand(node, n, text)
    if kind is exp.Literal:
        if node.is_string:
            raise SpecError(f"join expression {text!r}: string {node.sql()} is not a number")
        return repr(float(node.this)) if any(c in node.this for c in ".eE") else str(int(node.this))
    if kind is exp.Boolean:
        return "True" if node.this else "False"
    if kind is exp.Pi:
        return "math.pi"
    if kind in UNARY:
        return UNARY[kind].format(go(node.this))
    if kind in BINARY:
        return BINARY[kind].format(go(node.this), go(node.expression))
    if kind is exp.Log:
        if node.expression is None:
            return f"math.log10({go(node.this)})"
        return f"(math.log({go(node.expression)}) / math.log({go(node.this)}))"
    if kind is exp.Round:
        if node.args.get("decimals") is not None:
            raise SpecError(f"join expression {text!r}: round() takes one argument here")
        value = go(node.this)
        return f"math.copysign(math.floor(abs({value}) + 0.5), {value})"
    if kind in (exp.Greatest, exp.Least):
        args = [go(node.this)] + [go(e) for e in node.expressions]
        return f"{'max' if kind is exp.Greatest else 'min'}({', '.join(args)})"
    if kind is exp.Case:
        if node.this is not None:
            raise SpecError(f"join expression {text!r}: use CASE WHEN <condition>, not CASE <value>")
        result = go(node.args["default"]) if node.args.get("default") is not None else "0.0"
        for branch in reversed(node.args["ifs"]):
            result = f"({go(branch.args['true'])} if {go(branch.this)} else {result})"
        return result
    if kind is exp.If:
        otherwise = node.args.get("false")
        return f"({go(node.args['true'])} if {go(node.this)} else {go(otherwise) if otherwise else '0.0'})"
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
    """``CAST(e AS DOUBLE)``, and ``'inf'::DOUBLE`` / ``'-inf'`` / ``'nan'`` constants."""
    target = node.to.this.name if hasattr(node.to.this, "name") else str(node.to.this)
    if target not in FLOAT_TYPES:
        raise SpecError(f"join expression {text!r}: only casts to DOUBLE/FLOAT are supported")
    inner = node.this
    if isinstance(inner, exp.Literal) and inner.is_string:
        try:
            return f"float({float(inner.this)!r})".replace("float(inf)", "math.inf").replace(
                "float(-inf)", "(-math.inf)").replace("float(nan)", "math.nan")
        except ValueError:
            raise SpecError(f"join expression {text!r}: {inner.sql()} is not a number") from None
    return f"float({go(inner)})"


@lru_cache(maxsize=256)
def join_code(text: str, n_operands: int) -> str:
    """Numba source for the join expression ``text`` over ``n_operands`` scalars."""
    return _translate(parse_join(text), n_operands, text)
