"""Running a plan. A plan that fits in memory runs as one SQL program (the rebuilt DAG). One
that does not runs staged: one statement per node into a table (tables spill, a statement's
lists do not), and an op whose working set is over the budget runs in bands of its tile grid,
each band a statement with key ranges on the operands (``k BETWEEN lo AND hi``) appended to
the result; bands across an aggregated index write partial results that a last einsum sums.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import replace
from math import ceil
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa
from sqlglot import exp

from tra_sql import catalog
from tra_sql.catalog import TensorInfo
from tra_sql.decompose.cost import Budget, Constants, op_cost, parse_bytes, repartition_bands, retile_traffic
from tra_sql.decompose.plan import Plan, make_plan
from tra_sql.decompose.problem import extract, is_retile
from tra_sql.einsum import EinsumSpec
from tra_sql.errors import TraError
from tra_sql.graph import Einsum, Node, Place, Source, topological
from tra_sql.sqlgen import Program, key

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor

#: Auto-planning leaves programs alone whose inputs are smaller than this (bytes).
AUTO_MIN_BYTES = 256 * 2**20


def session_budget(session: Session, workers: int | None = None, memory=None) -> tuple[int, float]:
    """(workers, bytes per worker): DuckDB's threads and memory_limit unless given."""
    rows = session.con.execute("SELECT current_setting('threads'), current_setting('memory_limit')").fetchall()
    threads, limit = rows[0]
    workers = int(workers or threads)
    per_worker = parse_bytes(memory) if memory is not None else parse_bytes(str(limit).replace(" ", "")) / workers
    return workers, per_worker


def plan(session: Session, tensor: Tensor, workers=None, memory=None, **kw) -> Plan:
    from tra_sql.decompose.calibrate import load

    workers, per_worker = session_budget(session, workers, memory)
    return make_plan(tensor.node, workers, per_worker, load(session.con) or Constants(), **kw)


def _sparse(session, node: Source) -> bool:
    """Whether the stored relation lacks some of its tiles (a sparse relation)."""
    rows = session.con.execute(f'SELECT count(*) FROM "{node.table}"').fetchall()[0][0]
    return rows < int(np.prod(node.grid, dtype=np.int64))


def auto(tensor: Tensor) -> Plan | None:
    """The plan ``numpy()`` follows by default: none for small programs (inputs under
    ``AUTO_MIN_BYTES``); otherwise the DP's plan when the tiling as written does not fit in
    memory, or when the plan is predicted at least 30% and 0.5 s faster."""
    if not isinstance(getattr(tensor.session, "con", None), duckdb.DuckDBPyConnection):
        return None  # the planner's constants and staging are DuckDB's
    leaves = [n for n in topological(tensor.node) if isinstance(n, Source)]
    if not any(isinstance(n, Einsum) for n in topological(tensor.node)):
        return None
    if sum(n.dtype.itemsize * int(np.prod(n.shape)) for n in leaves) < AUTO_MIN_BYTES:
        return None
    if any(_sparse(tensor.session, n) for n in leaves):
        return None  # the cost model prices dense relations; sparse ones run as written
    p = plan(tensor.session, tensor, yardsticks=False)
    written = p.written_cost
    if not np.isfinite(written) or (p.cost < 0.7 * written and written - p.cost > 0.5):
        return p
    return None


def resolve(tensor: Tensor, plan_: Plan | bool | None) -> Plan | None:
    if plan_ is None:
        return auto(tensor)
    if plan_ is False:
        return None
    if not isinstance(plan_, Plan):
        raise TraError(f"plan must be a Plan from db.plan(), got {type(plan_).__name__}")
    if plan_.root is not tensor.node:
        raise TraError("this plan was made for another tensor: call db.plan() on this one")
    return plan_


def arrow(tensor: Tensor, plan_: Plan | None) -> pa.Table:
    """The tensor's tile relation under ``plan_`` (as written if None)."""
    if plan_ is None:
        return tensor.session.run(tensor.program())
    root = plan_.apply()
    if not plan_.staged:
        return tensor.session.run(Program.compile(root))
    table = run_staged(tensor.session, root, plan_)
    try:
        return tensor.session.con.sql(f'SELECT * FROM "{table}"').to_arrow_table()
    finally:
        if not isinstance(root, Source):
            _drop(tensor.session, [table])


def numpy(tensor: Tensor, plan_: Plan) -> np.ndarray:
    root = plan_.apply()
    info = TensorInfo(tensor.name or root.label, root.dtype, root.shape, root.tile)
    return catalog.assemble(info, arrow(tensor, plan_))


def store(tensor: Tensor, name: str, replace_: bool, plan_: Plan | None) -> Tensor:
    from tra_sql.tensor import Tensor

    session = tensor.session
    if plan_ is None:
        return session.store(tensor, name, replace=replace_)
    root = plan_.apply()
    if not plan_.staged:
        return session.store(Tensor(session, root), name, replace=replace_)
    table = run_staged(session, root, plan_)
    try:
        info = TensorInfo(name, root.dtype, root.shape, root.tile)
        catalog.create_tensor_table(session.con, info, f'SELECT * FROM "{table}"', replace_)
    finally:
        if not isinstance(root, Source):
            _drop(session, [table])
    return session.tensor(name)


# -- staged execution --------------------------------------------------------------------

def run_staged(session: Session, root: Node, plan_: Plan) -> str:
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
            inputs = tuple(Source(c.shape, c.dtype, c.tile, tables[id(c)]) for c in node.inputs)
            local = (replace(node, operands=inputs) if isinstance(node, Einsum)
                     else replace(node, sources=inputs) if isinstance(node, Place) else node)
            table = f"_tra_stage_{tag}_{k}"
            materialize(session, local, table, plan_.consts, budget)
            tables[id(node)] = table
            owned.add(table)
            done = [tables[id(c)] for c in node.inputs if last_use.get(id(c)) == k and tables[id(c)] in owned]
            _drop(session, done)
            owned -= set(done)
    except BaseException:
        _drop(session, sorted(owned))
        raise
    return tables[id(root)]


def _drop(session: Session, tables: list[str]) -> None:
    for t in tables:
        session.con.execute(f'DROP TABLE IF EXISTS "{t}"').fetchall()


def _create(session: Session, table: str, rank: int) -> None:
    cols = ", ".join([f"{key(d)} INTEGER" for d in range(rank)] + ["tile BLOB"])
    session.con.execute(f'CREATE TABLE "{table}" ({cols})').fetchall()


def bands(node: Einsum, consts: Constants, budget: Budget, reduce: bool = False) -> list[int]:
    """Bands per index (spec.indices order): first across aggregated indices, as many as a
    group needs to fit a worker, then across output indices (largest grid first) until one
    band's working set fits the statement budget."""
    op = extract(node).ops[0]
    q = np.array([ceil(n / node.tiles[c]) for c, n in zip(op.indices, op.sizes)], dtype=np.int64)
    cost = op_cost(op, q[None, :], consts, budget)
    need, need_agg = float(cost.bands[0]), float(cost.agg_bands[0])
    if reduce and need_agg >= float(np.prod([q[i] for i in op.agg])):
        need_agg = 1.0  # adding up partials one at a time would not shrink them: one pass
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
    for i in [] if reduce else sorted(op.agg, key=lambda i: -q[i]):
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


def _retile_bands(node: Place, select: exp.Select, consts: Constants, budget: Budget) -> list[str]:
    """A re-tiling as bands of its output tile grid, each reading only the source tiles that
    overlap it (key ranges on the source scan and on the output keys)."""
    src = node.sources[0]
    pieces, _ = retile_traffic(src.shape, src.dtype.itemsize, src.tile, node.tile)
    need = float(repartition_bands(pieces, src.dtype.itemsize * float(np.prod(src.tile)), consts, budget))
    if need <= 1:
        return [select.sql(dialect="duckdb")]
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
        out.append(query.sql(dialect="duckdb"))
    return out


def materialize(session: Session, node: Node, table: str, consts: Constants, budget: Budget,
                reduce: bool = False) -> None:
    """Create ``table`` holding ``node``'s tiles (its inputs are stored tables)."""
    program = Program.compile(node)
    session._prepare(program)
    select = program.query()
    _create(session, table, len(node.shape))
    if is_retile(node):
        for sql in _retile_bands(node, select, consts, budget):
            session.con.execute(f'INSERT INTO "{table}" {sql}').fetchall()
        return
    if not isinstance(node, Einsum):
        session.con.execute(f'INSERT INTO "{table}" {select.sql(dialect="duckdb")}').fetchall()
        return
    b = bands(node, consts, budget, reduce)
    idx = node.spec.indices
    grid = [ceil(node.sizes[c] / node.tiles[c]) for c in idx]
    split_agg = [i for i, c in enumerate(idx) if c not in node.spec.output and b[i] > 1]
    partial = f"{table}_p{uuid.uuid4().hex[:6]}" if split_agg else None
    if partial:
        _create(session, partial, len(node.shape) + 1)
    agg_boxes = list(itertools.product(*[_ranges(grid[i], b[i]) for i in split_agg]))
    out_pos = [i for i, c in enumerate(idx) if c in node.spec.output]
    for box in itertools.product(*[_ranges(grid[i], b[i]) for i in out_pos]):
        for s, agg_box in enumerate(agg_boxes):
            ranges = dict(zip(out_pos, box)) | dict(zip(split_agg, agg_box))
            query = select.copy()
            for i, (lo, hi) in ranges.items():
                if (lo, hi) == (0, grid[i] - 1):
                    continue
                for m, sub in enumerate(node.spec.inputs):
                    for d, c in enumerate(sub):
                        if c == idx[i]:
                            query = query.where(exp.Between(this=exp.column(key(d), f"x{m}"),
                                                            low=exp.Literal.number(lo), high=exp.Literal.number(hi)))
            sql = query.sql(dialect="duckdb")
            if partial:
                keys = ", ".join([f"{s} AS k0"] + [f"{key(d)} AS {key(d + 1)}" for d in range(len(node.shape))])
                sql = f'INSERT INTO "{partial}" SELECT {keys}, tile FROM ({sql})'
            else:
                sql = f'INSERT INTO "{table}" {sql}'
            session.con.execute(sql).fetchall()
    if partial:
        free = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in node.spec.output)
        src = Source((len(agg_boxes),) + node.shape, node.dtype, (1,) + node.tile, partial)
        total = Einsum(node.shape, node.dtype, node.tile, EinsumSpec((free + node.spec.output,), node.spec.output),
                       (src,), None, node.agg)
        session.con.execute(f'DROP TABLE "{table}"').fetchall()
        try:
            materialize(session, total, table, consts, budget, reduce=True)
        finally:
            _drop(session, [partial])

