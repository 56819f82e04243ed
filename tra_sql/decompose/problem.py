"""The planning problem extracted from a DAG: one variable per einsum op (its parts per
index), edges between ops, and the fixed tilings around them.

Each node kind plays a ``role`` (the ``ROLE`` rules): an einsum is an ``OP``, whose tiling
the plan chooses; re-tiling ``Place`` nodes in front of an einsum are looked through
(``RETILE``): they are artifacts of hand-picked tilings, and the plan decides the tiling each
op reads. A constant (``CONSTANT``) is generated directly in whatever tiling its consumer
reads. Sources, the other structural ops (slices, concatenations, reshapes) and any kind
without a rule keep their tiling (``FIXED``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from math import ceil, prod

import numpy as np

from tra_sql import absent
from tra_sql.aggregates import AGGREGATES
from tra_sql.graph import Einsum, Fill, Node, Place, topological
from tra_sql.kinds import Rules
from tra_sql.udfs.contract import blas_groups

#: Parts tried per index (normalized per size, see ``normalize``), besides those the presets
#: and the as-written tiling need. Not only powers of two.
BASE_PARTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def normalize(n: int, parts: int) -> int:
    """The number of tiles when ``n`` elements are cut into ``parts`` (tile = ceil(n/parts))."""
    parts = max(1, min(int(parts), n))
    return ceil(n / ceil(n / parts))


OP, CONSTANT, RETILE, FIXED = "op", "constant", "retile", "fixed"
ROLE: Rules = Rules("planner role")
"""``rule(node)``: the node's role in a plan (see the module's docstring)."""


@ROLE.register(Einsum)
def _einsum_role(node: Einsum) -> str:
    return OP


@ROLE.register(Fill)
def _fill_role(node: Fill) -> str:
    return CONSTANT


@ROLE.register(Place)
def _place_role(node: Place) -> str:
    same = len(node.sources) == 1 and not node.flat and node.shape == node.sources[0].shape
    return RETILE if same and not any(node.offsets[0]) else FIXED


def role(node: Node) -> str:
    """``node``'s role in a plan: ``OP``, ``CONSTANT``, ``RETILE`` or ``FIXED``."""
    rule = ROLE.get(node)
    return FIXED if rule is None else rule(node)


def is_retile(node: Node) -> bool:
    return role(node) == RETILE


def producer(node: Node) -> Node:
    """``node`` with re-tilings in front of it looked through."""
    while is_retile(node):
        node = node.sources[0]
    return node


def as_written(node: Einsum) -> bool:
    """Whether a plan must run ``node`` in its own tiling: a CSR operand cannot be re-tiled,
    and an operand the join ignores selects tiles (``absent.ignored_operands``)."""
    return any(op.layout != "dense" for op in node.operands) or bool(absent.ignored_operands(node))


def pinned(root: Node) -> set[int]:
    """The ids of the nodes a plan must leave in their own tiling: the einsums ``as_written``,
    and every node an operand their join ignores is computed from (a re-tiling of a relation
    lacking tiles changes which tiles it has, and those tiles' keys are the answer's)."""
    out: set[int] = set()
    for node in topological(root):
        if role(node) == OP and as_written(node):
            out.add(id(node))
            for m in absent.ignored_operands(node):
                out.update(id(n) for n in topological(node.operands[m]))
    return out


def parts_of(node: Node) -> tuple[int, ...]:
    return tuple(node.grid)


@dataclass
class Input:
    """Operand ``m`` of an op: index positions of its dimensions, and who produces it: an op
    (``op``), a leaf with a fixed tiling (``fixed`` parts per dimension) or a constant."""

    pos: tuple[int, ...]
    node: Node
    op: int | None = None
    fixed: tuple[int, ...] | None = None
    nbytes: int = 0


@dataclass
class Op:
    """One einsum node to plan."""

    node: Einsum
    indices: tuple[str, ...]
    sizes: tuple[int, ...]
    axes: tuple[int, ...]            # axis class of each index
    out: tuple[int, ...]             # positions of the output indices
    inputs: list[Input]
    fixed_consumers: list[tuple[int, ...]] = field(default_factory=list)  # tilings read by non-einsum consumers
    written: tuple[int, ...] = ()    # parts per index as the DAG is written
    pinned: bool = False             # the plan must keep the written tiling (``pinned``)

    @property
    def agg(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.indices)) if i not in self.out)

    @property
    def out_bytes(self) -> int:
        return self.node.dtype.itemsize * prod(self.node.shape)

    @property
    def blas(self) -> bool:
        """Whether the tile kernel is a BLAS contraction (``udfs.contract.blas_groups``)."""
        return (self.node.join is None and AGGREGATES[self.node.agg].contracts
                and blas_groups(self.node.spec.inputs, self.node.spec.output) is not None)


@dataclass
class Edge:
    """Op ``src``'s output read as operand ``m`` of op ``dst``."""

    src: int
    dst: int
    m: int
    nbytes: int


@dataclass
class Problem:
    root: Node
    ops: list[Op]
    edges: list[Edge]
    axis_size: dict[int, int]
    axis_members: dict[int, list[tuple[Node, int]]]
    root_op: int | None

    def op_of(self, node: Node) -> int | None:
        return self._index.get(id(node))

    def __post_init__(self) -> None:
        self._index = {id(op.node): i for i, op in enumerate(self.ops)}


class _Axes:
    """Union-find over (node, dimension): dimensions that an einsum index ties together."""

    def __init__(self) -> None:
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}
        self.nodes: dict[int, Node] = {}

    def find(self, x: tuple[int, int]) -> tuple[int, int]:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, members: Iterable[tuple[Node, int]]) -> None:
        members = list(members)
        for node, _ in members:
            self.nodes[id(node)] = node
        roots = [self.find((id(n), d)) for n, d in members]
        for r in roots[1:]:
            self.parent[self.find(r)] = self.find(roots[0])


def extract(root: Node) -> Problem:
    """The planning problem of the DAG under ``root``."""
    order = topological(root)
    kept = pinned(root)
    einsums = [n for n in order if role(n) == OP]
    index = {id(n): i for i, n in enumerate(einsums)}
    axes = _Axes()
    for node in einsums:
        spec = node.spec
        for c in spec.indices:
            members = [(producer(op), d) for sub, op in zip(spec.inputs, node.operands)
                       for d, ch in enumerate(sub) if ch == c]
            members += [(node, j) for j, ch in enumerate(spec.output) if ch == c]
            axes.union(members)
    ops: list[Op] = []
    edges: list[Edge] = []
    for i, node in enumerate(einsums):
        spec = node.spec
        indices = tuple(spec.indices)
        sizes = node.sizes
        tiles = node.tiles
        inputs = []
        for m, (sub, operand) in enumerate(zip(spec.inputs, node.operands)):
            src = producer(operand)
            nbytes = src.dtype.itemsize * prod(src.shape)
            item = Input(tuple(indices.index(c) for c in sub), src, nbytes=nbytes)
            if id(src) in index:
                item.op = index[id(src)]
                edges.append(Edge(item.op, i, m, nbytes))
            elif role(src) != CONSTANT:
                item.fixed = parts_of(src)
            inputs.append(item)
        op_axes = []
        for c in indices:
            where = next(((producer(op), d) for sub, op in zip(spec.inputs, node.operands)
                          for d, ch in enumerate(sub) if ch == c), None)
            where = where or (node, spec.output.index(c))
            op_axes.append(axes.find((id(where[0]), where[1])))
        ops.append(Op(node, indices, tuple(sizes[c] for c in indices), tuple(op_axes),
                      tuple(indices.index(c) for c in spec.output), inputs,
                      written=tuple(normalize(sizes[c], ceil(sizes[c] / tiles[c])) for c in indices),
                      pinned=id(node) in kept))
    # non-einsum consumers read an op's output in the tiling the DAG gives them
    for node in order:
        if role(node) in (OP, RETILE):
            continue
        for child in node.inputs:
            src = producer(child)
            if id(src) in index:
                ops[index[id(src)]].fixed_consumers.append(parts_of(child))
    # relabel axis classes 0..n-1
    labels: dict[tuple[int, int], int] = {}
    for op in ops:
        op.axes = tuple(labels.setdefault(a, len(labels)) for a in op.axes)
    axis_size: dict[int, int] = {}
    members: dict[int, list[tuple[Node, int]]] = {}
    for x in list(axes.parent):
        r = axes.find(x)
        if r in labels:
            node = axes.nodes[x[0]]
            members.setdefault(labels[r], []).append((node, x[1]))
            axis_size[labels[r]] = node.shape[x[1]]
    root_op = index.get(id(producer(root)))
    return Problem(root, ops, edges, axis_size, members, root_op)


def candidates(n: int, extra: Iterable[int] = (), base: Iterable[int] = BASE_PARTS) -> list[int]:
    """Distinct tile counts to try for an index of size ``n``."""
    return sorted({normalize(n, p) for p in list(base) + list(extra) if p >= 1})


@dataclass
class States:
    """Every partition vector an op may take: the cartesian product of its candidates, output
    indices varying slowest, so the states sharing one output tiling form a contiguous block."""

    Q: np.ndarray          # (S, k) tiles per index
    n_out: int             # number of distinct output tilings (blocks of S // n_out states)
    out_code: np.ndarray   # (S,) code of the output tiling
    in_codes: list[np.ndarray]  # (S,) code of each operand's tiling

    @property
    def inner(self) -> int:
        return len(self.Q) // self.n_out


RADIX = 1 << 16


def code(parts: np.ndarray) -> np.ndarray:
    """An integer per row of a (S, r) matrix of tile counts (equal codes: equal tilings)."""
    out = np.zeros(len(parts), dtype=np.int64)
    for d in range(parts.shape[1]):
        out = out * RADIX + parts[:, d]
    return out


def code1(parts: tuple[int, ...]) -> int:
    return int(code(np.array([parts], dtype=np.int64).reshape(1, len(parts)))[0])


def states(op: Op, cands: list[list[int]]) -> States:
    order = list(op.out) + [i for i in range(len(op.indices)) if i not in op.out]
    grids = np.meshgrid(*[np.array(cands[i], dtype=np.int64) for i in order], indexing="ij")
    flat = np.stack([g.reshape(-1) for g in grids], axis=1) if order else np.zeros((1, 0), np.int64)
    Q = np.empty_like(flat)
    Q[:, order] = flat
    n_out = prod(len(cands[i]) for i in op.out)
    return States(Q, n_out, code(Q[:, list(op.out)]), [code(Q[:, list(x.pos)]) for x in op.inputs])
