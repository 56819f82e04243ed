"""Reverse-mode differentiation of the lazy DAG, one rule per node kind in ``GRADIENT``
(docs/training.md).

The gradient of a node is built from the same node kinds, so it compiles to SQL like any
program (``db.grad(loss, [W])[0].sql()`` shows it):

- ``Einsum``: an aggregating einsum runs its aggregation's ``gradient`` rule
  (``tra_sql.aggregates``), handed a ``Backward`` (``_vjp`` and cached helper reductions); an
  element-wise one (no aggregated index) ``d x_i = dOut[o] · ∂⊗/∂x_i(...)``. The sum's rule,
  ``d x_i = Σ_{indices not in x_i} dOut[o] · ∂⊗/∂x_i(...)``, is an
  einsum whose join is ``x0 * <symbolic derivative>`` (``tra_sql.derivative``). With the
  default product join the derivative is the product of the other operands, so the gradient
  is again a plain contraction (BLAS). Operands the derivative does not use are dropped when
  their relation is dense (an index seen only there scales by its size); CSR ones stay as
  join filters under a non-product join (only their entries take part; a dense operand that
  lacks tiles was completed with zeros, see ``tra_sql.absent``), and a sparse ``x_i`` filters
  its own gradient, so a gradient with respect to a sparse relation exists at its keys only.
  ``max``/``min`` route to the elements equal to the result, ``prod`` divides the product.
- ``Place`` (re-tile, slice, concatenation, reshape, keyed sum): the transposed placement.
- Fan-out: a node used several times gets the keyed sum (``graph.add``) of its gradients.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from sqlglot import exp

from tra_sql import graph
from tra_sql.absent import Completeness
from tra_sql.aggregates import AGGREGATES
from tra_sql.derivative import diff, through_output
from tra_sql.errors import DTypeError, ShapeError
from tra_sql.expressions import is_zero, mul, num, parse_join, product, rename, shift, to_sql, variables
from tra_sql.graph import Einsum, Fill, Node, Place, Source, topological
from tra_sql.kinds import Rules

GRADIENT: Rules = Rules("gradient")
"""Each node kind's rule: ``rule(node, g, needs, ctx)`` yields ``(input, contribution)``
pairs (a kind without a rule passes no gradient on)."""


@dataclass
class Context:
    """What the rules need from outside the graph: whether a relation has every tile
    (``source_dense``) and identity matrices for indices repeated inside one operand (``eye``)."""

    source_dense: Callable[[Source], bool]
    eye: Callable[[int, np.dtype], Node]
    complete: Completeness = field(init=False)
    cache: dict[tuple, Node] = field(default_factory=dict)
    #: (primal, gradient) id pairs where the gradient's tiles lie within the primal's tiles
    tight: set[tuple[int, int]] = field(default_factory=set)

    def dense(self, node: Node) -> bool:
        """Whether every element of ``node`` is held: a dense tile at every key (absent tiles,
        and the elements a CSR tile leaves out, are zeros)."""
        return node.layout == "dense" and self.complete(node)

    def __post_init__(self):
        self.complete = Completeness(self.source_dense)  # a tile at every key of a node?


def gradients(loss: Node, wrt: Sequence[Node], ctx: Context, seed: Node | None = None) -> list[Node]:
    """Nodes computing ``d loss / d w`` for each ``w`` in ``wrt`` (``seed`` is ``d loss``;
    by default 1 for a scalar loss)."""
    if seed is None:
        if loss.shape != ():
            raise ShapeError(f"grad needs a scalar loss, got shape {loss.shape}; pass seed= for "
                             f"a vector-Jacobian product")
        seed = Fill((), loss.dtype, (), 1.0)
    elif seed.shape != loss.shape:
        raise ShapeError(f"seed has shape {seed.shape} but the loss has shape {loss.shape}")
    for w in wrt:
        if not np.issubdtype(w.dtype, np.floating):
            raise DTypeError(f"cannot differentiate with respect to {w.label!r} of dtype {w.dtype}")
    order = topological(loss)
    targets = {id(w) for w in wrt}
    needs: set[int] = set()
    for node in order:
        if id(node) in targets or (np.issubdtype(node.dtype, np.floating) and not getattr(node, "constant", False)
                                   and any(id(c) in needs for c in node.inputs)):
            needs.add(id(node))
    adjoint: dict[int, list[Node]] = {id(loss): [seed]}
    if ctx.complete(loss):  # the seed's tiles lie within the loss's (not where the loss has none)
        ctx.tight.add((id(loss), id(seed)))
    found: dict[int, Node] = {}
    for node in reversed(order):
        parts = adjoint.pop(id(node), None)
        if not parts or id(node) not in needs:
            continue
        g = parts[0] if len(parts) == 1 else _sum(parts, ctx)
        if all((id(node), id(p)) in ctx.tight for p in parts):
            ctx.tight.add((id(node), id(g)))
        if id(node) in targets:
            found[id(node)] = g
        rule = GRADIENT.get(node)
        if rule is None:
            continue
        for child, contribution in rule(node, g, needs, ctx):
            adjoint.setdefault(id(child), []).append(contribution)
    out = []
    for w in wrt:
        g = found.get(id(w))
        if g is None:
            out.append(Fill(w.shape, w.dtype, w.tile, 0.0))
            continue
        if not ctx.dense(w) and (id(w), id(g)) not in ctx.tight:  # a sparse relation: at its keys only
            idx = _letters(len(w.shape))
            g = graph.einsum(f"{idx},{idx}->{idx}", [g, w], ["gradient", w.label], join="x0")
        out.append(_as_dtype(graph.retile(g, w.tile), w.dtype))
    return out


def _as_dtype(g: Node, dtype: np.dtype) -> Node:
    """``g`` in ``dtype`` (a gradient has its parameter's dtype, as in PyTorch): the kernel
    writes its result in the node's dtype."""
    if g.dtype == dtype:
        return g
    idx = _letters(len(g.shape))
    return dataclasses.replace(graph.einsum(f"{idx}->{idx}", [g], ["gradient"], join="x0"), dtype=dtype)


def _sum(parts: list[Node], ctx: Context) -> Node:
    """The fan-out sum of gradient contributions: an element-wise einsum where each has a dense
    tile at every key in one tiling (so it can fuse into the step computing one of them), else
    a keyed sum (absent tiles are zeros)."""
    first = parts[0]
    if all(p.tile == first.tile and ctx.dense(p) for p in parts):
        idx = _letters(len(first.shape))
        join = " + ".join(f"x{m}" for m in range(len(parts)))
        return graph.einsum(",".join([idx] * len(parts)) + "->" + idx, parts, ["gradient"] * len(parts), join)
    return graph.add(parts)


def _letters(n: int) -> str:
    return string.ascii_letters[:n]


# -- einsum -------------------------------------------------------------------------------
def _vjp(node: Einsum, i: int, lead: list[Node], expr: exp.Expression, ctx: Context,
         within_output: bool = False) -> Node | None:
    """``Σ over the indices not in operand i`` of ``expr``, an expression over the ``lead``
    nodes (``x0..``, subscripted like the output, the first being its gradient) followed by
    the forward operands (``x<len(lead)+k>``). ``within_output``: a lead node is the forward
    output of an element-wise ``node``, whose tiles lie where every operand has one."""
    if is_zero(expr):
        return None
    subs, target, o = node.spec.inputs, node.spec.inputs[i], node.spec.output
    candidates = [(o, x) for x in lead] + list(zip(subs, node.operands))
    used = variables(expr)
    # Sparse operands stay as join filters: under a non-product join only a CSR operand's entries
    # take part (a dense one that lacks tiles was completed, see tra_sql.absent), and the
    # gradient of a sparse operand itself exists at its keys only (no dense outer products). A
    # filter is redundant where the output's gradient lies within the output's tiles (the
    # forward join already kept only keys where every operand has a tile) and covers its indices.
    g_tight = (id(node), id(lead[0])) in ctx.tight
    filters = [not within_output and m >= len(lead) and (node.join is not None or m == len(lead) + i)
               and not ctx.dense(op)
               and not (g_tight and set(sub) <= set(o)) for m, (sub, op) in enumerate(candidates)]
    keep = [f"x{m}" in used or f for m, f in enumerate(filters)]
    letters = set("".join(sub for (sub, _), k in zip(candidates, keep) if k))
    if not set(target) <= letters:
        keep[len(lead) + i] = True
        letters |= set(target)
    factor = 1
    for c in {c for (sub, _), k in zip(candidates, keep) if not k for c in sub} - letters:
        factor *= node.sizes[c]
    chosen = [(sub, op) for (sub, op), k in zip(candidates, keep) if k]
    mapping = {f"x{m}": f"x{j}" for j, m in enumerate(m for m, k in enumerate(keep) if k)}
    expr = mul(rename(expr, mapping), num(factor))
    out, fresh = "", iter(c for c in string.ascii_letters if c not in "".join(subs) + node.spec.output)
    for c in target:  # an index repeated inside the operand: its gradient lives on the diagonal
        if c in out:
            other = next(fresh)
            chosen.append((c + other, ctx.eye(node.sizes[c], node.dtype)))
            expr = mul(expr, exp.column(f"x{len(chosen) - 1}"))
            c = other
        out += c
    x_i = node.operands[i]
    tight = within_output or keep[len(lead) + i] or (g_tight and set(target) <= set(o)) or ctx.dense(x_i)
    if len(chosen) == 1 and chosen[0][0] == out and expr == exp.column("x0"):
        result = chosen[0][1]
    else:
        join = None if _is_product(expr, len(chosen)) else to_sql(expr)
        spec = ",".join(sub for sub, _ in chosen) + "->" + out
        result = graph.einsum(spec, [op for _, op in chosen], [f"d{node.label}"] * len(chosen), join, "sum")
    if tight:
        ctx.tight.add((id(x_i), id(result)))
    return result


def _is_product(expr: exp.Expression, n: int) -> bool:
    """Whether ``expr`` is ``x0 * ... * x(n-1)`` in some order, each once."""
    factors: list[exp.Expression] = []
    stack = [expr]
    while stack:
        e = stack.pop()
        e = e.this if isinstance(e, exp.Paren) else e
        if isinstance(e, exp.Mul):
            stack += [e.this, e.expression]
        else:
            factors.append(e)
    names = [f.name for f in factors if isinstance(f, exp.Column)]
    return len(names) == len(factors) == n and set(names) == {f"x{m}" for m in range(n)}


def _helper(ctx: Context, node: Einsum, what: str, join: str, agg: str, with_output: bool) -> Node:
    """An auxiliary reduction over ``node``'s operands (and its output), cached."""
    key = (id(node), what)
    if key not in ctx.cache:
        subs = list(node.spec.inputs) + ([node.spec.output] if with_output else [])
        ops = list(node.operands) + ([node] if with_output else [])
        ctx.cache[key] = graph.einsum(",".join(subs) + "->" + node.spec.output, ops, [node.label] * len(ops),
                                      join, agg)
    return ctx.cache[key]


@dataclass
class _Backward:
    """The ``aggregates.Backward`` autodiff hands an aggregation's gradient rule."""

    node: Einsum
    g: Node
    join: exp.Expression
    needs: set[int]
    ctx: Context

    def operands(self, part):
        node, o = self.node, self.node.spec.output
        for i in sorted(range(len(node.operands)), key=lambda m: node.spec.inputs[m] != o):
            op = node.operands[i]
            if id(op) not in self.needs:
                continue
            D = diff(self.join, f"x{i}", node.join)
            if is_zero(D):
                continue
            result = part(i, D)
            if result is not None:
                yield op, result

    def reduce(self, i: int, lead: list[Node], expr: exp.Expression, within_output: bool = False) -> Node | None:
        return _vjp(self.node, i, lead, expr, self.ctx, within_output)

    def helper(self, what: str, join: str, agg: str, with_output: bool = False) -> Node:
        return _helper(self.ctx, self.node, what, join, agg, with_output)

    def einsum(self, spec: str, operands: list[Node], join: str | None) -> Node:
        return graph.einsum(spec, operands, [self.node.label] * len(operands), join, pairwise=False)

    def through(self, einsum: Node, gradient: Node):
        self.ctx.tight.add((id(einsum), id(gradient)))
        return GRADIENT(einsum)(einsum, gradient, self.needs, self.ctx)


@GRADIENT.register(Einsum)
def _einsum_rule(node: Einsum, g: Node, needs: set[int], ctx: Context):
    J = parse_join(node.join) if node.join else product(len(node.operands))
    backward = _Backward(node, g, J, needs, ctx)
    if node.spec.aggregated:
        return AGGREGATES[node.agg].gradient(backward)
    return _elementwise_rule(backward)


def _elementwise_rule(b: _Backward):
    """An einsum without aggregated indices: ``d x_i = dOut · ∂join/∂x_i`` (summed over the
    indices a broadcast ``x_i`` lacks). Operands with the same derivative (``x0 + x1`` in a
    bias add) share ``g·D`` at the output's shape: the broadcast ones sum it, rather than
    recompute it from ``g``; a derivative that can be written over the output reads it."""
    node, g, o, n = b.node, b.g, b.node.spec.output, len(b.node.operands)
    at_output: dict[str, Node] = {}

    def part(i: int, D: exp.Expression) -> Node | None:
        op, sub = node.operands[i], node.spec.inputs[i]
        shared = at_output.get(to_sql(D)) if len(set(sub)) == len(sub) and b.ctx.dense(op) else None
        if shared is not None:
            return graph.einsum(f"{o}->{sub}", [shared], [f"d{node.label}"])
        over_y = _over_output(node, b.join, D)
        if over_y is not None:  # g·D(y): the backward reads the output, not the inputs
            result = b.reduce(i, [g, node], mul(exp.column("x0"), over_y), within_output=True)
        else:
            result = b.reduce(i, [g], mul(exp.column("x0"), shift(D, n, 1)))
        if sub == o and result is not None:
            at_output[to_sql(D)] = result
        return result

    return b.operands(part)


def _over_output(node: Einsum, J: exp.Expression, D: exp.Expression) -> exp.Expression | None:
    """``D`` over the output ``y = J`` (as ``x1``, after the gradient ``x0``) for an
    element-wise einsum of dense tiles whose derivative can be written so (ReLU, tanh,
    sigmoid, exp)."""
    if any(n.layout != "dense" for n in (node, *node.operands)) or not variables(D):
        return None
    over_y = through_output(J, D, "_y")
    return None if over_y is None else rename(over_y, {"_y": "x1"})


# -- structural ops -------------------------------------------------------------------------
@GRADIENT.register(Place)
def _place_rule(node: Place, g: Node, needs: set[int], ctx: Context):
    for m, src in enumerate(node.sources):
        if id(src) not in needs:
            continue
        if node.flat:
            part = graph.retile(graph.reshape(g, src.shape), src.tile)
        elif node.add:
            part = graph.retile(g, src.tile)
        elif src.shape == node.shape and not any(node.offsets[m]):
            part = graph.retile(g, src.tile)
        else:
            part = Place(src.shape, g.dtype, src.tile, (g,), (tuple(-o for o in node.offsets[m]),))
        yield src, part


def stop_gradient(node: Node) -> Node:
    """A copy of ``node`` (same SQL, computed once) that gradients do not flow through, like
    ``torch.Tensor.detach``: e.g. the max subtracted inside a log-sum-exp for stability."""
    copy = dataclasses.replace(node)
    copy.constant = True
    return copy

