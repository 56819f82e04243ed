"""The chain fusion: einsums that each read the previous one's result, which nothing else
reads, are one ``Chain`` step when every index they sum over is a single tile: one
``tra_chain_<n>`` call per joined row computes them in turn (an MLP's layers at inference)."""

from __future__ import annotations

import string
from collections import Counter
from dataclasses import dataclass
from math import ceil, prod

from sqlglot import exp

from tra_sql.compile import blocks
from tra_sql.compile.blocks import array, call, select_keys
from tra_sql.compile.epilogue import Epilogue
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.compile.passes import Fused, replaced, result
from tra_sql.graph import Einsum, Node
from tra_sql.udfs.protocol import ChainStep, EinsumStep, Kernel

CHAIN_CALL_BYTES = 1 << 30  # the most input bytes a chain's kernel call may receive (else: steps)
BATCH_ROWS = 2048  # the most rows a UDF call receives


def chainable(node: Node) -> bool:
    """Whether ``node`` can be a link of a ``Chain``: a dense einsum whose aggregated indices
    are single tiles, so one kernel call per joined row computes it."""
    return (isinstance(node, Einsum) and node.layout == "dense" and all(op.layout == "dense" for op in node.operands)
            and all(node.tiles[c] == node.sizes[c] for c in node.spec.aggregated))


def feeds(node: Einsum, position: int) -> bool:
    """Whether ``node`` can compute its operand ``position`` per joined row without doing it
    twice: every index the operand lacks is a single tile (so each of its tiles joins one row)."""
    sub = node.spec.inputs[position]
    letters = set("".join(node.spec.inputs))
    return len(set(sub)) == len(sub) and all(node.tiles[c] == node.sizes[c] for c in letters - set(sub))


@dataclass(eq=False)
class Chain(Fused):
    """Einsums that each read the previous one's result (contractions with their fused
    element-wise epilogues, or element-wise steps), computed one after another in one kernel
    call per joined row, so their intermediate results never become relations. ``steps``: the
    einsums in order (the last is the ``result``, the others ``absorbed``); ``leaves``: the
    relations joined, ``subscripts`` their subscripts in the chain's letters, ``output`` the
    result's; ``sources``: per step, each operand's origin (leaf ``m``, or ``-1 - k`` for step
    ``k``'s result)."""

    steps: tuple[Einsum, ...]
    leaves: tuple[Node, ...]
    subscripts: tuple[str, ...]
    output: str
    sources: tuple[tuple[int, ...], ...]

    @property
    def inputs(self) -> tuple[Node, ...]:
        return self.leaves

    @staticmethod
    def of(links: list[tuple[Einsum, Einsum | None]]) -> Chain | None:
        """The chain of ``links`` (einsum, its epilogue or None), each link's einsum reading the
        previous link's result; ``None`` if its indices need more than 52 letters."""
        fresh = iter(string.ascii_letters)
        steps: list[Einsum] = []
        leaves: list[Node] = []
        inputs: list[str] = []
        sources: list[tuple[int, ...]] = []
        output = ""
        try:
            for inner, epilogue in links:
                rename: dict[str, str] = {}
                for sub, op in zip(inner.spec.inputs, inner.operands):
                    if steps and op is steps[-1]:
                        rename.update(zip(sub, output))
                for c in "".join(inner.spec.inputs):
                    if c not in rename:
                        rename[c] = next(fresh)
                parts = [(inner, rename)]
                if epilogue is not None:  # its output's letters are those of the einsum it wraps
                    outer = dict(zip(epilogue.spec.output, (rename[c] for c in inner.spec.output)))
                    parts.append((epilogue, outer))
                for node, names in parts:
                    origin = []
                    for sub, op in zip(node.spec.inputs, node.operands):
                        if steps and op is steps[-1]:
                            origin.append(-len(steps))
                        else:
                            origin.append(len(leaves))
                            leaves.append(op)
                            inputs.append("".join(names[c] for c in sub))
                    steps.append(node)
                    sources.append(tuple(origin))
                    output = "".join(names[c] for c in node.spec.output)
        except StopIteration:
            return None
        last = steps[-1]
        return Chain(last.shape, last.dtype, last.tile, last, tuple(steps[:-1]), tuple(steps), tuple(leaves),
                     tuple(inputs), output, tuple(sources))

    def call_bytes(self) -> int:
        """The input bytes of the largest kernel call: every joined row (one per output tile)
        carries a tile of every leaf, weights included, so a chain of many large weights over
        many row tiles is better run as steps."""
        grid = {c: ceil(n / t) for sub, op in zip(self.subscripts, self.leaves)
                for c, n, t in zip(sub, op.shape, op.tile)}
        per_row = sum(prod(op.tile) * op.dtype.itemsize for op in self.leaves)
        return min(prod(grid[c] for c in self.output), BATCH_ROWS) * per_row


def _link(step: Node) -> tuple[Einsum, Einsum | None] | None:
    """``step`` as a chain's link (a chainable einsum and its fused epilogue, if any)."""
    if isinstance(step, Epilogue):
        return (step.inner, step.result) if chainable(step.inner) else None
    return (step, None) if not isinstance(step, Fused) and chainable(step) else None


def fuse_chains(steps: list[Node], consumers: Counter) -> list[Node]:
    """The pass: the ``Chain`` of two or more links ending at each step that ends one. A link
    joins the chain of the link that produces its operand (the longest such chain) when
    nothing else reads that operand and it ``feeds`` the link's einsum; a chain whose kernel
    calls would receive over ``CHAIN_CALL_BYTES`` stays steps."""
    links = {id(result(step)): link for step in steps if (link := _link(step)) is not None}
    runs: dict[int, list[tuple[Einsum, Einsum | None]]] = {}
    for step in steps:
        if id(result(step)) not in links:
            continue
        inner = links[id(result(step))][0]
        producers = [op for p, op in enumerate(inner.operands)
                     if id(op) in runs and consumers[id(op)] == 1 and feeds(inner, p)]
        longest = max(producers, key=lambda op: len(runs[id(op)]), default=None)
        runs[id(result(step))] = ([] if longest is None else runs.pop(id(longest))) + [links[id(result(step))]]
    chains = {key: Chain.of(run) for key, run in runs.items() if len(run) > 1}
    return replaced(steps, {key: chain for key, chain in chains.items()
                            if chain is not None and chain.call_bytes() <= CHAIN_CALL_BYTES})


@LOWERING.register(Chain)
def lower_chain(chain: Chain, relations: Relations) -> exp.Select:
    """The chain's leaves joined on their shared indices, one ``tra_chain_<n>`` call per
    joined row computing every step in turn."""
    refs, names = relations(chain.leaves)
    joins, where, first = blocks.joins(chain.subscripts, refs)
    out_keys = [first[c] for c in chain.output]
    sizes, tiles = blocks.extents(chain.subscripts, chain.leaves)
    labels = [*names, *(step.label for step in chain.steps)]
    steps = tuple(node.step([labels[s if s >= 0 else len(names) - 1 - s] for s in origin], sources=origin)
                  for node, origin in zip(chain.steps, chain.sources))
    leaves = EinsumStep(chain.subscripts, chain.output, sizes, tiles, tuple(op.dtype.name for op in chain.leaves),
                        chain.steps[-1].dtype.name, tuple(names))
    per_row = [array([k.copy() for k in out_keys])] + [f.expression for f in blocks.operand_fields(chain.subscripts)]
    tile = call(Kernel("chain", len(refs)), ChainStep(leaves, steps), per_row)
    return blocks.joined(refs[0], joins, where).select(*select_keys(out_keys, tile))
