"""The epilogue fusion: an element-wise einsum over a plain contraction that only it reads
is applied by the contraction's kernel to each tile it computes: an ``Epilogue`` step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlglot import exp

from tra_sql.compile.einsum import einsum_select
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.compile.passes import Fused, plain, replaced
from tra_sql.graph import Einsum, Node


@dataclass(eq=False)
class Epilogue(Fused):
    """``result`` (element-wise) applied to the contraction ``inner`` (absorbed), which it
    reads at operand ``position``."""

    position: int

    @property
    def inner(self) -> Einsum:
        return self.absorbed[0]

    @property
    def others(self) -> list[Node]:
        """The element-wise einsum's operands other than the contraction."""
        return [child for i, child in enumerate(self.result.inputs) if i != self.position]

    @property
    def inputs(self) -> tuple[Node, ...]:
        return (*self.inner.inputs, *self.others)


def fusable(node: Node, consumers: Counter) -> int | None:
    """The operand of ``node`` that can absorb ``node`` as an epilogue: ``node`` is an
    element-wise einsum (custom join, nothing aggregated) over a plain contraction that only
    it consumes, laid out exactly as ``node``'s output (so tiles correspond one to one)."""
    if not isinstance(node, Einsum) or node.join is None or node.spec.aggregated or node.layout != "dense":
        return None
    for p, (op, sub) in enumerate(zip(node.operands, node.spec.inputs)):
        if (isinstance(op, Einsum) and op.join is None and op.agg == "sum" and consumers[id(op)] == 1
                and sub == node.spec.output and op.tile == node.tile):
            return p
    return None


def fuse_epilogues(steps: list[Node], consumers: Counter) -> list[Node]:
    """The pass: every element-wise einsum among ``steps`` over a contraction that is a step
    of its own (no other fusion took it) an ``Epilogue`` of it."""
    mine = plain(steps)
    fused = {}
    for step in steps:
        if id(step) in mine and (p := fusable(step, consumers)) is not None and id(step.inputs[p]) in mine:
            fused[id(step)] = Epilogue(step.shape, step.dtype, step.tile, step, (step.inputs[p],), p)
    return replaced(steps, fused)


@LOWERING.register(Epilogue)
def lower_epilogue(step: Epilogue, relations: Relations) -> exp.Select:
    outer_refs, outer_labels = relations(step.others)
    outer_refs.insert(step.position, "")  # the contraction's own result
    outer_labels.insert(step.position, "")
    refs, labels = relations(list(step.inner.inputs))
    return einsum_select(step.inner, refs, labels, (step.result, step.position, outer_refs, outer_labels))
