"""The attention fusion: ``softmax(scale * Q·K, mask) · V`` (a ``Softmax``-marked einsum of
scores contracted with V) becomes one ``Attention`` step, one ``tra_attention_<n>`` call per
output tile running the softmax online across the key tiles (``tra_sql.udfs.attention``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlglot import exp

from tra_sql.compile import blocks
from tra_sql.compile.blocks import array, call, select_keys
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.compile.passes import Fused, plain, replaced
from tra_sql.graph import Einsum, Node
from tra_sql.udfs import blas
from tra_sql.udfs.attention import Roles
from tra_sql.udfs.protocol import AttentionStep, Kernel


@dataclass(eq=False)
class Attention(Fused):
    """``result = softmax(scale * Q·K, mask) · V``, absorbing the scores, the row max, the
    row sum and the probabilities: the operands (Q, K, V, the mask if any) with their
    ``subscripts``, the ``scores``' subscript and the ``output``'s, all in the scores' letters."""

    operands: tuple[Node, ...]
    subscripts: tuple[str, ...]
    scores: str
    output: str
    scale: float

    @property
    def inputs(self) -> tuple[Node, ...]:
        return self.operands


def attention_parts(node: Node, consumers: Counter) -> Attention | None:
    """``node`` as a fused attention step, when it contracts V with a ``Softmax``-marked einsum
    (over its last index) of scores ``Q·K`` and nothing else reads the scores, the row max,
    the row sum or the probabilities. The scores' contracted indices must be single tiles
    (the kernel computes whole score tiles), the indices must play the parts of ``Roles``,
    everything dense."""
    if not isinstance(node, Einsum) or node.join is not None or node.agg != "sum" or len(node.operands) != 2:
        return None
    probs, values = node.operands
    if not isinstance(probs, Einsum) or probs.softmax is None or consumers[id(probs)] != 1:
        return None
    scores, row_max, row_sum = probs.operands[0], probs.operands[-2], probs.operands[-1]
    if not (isinstance(scores, Einsum) and scores.join is None and scores.agg == "sum" and len(scores.operands) == 2
            and isinstance(row_max, Einsum) and isinstance(row_sum, Einsum)
            and row_max.operands[0] is scores and row_sum.operands[0] is scores and row_sum.operands[-1] is row_max):
        return None
    if (consumers[id(scores)], consumers[id(row_max)], consumers[id(row_sum)]) != (3, 2, 1):
        return None
    mask = probs.operands[1:2] if probs.softmax.masked else ()
    if any(n.layout != "dense" for n in (*scores.operands, values, *mask)):
        return None
    if any(scores.tiles[c] < scores.sizes[c] for c in scores.spec.aggregated):
        return None
    letters = scores.spec.output
    probs_sub, (over, own) = probs.spec.inputs[0], node.spec.inputs
    if (probs.spec.output != probs_sub or len(set(letters)) != len(letters) or over[-1] in node.spec.output
            or set(node.spec.aggregated) != {over[-1]}):
        return None
    rename = dict(zip(over, letters))
    fresh = (c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in "".join(scores.spec.inputs))
    for c in own:
        rename.setdefault(c, next(fresh))
    inputs = (*scores.spec.inputs, "".join(rename[c] for c in own))
    if mask:
        inputs += ("".join(dict(zip(probs_sub, letters))[c] for c in probs.spec.inputs[1]),)
    output = "".join(rename[c] for c in node.spec.output)
    if Roles.of(inputs, output, letters[-1]) is None:
        return None
    return Attention(node.shape, node.dtype, node.tile, node, (scores, row_max, row_sum, probs),
                     (*scores.operands, values, *mask), inputs, letters, output, probs.softmax.scale)


def fuse_attention(steps: list[Node], consumers: Counter) -> list[Node]:
    """The pass: every attention among ``steps`` one ``Attention`` step. None without NumPy's
    bundled OpenBLAS (``blas.FOUND``; a NumPy built on another BLAS), whose ``?gemm`` the
    kernel's body calls: the einsums then run unfused."""
    if not blas.FOUND:
        return steps
    mine = plain(steps)
    fused = {id(step): att for step in steps if id(step) in mine and (att := attention_parts(step, consumers))}
    return replaced(steps, fused)


@LOWERING.register(Attention)
def lower_attention(att: Attention, relations: Relations) -> exp.Select:
    """Q, K, V (and the mask) joined on their shared indices, one ``tra_attention_<n>`` call
    per output tile over the list of its joined rows (one per key tile)."""
    refs, names = relations(att.operands)
    joins, where, first = blocks.joins(att.subscripts, refs)
    out_keys = [first[c] for c in att.output]
    sizes, tiles = blocks.extents(att.subscripts, att.operands)
    step = AttentionStep(att.subscripts, att.scores, att.output, sizes, tiles,
                         tuple(op.dtype.name for op in att.operands), att.result.dtype.name,
                         att.absorbed[-1].dtype.name, tuple(names), att.scale)
    tile = call(Kernel("attention", len(refs)), step,
                [array([k.copy() for k in out_keys]), blocks.list_of_structs(blocks.operand_fields(att.subscripts))])
    return blocks.grouped(blocks.joined(refs[0], joins, where).select(*select_keys(out_keys, tile)), out_keys)
