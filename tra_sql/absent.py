"""Absent tiles: the rule that every path (planned or not, fused or not, DuckDB or Spark)
applies the same way.

A tensor relation of dense tiles may lack some tiles (a deleted row, an empty block of a
relation, a sum of products over such tiles). **An absent tile is a tile of zeros, under every
join and every aggregation**, which is what NumPy computes on the dense array, and the only
rule whose answers do not depend on the tiling (a re-tiling or a plan turns part of an absent
tile into zeros inside a present one).

Joining only the present tiles (an inner join) gives exactly that when an absent tile can
contribute nothing: with ``agg="sum"`` and a join that is zero where that operand is zero (the
product, or any product with the operand as a factor). Every other operand that may lack
tiles is completed first: a keyed sum with zeros (``graph.add``), so its absent tiles become
zero tiles in SQL. Complete operands (stored with every tile, constants, ops over complete
operands) are left as they are and cost nothing.

CSR operands keep their own rule: elements that are not entries take no part in an einsum
(see ``tra_sql.udfs.sparse``); a CSR relation cannot be re-tiled, so no path changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

from sqlglot import exp

from tra_sql import graph
from tra_sql.aggregates import AGGREGATES
from tra_sql.expressions import parse_join
from tra_sql.graph import Einsum, Fill, Node, Place, Source
from tra_sql.kinds import Rules


def absorbs(join: str | None, agg: str, m: int) -> bool:
    """Whether absent tiles of operand ``m`` contribute nothing: ``agg`` absorbs zeros (a sum)
    and ``join`` is zero wherever ``x<m>`` is (the default product, or a product with ``x<m>``
    a factor)."""
    if not AGGREGATES[agg].absorbs_zeros:
        return False
    return join is None or _factor(parse_join(join), f"x{m}")


def ignored_operands(node: Einsum) -> tuple[int, ...]:
    """The operands ``node``'s join ignores: they only select tiles (a gradient kept at a
    relation's keys), so their tiles' keys are part of the answer."""
    if node.join is None:
        return ()
    used = {c.name for c in parse_join(node.join).find_all(exp.Column) if not c.table}
    return tuple(m for m in range(len(node.operands)) if f"x{m}" not in used)


def _factor(expr: exp.Expression, name: str) -> bool:
    """Whether ``expr`` is ``name`` times something (parentheses and negation aside)."""
    if isinstance(expr, (exp.Paren, exp.Neg)):
        return _factor(expr.this, name)
    if isinstance(expr, exp.Mul):
        return _factor(expr.this, name) or _factor(expr.expression, name)
    return isinstance(expr, exp.Column) and not expr.table and expr.name == name


COMPLETE: Rules = Rules("completeness")
"""``rule(node, complete)``: whether ``node`` has a tile at every key of its grid, given
``complete`` for its inputs (a kind without a rule may lack tiles)."""


class Completeness:
    """Which nodes have a tile at every key of their grid (whatever their layout);
    ``source_complete`` answers for stored relations (it counts their rows)."""

    def __init__(self, source_complete: Callable[[Source], bool]):
        self.source_complete = source_complete
        self.memo: dict[int, bool] = {}

    def __call__(self, node: Node) -> bool:
        if id(node) not in self.memo:
            rule = COMPLETE.get(node)
            self.memo[id(node)] = rule is not None and rule(node, self)
        return self.memo[id(node)]


@COMPLETE.register(Fill)
def _fill_complete(node: Fill, complete: Completeness) -> bool:
    return True


@COMPLETE.register(Source)
def _source_complete(node: Source, complete: Completeness) -> bool:
    return complete.source_complete(node)


@COMPLETE.register(Einsum)
def _einsum_complete(node: Einsum, complete: Completeness) -> bool:
    """An inner join of complete operands has every output key."""
    return all(complete(op) for op in node.operands)


@COMPLETE.register(Place)
def _place_complete(node: Place, complete: Completeness) -> bool:
    if node.flat:
        return complete(node.sources[0])
    volumes = [covered(node, m) for m in range(len(node.sources))]
    total = prod(node.shape)
    if node.add:
        return any(v == total and complete(s) for v, s in zip(volumes, node.sources))
    return all(complete(s) for s in node.sources) and sum(volumes) >= total


def covered(node: Place, m: int) -> int:
    """Elements of ``node``'s output that source ``m`` covers."""
    src, off = node.sources[m], node.offsets[m]
    return prod(max(0, min(n, o + s) - max(0, o)) for n, o, s in zip(node.shape, off, src.shape))


def with_zeros(node: Node) -> Node:
    """``node`` with its absent tiles present as zero tiles (a keyed sum with zeros)."""
    return graph.add([node, Fill(node.shape, node.dtype, node.tile, 0)])


def complete_operands(node: Node, complete: Callable[[Node], bool]) -> Node:
    """``node`` (an einsum) reading its dense operands completed with zeros wherever their
    absent tiles would otherwise change the answer (see the module's rule)."""
    if not isinstance(node, Einsum):
        return node
    operands = [op if op.layout != "dense" or absorbs(node.join, node.agg, m) or complete(op) else with_zeros(op)
                for m, op in enumerate(node.operands)]
    return graph.with_inputs(node, operands)
