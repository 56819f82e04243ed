"""Training in the database: losses, dropout, and a resumable loop.

- Parameters are stored tensors (``tra_sql.parameters``; ``db.parameter``).
- A step (``tra_sql.train_step``) evaluates the loss, the gradients (``tra_sql.autodiff``) and the optimizer's new
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
import numbers
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from math import ceil
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlglot
from sqlglot import exp
from tqdm.auto import tqdm

from tra_sql import catalog, graph, relations
from tra_sql.compile.blocks import grid_table
from tra_sql.errors import ShapeError, SpecError
from tra_sql.graph import Node, Source
from tra_sql.optim import Optimizer
from tra_sql.train_step import FusedOutOfMemory, Step, compile_step, run_step, scalar_value
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor

RUNS = "tra_runs"
STAGED = "_tra_staged"  # a fused step's rows, registered while they are committed
LOG = "tra_run_log"


# -- losses and metrics ------------------------------------------------------------------------
def cross_entropy(db: Session, logits: Tensor, targets: Tensor, count: int) -> Tensor:
    """``-Σ targets · log_softmax(logits) / count`` over (rows, classes): ``targets`` is one-hot
    (or a distribution); rows whose targets are all zero (unlabeled nodes, padding) add nothing.
    Three einsums: the row max (a constant for differentiation, as it cancels), the row sum of
    ``exp(logit - max)``, and ``Σ t · (max + ln sum - logit)``."""
    top = db.detach(db.einsum("nc->n", logits, agg="max"))
    total = db.einsum("nc,n->n", logits, top, join="exp(x0 - x1)")
    return db.einsum("nc,nc,n,n->", targets, logits, top, total, join=f"x0 * (x2 + ln(x3) - x1) / {float(count)!r}")


def accuracy(db: Session, logits: Tensor, targets: Tensor, count: int) -> Tensor:
    """The fraction of ``count`` one-hot rows of ``targets`` whose class has the row's largest
    logit, as a scalar tensor (argmax in SQL: a row max, then a comparison in the join)."""
    top = db.einsum("nc->n", logits, agg="max")
    hits = db.einsum("nc,nc,n->", targets, logits, top, join="CASE WHEN x1 = x2 THEN x0 ELSE 0 END")
    return db.einsum("->", hits, join=f"x0 / {float(count)!r}")  # one division: k / count as NumPy rounds it


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
            pack = relations.PACK[self.dtype.name].name
            bits = f"hash({', '.join(columns)}, {seed}) % 16777216"
            draw = f"{pack}((({bits}) + 16777216) % 16777216 / 16777216.0)"
        else:
            meta = json.dumps({"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape),
                               "tile": list(self.tile), "seed": seed, "dist": "uniform"})
            draw = f"{protocol.RANDOM_TILE.name}('{meta}', [{', '.join(columns)}])"
        relations.ensure_udfs(self.db)
        self.db.engine.ensure_kernels([protocol.RANDOM_TILE])
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
    db.engine.rows(f"CREATE TABLE IF NOT EXISTS {RUNS} (run VARCHAR PRIMARY KEY, step BIGINT, epoch BIGINT, "
                   f"batch BIGINT, loss_sum DOUBLE, params VARCHAR, optimizer VARCHAR)")
    db.engine.rows(f"CREATE TABLE IF NOT EXISTS {LOG} (run VARCHAR, epoch BIGINT, step BIGINT, loss DOUBLE, "
                   f"seconds DOUBLE)")


def history(db: Session, run: str) -> History:
    """The logged epochs of ``run``."""
    _ensure_tables(db)
    rows = db.engine.rows(f"SELECT loss, seconds, step FROM {LOG} WHERE run = ? ORDER BY epoch", [run])
    return History(run, [r[0] for r in rows], [r[1] for r in rows], rows[-1][2] if rows else 0)


class Trainer:
    """The compiled pieces of one run: per batch, a ``Step`` computing the loss and every
    parameter's and state tensor's new value into staging tables."""

    def __init__(self, db: Session, loss, params: Sequence, optimizer: Optimizer, run: str, batches: int):
        catalog.check_name(run)
        if isinstance(batches, bool) or not isinstance(batches, numbers.Integral) or batches < 1:
            raise SpecError(f"batches must be a positive integer, got {batches!r}")
        self.db, self.optimizer, self.run, self.batches = db, optimizer, run, batches
        self.loss_fn = loss if callable(loss) else (lambda b: loss)
        self.params = [db.tensor(p) if isinstance(p, str) else p for p in params]
        for p in self.params:
            if p.name is None:
                raise SpecError("parameters must be stored tensors (db.parameter or db.from_numpy)")
        self.names = [p.name for p in self.params]
        counts = Counter(n.lower() for n in self.names)
        twice = next((n for n in self.names if counts[n.lower()] > 1), None)
        if twice is not None:
            raise SpecError(f"parameter {twice!r} is given more than once")
        self.created: list[str] = []  # the state tensors this trainer made (``discard`` drops them)
        self.claimed = False  # whether ``resume`` wrote the run's row
        try:
            self.state = {(name, slot): self._zeros(f"{run}__{slot}__{name}", p)
                          for name, p in zip(self.names, self.params) for slot in optimizer.slots}
            # the optimizer's step-dependent numbers as scalar tensors, one set per parameter dtype
            # (float32 weights must stay float32): <run>__<name>, <run>__<name>__float32
            dtypes = {"float32" if p.dtype == np.float32 else "float64" for p in self.params}
            self.scalars = {dt: {s: self._scalar(f"{run}__{s}" + ("" if dt == "float64" else f"__{dt}"), dt)
                                 for s in optimizer.scalars(1)} for dt in sorted(dtypes)}
        except BaseException:
            self.discard()
            raise
        self.plans: dict[int, Step] = {}
        self.snapshots: set[int] = set()  # batches whose relation views were read in this run
        self.staged: dict[int, pa.Table] = {}  # per batch, the rows of a fused step not yet committed

    def _zeros(self, name: str, like: Tensor) -> Tensor:
        if name.lower() not in (t.lower() for t in self.db.tensors()):
            self.db.from_numpy(name, np.zeros(like.shape, like.dtype), tile=like.tile)
            self.created.append(name)
        return self.db.tensor(name)

    def _scalar(self, name: str, dtype: str) -> Tensor:
        if name.lower() not in (t.lower() for t in self.db.tensors()):
            self.db.from_numpy(name, np.array(0.0, dtype))
            self.created.append(name)
        return self.db.tensor(name)

    def keep(self) -> None:
        """A step is committed: the run and its state stay, whatever happens next."""
        self.created.clear()
        self.claimed = False

    def discard(self) -> None:
        """Undo a run that failed before its first commit: drop the state tensors this
        trainer made and the run's row, so that nothing of it is left (nor its name taken)."""
        for name in reversed(self.created):
            self.db.drop(name)
        self.created.clear()
        if self.claimed:
            self.db.engine.rows(f"DELETE FROM {RUNS} WHERE run = ? AND step = 0", [self.run])
            self.claimed = False

    def plan(self, batch: int) -> Step:
        if batch not in self.plans:
            loss = self.loss_fn(batch)
            if loss.shape != ():
                raise ShapeError(f"the loss must be a scalar, got shape {loss.shape}")
            self.verify(loss)
            grads = self.db.grad(loss, self.params)
            roots: dict[str, Node] = {"loss": loss.node}
            for name, w, g in zip(self.names, self.params, grads):
                if not self.db.gradient_context().complete(g.node):  # absent gradient tiles are zeros
                    g = self.db.add(g, self.db.zeros(w.shape, w.dtype, w.tile))
                state = {slot: self.state[(name, slot)] for slot in self.optimizer.slots}
                scalars = self.scalars["float32" if w.dtype == np.float32 else "float64"]
                new = self.optimizer.update(self.db, name, w, g, state, scalars)
                for key, value in new.items():
                    target = name if key == "param" else f"{self.run}__{key}__{name}"
                    roots[target] = graph.retile(value.node, w.tile)
            self.plans[batch] = compile_step(roots, self.prefix(batch), self.views(), self.fuse_bytes())
        return self.plans[batch]

    def verify(self, loss: Tensor) -> None:
        """Look up every stored tensor ``loss`` reads and every parameter by name, so that a
        table altered or corrupted since they were made raises its ``TraError`` now (a
        duplicated weight tile would otherwise be trained twice), and check that the handles
        are current (a tensor replaced since, ``StaleTensorError``)."""
        tables = {n.table for n in graph.topological(loss.node) if isinstance(n, Source)} | set(self.names)
        for table in sorted(tables):
            self.db.tensor(table)
        for tensor in (loss, *self.params):
            self.db.check_current(tensor)

    def prefix(self, batch: int) -> str:
        """How batch ``batch``'s staging tables begin."""
        return f"_tra_{self.run}" + (f"_b{batch}" if self.batches > 1 else "")

    def fuse_bytes(self) -> float:
        """Up to how many bytes of intermediates a step runs as one query (the engine's
        ``fuse_bytes``: on DuckDB half its memory_limit, as materialized CTEs stay in memory
        and staging tables spill)."""
        return self.db.engine.fuse_bytes()

    def views(self) -> frozenset[str]:
        """Lower-case names of the relation views (see ``compile_step``)."""
        return self.db.engine.views()

    def set_scalars(self, step: int) -> None:
        for key, value in self.optimizer.scalars(step).items():
            for dtype, tensors in self.scalars.items():
                blob = np.array(value, dtype=dtype).tobytes()
                self.db.engine.rows(f'UPDATE "{tensors[key].name}" SET tile = ?', [blob])

    def step(self, batch: int, step: int) -> float:
        """Stage one step (loss, new weights and state); returns the loss. Nothing is
        committed: see ``commit``."""
        p = self.plan(batch)
        self.set_scalars(step)
        try:
            rows = run_step(self.db, p, prologue=batch not in self.snapshots)
        except FusedOutOfMemory:  # the same roots staged in tables, which spill, from now on
            p = self.plans[batch] = compile_step(p.nodes, self.prefix(batch), self.views(), fuse_bytes=0)
            rows = run_step(self.db, p)
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
        row = self.db.engine.rows(f"SELECT step, epoch, batch, loss_sum, params, optimizer FROM {RUNS} "
                                  f"WHERE run = ?", [self.run])
        if not row:
            self.db.engine.rows(f"INSERT INTO {RUNS} VALUES (?, 0, 0, 0, 0.0, ?, ?)",
                                [self.run, described, self.optimizer.describe()])
            self.claimed = True
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
        engine, p = self.db.engine, self.plans[batch]
        staged = self.staged.pop(batch, None)
        try:
            with engine.registered(STAGED, staged) if staged is not None else nullcontext(), engine.transaction():
                for target, table in p.tables.items():
                    if target == "loss":
                        continue
                    engine.rows(f'DELETE FROM "{target}"')
                    if staged is None:
                        engine.rows(f'INSERT INTO "{target}" SELECT * FROM "{table}"')
                    else:
                        keys = "".join(f"k{d}, " for d in range(len(p.nodes[target].shape)))
                        engine.rows(f'INSERT INTO "{target}" SELECT {keys}tile FROM {STAGED} WHERE target = ?',
                                    [target])
                engine.rows(f"UPDATE {RUNS} SET {sets} WHERE run = ?", [*fields.values(), self.run])
                if log is not None:
                    engine.rows(f"INSERT INTO {LOG} VALUES (?, ?, ?, ?, ?)", [self.run] + log)
        except engine.Error as err:
            raise engine.translate(err, f"committing a step of run '{self.run}'") from None


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
    with db.engine.settings(enable_progress_bar=False):  # one bar: ours (in Jupyter DuckDB's may stay)
        return loop(Trainer(db, loss, params, optimizer, run, batches), epochs, before_step, on_epoch, progress)


def check_run(run: str, stored: tuple[str, str], given: tuple[str, str]) -> None:
    """A run continues only with the parameters and optimizer configuration it started with."""
    if stored != given:
        raise SpecError(f"run '{run}' was started with parameters {stored[0]} and {stored[1]}; "
                       f"this call has {given[0]} and {given[1]}: use another run name")


def loop(trainer: Trainer, epochs: int, before_step, on_epoch, progress: bool | None) -> History:
    """``train``'s epochs and batches from where ``trainer``'s run stopped, committing every
    step; the run's ``History``."""
    try:
        return _loop(trainer, epochs, before_step, on_epoch, progress)
    except BaseException:
        trainer.discard()  # a no-op once a step is committed (``keep``)
        raise


def _loop(trainer: Trainer, epochs: int, before_step, on_epoch, progress: bool | None) -> History:
    if isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 0:
        raise SpecError(f"epochs must be a non-negative integer, got {epochs!r}")
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
                    trainer.keep()
            mean = loss_sum / batches
            trainer.commit(batch - 1, {"step": step, "epoch": epoch + 1, "batch": 0, "loss_sum": 0.0},
                           log=[epoch, step, mean, time.perf_counter() - started])
            trainer.keep()
            epoch, batch, loss_sum = epoch + 1, 0, 0.0
            bar.update(1)
            bar.set_postfix(loss=f"{mean:.4f}")
            if on_epoch is not None:
                on_epoch(epoch - 1, mean)
    finally:
        bar.close()
    return trainer.history()
