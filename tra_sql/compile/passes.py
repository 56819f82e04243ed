"""The fusion passes' common ground: which fusions are on, and the explicit fused node kind
a pass puts in place of the nodes it fuses.

Each fusion (``attention``, ``prologue``, ``epilogue``, ``chain``; see their modules) is a
pass over the DAG's steps: it takes the steps (in topological order) and the consumer counts
of the program as written, and returns the steps with some replaced by ``Fused`` nodes;
``program.PASSES`` runs them in that fixed order. The two ways of a split aggregation,
``partials`` and ``agg_inputs``, are choices of the einsum lowering (``partials_first``);
``contractions`` is a dialect writing a split aggregation in its engine's form
(``dialect.Dialect.fuse``: DuckDB's fused contraction aggregate for a split sum of BLAS products,
Spark's one aggregate of the joined input tiles where per-row partial results would move more
bytes), ``loops`` DuckDB's writing a per-row step over dense float tiles as the native loop
kernel ``tra_loop_<n>`` (``dialect.Dialect.call``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tra_sql.graph import Node

#: The fusions ``Program.compile`` may make: ``attention``, ``prologue``, ``epilogue``, ``chain``;
#: the two ways of a split aggregation, ``partials`` and ``agg_inputs`` (see ``partials_first``);
#: and the dialects' forms of split aggregations, ``contractions``, and DuckDB's native loops, ``loops``.
FUSIONS = frozenset({"attention", "prologue", "epilogue", "chain", "partials", "agg_inputs", "contractions", "loops"})
enabled = FUSIONS


@contextlib.contextmanager
def fusions(off=()):
    """Compile with the fusions named in ``off`` switched off (a testing and debugging aid;
    not thread-safe): ``with passes.fusions(off={"epilogue"}): C.numpy()`` runs C with every
    element-wise step as a step of its own. Off ``partials``, a split aggregation always
    aggregates its input tiles (but for CSR results); off ``agg_inputs``, it always aggregates
    the partial results; not both. Off ``contractions``, every dialect leaves split
    aggregations as the lowering chose them; off ``loops``, per-row steps ``tra_einsum_<n>``
    (the Arrow UDF on either kernel path)."""
    global enabled
    off = frozenset(off)
    if off - FUSIONS or {"partials", "agg_inputs"} <= off:
        raise ValueError(f"fusions(off={sorted(off)}): name some of {sorted(FUSIONS)}, not both ways of aggregating")
    before, enabled = enabled, FUSIONS - off
    try:
        yield
    finally:
        enabled = before


@dataclass(eq=False)
class Fused(Node):
    """One step computing ``result`` and the ``absorbed`` nodes inside it (their results
    never become relations); ``inputs`` are the nodes whose relations it reads."""

    result: Node
    absorbed: tuple[Node, ...]

    @property
    def computes(self) -> tuple[Node, ...]:
        return (self.result, *self.absorbed)

    @property
    def label(self) -> str:
        return self.result.label


#: A fusion pass: (steps in topological order, consumer counts by node id) -> steps
Pass = Callable[[list[Node], Counter], list[Node]]


def result(step: Node) -> Node:
    """The node whose result ``step`` computes (itself, if no pass fused it)."""
    return step.result if isinstance(step, Fused) else step


def replaced(steps: list[Node], fused: dict[int, Fused]) -> list[Node]:
    """``steps`` with the new ``fused`` steps (by the id of their result) in place of the
    steps computing their results, and without the steps computing what they absorb."""
    gone = {id(node) for step in fused.values() for node in step.absorbed}
    return [fused.get(id(result(step)), step) for step in steps if id(result(step)) not in gone]


def plain(steps: list[Node]) -> set[int]:
    """The ids of the steps that no pass has fused."""
    return {id(step) for step in steps if not isinstance(step, Fused)}
