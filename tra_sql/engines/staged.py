"""Staged execution of a plan: one statement per node into a table (tables spill, a
statement's lists do not), and an op whose working set is over the budget in bands of its
tile grid, each band a statement that reads its operands in key ranges. Bands across an
aggregated index read their tiles by key value (through an index, where the engine has
them) and run in sequence, each adding the partial result of the bands before it into its
own (out of core: a few tiles in memory at a time). An engine takes part through its
``Stages`` (tables created, filled by a query, dropped): DuckDB's are here, Spark's in
``tra_sql.backends.spark_staged``.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import replace
from math import ceil
from typing import TYPE_CHECKING

import numpy as np
from sqlglot import exp

from tra_sql import graph
from tra_sql.aggregates import AGGREGATES
from tra_sql.compile.blocks import key
from tra_sql.compile.dialect import DUCKDB, Dialect
from tra_sql.compile.program import Program
from tra_sql.decompose.cost import Budget, Constants, op_cost, repartition_bands, retile_traffic
from tra_sql.decompose.problem import extract, is_retile
from tra_sql.einsum import EinsumSpec
from tra_sql.engines.duckdb_catalog import STAGE_PREFIX
from tra_sql.errors import TraError
from tra_sql.graph import Einsum, Node, Place, Source, topological, with_inputs

if TYPE_CHECKING:
    from tra_sql.decompose.plan import Plan
    from tra_sql.engines.base import Engine
    from tra_sql.engines.duckdb import DuckDBEngine


class Stages(ABC):
    """What the staged executor asks of ``engine``: tile tables created, filled by queries
    (sqlglot SELECTs of ``k0..``, ``tile`` rendered in ``dialect``) and dropped; an index on a
    key column and scans through it where the engine has them."""

    dialect: Dialect

    def __init__(self, engine: Engine):
        self.engine = engine

    @abstractmethod
    def create(self, table: str, rank: int, temp: bool = False) -> None:
        """An empty tile table of a rank-``rank`` tensor (``temp``: the engine may keep it
        out of its catalog)."""

    @abstractmethod
    def insert(self, table: str, query: exp.Select) -> None:
        """Append the rows of ``query`` to ``table``."""

    @abstractmethod
    def drop(self, tables: list[str]) -> None:
        """Drop ``tables`` (those that exist)."""

    def index(self, table: str, column: str) -> bool:
        """An index on ``column`` of ``table`` if the engine has indexes (False: it cannot)."""
        return False

    def keyed(self, threaded_kernel: bool = False) -> contextlib.AbstractContextManager:
        """A context in which scans by key value go through the indexes; ``threaded_kernel``:
        the op's kernel runs on every core itself (a BLAS product)."""
        return contextlib.nullcontext()


class DuckDBStages(Stages):
    """DuckDB's: tables (tiles uncompressed: reading one tile of a ZSTD-compressed segment,
    which DuckDB picks for large blobs, decompresses most of the segment) and ART indexes."""

    dialect = DUCKDB
    engine: DuckDBEngine

    def create(self, table: str, rank: int, temp: bool = False) -> None:
        cols = ", ".join([f"{key(d)} INTEGER" for d in range(rank)] + ["tile BLOB USING COMPRESSION uncompressed"])
        self.engine.con.execute(f'CREATE {"TEMP " if temp else ""}TABLE "{table}" ({cols})').fetchall()

    def insert(self, table: str, query: exp.Select) -> None:
        self.engine.con.execute(f'INSERT INTO "{table}" {self.dialect.render(query)[0]}').fetchall()

    def drop(self, tables: list[str]) -> None:
        for t in tables:
            self.engine.con.execute(f'DROP TABLE IF EXISTS "{t}"').fetchall()

    def index(self, table: str, column: str) -> bool:
        """An ART index (views and read-only databases go without)."""
        try:
            self.engine.con.execute(f'CREATE INDEX IF NOT EXISTS "_tra_ix_{table}_{column}" '
                                    f'ON "{table}" ({column})').fetchall()
        except self.engine.Error:
            return False
        return True

    def keyed(self, threaded_kernel: bool = False):
        """Without DuckDB's join filter pushdown, which adds a range filter to a probe-side
        scan at run time and turns it back into a full table scan; on one DuckDB thread when
        the kernel is threaded: a band's statement joins a few tiles in one pipeline, and a
        second DuckDB thread only contends with the kernel's (a 2048 x 62500 x 2048 float32
        matmul in 20 bands: 5.0 s on two DuckDB threads, 4.25 s on one, bench/RESULTS.md)."""
        before = self.engine.setting("disabled_optimizers")
        values = {"disabled_optimizers": ",".join(x for x in [before, "join_filter_pushdown"] if x)}
        return self.engine.settings(**values, **({"threads": 1} if threaded_kernel else {}))


@contextlib.contextmanager
def computed(stages: Stages, root: Node, plan_: Plan) -> Iterator[str]:
    """The table holding ``root`` computed by ``run_staged``, while the ``with`` block runs;
    then it is dropped (unless ``root`` is a stored tensor)."""
    table = run_staged(stages, root, plan_)
    try:
        yield table
    finally:
        if not isinstance(root, Source):
            stages.drop([table])


def run_staged(stages: Stages, root: Node, plan_: Plan) -> str:
    """Compute every node of ``root``'s DAG into its own table, node by node, each op in as
    many bands as its working set needs; returns the root's table (the caller drops it)."""
    order = topological(root)
    last_use = {id(c): k for k, node in enumerate(order) for c in node.inputs}
    tag = uuid.uuid4().hex[:8]
    tables: dict[int, str] = {}
    owned: set[str] = set()
    budget = plan_.model.budget
    try:
        for k, node in enumerate(order):
            if isinstance(node, Source):
                tables[id(node)] = node.table
                continue
            inputs = tuple(Source(c.shape, c.dtype, c.tile, tables[id(c)], c.layout) for c in node.inputs)
            local = with_inputs(node, inputs) if inputs else node
            table = f"{STAGE_PREFIX}{tag}_{k}"
            owned.add(table)  # before it exists: a failure inside materialize drops it too
            materialize(stages, local, table, plan_.consts, budget)
            tables[id(node)] = table
            done = [tables[id(c)] for c in node.inputs if last_use.get(id(c)) == k and tables[id(c)] in owned]
            stages.drop(done)
            owned -= set(done)
    except BaseException as err:
        stages.drop(sorted(owned))
        if isinstance(err, stages.engine.Error) and not isinstance(err, TraError):
            raise stages.engine.translate(err, f"computing {root.label} in stages") from None
        raise
    return tables[id(root)]


def bands(node: Einsum, consts: Constants, budget: Budget) -> list[int]:
    """Bands per index (spec.indices order): first across aggregated indices, as many as a
    group needs to fit a worker, then across output indices (largest grid first) until one
    band's working set fits the statement budget."""
    op = extract(node).ops[0]
    q = np.array([ceil(n / node.tiles[c]) for c, n in zip(op.indices, op.sizes)], dtype=np.int64)
    cost = op_cost(op, q[None, :], consts, budget)
    need, need_agg = float(cost.bands[0]), float(cost.agg_bands[0])
    b = [1] * len(q)
    for i in sorted(op.agg, key=lambda i: -q[i]):
        if need_agg <= 1:
            break
        b[i] = int(min(q[i], ceil(need_agg)))
        need_agg /= b[i]
    if need / float(np.prod(b)) <= 1:
        return b
    for i in op.out:  # one output tile per statement: DuckDB's list() memory grows with the groups
        b[i] = int(q[i])
    need /= float(np.prod(b))
    for i in sorted(op.agg, key=lambda i: -q[i]):
        if need <= 1:
            break
        more = int(min(q[i] // b[i], ceil(need)))
        if more > 1:
            b[i] *= more
            need /= more
    return b


def _ranges(n: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _retile_bands(node: Place, select: exp.Select, consts: Constants, budget: Budget) -> list[exp.Select]:
    """A re-tiling as bands of its output tile grid, each reading only the source tiles that
    overlap it (key ranges on the source scan and on the output keys)."""
    src = node.sources[0]
    pieces, _ = retile_traffic(src.shape, src.dtype.itemsize, src.tile, node.tile)
    need = float(repartition_bands(pieces, src.dtype.itemsize * float(np.prod(src.tile)), consts, budget))
    if need <= 1:
        return [select]
    b = list(node.grid)  # one output tile per statement: DuckDB's list() memory grows with the groups
    out = []
    for box in itertools.product(*[_ranges(g, x) for g, x in zip(node.grid, b)]):
        query = select.copy()
        pieces = query.args["from_"].this.this
        for d, (lo, hi) in enumerate(box):
            if (lo, hi) == (0, node.grid[d] - 1):
                continue
            first = lo * node.tile[d] // src.tile[d]
            last = (min((hi + 1) * node.tile[d], node.shape[d]) - 1) // src.tile[d]
            pieces = pieces.where(exp.Between(this=exp.column(key(d), "s"), low=exp.Literal.number(first),
                                              high=exp.Literal.number(last)))
            query = query.where(exp.Between(this=exp.column(f"o{d}", "p"), low=exp.Literal.number(lo),
                                            high=exp.Literal.number(hi)))
        query.args["from_"].this.set("this", pieces)
        out.append(query)
    return out


def materialize(stages: Stages, node: Node, table: str, consts: Constants, budget: Budget) -> None:
    """Create ``table`` holding ``node``'s tiles (its inputs are stored tables)."""
    program = Program.compile(node)
    stages.engine.ensure_kernels(program.kernels)
    select = program.query(stages.dialect.materialized)
    stages.create(table, len(node.shape))
    if is_retile(node):
        for query in _retile_bands(node, select, consts, budget):
            stages.insert(table, query)
        return
    if not isinstance(node, Einsum):
        stages.insert(table, select)
        return
    b = bands(node, consts, budget)
    idx = node.spec.indices
    split_agg = [i for i, c in enumerate(idx) if c not in node.spec.output and b[i] > 1]
    for m in range(len(node.operands)):
        _index_keys(stages, node, m, [idx[i] for i in split_agg])
    with stages.keyed(extract(node).ops[0].blas) if split_agg else contextlib.nullcontext():
        _run_bands(stages, node, table, b, split_agg)


def _run_bands(stages: Stages, node: Einsum, table: str, b: list[int], split_agg: list[int]) -> None:
    """``node`` into ``table`` in ``b`` bands per index: for each band of the aggregated
    indices ``split_agg`` in turn, every output band, each adding the previous partial result.
    A band's operands are the slices of ``node``'s it reads, keyed from 0 along the
    aggregated indices (a ReKey), so a band of one tile per aggregated index runs as an
    unsplit contraction: one kernel call per joined row, no list()."""
    idx = node.spec.indices
    grid = [ceil(node.sizes[c] / node.tiles[c]) for c in idx]
    out_pos = [i for i, c in enumerate(idx) if c in node.spec.output]
    agg_boxes = list(itertools.product(*[_ranges(grid[i], b[i]) for i in split_agg]))
    acc = None
    engine, materialized = stages.engine, stages.dialect.materialized
    keyed = node.agg == "sum" and not engine.completeness()(node)  # bands may lack tiles: add as a keyed sum
    partial: list[str] = []  # tables of earlier bands, dropped on failure too
    try:
        for s, agg_box in enumerate(agg_boxes):
            target = table if s == len(agg_boxes) - 1 else f"{table}_a{s}"
            into = f"{table}_b{s}" if keyed and acc is not None else target  # the band alone, then added
            for t in {target, into} - {table}:
                partial.append(t)
                stages.create(t, len(node.shape), temp=True)
            shift = {idx[i]: lo for i, (lo, _) in zip(split_agg, agg_box)}
            band = _band(node, {idx[i]: r for i, r in zip(split_agg, agg_box)})
            program = Program.compile(band if acc is None or into != target else _accumulate(band, acc))
            engine.ensure_kernels(program.kernels)
            for box in itertools.product(*[_ranges(grid[i], b[i]) for i in out_pos]):
                ranges = dict(zip(out_pos, box)) | dict(zip(split_agg, agg_box))
                query = _restrict(program.query(materialized), node,
                                  {idx[i]: r for i, r in ranges.items() if r != (0, grid[i] - 1)}, shift)
                stages.insert(into, query)
            if into != target:
                added = Program.compile(graph.add([Source(node.shape, node.dtype, node.tile, into, node.layout), acc]))
                engine.ensure_kernels(added.kernels)
                stages.insert(target, added.query(materialized))
                stages.drop([into])
            if acc is not None:
                stages.drop([acc.table])
            acc = Source(node.shape, node.dtype, node.tile, target, node.layout)
    except BaseException:
        stages.drop(partial)
        raise


def _band(node: Einsum, ranges: dict[str, tuple[int, int]]) -> Einsum:
    """``node`` over the slices of its operands in tile ranges ``ranges`` of some of its
    aggregated indices (operands read under the same table names, rekeyed by ``_restrict``)."""
    def extent(c: str, n: int, t: int) -> int:
        lo, hi = ranges[c]
        return min((hi + 1) * t, n) - lo * t

    operands = tuple(Source(tuple(extent(c, n, t) if c in ranges else n for c, n, t in zip(sub, x.shape, x.tile)),
                            x.dtype, x.tile, x.table, x.layout) for sub, x in zip(node.spec.inputs, node.operands))
    return replace(node, operands=operands)


def _accumulate(node: Einsum, acc: Source) -> Einsum:
    """``node`` combined with the partial result ``acc`` of the bands before (the kernel adds
    it to each contracted tile: an epilogue of the contraction); both have every tile."""
    out = node.spec.output
    return Einsum(node.shape, node.dtype, node.tile, EinsumSpec((out, out), out), (node, acc),
                  AGGREGATES[node.agg].combine, "sum")


def _index_keys(stages: Stages, node: Einsum, m: int, indices: list[str]) -> None:
    """An index on each key column of operand ``m`` that a band selects by value: a scan
    through it loads only the selected tiles, where a DuckDB table scan loads every tile of
    each 2048-row vector it touches (see ``cost.scan_memory``)."""
    table = node.operands[m].table
    for d, c in enumerate(node.spec.inputs[m]):
        if c in indices and not stages.index(table, key(d)):
            return


def _restrict(query: exp.Select, node: Einsum, ranges: dict[str, tuple[int, int]], shift: dict[str, int]) -> exp.Select:
    """``query`` with each operand of ``node`` read only in the given key ranges per index:
    a range (``BETWEEN``) on output indices; on the aggregated indices in ``shift`` one
    equality scan per key value (``UNION ALL``), which DuckDB runs through the key's index,
    with the key lowered by ``shift`` (the band's slice keyed from 0)."""
    for m, (sub, operand) in enumerate(zip(node.spec.inputs, node.operands)):
        mine = [(d, c) for d, c in enumerate(sub) if c in ranges]
        if not mine:
            continue
        exact = [(d, c) for d, c in mine if c in shift]
        columns = [exp.alias_(exp.Sub(this=exp.column(key(d)), expression=exp.Literal.number(shift[c])), key(d))
                   if c in shift else exp.column(key(d)) for d, c in enumerate(sub)] + [exp.column("tile")]
        scans = []
        for value in itertools.product(*[range(ranges[c][0], ranges[c][1] + 1) for _, c in exact]):
            scan = exp.select(*[col.copy() for col in columns]).from_(
                exp.Table(this=exp.to_identifier(operand.table, quoted=True)))
            for (d, _), v in zip(exact, value):
                scan = scan.where(exp.EQ(this=exp.column(key(d)), expression=exp.Literal.number(v)))
            for d, c in mine:
                if c not in shift:
                    scan = scan.where(exp.Between(this=exp.column(key(d)), low=exp.Literal.number(ranges[c][0]),
                                                  high=exp.Literal.number(ranges[c][1])))
            scans.append(scan)
        union = scans[0]
        for scan in scans[1:]:
            union = exp.union(union, scan, distinct=False)
        alias = f"x{m}"
        for t in list(query.find_all(exp.Table)):
            if t.name == operand.table and t.alias == alias:
                t.replace(exp.Subquery(this=union.copy(), alias=exp.TableAlias(this=exp.to_identifier(alias))))
    return query
