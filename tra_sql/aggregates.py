"""The aggregations of an extended einsum (``agg=``), one definition each.

Everything a layer needs to know about an aggregation is in its ``Aggregate``: the graph
checks names against ``AGGREGATES``, asks ``contracts`` whether opt_einsum's pairwise path
applies and ``floating`` whether the result is floating point; the kernels start from
``identity``, fold joined values with ``loop_update`` (generated loops) and fold tiles with
``ufunc`` (NumPy, also on Spark); staged plans combine partial results with the join
``combine``; the absent-tile rule asks ``absorbs_zeros``; autodiff runs ``gradient``. Adding
an aggregation is adding an entry here (and its test). The gradient rules import sqlglot when
they run, so the kernels (a Spark Python worker's) import no sqlglot through this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from sqlglot import exp

Node = Any  # a ``tra_sql.graph.Node`` (the graph imports this module)
Part = Callable[[int, "exp.Expression"], "Node | None"]


class Backward(Protocol):
    """What autodiff hands an aggregation's gradient rule for one aggregating einsum ``node``,
    ``out = agg over the other indices of join(x0, ..., x(n-1))``, whose output has gradient ``g``."""

    node: Node
    g: Node
    join: exp.Expression  # the join as an expression (the product for the default join)

    def operands(self, part: Part) -> Iterator[tuple[Node, Node]]:
        """``(x_i, part(i, D))`` for each operand ``x_i`` that needs a gradient and whose
        derivative ``D = d join / d x_i`` is not 0 (a ``None`` part is left out)."""

    def reduce(self, i: int, lead: list[Node], expr: exp.Expression) -> Node | None:
        """The gradient of operand ``i``: ``expr`` summed over the indices not in it, where
        ``expr`` reads the ``lead`` nodes (subscripted like the output) as ``x0..`` followed
        by the forward operands (``x<len(lead)+k>``); None where ``expr`` is 0."""

    def helper(self, what: str, join: str, agg: str, with_output: bool = False) -> Node:
        """The auxiliary reduction ``agg`` over ``join`` of the operands (the output after them
        with ``with_output``) into the output's indices, built once per ``node`` and ``what``."""

    def einsum(self, spec: str, operands: list[Node], join: str | None) -> Node:
        """A summing einsum over ``operands`` as one step (for rules that rewrite ``node``:
        ``through`` differentiates it into its operands)."""

    def through(self, einsum: Node, gradient: Node) -> Iterable[tuple[Node, Node]]:
        """The gradients of an einsum that computes ``node``'s values elementwise, given its
        gradient ``gradient`` (whose tiles lie within its own)."""


Gradient = Callable[[Backward], Iterable[tuple[Node, Node]]]


@dataclass(frozen=True)
class Aggregate:
    """One aggregation over joined values.

    ``loop_update``: statements (``; ``-separated) that fold the scalar ``v`` into the
    accumulator ``acc`` in a generated Numba loop; with ``compensated``, ``err`` carries the
    rounding error of each step (``acc + err`` is the result). ``combine``: a SQL join
    expression over two partial results ``x0, x1`` (tiles of the same keys). ``gradient``:
    the (operand, gradient) pairs of an einsum that aggregates with it (see ``Backward``).
    ``contracts``: aggregating a product is a contraction (a sum of products), so a product of
    several operands may be aggregated pairwise and a BLAS kernel computes two. ``floating``:
    the result is floating point (float64 over integer operands), as a join's is."""

    name: str
    ufunc: np.ufunc
    loop_update: str
    combine: str
    gradient: Gradient
    compensated: bool = False
    absorbs_zeros: bool = False  # an absent (zero) tile under a product changes nothing
    contracts: bool = False
    floating: bool = False

    def identity(self, dtype: np.dtype):
        """The value this aggregation starts from for elements of ``dtype``."""
        return self.ufunc.reduce(np.empty(0, dtype=dtype)) if self.ufunc.identity is not None \
            else _extreme(self.name, np.dtype(dtype))


def _extreme(name: str, dtype: np.dtype):
    """max/min start from the other end of the dtype's range."""
    if np.issubdtype(dtype, np.floating):
        return -np.inf if name == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if name == "max" else info.max


def _sum_gradient(b: Backward) -> Iterable[tuple[Node, Node]]:
    """``d x_i = Σ_{indices not in x_i} dOut[o] · ∂join/∂x_i``."""
    from sqlglot import exp

    from tra_sql.expressions import mul, shift

    n = len(b.node.operands)
    return b.operands(lambda i, D: b.reduce(i, [b.g], mul(exp.column("x0"), shift(D, n, 1))))


def _extremum_gradient(b: Backward) -> Iterable[tuple[Node, Node]]:
    """The gradient goes to the elements equal to the result, split evenly among ties (as
    ``torch.amax``): ``dOut · [join = out] / count(join = out) · ∂join/∂x_i``."""
    from sqlglot import exp

    from tra_sql.expressions import div, mul, num, shift, to_sql

    node, J = b.node, b.join
    if node.dtype == np.float32 and not isinstance(J, exp.Column):
        return _via_elementwise(b)
    n = len(node.operands)

    def part(i: int, D: exp.Expression) -> Node | None:
        count = b.helper("ties", f"CASE WHEN {to_sql(J)} = x{n} THEN 1 ELSE 0 END", "sum", with_output=True)
        equal = exp.EQ(this=exp.Paren(this=shift(J, n, 3)), expression=exp.column("x1"))
        share = mul(div(exp.column("x0"), exp.column("x2")), shift(D, n, 3))
        expr = exp.Case(ifs=[exp.If(this=equal, true=share)], default=num(0))
        return b.reduce(i, [b.g, node, count], expr)

    return b.operands(part)


def _via_elementwise(b: Backward) -> Iterable[tuple[Node, Node]]:
    """max/min of a float32 computed join: materialize ``E = join`` over all indices (so the
    comparison with the output is exact), route the gradient to ``E``'s extremal elements,
    then differentiate the elementwise einsum."""
    node = b.node
    subs, o = node.spec.inputs, node.spec.output
    every = "".join(dict.fromkeys("".join(subs)))
    E = b.einsum(",".join(subs) + "->" + every, list(node.operands), node.join)
    count = b.einsum(f"{every},{o}->{o}", [E, node], "CASE WHEN x0 = x1 THEN 1 ELSE 0 END")
    dE = b.einsum(f"{o},{o},{o},{every}->{every}", [b.g, node, count, E], "CASE WHEN x3 = x1 THEN x0 / x2 ELSE 0 END")
    return b.through(E, dE)


def _prod_gradient(b: Backward) -> Iterable[tuple[Node, Node]]:
    """``dOut · out / join · ∂join/∂x_i``, computed as PyTorch does without dividing by zero:
    with one zero factor in a group only that element gets the product of the others."""
    from sqlglot import exp

    from tra_sql.expressions import div, mul, num, shift, to_sql

    n, text = len(b.node.operands), to_sql(b.join)

    def part(i: int, D: exp.Expression) -> Node | None:
        nonzero = b.helper("nonzero", f"CASE WHEN {text} = 0 THEN 1 ELSE {text} END", "prod")
        zeros = b.helper("zeros", f"CASE WHEN {text} = 0 THEN 1 ELSE 0 END", "sum")
        Jp, Dp = exp.Paren(this=shift(b.join, n, 3)), shift(D, n, 3)
        scaled = mul(mul(exp.column("x0"), exp.column("x1")), Dp)
        expr = exp.Case(ifs=[
            exp.If(this=exp.EQ(this=exp.column("x2"), expression=num(0)), true=div(scaled, Jp)),
            exp.If(this=exp.And(this=exp.EQ(this=exp.column("x2"), expression=num(1)),
                                expression=exp.EQ(this=Jp.copy(), expression=num(0))), true=scaled),
        ], default=num(0))
        return b.reduce(i, [b.g, nonzero, zeros], expr)

    return b.operands(part)


def _logsumexp_gradient(b: Backward) -> Iterable[tuple[Node, Node]]:
    """``dOut · exp(join - out) · ∂join/∂x_i``: each joined value's softmax weight in its group."""
    from sqlglot import exp

    from tra_sql.expressions import mul, shift

    n = len(b.node.operands)
    weight = exp.Exp(this=exp.Sub(this=exp.Paren(this=shift(b.join, n, 2)), expression=exp.column("x1")))
    return b.operands(lambda i, D: b.reduce(i, [b.g, b.node], mul(mul(exp.column("x0"), weight), shift(D, n, 2))))


AGGREGATES: dict[str, Aggregate] = {agg.name: agg for agg in (
    # a compensated sum (Neumaier's, branch-free): ``err`` keeps what each addition rounded
    # off, so a long sum keeps ~1e-16 relative error whatever the tiling (exact on integers)
    Aggregate("sum", np.add, "t = acc + v; w = t - acc; err = err + ((acc - (t - w)) + (v - w)); acc = t",
              "x0 + x1", _sum_gradient, compensated=True, absorbs_zeros=True, contracts=True),
    # NaN wins, as in NumPy's max and min (``acc != acc`` only for NaN)
    Aggregate("max", np.maximum, "acc = acc if acc != acc or acc >= v else v", "greatest(x0, x1)",
              _extremum_gradient),
    Aggregate("min", np.minimum, "acc = acc if acc != acc or acc <= v else v", "least(x0, x1)",
              _extremum_gradient),
    Aggregate("prod", np.multiply, "acc = acc * v", "x0 * x1", _prod_gradient),
    # log(Σ exp(v)) without overflow; two partial results combine the same way (equal ones,
    # -inf included, give x + ln 2)
    Aggregate("logsumexp", np.logaddexp, "acc = np.logaddexp(acc, v)",
              "CASE WHEN x0 = x1 THEN x0 + ln(2) "
              "ELSE greatest(x0, x1) + ln(1 + exp(least(x0, x1) - greatest(x0, x1))) END",
              _logsumexp_gradient, floating=True),
)}
