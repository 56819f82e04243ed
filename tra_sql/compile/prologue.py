"""The prologue fusion: an element-wise einsum computes the row statistics only it reads
(reductions over whole tiles of its other operands, such as layer norm's mean and variance
or softmax's row max and sum) inside its own kernel call: a ``Prologue`` step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlglot import exp

from tra_sql.compile.einsum import einsum_select
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.compile.passes import Fused, plain, replaced
from tra_sql.graph import Einsum, Node


@dataclass(eq=False)
class Prologue(Fused):
    """``result`` computing its operands at ``positions`` (the absorbed statistics, in the
    order to compute them) from its other operands."""

    positions: tuple[int, ...]

    @property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(op for op in self.result.inputs if op not in self.absorbed)


def _statistic(op: Node, position: dict[int, int]) -> bool:
    """Whether ``op`` is a reduction over whole tiles of dense operands at ``position``."""
    return (isinstance(op, Einsum) and op.layout == "dense" and bool(op.spec.aggregated)
            and all(op.tiles[c] == op.sizes[c] for c in op.spec.aggregated)
            and all(id(src) in position and src.layout == "dense" for src in op.operands))


def _aligned(node: Einsum, stat: Einsum, position: dict[int, int]) -> bool:
    """Whether ``node`` joins ``stat`` on the indices ``stat`` keeps of its sources, so each
    joined row's source tiles are exactly the ones ``stat``'s tile is computed from."""
    letter: dict[str, str] = {}
    for sub, src in zip(stat.spec.inputs, stat.operands):
        for c, outer in zip(sub, node.spec.inputs[position[id(src)]]):
            if letter.setdefault(c, outer) != outer:
                return False
    return all(letter.get(c) == outer for c, outer in zip(stat.spec.output, node.spec.inputs[position[id(stat)]]))


def prologue_parts(node: Node, consumers: Counter) -> tuple[int, ...]:
    """Positions of ``node``'s operands that its kernel computes itself, in the order to
    compute them: row statistics of its other operands that nothing else reads. ``node``
    must be element-wise (nothing aggregated), dense, its operands distinct."""
    if not isinstance(node, Einsum) or node.spec.aggregated or node.layout != "dense":
        return ()
    operands = node.operands
    position = {id(op): p for p, op in enumerate(operands)}
    if len(position) != len(operands):
        return ()
    chosen = {p for p, op in enumerate(operands) if _statistic(op, position) and _aligned(node, op, position)}
    while True:
        uses = Counter(id(c) for n in (node, *(operands[p] for p in chosen)) for c in n.inputs)
        kept = {p for p in chosen if consumers[id(operands[p])] == uses[id(operands[p])]}
        if kept == chosen:
            break
        chosen = kept
    order: list[int] = []
    while len(order) < len(chosen):  # sources first
        order += [p for p in sorted(chosen) if p not in order and all(
            position[id(src)] in order or position[id(src)] not in chosen for src in operands[p].operands)]
    return tuple(order) if len(order) < len(operands) else ()


def fuse_prologues(steps: list[Node], consumers: Counter) -> list[Node]:
    """The pass: every einsum among ``steps`` with row statistics to compute a ``Prologue``."""
    mine = plain(steps)
    fused = {}
    for step in steps:
        if id(step) in mine and (positions := prologue_parts(step, consumers)):
            fused[id(step)] = Prologue(step.shape, step.dtype, step.tile, step,
                                       tuple(step.inputs[p] for p in positions), positions)
    return replaced(steps, fused)


@LOWERING.register(Prologue)
def lower_prologue(step: Prologue, relations: Relations) -> exp.Select:
    node = step.result
    refs, labels = relations(list(step.inputs))
    for p in sorted(step.positions):  # computed in the kernel: no relation
        refs.insert(p, "")
        labels.insert(p, node.inputs[p].label)
    return einsum_select(node, refs, labels, prologue=step.positions)
