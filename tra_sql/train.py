"""Training in the database: parameters, a step as SQL, and a resumable loop.

- ``parameter(db, "W1", (64, 32), init="glorot_uniform")`` stores a parameter tensor (or
  returns the stored one, so a resumed script picks up where it stopped).
- A step evaluates the loss, the gradients (``tra_sql.autodiff``) and the optimizer's new
  weights and state (``tra_sql.optim``), shared intermediates once: in one query whose steps
  are materialized CTEs when they fit in half of DuckDB's memory_limit, else as SQL statements
  into staging tables (which spill); then, in one transaction, it copies the new values into
  the weight and state tables and advances the run's step counter (table ``tra_runs``). A step
  that is interrupted leaves the tables as they were; ``train`` with the same ``run`` resumes.
- ``train`` loops over epochs (and batches), shows a tqdm bar with the loss, and logs every
  epoch's mean loss and time in table ``tra_run_log``.
- ``Dropout`` draws its masks in SQL from (seed, step), so a resumed run draws the same ones.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import ceil, prod, sqrt
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp
from tqdm.auto import tqdm

from tra_sql import autodiff, catalog, graph, relations
from tra_sql.compile.blocks import grid_table
from tra_sql.compile.program import Program
from tra_sql.duckdb_errors import translate
from tra_sql.errors import ShapeError, SpecError, TraError
from tra_sql.graph import Fill, Node, Source
from tra_sql.optim import Optimizer
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor

RUNS = "tra_runs"
STAGED = "_tra_staged"  # a fused step's rows, registered while they are committed
LOG = "tra_run_log"


# -- parameters ------------------------------------------------------------------------------
def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) for a weight used as ``x @ W`` (inputs on the leading axes)."""
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    return prod(shape[:-1]), shape[-1]


def initial_value(shape: tuple[int, ...], init, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """An initial array: ``zeros``, ``ones``, ``normal`` (std ``scale``, default 1),
    ``uniform`` (±``scale``, default 1), ``glorot_uniform``/``xavier_uniform``,
    ``glorot_normal``, ``he_normal``, ``fan_in_uniform`` (±1/sqrt(fan_in), PyTorch's Linear
    default); an array; or a function ``(rng, shape) -> array``."""
    fan_in, fan_out = _fans(shape)
    if callable(init):
        return np.asarray(init(rng, shape))
    if not isinstance(init, str):
        array = np.asarray(init)
        if array.shape != tuple(shape):
            raise ShapeError(f"initial value has shape {array.shape}, expected {tuple(shape)}")
        return array
    s = scale
    table = {
        "zeros": lambda: np.zeros(shape),
        "ones": lambda: np.ones(shape),
        "normal": lambda: rng.standard_normal(shape) * (1.0 if s is None else s),
        "uniform": lambda: rng.uniform(-(s or 1.0), s or 1.0, shape),
        "glorot_uniform": lambda: rng.uniform(-1, 1, shape) * sqrt(6 / (fan_in + fan_out)),
        "xavier_uniform": lambda: rng.uniform(-1, 1, shape) * sqrt(6 / (fan_in + fan_out)),
        "glorot_normal": lambda: rng.standard_normal(shape) * sqrt(2 / (fan_in + fan_out)),
        "he_normal": lambda: rng.standard_normal(shape) * sqrt(2 / fan_in),
        "fan_in_uniform": lambda: rng.uniform(-1, 1, shape) / sqrt(fan_in),
    }
    if init not in table:
        raise SpecError(f"initializer {init!r} is not one of {', '.join(table)}")
    return table[init]()


def parameter(db: Session, name: str, shape=None, init="glorot_uniform", *, seed: int = 0, dtype="float64",
              tile=None, scale: float | None = None) -> Tensor:
    """The parameter tensor ``name``: the stored one if it exists (a resumed run), else a new
    one drawn by ``init`` from a generator seeded with (``seed``, the name)."""
    if name.lower() in (t.lower() for t in db.tensors()):
        return db.tensor(name)
    if shape is None:
        shape = np.shape(init)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    value = initial_value(tuple(int(n) for n in shape), init, rng, scale).astype(dtype)
    return db.from_numpy(name, value, tile=tile)


# -- evaluating several roots with shared intermediates ---------------------------------------
@dataclass
class Plan:
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


def _rebuild(node: Node, subst: dict[int, Node], memo: dict[int, Node]) -> Node:
    if id(node) in subst:
        return subst[id(node)]
    if id(node) in memo:
        return memo[id(node)]
    new = graph.with_inputs(node, [_rebuild(c, subst, memo) for c in node.inputs]) if node.inputs else node
    memo[id(node)] = new
    return new


def plan(roots: dict[str, Node], prefix: str, views: frozenset[str] = frozenset(), fuse_bytes: float = 0) -> Plan:
    """A ``Plan`` storing each root into temp table ``<prefix>_<key>``. Sources that are
    ``views`` (lower-case names: relations, which pack their tiles when read) are copied into
    temp tables by the plan's prologue, which ``execute`` runs only when asked to. If the
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
        fused = program.union_query(results).sql(dialect="duckdb")
        udfs |= program.kernels
    return Plan(statements, udfs, tables, dict(roots), prologue, programs, fused)


class FusedOutOfMemory(Exception):
    """A plan's ``fused`` query ran out of memory (it wrote nothing; the staged statements may fit)."""


def execute(db: Session, p: Plan, prologue: bool = True) -> pa.Table | None:
    """Run a plan, after its prologue if ``prologue`` (the engine's errors become
    ``TraError``s): its ``fused`` query, whose rows it returns, or else its statements."""
    db.ensure_udfs(p.udfs)
    for table, sql in (p.prologue if prologue else []) + p.statements:
        try:
            db.con.execute(sql).fetchall()
        except duckdb.Error as err:
            raise translate(err, f"computing {table}") from None
    if p.fused:
        try:
            return db.con.sql(p.fused).to_arrow_table()
        except duckdb.OutOfMemoryException:
            raise FusedOutOfMemory from None
        except duckdb.Error as err:
            raise translate(err, f"computing {', '.join(p.tables)}") from None
    return None


def scalar_value(db: Session, table: str, dtype: np.dtype) -> float:
    """The value of a stored scalar tensor (0 if its one tile is absent)."""
    rows = db.con.execute(f'SELECT tile FROM "{table}"').fetchall()
    return float(np.frombuffer(rows[0][0], dtype=dtype)[0]) if rows else 0.0


# -- losses and metrics ------------------------------------------------------------------------
def cross_entropy(db: Session, logits: Tensor, targets: Tensor, count: int) -> Tensor:
    """``-Σ targets · log_softmax(logits) / count`` over (rows, classes): ``targets`` is one-hot
    (or a distribution); rows whose targets are all zero (unlabeled nodes, padding) add nothing.
    Three einsums: the row max (a constant for differentiation, as it cancels), the row sum of
    ``exp(logit - max)``, and ``Σ t · (max + ln sum - logit)``."""
    top = autodiff.detach(db, db.einsum("nc->n", logits, agg="max"))
    total = db.einsum("nc,n->n", logits, top, join="exp(x0 - x1)")
    return db.einsum("nc,nc,n,n->", targets, logits, top, total, join=f"x0 * (x2 + ln(x3) - x1) / {float(count)!r}")


def accuracy(db: Session, logits: Tensor, targets: Tensor, count: int) -> Tensor:
    """The fraction of ``count`` one-hot rows of ``targets`` whose class has the row's largest
    logit, as a scalar tensor (argmax in SQL: a row max, then a comparison in the join)."""
    top = db.einsum("nc->n", logits, agg="max")
    return db.einsum("nc,nc,n->", targets, logits, top, join=f"CASE WHEN x1 = x2 THEN x0 / {float(count)!r} ELSE 0 END")


# -- dropout ----------------------------------------------------------------------------------
class Dropout:
    """Inverted dropout with masks drawn in SQL: ``apply(x)`` keeps an element where a uniform
    draw is ``>= p`` and scales it by ``1/(1-p)``. The uniform tensor is table ``name``,
    redrawn by ``resample(step)`` from (``seed``, ``step``), so masks are reproducible and a
    resumed run draws the same ones. With ``like`` (a stored tensor, e.g. a sparse relation)
    the draws exist at its tile keys only. 1x1 tiles are drawn by hashing (keys, seed, step)
    in SQL; larger tiles by ``tra_random_tile``."""

    def __init__(self, db: Session, name: str, shape=None, p: float = 0.5, *, tile=None, seed: int = 0,
                 dtype="float64", like: Tensor | None = None):
        if not 0 <= p < 1:
            raise SpecError(f"dropout probability must be in [0, 1), got {p}")
        if like is not None and like.name is None:
            raise SpecError("dropout like= needs a stored tensor (its tile keys are read)")
        self.db, self.name, self.p, self.seed = db, catalog.check_name(name), float(p), seed
        self.like = like.name if like is not None else None
        self.shape = like.shape if like is not None else tuple(int(n) for n in shape)
        self.tile = like.tile if like is not None else catalog.check_tile(self.shape, tile, name)
        self.dtype = catalog.check_dtype(dtype)
        self.resample(0)

    def resample(self, step: int) -> None:
        """Draw the uniform tensor for ``step``."""
        rank = len(self.shape)
        seed = int(self.seed) * 1_000_003 + int(step)
        if self.like is not None:
            columns = [f"k{d}" for d in range(rank)]
            query = exp.select(*columns).from_(exp.to_table(self.like, quoted=True))
        else:  # the tile keys: range() tables, one per dimension
            columns = [f"r{d}.o" for d in range(rank)]
            query = exp.select(*[exp.alias_(exp.cast(exp.column("o", f"r{d}"), "INTEGER"), f"k{d}")
                                 for d in range(rank)])
            for d, (n, t) in enumerate(zip(self.shape, self.tile)):
                grid = grid_table(d, ceil(n / t))
                query = query.from_(grid) if d == 0 else query.join(grid, join_type="CROSS")
        if all(t == 1 for t in self.tile):  # hash(...) is unsigned on DuckDB, signed on Spark
            pack = "tra_pack" if self.dtype == np.float64 else "tra_pack_f32"
            bits = f"hash({', '.join(columns)}, {seed}) % 16777216"
            draw = f"{pack}((({bits}) + 16777216) % 16777216 / 16777216.0)"
        else:
            meta = json.dumps({"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape),
                               "tile": list(self.tile), "seed": seed, "dist": "uniform"})
            draw = f"tra_random_tile('{meta}', [{', '.join(columns)}])"
        relations.ensure_udfs(self.db)
        self.db.ensure_udfs([protocol.RANDOM_TILE])
        query = query.select(exp.alias_(sqlglot.parse_one(draw, read="duckdb"), "tile"))
        self.db.store_query(catalog.TensorInfo(self.name, self.dtype, self.shape, self.tile), query, replace=True)

    def apply(self, x: Tensor) -> Tensor:
        if x.shape != self.shape:
            raise ShapeError(f"dropout '{self.name}' has shape {self.shape}, input has {x.shape}")
        if not self.p:
            return x
        idx = "abcdefghijklmnopqrstuvwxyz"[: x.ndim]
        keep = f"CASE WHEN x1 >= {self.p!r} THEN x0 * {1 / (1 - self.p)!r} ELSE 0.0 END"
        return self.db.einsum(f"{idx},{idx}->{idx}", x, self.db.tensor(self.name), join=keep)


# -- the training loop -------------------------------------------------------------------------
@dataclass
class History:
    """Per-epoch mean losses of a run (all epochs, also those before a resume)."""

    run: str
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    steps: int = 0

    @property
    def epochs(self) -> int:
        return len(self.losses)


def _ensure_tables(db: Session) -> None:
    db.con.execute(f"CREATE TABLE IF NOT EXISTS {RUNS} (run VARCHAR PRIMARY KEY, step BIGINT, epoch BIGINT, "
                   f"batch BIGINT, loss_sum DOUBLE, params VARCHAR, optimizer VARCHAR)").fetchall()
    db.con.execute(f"CREATE TABLE IF NOT EXISTS {LOG} (run VARCHAR, epoch BIGINT, step BIGINT, loss DOUBLE, "
                   f"seconds DOUBLE)").fetchall()


def history(db: Session, run: str) -> History:
    """The logged epochs of ``run``."""
    _ensure_tables(db)
    rows = db.con.execute(f"SELECT loss, seconds, step FROM {LOG} WHERE run = ? ORDER BY epoch", [run]).fetchall()
    return History(run, [r[0] for r in rows], [r[1] for r in rows], rows[-1][2] if rows else 0)


class Trainer:
    """The compiled pieces of one run: per batch, a ``Plan`` computing the loss and every
    parameter's and state tensor's new value into staging tables."""

    def __init__(self, db: Session, loss, params: Sequence, optimizer: Optimizer, run: str, batches: int):
        catalog.check_name(run)
        self.db, self.optimizer, self.run, self.batches = db, optimizer, run, batches
        self.loss_fn = loss if callable(loss) else (lambda b: loss)
        self.params = [db.tensor(p) if isinstance(p, str) else p for p in params]
        for p in self.params:
            if p.name is None:
                raise SpecError("parameters must be stored tensors (db.parameter or db.from_numpy)")
        self.names = [p.name for p in self.params]
        self.state = {(name, slot): self._zeros(f"{run}__{slot}__{name}", p)
                      for name, p in zip(self.names, self.params) for slot in optimizer.slots}
        # the optimizer's step-dependent numbers as scalar tensors, one set per parameter dtype
        # (float32 weights must stay float32): <run>__<name>, <run>__<name>__float32
        dtypes = {"float32" if p.dtype == np.float32 else "float64" for p in self.params}
        self.scalars = {dt: {s: self._scalar(f"{run}__{s}" + ("" if dt == "float64" else f"__{dt}"), dt)
                             for s in optimizer.scalars(1)} for dt in sorted(dtypes)}
        self.plans: dict[int, Plan] = {}
        self.snapshots: set[int] = set()  # batches whose relation views were read in this run
        self.staged: dict[int, pa.Table] = {}  # per batch, the rows of a fused step not yet committed

    def _zeros(self, name: str, like: Tensor) -> Tensor:
        if name.lower() not in (t.lower() for t in self.db.tensors()):
            self.db.from_numpy(name, np.zeros(like.shape, like.dtype), tile=like.tile)
        return self.db.tensor(name)

    def _scalar(self, name: str, dtype: str) -> Tensor:
        if name.lower() not in (t.lower() for t in self.db.tensors()):
            self.db.from_numpy(name, np.array(0.0, dtype))
        return self.db.tensor(name)

    def plan(self, batch: int) -> Plan:
        if batch not in self.plans:
            loss = self.loss_fn(batch)
            if loss.shape != ():
                raise ShapeError(f"the loss must be a scalar, got shape {loss.shape}")
            self.verify(loss)
            grads = autodiff.grad(self.db, loss, self.params)
            roots: dict[str, Node] = {"loss": loss.node}
            for name, w, g in zip(self.names, self.params, grads):
                if not autodiff.context(self.db).complete(g.node):  # absent gradient tiles are zeros
                    g = self.db.add(g, self.db.zeros(w.shape, w.dtype, w.tile))
                state = {slot: self.state[(name, slot)] for slot in self.optimizer.slots}
                scalars = self.scalars["float32" if w.dtype == np.float32 else "float64"]
                new = self.optimizer.update(self.db, name, w, g, state, scalars)
                for key, value in new.items():
                    target = name if key == "param" else f"{self.run}__{key}__{name}"
                    roots[target] = graph.retile(value.node, w.tile)
            self.plans[batch] = plan(roots, self.prefix(batch), self.views(), self.fuse_bytes())
        return self.plans[batch]

    def verify(self, loss: Tensor) -> None:
        """Look up every stored tensor ``loss`` reads and every parameter by name, so that a
        table altered or corrupted since they were made raises its ``TraError`` now (a
        duplicated weight tile would otherwise be trained twice)."""
        tables = {n.table for n in graph.topological(loss.node) if isinstance(n, Source)} | set(self.names)
        for table in sorted(tables):
            self.db.tensor(table)

    def prefix(self, batch: int) -> str:
        """How batch ``batch``'s staging tables begin."""
        return f"_tra_{self.run}" + (f"_b{batch}" if self.batches > 1 else "")

    def fuse_bytes(self) -> float:
        """Up to how many bytes of intermediates a step runs as one query: half of DuckDB's
        memory_limit (materialized CTEs stay in memory; staging tables spill)."""
        if not isinstance(getattr(self.db, "con", None), duckdb.DuckDBPyConnection):
            return 0
        from tra_sql.decompose.cost import parse_bytes

        limit = self.db.con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        return parse_bytes(str(limit).replace(" ", "")) / 2

    def views(self) -> frozenset[str]:
        """Lower-case names of the relation views (see ``plan``)."""
        rows = self.db.con.execute("SELECT lower(view_name) FROM duckdb_views() WHERE NOT internal").fetchall()
        return frozenset(v[0] for v in rows)

    def set_scalars(self, step: int) -> None:
        for key, value in self.optimizer.scalars(step).items():
            for dtype, tensors in self.scalars.items():
                blob = np.array(value, dtype=dtype).tobytes()
                self.db.con.execute(f'UPDATE "{tensors[key].name}" SET tile = ?', [blob]).fetchall()

    def step(self, batch: int, step: int) -> float:
        """Stage one step (loss, new weights and state); returns the loss. Nothing is
        committed: see ``commit``."""
        p = self.plan(batch)
        self.set_scalars(step)
        try:
            rows = execute(self.db, p, prologue=batch not in self.snapshots)
        except FusedOutOfMemory:  # the same roots staged in tables, which spill, from now on
            p = self.plans[batch] = plan(p.nodes, self.prefix(batch), self.views(), fuse_bytes=0)
            rows = execute(self.db, p)
        self.snapshots.add(batch)
        if rows is None:
            return scalar_value(self.db, p.tables["loss"], p.nodes["loss"].dtype)
        self.staged[batch] = rows
        tiles = rows.filter(pc.equal(rows.column("target"), "loss")).column("tile").to_pylist()
        return float(np.frombuffer(tiles[0], dtype=p.nodes["loss"].dtype)[0]) if tiles else 0.0

    def resume(self) -> tuple[int, int, int, float]:
        """(step, epoch, batch, loss sum) where the run stopped; a new run starts at zero. A
        run started with other parameters or another optimizer configuration is refused."""
        described = json.dumps(self.names)
        row = self.db.con.execute(f"SELECT step, epoch, batch, loss_sum, params, optimizer FROM {RUNS} "
                                  f"WHERE run = ?", [self.run]).fetchall()
        if not row:
            self.db.con.execute(f"INSERT INTO {RUNS} VALUES (?, 0, 0, 0, 0.0, ?, ?)",
                                [self.run, described, self.optimizer.describe()]).fetchall()
            return 0, 0, 0, 0.0
        step, epoch, batch, loss_sum, params, optimizer = row[0]
        check_run(self.run, (params, optimizer), (described, self.optimizer.describe()))
        return step, epoch, batch, loss_sum

    def history(self) -> History:
        return history(self.db, self.run)

    def commit(self, batch: int, fields: dict, log: list | None = None) -> None:
        """Swap batch ``batch``'s staged tables in, set ``fields`` of the run row and (at the
        end of an epoch) log it, in one transaction."""
        sets = ", ".join(f"{name} = ?" for name in fields)
        con, p = self.db.con, self.plans[batch]
        staged = self.staged.pop(batch, None)
        if staged is not None:
            con.register(STAGED, staged)
        con.execute("BEGIN TRANSACTION").fetchall()
        try:
            for target, table in p.tables.items():
                if target == "loss":
                    continue
                con.execute(f'DELETE FROM "{target}"').fetchall()
                if staged is None:
                    con.execute(f'INSERT INTO "{target}" SELECT * FROM "{table}"').fetchall()
                else:
                    keys = "".join(f"k{d}, " for d in range(len(p.nodes[target].shape)))
                    con.execute(f'INSERT INTO "{target}" SELECT {keys}tile FROM {STAGED} WHERE target = ?',
                                [target]).fetchall()
            con.execute(f"UPDATE {RUNS} SET {sets} WHERE run = ?", [*fields.values(), self.run]).fetchall()
            if log is not None:
                con.execute(f"INSERT INTO {LOG} VALUES (?, ?, ?, ?, ?)", [self.run] + log).fetchall()
            con.execute("COMMIT").fetchall()
        except BaseException as err:
            con.execute("ROLLBACK").fetchall()
            if isinstance(err, duckdb.Error):
                raise translate(err, f"committing a step of run '{self.run}'") from None
            raise
        finally:
            if staged is not None:
                con.unregister(STAGED)


def _progress_bar(db: Session, on: bool) -> bool:
    """Switch DuckDB's own progress bar; returns whether it was on. (In Jupyter, switching it
    on needs ipywidgets: then it stays as it is.)"""
    was = bool(db.con.execute("SELECT current_setting('enable_progress_bar')").fetchall()[0][0])
    if was != on:
        try:
            db.con.execute(f"SET enable_progress_bar = {'true' if on else 'false'}").fetchall()
        except duckdb.Error:
            pass
    return was


def train(db: Session, loss, params: Sequence, optimizer: Optimizer, epochs: int, *, run: str = "run",
          batches: int = 1, before_step: Callable[[int, int], None] | None = None,
          on_epoch: Callable[[int, float], None] | None = None, progress: bool | None = None) -> History:
    """Minimize ``loss`` over ``params`` for ``epochs`` epochs of ``batches`` steps.

    ``loss`` is a scalar Tensor, or a function of the batch number returning one (each
    batch's program is compiled once and reused). ``before_step(step, batch)`` runs before
    each step (e.g. ``Dropout.resample``); ``on_epoch(epoch, loss)`` after each epoch.
    Progress and state live in tables ``tra_runs`` and ``tra_run_log``: calling ``train`` again
    with the same ``run`` continues from the last committed step (pass a larger ``epochs`` to
    train further). Returns the run's ``History``.
    """
    relations.ensure_udfs(db)
    _ensure_tables(db)
    engine_bar = _progress_bar(db, False)  # one bar: ours
    try:
        return loop(Trainer(db, loss, params, optimizer, run, batches), epochs, before_step, on_epoch, progress)
    finally:
        _progress_bar(db, engine_bar)


def check_run(run: str, stored: tuple[str, str], given: tuple[str, str]) -> None:
    """A run continues only with the parameters and optimizer configuration it started with."""
    if stored != given:
        raise TraError(f"run '{run}' was started with parameters {stored[0]} and {stored[1]}; "
                       f"this call has {given[0]} and {given[1]}: use another run name")


def loop(trainer: Trainer, epochs: int, before_step, on_epoch, progress: bool | None) -> History:
    """``train``'s epochs and batches from where ``trainer``'s run stopped, committing every
    step; the run's ``History``."""
    step, epoch, batch, loss_sum = trainer.resume()
    batches = trainer.batches
    bar = tqdm(total=epochs, initial=min(epoch, epochs), disable=None if progress is None else not progress,
               desc=trainer.run, unit="epoch")
    try:
        while epoch < epochs:
            started = time.perf_counter()
            while batch < batches:
                if before_step is not None:
                    before_step(step, batch)
                loss_sum += trainer.step(batch, step + 1)
                step, batch = step + 1, batch + 1
                if batch < batches:
                    trainer.commit(batch - 1, {"step": step, "batch": batch, "loss_sum": loss_sum})
            mean = loss_sum / batches
            trainer.commit(batch - 1, {"step": step, "epoch": epoch + 1, "batch": 0, "loss_sum": 0.0},
                           log=[epoch, step, mean, time.perf_counter() - started])
            epoch, batch, loss_sum = epoch + 1, 0, 0.0
            bar.update(1)
            bar.set_postfix(loss=f"{mean:.4f}")
            if on_epoch is not None:
                on_epoch(epoch - 1, mean)
    finally:
        bar.close()
    return trainer.history()
