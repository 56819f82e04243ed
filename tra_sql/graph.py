"""The lazy DAG of tensor operations: stored sources, constants, einsum steps, and the
structural ops (re-tiling, slicing, concatenation, reshaping) as one placement op.

Every node knows its shape, dtype and tile shape; building a node checks its inputs, so
errors surface when the program is written, not when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from math import ceil, prod
from typing import ClassVar

import numpy as np
import opt_einsum

from tra_sql.aggregates import AGGREGATES
from tra_sql.einsum import EinsumSpec, broadcast, parse_spec
from tra_sql.errors import DTypeError, ShapeError, SpecError
from tra_sql.udfs.protocol import EinsumStep


@dataclass(eq=False)
class Node:
    shape: tuple[int, ...]
    dtype: np.dtype
    tile: tuple[int, ...]

    #: the field that holds a kind's input nodes (a tuple); None for a leaf
    INPUTS: ClassVar[str | None] = None

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(ceil(n / t) for n, t in zip(self.shape, self.tile))

    @property
    def inputs(self) -> tuple[Node, ...]:
        return getattr(self, self.INPUTS) if self.INPUTS else ()

    @property
    def label(self) -> str:
        return type(self).__name__

    @property
    def layout(self) -> str:
        """How the tiles hold their elements: ``dense``, or ``csr`` (stored sparse matrices)."""
        return "dense"


@dataclass(eq=False)
class Source(Node):
    """A tensor relation stored in table ``table``."""

    table: str
    layout: str = "dense"

    @property
    def label(self) -> str:
        return self.table


@dataclass(eq=False)
class Fill(Node):
    """A constant tensor, its tiles generated in SQL."""

    value: float

    @property
    def label(self) -> str:
        return f"fill {self.value!r}"


@dataclass(eq=False)
class Place(Node):
    """Tiles of shape ``tile`` cut from ``sources`` placed at element ``offsets`` of the
    output (TRA Tile / Concat / ReKey / Filter): re-tiling (one source, offset 0), slicing
    (a negative offset, elements outside the output dropped) and concatenation.

    With ``flat``, placement happens in row-major flat element order instead (reshape): the
    source's tiles must then span all but its first dimension, and so must the output's.
    With ``add``, overlapping pieces are summed (a keyed sum: fan-out, gradients), and a tile
    absent from every source stays absent.
    """

    sources: tuple[Node, ...]
    offsets: tuple[tuple[int, ...], ...]
    flat: bool = False
    add: bool = False

    INPUTS: ClassVar[str] = "sources"

    def __post_init__(self):
        sparse = [s for s in self.sources if s.layout != "dense"]
        if sparse:
            raise ShapeError(f"{self.label} needs dense tiles, but {sparse[0].label} is stored {sparse[0].layout}: "
                             f"store it with the tiling the program needs")

    @property
    def label(self) -> str:
        if self.flat:
            return f"reshape {self.sources[0].shape} -> {self.shape}"
        if self.add:
            return f"add {len(self.sources)} tensors"
        if len(self.sources) > 1:
            return f"concat {len(self.sources)} parts"
        if self.shape != self.sources[0].shape:
            return f"slice {self.sources[0].shape} at {tuple(-o for o in self.offsets[0])} -> {self.shape}"
        return f"retile {self.sources[0].tile} -> {self.tile}"


@dataclass(frozen=True)
class Softmax:
    """Marks an einsum as ``nn.softmax``'s last step: ``softmax(scale * scores)`` over the
    last index, ``masked`` where the mask (operand 1) is not > 0; its operands are the scores,
    the mask if any, the row max and the row sum. The compiler may fuse it with the
    contraction that reads it (see ``compile.attention``)."""

    scale: float
    masked: bool


@dataclass(eq=False)
class Einsum(Node):
    """``out[o] = agg over the other indices of join(x0[...], ..., xn[...])``."""

    spec: EinsumSpec
    operands: tuple[Node, ...]
    join: str | None
    agg: str
    softmax: Softmax | None = None

    INPUTS: ClassVar[str] = "operands"

    @property
    def label(self) -> str:
        extra = (f" join={self.join!r}" if self.join else "") + (f" agg={self.agg}" if self.agg != "sum" else "")
        return f"einsum {self.spec}{extra}"

    @cached_property
    def layout(self) -> str:
        """``csr`` when the output is subscripted like a CSR operand: the result has its entries
        (kept: recomputing it walked the whole DAG below, once per use)."""
        sparse = any(op.layout == "csr" and sub == self.spec.output for sub, op in zip(self.spec.inputs, self.operands))
        return "csr" if sparse else "dense"

    @property
    def sizes(self) -> dict[str, int]:
        return {c: n for sub, op in zip(self.spec.inputs, self.operands) for c, n in zip(sub, op.shape)}

    @property
    def tiles(self) -> dict[str, int]:
        return {c: t for sub, op in zip(self.spec.inputs, self.operands) for c, t in zip(sub, op.tile)}

    def step(self, names=(), **more) -> EinsumStep:
        """The kernel's description of this einsum: subscripts, sizes and tiles, dtypes, the
        operands' ``names`` (for error messages), join, aggregation, layouts (when any is not
        dense); ``more``: epilogue or prologue fields."""
        layouts = tuple(op.layout for op in self.operands)
        dense = all(layout == "dense" for layout in layouts)
        return EinsumStep(self.spec.inputs, self.spec.output, self.sizes, self.tiles,
                          tuple(op.dtype.name for op in self.operands), self.dtype.name, tuple(names), self.join,
                          self.agg, () if dense else layouts, "dense" if dense else self.layout, **more)


DEFAULT_TILE_ELEMENTS = 1 << 20


def default_tile(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tile shape of a tensor stored without one: the largest dimension halved until a
    tile holds at most 2^20 elements."""
    tile = list(shape)
    while prod(tile) > DEFAULT_TILE_ELEMENTS:
        d = max(range(len(tile)), key=tile.__getitem__)
        tile[d] = ceil(tile[d] / 2)
    return tuple(tile)


def retile(node: Node, tile: tuple[int, ...]) -> Node:
    """``node`` with tile shape ``tile`` (``node`` itself if it already has it)."""
    tile = tuple(min(t, n) for t, n in zip(tile, node.shape))
    return node if tile == node.tile else Place(node.shape, node.dtype, tile, (node,), ((0,) * len(tile),))


def slice_(node: Node, starts: tuple[int, ...], stops: tuple[int, ...]) -> Node:
    """Elements ``starts[d] <= i < stops[d]`` of ``node``, tiled like ``node``."""
    shape = tuple(b - a for a, b in zip(starts, stops))
    if shape == node.shape:
        return node
    tile = tuple(min(t, n) for t, n in zip(node.tile, shape))
    return Place(shape, node.dtype, tile, (node,), (tuple(-a for a in starts),))


def concat(nodes: list[Node], axis: int) -> Node:
    """``nodes`` joined along ``axis``, tiled like the first."""
    offsets, at = [], 0
    for node in nodes:
        offsets.append(tuple(at if d == axis else 0 for d in range(len(node.shape))))
        at += node.shape[axis]
    shape = tuple(at if d == axis else n for d, n in enumerate(nodes[0].shape))
    dtype = np.result_type(*(n.dtype for n in nodes))
    return Place(shape, dtype, nodes[0].tile, tuple(nodes), tuple(offsets))


def add(nodes: list[Node]) -> Node:
    """The element-wise sum of same-shaped ``nodes`` as a keyed sum: absent tiles are zeros,
    and an output tile exists where any input has one (unlike an einsum join)."""
    dtype = np.result_type(*(n.dtype for n in nodes))
    zero = (0,) * len(nodes[0].shape)
    return Place(nodes[0].shape, dtype, nodes[0].tile, tuple(nodes), (zero,) * len(nodes), add=True)


def reshape(node: Node, shape: tuple[int, ...]) -> Node:
    """``node`` with a new shape of the same size, in row-major order: the source is first
    re-tiled to full trailing dimensions, so each of its tiles is one contiguous flat range."""
    if shape == node.shape:
        return node
    source = retile(node, node.tile[:1] + node.shape[1:])
    trailing = int(np.prod(shape[1:], dtype=np.int64))
    per_tile = int(np.prod(node.tile, dtype=np.int64))
    tile = (max(1, min(shape[0], per_tile // trailing)),) + tuple(shape[1:]) if shape else ()
    return Place(tuple(shape), node.dtype, tile, (source,), ((0,),), flat=True)


def result_dtype(operands: list[Node], join: str | None, agg: str = "sum") -> np.dtype:
    """The operands' common dtype; float64 for integer operands under a join or a floating
    aggregation."""
    dtype = np.result_type(*(op.dtype for op in operands)) if operands else np.dtype("float64")
    if (join is not None or AGGREGATES[agg].floating) and not np.issubdtype(dtype, np.floating):
        return np.dtype("float64")
    return dtype


def einsum(spec: str, operands: list[Node], names: list[str], join: str | None = None,
           agg: str = "sum", pairwise: bool = True) -> Node:
    """The node computing ``spec`` over ``operands`` (``names`` are for error messages).

    Each index takes the tile size it has in the first operand that uses it (CSR operands
    first: they cannot be re-tiled); operands tiled otherwise are re-tiled. Three or more
    operands with the default join and an aggregation that ``contracts`` (``sum``) follow
    opt_einsum's contraction path as pairwise steps, unless ``pairwise`` is false (one step,
    for autodiff rules that differentiate the node they build).
    """
    if agg not in AGGREGATES:
        raise SpecError(f"agg={agg!r} is not one of {', '.join(AGGREGATES)}")
    if join is not None and not isinstance(join, str):
        raise SpecError(f"join must be a SQL expression string, got {type(join).__name__}")
    parsed = parse_spec(spec, len(operands), [len(op.shape) for op in operands])
    parsed, sizes = broadcast(parsed, [op.shape for op in operands], names)
    for op, name in zip(operands, names):
        if op.dtype.name not in ("float32", "float64", "int32", "int64"):
            raise DTypeError(f"operand '{name}' has unsupported dtype {op.dtype}")
    tiles: dict[str, int] = {}
    for sub, op in sorted(zip(parsed.inputs, operands), key=lambda pair: pair[1].layout == "dense"):
        for c, t in zip(sub, op.tile):
            tiles.setdefault(c, t)
    aligned = [retile(op, tuple(tiles[c] for c in sub)) for sub, op in zip(parsed.inputs, operands)]
    dtype = result_dtype(operands, join, agg)
    if not pairwise or len(aligned) <= 2 or join is not None or not AGGREGATES[agg].contracts:
        return _step(parsed, aligned, sizes, tiles, dtype, join, agg)
    _, info = opt_einsum.contract_path(
        str(parsed), *[op.shape for op in aligned], shapes=True, optimize="auto"
    )
    pending = list(aligned)
    for positions, _, step_spec, _, _ in info.contraction_list:
        chosen = [pending.pop(p) for p in sorted(positions, reverse=True)]
        step = parse_spec(step_spec, len(chosen))
        pending.append(_step(step, chosen, sizes, tiles, dtype, None, agg))
    return pending[0]


def _step(spec: EinsumSpec, operands: list[Node], sizes, tiles, dtype, join, agg) -> Einsum:
    shape = tuple(sizes[c] for c in spec.output)
    tile = tuple(tiles[c] for c in spec.output)
    return Einsum(shape, dtype, tile, spec, tuple(operands), join, agg)


def with_inputs(node: Node, inputs) -> Node:
    """``node`` reading ``inputs`` instead of its own inputs, every other field kept (the one
    way to rebuild a node: a copy that forgets a field, such as a keyed sum's ``add``,
    changes the answer)."""
    inputs = tuple(inputs)
    if all(a is b for a, b in zip(inputs, node.inputs)):
        return node
    if node.INPUTS is None:
        raise TypeError(f"{node.label} has no inputs to replace")
    return replace(node, **{node.INPUTS: inputs})


def topological(root: Node) -> list[Node]:
    """Every node the root depends on, each once, inputs before their consumers."""
    order: list[Node] = []
    seen: set[int] = set()

    def visit(node: Node) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for child in node.inputs:
            visit(child)
        order.append(node)

    visit(root)
    return order
