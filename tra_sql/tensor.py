"""``Tensor``: a node of the lazy DAG, bound to the session that runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from tra_sql import budget, graph, structure
from tra_sql.compile import passes
from tra_sql.compile.program import Program
from tra_sql.decompose import choose
from tra_sql.graph import Node, Source, topological
from tra_sql.ops.cast import cast

if TYPE_CHECKING:
    from tra_sql.session import Session


class Tensor:
    """A tensor relation, stored or still to be computed. Nothing runs until ``numpy()``,
    ``arrow()`` or ``store()``."""

    def __init__(self, session: Session, node: Node):
        self.session = session
        self.node = node
        self._compiled: dict[frozenset[str], Program] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> np.dtype:
        return self.node.dtype

    @property
    def tile(self) -> tuple[int, ...]:
        return self.node.tile

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    @property
    def name(self) -> str | None:
        """The table holding this tensor, if it is stored."""
        return self.node.table if isinstance(self.node, Source) else None

    def program(self) -> Program:
        """The compiled program, compiled once per set of enabled fusions (``passes.fusions``):
        the DAG under a tensor never changes, so every ``numpy()`` after the first runs the same
        SQL without compiling or rendering it again (``Program.sql`` keeps its text)."""
        if passes.enabled not in self._compiled:
            self._compiled[passes.enabled] = Program.compile(self.node)
        return self._compiled[passes.enabled]

    def sql(self, dialect: str = "duckdb") -> str:
        """The SQL that computes this tensor's tile relation (columns ``k0..``, ``tile``)."""
        return self.program().sql(dialect)

    def arrow(self, plan=None) -> pa.Table:
        """Run the program (under ``plan``, from ``db.plan()``, if given); the tile relation
        as an Arrow table. A result this process cannot hold raises ``MemoryBudgetError``
        first (``tra_sql.budget``)."""
        budget.check_result(self, "arrow")
        return self.session.fetch_arrow(self, None if plan is None else choose.resolve(self, plan))

    def numpy(self, plan=None) -> np.ndarray:
        """Run the program in the engine and assemble the tiles into an ndarray. ``plan``:
        a ``db.plan()`` to follow; by default large programs are planned automatically
        (``False``: run as written). The array, and the tiles it is assembled from, must fit
        in the memory available (twice the result's bytes), else ``MemoryBudgetError`` is
        raised before anything runs (``tra_sql.budget``)."""
        budget.check_result(self, "numpy")
        return self.session.fetch_numpy(self, choose.resolve(self, plan))

    def store(self, name: str, replace: bool = False, plan=None) -> Tensor:
        """Materialize as tensor relation ``name`` (table + catalog row); all or nothing.
        ``plan``: a ``db.plan()`` to follow (staged in bands if it needs to be)."""
        return self.session.store(self, name, replace, None if plan is None else choose.resolve(self, plan))

    def retile(self, tile) -> Tensor:
        """The same tensor cut into tiles of shape ``tile`` (done in SQL)."""
        return self.session.retile(self, tile)

    def astype(self, dtype) -> Tensor:
        """The same tensor converted to ``dtype`` (float32, float64, int32 or int64), tile by
        tile (NumPy's ``astype``; a float that has no value in an integer dtype raises)."""
        return Tensor(self.session, cast(self.node, dtype, self.name or "tensor"))

    def __getitem__(self, index) -> Tensor:
        """Basic indexing with integers and step-1 slices (a TRA filter + re-key in SQL)."""
        starts, stops, dropped = structure.index_bounds(index, self.shape, self.name or "tensor")
        node = graph.slice_(self.node, starts, stops)
        if dropped:
            kept = [d for d in range(self.ndim) if d not in dropped]
            node = graph.reshape(node, tuple(stops[d] - starts[d] for d in kept))
        return Tensor(self.session, node)

    def reshape(self, *shape) -> Tensor:
        """The same elements in row-major order under a new shape (one ``-1`` allowed)."""
        shape = structure.new_shape(shape, self.shape)
        return Tensor(self.session, graph.reshape(self.node, shape))

    def transpose(self, *axes) -> Tensor:
        """Axes permuted (reversed by default): an einsum that re-keys and transposes tiles."""
        perm = structure.permutation(axes, self.ndim)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[: self.ndim]
        return self.session.einsum(f"{letters}->{''.join(letters[p] for p in perm)}", self)

    @property
    def T(self) -> Tensor:  # noqa: N802 - numpy's name
        return self.transpose()

    def explain(self) -> str:
        """The program: one line per step with shape, tile shape and dtype, then its SQL."""
        program = self.program()
        lines = []
        for node in topological(self.node):
            lines.append(f"{program.refs[id(node)]:>10} = {node.label}  shape={node.shape} "
                         f"tile={node.tile} dtype={node.dtype}")
        return "\n".join(lines) + "\n\n" + program.sql()

    def __repr__(self) -> str:
        what = f"'{self.name}'" if self.name else self.node.label
        return f"<Tensor {what} shape={self.shape} tile={self.tile} dtype={self.dtype}>"
