"""Symbolic derivatives of join expressions (SQL scalar expressions over ``x0..xn``).

``diff(expr, "x1")`` returns a sqlglot expression for the partial derivative, simplified as it
is built (``tra_sql.expressions``); each function's rule is its entry in
``tra_sql.functions``. Conventions follow PyTorch:

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

from sqlglot import exp

from tra_sql.errors import SpecError
from tra_sql.expressions import bare, gt, num, to_sql, variables
from tra_sql.functions import rule_of


class NotDifferentiableError(SpecError):
    """A join expression that uses a function or operator without a derivative rule."""


def through_output(join: exp.Expression, derivative: exp.Expression, y: str) -> exp.Expression | None:
    """``derivative`` (of ``join``) over ``join``'s value alone, the variable ``y``, if it can
    be written so; else None. Occurrences of ``join`` become ``y`` (``1 - tanh(a)^2`` becomes
    ``1 - y*y``), and the condition ``a > c`` of a ``greatest(a, c)`` or ``relu(a)`` (``c > a``
    of ``least(a, c)``), with ``c`` a constant, becomes ``y > c`` (``c > y``). A backward pass
    that needs only the output spares keeping the input, as PyTorch's ReLU does."""
    core = bare(join)
    args = [core.this, *core.expressions] if isinstance(core, (exp.Greatest, exp.Least)) else []
    if isinstance(core, exp.Anonymous) and core.name.lower() == "relu" and len(core.expressions) == 1:
        core_args, kind = [core.expressions[0], num(0)], exp.Greatest
    elif len(args) == 2 and not variables(args[1]):
        core_args, kind = args, type(core)
    else:
        core_args, kind = None, None
    out = exp.column(y)

    def swap(node: exp.Expression) -> exp.Expression:
        if bare(node) == core:
            return out.copy()
        if core_args and isinstance(node, exp.GT):
            first, const = core_args
            left, right = bare(node.this), bare(node.expression)
            if kind is exp.Greatest and left == bare(first) and right == bare(const):
                return gt(out, const)
            if kind is exp.Least and left == bare(const) and right == bare(first):
                return gt(const, out)
        return node

    result = derivative.copy().transform(swap)
    return result if not variables(result) else None


# -- differentiation ------------------------------------------------------------------------
def diff(expr: exp.Expression, var: str, text: str | None = None) -> exp.Expression:
    """The partial derivative of ``expr`` with respect to variable ``var`` (e.g. ``"x0"``);
    ``text`` (the expression as the user wrote it) is for error messages."""
    return _Diff(var, text or to_sql(expr))(expr)


class _Diff:
    """Differentiates with respect to ``var``, each construct by its ``tra_sql.functions`` rule."""

    def __init__(self, var: str, text: str):
        self.var, self.text = var, text

    def fail(self, what: str) -> NotDifferentiableError:
        return NotDifferentiableError(
            f"join expression {self.text!r}: no derivative rule for {what}; write it with "
            f"differentiable functions (+ - * / pow exp ln log sqrt abs tanh sin cos sigmoid relu erf "
            f"greatest least CASE) or keep this operand out of the gradient")

    def __call__(self, e: exp.Expression) -> exp.Expression:
        if isinstance(e, exp.Column):
            return num(1 if e.name == self.var and not e.table else 0)
        if self.var not in variables(e):
            return num(0)
        function = rule_of(e)
        if isinstance(e, exp.Anonymous):
            name = e.name.lower()
            if function is None or len(e.expressions) != function.arity:
                if function is None and len(e.expressions) == 1:
                    self(e.expressions[0])  # an error inside the argument is reported first
                raise self.fail(f"{name}()")
        elif function is None:
            raise self.fail(f"{e.sql(dialect='duckdb')!r} ({type(e).__name__})")
        return function.derivative(e, self)
