"""A compiled program: the DAG's steps after the fusion passes, each lowered to a SELECT
(``LOWERING``), as one ``WITH ... AS MATERIALIZED`` chain, one CTE per step, shared steps once."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sqlglot import exp

from tra_sql.compile import passes, placement  # noqa: F401  (placement: the Source, Fill and Place lowering)
from tra_sql.compile.attention import fuse_attention
from tra_sql.compile.blocks import kernels_called, key, select_keys
from tra_sql.compile.chain import fuse_chains
from tra_sql.compile.common import merge_common
from tra_sql.compile.dialect import DUCKDB, Dialect
from tra_sql.compile.epilogue import fuse_epilogues
from tra_sql.compile.lowering import LOWERING
from tra_sql.compile.passes import Fused, Pass
from tra_sql.compile.prologue import fuse_prologues
from tra_sql.graph import Node, Source
from tra_sql.udfs.protocol import Kernel

#: The fusion passes in the order they run, each by its name in ``passes.FUSIONS``.
PASSES: tuple[tuple[str, Pass], ...] = (
    ("attention", fuse_attention),
    ("prologue", fuse_prologues),
    ("epilogue", fuse_epilogues),
    ("chain", fuse_chains),
)


@dataclass
class Program:
    """The SQL of a DAG: one SELECT per step (a materialized CTE, but for the root's, which is
    the final SELECT), and the kernels it calls. Steps whose SQL is identical (the same
    computation on the same inputs) share one CTE; ``refs`` maps every node's id to the
    relation holding its result (a fused step's for the nodes it absorbs)."""

    root: Node
    ctes: list[tuple[str, exp.Select, Node]] = field(default_factory=list)
    kernels: set[Kernel] = field(default_factory=set)
    refs: dict[int, str] = field(default_factory=dict)
    by_sql: dict[str, str] = field(default_factory=dict)
    #: every node's id to the step computing it once identical nodes are merged (``common``)
    merged: dict[int, Node] = field(default_factory=dict, repr=False)
    #: ``sql``'s texts by (pretty, dialect, enabled fusions): a compiled program does not change
    rendered: dict[tuple, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def compile(cls, root: Node, *others: Node) -> Program:
        """Compile the DAG under ``root`` (and ``others``: more results, see ``union_query``):
        identical nodes are merged (``common``), the ``PASSES`` that ``passes.fusions`` has not
        switched off replace the nodes they fuse, then every step is lowered in topological order."""
        program = cls(root)
        steps, program.merged = merge_common((root, *others))
        consumers = Counter(id(child) for node in steps for child in node.inputs)
        consumers.update(id(program.merged[id(top)]) for top in (root, *others))  # a result stays a step of its own
        for name, fuse in PASSES:
            if name in passes.enabled:
                steps = fuse(steps, consumers)
        for step in steps:
            program._add(step)
        for original, step in program.merged.items():
            program.refs[original] = program.refs[id(step)]
        return program

    def relations(self, nodes) -> tuple[list[str], list[str]]:
        """The relations holding ``nodes``' results, and their labels for the kernels' error
        messages (a stored tensor's name, else the relation's)."""
        refs = [self.refs[id(child)] for child in nodes]
        return refs, [child.table if isinstance(child, Source) else r for child, r in zip(nodes, refs)]

    def _add(self, step: Node) -> None:
        select = LOWERING(step)(step, self.relations)
        computes = step.computes if isinstance(step, Fused) else (step,)
        if isinstance(select, str):  # a stored relation
            self.refs[id(step)] = select
            return
        text = select.sql(dialect="duckdb")
        if text not in self.by_sql:
            self.kernels |= kernels_called(select)
            self.ctes.append((f"_t{len(self.ctes) + 1}", select, step))
            self.by_sql[text] = self.ctes[-1][0]
        for node in computes:
            self.refs[id(node)] = self.by_sql[text]

    def query(self, materialized: bool = True) -> exp.Select:
        """``WITH <steps> AS MATERIALIZED (...) <root's SELECT>``: columns ``k0, ..., tile``
        (plain CTEs without ``materialized``, for engines that lack the keyword)."""
        root = self.refs[id(self.root)]
        steps = [(name, cte) for name, cte, _ in self.ctes if name != root]
        final = next((cte for name, cte, _ in self.ctes if name == root), None)
        if final is None:  # the root is a stored table
            columns = [exp.column(key(d)) for d in range(len(self.root.shape))] + [exp.column("tile")]
            final = exp.select(*columns).from_(exp.to_table(root, quoted=True))
        select = final.copy()
        for name, cte in steps:  # copy=False: each step is copied once, not the whole query per step
            select = select.with_(name, as_=cte.copy(), materialized=materialized or None, copy=False)
        return select

    def sql(self, pretty: bool = True, dialect: Dialect = DUCKDB) -> str:
        """The whole program as one query in ``dialect`` (rendered once per ``pretty``,
        dialect and set of enabled fusions, which the dialect reads)."""
        key = (pretty, dialect, passes.enabled)
        if key not in self.rendered:
            self.rendered[key] = dialect.render(self.query(dialect.materialized), pretty)[0]
        return self.rendered[key]

    def union_query(self, results: dict[str, Node]) -> exp.Select:
        """Several results of one compiled DAG in one query: every step a materialized CTE,
        then ``target, k0, ..., tile`` rows of each result (``target`` its key in ``results``;
        keys past a result's rank are NULL)."""
        rank = max((len(node.shape) for node in results.values()), default=0)
        parts = []
        for target, node in results.items():
            keys = [exp.column(key(d)) if d < len(node.shape) else exp.cast(exp.Null(), "INTEGER")
                    for d in range(rank)]
            columns = [exp.alias_(exp.Literal.string(target), "target"), *select_keys(keys, exp.column("tile"))]
            parts.append(exp.select(*columns).from_(exp.to_table(self.refs[id(node)], quoted=True)))
        select = parts[0]
        for part in parts[1:]:
            select = exp.union(select, part, distinct=False)
        for name, cte, _ in self.ctes:
            select = select.with_(name, as_=cte.copy(), materialized=True, copy=False)
        return select
