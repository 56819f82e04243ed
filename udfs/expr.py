"""Join expressions: SQL scalar expressions over ``x0..xn``, translated to Numba code.

The expression is parsed by sqlglot (DuckDB dialect) and rewritten node by node, each
function by its template in ``tra_sql.functions``, into a Python expression that Numba
compiles inside a loop kernel. It evaluates as DuckDB evaluates
it: ``log(x)`` is base 10, ``log(b, x)`` is base ``b``, ``ln`` is natural, ``round`` rounds
half away from zero, ``%`` and ``//`` truncate like C, ``/`` divides in floating point
(``x / 0`` is ``inf``), NaN compares above every number and equal to itself (so
``greatest(x, nan)`` is NaN and ``least(x, nan)`` is ``x``), any non-zero number is true.
Where DuckDB has no value to give, IEEE arithmetic does: ``x % 0`` and ``x // 0`` (errors in
DuckDB) and ``CASE`` without ``ELSE`` (NULL in DuckDB; a tile holds no NULLs) give NaN, inf
and 0. Each operand of a node is evaluated once (compound ones are bound by a ``lambda``).
Where a faster formula gives DuckDB's value within a few ulp of float64 it may replace libm's
call (below float32's resolution, within float64 tests' tolerances), so that a loop over the
expression vectorizes: ``exp`` is ``vector_exp.exp64`` (within 3 ulp, of a DOUBLE as in DuckDB),
``tanh`` is computed from it (``functions.TANH``, within 4 ulp; a GELU's loop 4x faster).
"""

from __future__ import annotations

import re
from functools import lru_cache

from sqlglot import exp

from tra_sql.errors import SpecError
from tra_sql.expressions import parse_join
from tra_sql.functions import ANONYMOUS, FUNCTION_NAMES, FUNCTIONS

OPERAND = re.compile(r"x(0|[1-9][0-9]*)")
INT64 = 2**63


def _operand(node: exp.Column, n: int, text: str) -> str:
    match = OPERAND.fullmatch(node.name) if not node.table else None
    if match is None:
        raise SpecError(f"join expression {text!r}: unknown name {node.sql()!r}; "
                        f"operands are x0..x{n - 1}")
    if int(match.group(1)) >= n:
        raise SpecError(f"join expression {text!r} refers to {node.name} but the einsum has "
                        f"{n} operand(s): x0..x{n - 1}")
    return node.name


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
    if kind in FUNCTIONS:
        return FUNCTIONS[kind].numba(node, go, text)
    if kind is exp.Anonymous:
        name = node.name.lower()
        if name not in ANONYMOUS:
            raise SpecError(f"join expression {text!r}: unknown function {node.name}(); "
                            f"known: {', '.join(FUNCTION_NAMES)}")
        function = ANONYMOUS[name]
        if len(node.expressions) != function.arity:
            raise SpecError(f"join expression {text!r}: {name}() takes {function.arity} argument(s), "
                            f"got {len(node.expressions)}")
        return function.numba(node, go, text)
    if isinstance(node, exp.Func):
        raise SpecError(f"join expression {text!r}: function {node.sql_name()}() is not "
                        f"supported; known: {', '.join(FUNCTION_NAMES)}")
    raise SpecError(f"join expression {text!r}: {node.sql()!r} is not supported")


@lru_cache(maxsize=256)
def join_code(text: str, n_operands: int) -> str:
    """Numba source for the join expression ``text`` over ``n_operands`` scalars."""
    tree = parse_join(text)
    try:
        return _translate(tree, n_operands, text)
    except RecursionError:
        raise SpecError(f"join expression {text!r} is nested too deeply") from None
