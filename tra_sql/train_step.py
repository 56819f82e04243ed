"""A training step as SQL: several roots (the loss, the optimizer's new weights and state)
evaluated together, every node they share once: one fused query when the intermediates fit,
else statements into temp tables (``compile_step``), run by ``run_step``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from tra_sql import graph
from tra_sql.compile.dialect import DUCKDB
from tra_sql.compile.program import Program
from tra_sql.graph import Fill, Node, Source

if TYPE_CHECKING:
    from tra_sql.session import Session


@dataclass
class Step:
    """SQL statements that store several roots into temp tables, evaluating every node
    shared between them once (into a temp table of its own)."""

    statements: list[tuple[str, str]]
    udfs: set[str]
    tables: dict[str, str]
    nodes: dict[str, Node]
    prologue: list[tuple[str, str]] = field(default_factory=list)
    #: each table's program, prologue's and statements' in order (for engines other than DuckDB)
    programs: dict[str, Program] = field(default_factory=dict)
    #: one query of every root's rows (``Program.union_query``) in place of the statements, if it fits
    fused: str | None = None


def _consumers(roots: Sequence[Node]) -> tuple[list[Node], dict[int, int]]:
    order: list[Node] = []
    seen: set[int] = set()
    uses: dict[int, int] = {}
    for root in roots:
        uses[id(root)] = uses.get(id(root), 0) + 1
        for node in graph.topological(root):
            if id(node) not in seen:
                seen.add(id(node))
                order.append(node)
                for child in {id(c): c for c in node.inputs}.values():
                    uses[id(child)] = uses.get(id(child), 0) + 1
    return order, uses


def _rebuild(root: Node, subst: dict[int, Node], memo: dict[int, Node]) -> Node:
    """``root`` with the nodes in ``subst`` replaced (``memo``: the nodes rebuilt so far)."""
    for node in graph.topological(root):
        if id(node) in subst:
            memo[id(node)] = subst[id(node)]
        elif id(node) not in memo:
            memo[id(node)] = graph.with_inputs(node, [memo[id(c)] for c in node.inputs]) if node.inputs else node
    return memo[id(root)]


def compile_step(roots: dict[str, Node], prefix: str, views: frozenset[str] = frozenset(),
                 fuse_bytes: float = 0) -> Step:
    """A ``Step`` storing each root into temp table ``<prefix>_<key>``. Sources that are
    ``views`` (lower-case names: relations, which pack their tiles when read) are copied into
    temp tables by the plan's prologue, which ``run_step`` runs only when asked to. If the
    computed nodes hold at most ``fuse_bytes`` (dense), the roots are computed by the one
    ``fused`` query instead of statements."""
    order, uses = _consumers(list(roots.values()))
    fits = sum(prod(n.shape) * n.dtype.itemsize for n in order if not isinstance(n, Source)) <= fuse_bytes
    wanted = {id(n): key for key, n in roots.items()}
    subst: dict[int, Node] = {}
    view_subst: dict[int, Node] = {}
    statements, prologue, udfs, tables, programs = [], [], set(), {}, {}
    for node in order:
        view = isinstance(node, Source) and node.table.lower() in views
        shared = not isinstance(node, (Source, Fill)) and uses.get(id(node), 0) > 1
        if id(node) not in wanted and not (shared or view):
            continue
        number = len(statements) + len(prologue)
        table = f"{prefix}_{wanted[id(node)]}" if id(node) in wanted else f"{prefix}__s{number}"
        if id(node) in wanted:
            tables[wanted[id(node)]] = table
        if fits and not view:  # computed by the fused query
            continue
        program = Program.compile(_rebuild(node, subst, {}))
        (prologue if view else statements).append(
            (table, f'CREATE OR REPLACE TEMP TABLE "{table}" AS {program.sql(pretty=False)}'))
        udfs |= program.kernels
        programs[table] = program
        subst[id(node)] = Source(node.shape, node.dtype, node.tile, table, node.layout)
        if view:
            view_subst[id(node)] = subst[id(node)]
    fused = None
    if fits:
        memo: dict[int, Node] = {}
        results = {key: _rebuild(node, view_subst, memo) for key, node in roots.items()}
        program = Program.compile(*results.values())
        fused, called = DUCKDB.render(program.union_query(results))
        udfs |= program.kernels | called
    return Step(statements, udfs, tables, dict(roots), prologue, programs, fused)


class FusedOutOfMemory(Exception):
    """A step's ``fused`` query ran out of memory (it wrote nothing; the staged statements may fit)."""


def run_step(db: Session, step: Step, prologue: bool = True) -> pa.Table | None:
    """Run a step, after its prologue if ``prologue`` (the engine's errors become
    ``TraError``s): its ``fused`` query, whose rows it returns, or else its statements."""
    engine = db.engine
    engine.ensure_kernels(step.udfs)
    for table, sql in (step.prologue if prologue else []) + step.statements:
        try:
            engine.rows(sql)
        except engine.Error as err:
            raise engine.translate(err, f"computing {table}") from None
    if step.fused:
        try:
            return engine.arrow(step.fused)
        except engine.OutOfMemory:
            raise FusedOutOfMemory from None
        except engine.Error as err:
            raise engine.translate(err, f"computing {', '.join(step.tables)}") from None
    return None


def scalar_value(db: Session, table: str, dtype: np.dtype) -> float:
    """The value of a stored scalar tensor (0 if its one tile is absent)."""
    rows = db.engine.rows(f'SELECT tile FROM "{table}"')
    return float(np.frombuffer(rows[0][0], dtype=dtype)[0]) if rows else 0.0
