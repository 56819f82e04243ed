"""Training on Spark: ``tra_sql.train``'s steps with the warehouse for tables.

A step computes the roots of the same ``train_step.Step`` as on DuckDB (the loss, the optimizer's
new weights and state) in one write: one query of every root's rows over the step's views
(``spark_sql.SparkDialect.union_steps``; the views that several steps read are local checkpoints,
so shared nodes run once) written with ``partitionBy("target")`` to
``<warehouse>/_staging/<Trainer.prefix>/target=<root>/``.
Committing the step first writes its journal (``COMMIT.json`` beside the staged results: the
tables to publish, the new run row and, at the end of an epoch, the log row) with one atomic
rename; then it publishes the directories as the parameter and state tables (a rename each),
rewrites the run row (table ``tra_runs``) and the log (``tra_run_log``), and removes the
staging directory with the journal. A crash before the journal leaves the step undone; after
it, ``train`` with the same ``run`` finishes the commit (redoes what the journal lists:
idempotent) before it resumes from the last committed step, so a step is applied whole or not
at all, as in DuckDB's transaction. ``train`` plans each step after a run's first while the step
before runs (``spark_pipeline``), unless a ``before_step`` hook is given.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tra_sql import graph
from tra_sql import train as core
from tra_sql.backends import spark_udfs
from tra_sql.backends.spark_parameters import marker
from tra_sql.backends.spark_pipeline import Pipeline
from tra_sql.backends.spark_session import call_site, settings
from tra_sql.backends.spark_sql import Steps
from tra_sql.backends.warehouse import columns, write_parquet
from tra_sql.compile.program import Program
from tra_sql.graph import Source
from tra_sql.optim import Optimizer

RUN_SCHEMA = pa.schema([("run", pa.string()), ("step", pa.int64()), ("epoch", pa.int64()), ("batch", pa.int64()),
                        ("loss_sum", pa.float64()), ("params", pa.string()), ("optimizer", pa.string())])
JOURNAL = "COMMIT.json"
LOG_SCHEMA = pa.schema([("run", pa.string()), ("epoch", pa.int64()), ("step", pa.int64()), ("loss", pa.float64()),
                        ("seconds", pa.float64())])


def rows(db, table: str, schema: pa.Schema) -> list[dict]:
    """The rows of a small warehouse table (none if it does not exist)."""
    path = db.engine.warehouse.path(table)
    return pq.read_table(path, schema=schema).to_pylist() if path.exists() else []


def write_rows(db, table: str, schema: pa.Schema, values: list[dict]) -> None:
    db.engine.warehouse.create(table, lambda d: write_parquet(pa.Table.from_pylist(values, schema), d), replace=True,
                               schema=columns(schema))


def history(db, run: str) -> core.History:
    """The logged epochs of ``run``."""
    logged = sorted((r for r in rows(db, core.LOG, LOG_SCHEMA) if r["run"] == run), key=lambda r: r["epoch"])
    return core.History(run, [r["loss"] for r in logged], [r["seconds"] for r in logged],
                        logged[-1]["step"] if logged else 0)


class SparkTrainer(core.Trainer):
    """``core.Trainer`` whose staged results, scalars and commits live in the warehouse; with
    ``pipelined``, each step after the first is planned while the one before runs
    (``spark_pipeline``), up to the last of ``epochs``."""

    def __init__(self, *args, pipelined: bool = False, epochs: int = 0):
        super().__init__(*args)
        self.queries: dict[tuple[int, int], Steps] = {}  # by batch and copy (``compiled``)
        self.reads: dict[int, set[str]] = {}  # the stored tables each batch's step reads (lower-case)
        self.kept: set[str] = set()  # the training data this run keeps in the executors
        self.pipelined, self.epochs = pipelined, epochs
        self.pipeline: Pipeline | None = None  # made by the first step, if pipelined
        self.running = ExitStack()  # a pipelined run's settings, held while it runs

    def staging(self, batch: int):
        return self.db.engine.warehouse.root / "_staging" / self.prefix(batch)

    def views(self) -> frozenset[str]:
        return frozenset()  # relations on Spark are tables

    def scalar_relations(self) -> frozenset[str]:
        """Lower-case names of the optimizer's scalar relations."""
        return frozenset(t.name.lower() for tensors in self.scalars.values() for t in tensors.values())

    def data(self, roots, written: set[str]) -> set[str]:
        """The stored tables a step of ``roots`` reads that no step writes (the step's
        ``written`` results, the optimizer's scalars): the training data."""
        written = {name.lower() for name in written} | self.scalar_relations()
        read = {n.table for root in roots for n in graph.topological(root) if isinstance(n, Source)}
        return {name for name in read if name.lower() not in written}

    def keep_data(self, data: set[str]) -> None:
        """Keep ``data`` in the executors for the run if it and the data kept already fit a
        task's tile budget (``SparkEngine.budget``): data kept in an executor's memory is taken
        from its tasks', which the step's plan counts on; larger data is read from its files
        each step."""
        engine = self.db.engine
        if sum(engine.stored_bytes(name) for name in data | self.kept) <= engine.budget()[1]:
            self.kept |= engine.keep_tables(data)

    def release(self) -> None:
        """Stop keeping the training data in the executors, and end a pipelined run."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        self.running.close()
        self.db.engine.release_tables(self.kept)
        self.kept.clear()

    def bind_scalars(self, step: int, batch: int) -> dict[str, bytes]:
        """Step ``step``'s scalars that batch ``batch``'s step reads: the tiles of those it reads as
        query parameters (``spark_parameters``), by parameter; the others are written to their
        tables."""
        steps, args = self.compiled(batch), {}
        for key, value in self.optimizer.scalars(step).items():
            for dtype, tensors in self.scalars.items():
                name = tensors[key].name
                if name.lower() in steps.parameters:
                    args[marker(name)] = np.array(value, dtype=dtype).tobytes()
                elif name.lower() in self.reads[batch]:
                    self.db.from_numpy(name, np.array(value, dtype=dtype), replace=True)
        return args

    def compiled(self, batch: int, copy: int = 0) -> Steps:
        """Batch ``batch``'s step as Spark steps that read the results of the step before (its
        parameters and state) through input views (``Steps.inputs``). Two copies, 0 and 1,
        whose views are named apart: a pipelined run plans one step while the other runs."""
        if copy and (batch, copy) not in self.queries:
            self.queries[batch, copy] = self.compiled(batch).renamed()
        if (batch, copy) not in self.queries:
            p = self.plan(batch)
            program = Program.compile(*p.nodes.values())
            read = self.reads[batch] = {n.table.lower() for root in p.nodes.values()
                                        for n in graph.topological(root) if isinstance(n, Source)}
            inputs = frozenset(target.lower() for target in p.nodes if target != "loss") & read
            self.queries[batch, copy] = self.db.engine.sql_dialect().union_steps(
                program, p.nodes, self.db.engine.completeness(), self.scalar_relations(), inputs)
            self.keep_data(self.data(p.nodes.values(), set(p.tables)))
        return self.queries[batch, copy]

    def step(self, batch: int, step: int) -> float:
        if self.pipelined and self.pipeline is None:
            self.start_pipeline()
        steps = self.compiled(batch, step % 2 if self.pipeline is not None else 0)
        args = self.bind_scalars(step, batch)
        what = f"step {step} of run '{self.run}'"
        if self.pipeline is None:
            with self.db.engine.steps(steps, what, args) as frame:
                self.write(batch, frame, what)
        else:
            self.pipelined_step(batch, step, steps, args, what)
        loss = self.staging(batch) / "target=loss"
        tiles = pq.read_table(loss).column("tile").to_pylist() if loss.exists() else []
        return float(np.frombuffer(tiles[0], dtype=self.plans[batch].nodes["loss"].dtype)[0]) if tiles else 0.0

    def start_pipeline(self) -> None:
        """Start pipelining unless a step reads a scalar from its table (a step planned ahead
        would read its old value) or the step's results exceed a task's tile budget (each input
        view of a step planned ahead reads the kept result whole): every batch's steps
        compiled, the settings of the largest held for the run (the thread that plans ahead
        and the jobs share the session's settings)."""
        engine = self.db.engine
        compiled = [self.compiled(batch, copy) for batch in range(self.batches) for copy in (0, 1)]
        results = sum(n.dtype.itemsize * math.prod(n.shape) for n in self.plan(0).nodes.values())
        tabled = any(self.scalar_relations() & self.reads[batch] - self.compiled(batch).parameters
                     for batch in range(self.batches))
        if tabled or results > engine.budget()[1]:
            self.pipelined = False
            return
        self.running.enter_context(settings(engine.spark, engine.step_settings(max(compiled, key=lambda s: s.nbytes))))
        self.pipeline = Pipeline(engine)

    def pipelined_step(self, batch: int, step: int, steps: Steps, args: dict, what: str) -> None:
        """Run step ``step`` as planned ahead (else planned now, over the tables), its result
        kept, while the next step is planned; if a step planned ahead fails, run it again
        planned over the tables."""
        from pyspark import StorageLevel

        engine, pipeline = self.db.engine, self.pipeline
        keep = StorageLevel.MEMORY_AND_DISK
        with call_site(engine.spark, f"tra_sql: {what}"):
            prepared = pipeline.take((batch, step), args)
            ahead = prepared is not None
            if not ahead:
                prepared = engine.prepare(steps, what, args, keep=keep)
            if step < self.epochs * self.batches:
                self.plan_ahead(batch, step, prepared, keep)
            try:
                self.write(batch, prepared.frame, what, translated=not ahead)
            except BaseException as err:
                pipeline.cancel()
                prepared.discard()
                if not ahead or not isinstance(err, Exception):
                    raise
                prepared = engine.prepare(steps, what, args, keep=keep)
                try:
                    self.write(batch, prepared.frame, what)
                except BaseException:
                    prepared.discard()
                    raise
        prepared.close()
        pipeline.ran(prepared)

    def plan_ahead(self, batch: int, step: int, prepared, keep) -> None:
        """Plan step ``step + 1`` in the background over ``prepared``'s kept result (step
        ``step``'s, of batch ``batch``); nothing if its scalars cannot be bound (a schedule's
        bad rate, say): that step then raises when it runs, after step ``step`` is committed,
        as it would unpipelined."""
        following = (batch + 1) % self.batches
        try:
            args = self.bind_scalars(step + 1, following)
        except Exception:
            return
        nxt = self.compiled(following, (step + 1) % 2)
        targets = {target.lower(): (target, len(node.shape)) for target, node in self.plans[batch].nodes.items()
                   if target.lower() in nxt.inputs}
        self.pipeline.plan((following, step + 1), nxt, f"step {step + 1} of run '{self.run}'", args, prepared,
                           targets, keep)

    def write(self, batch: int, frame, what: str, translated: bool = True) -> None:
        """Write the step's rows ``frame`` to batch ``batch``'s staging directory (Spark's
        errors as ``TraError``s, if ``translated``)."""
        staging = self.staging(batch)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            frame.write.partitionBy("target").parquet(str(staging))
        except Exception as err:
            if not translated:
                raise
            raise spark_udfs.translate(err, what) from None

    def resume(self) -> tuple[int, int, int, float]:
        for batch in range(self.batches):  # a commit a crash interrupted
            journal = self.staging(batch) / JOURNAL
            if journal.exists():
                self.apply(json.loads(journal.read_text()), journal.parent)
        described = (json.dumps(self.names), self.optimizer.describe())
        row = next((r for r in rows(self.db, core.RUNS, RUN_SCHEMA) if r["run"] == self.run), None)
        if row is None:
            row = {"run": self.run, "step": 0, "epoch": 0, "batch": 0, "loss_sum": 0.0, "params": described[0],
                   "optimizer": described[1]}
        core.check_run(self.run, (row["params"], row["optimizer"]), described)
        self.row = row
        return row["step"], row["epoch"], row["batch"], row["loss_sum"]

    def history(self) -> core.History:
        return history(self.db, self.run)

    def commit(self, batch: int, fields: dict, log: list | None = None) -> None:
        """Commit batch ``batch``'s step (see the module docstring): its staged weights and
        state, the run row with ``fields`` and the log row ``log``."""
        staging = self.staging(batch)
        targets = [t for t in self.plans[batch].tables if t != "loss"]
        for target in targets:  # every target gets a directory: one missing later was published
            directory = staging / f"target={target}"
            if not directory.exists():
                self.db.engine.warehouse.empty_tiles(target, directory)
        entry = {"targets": targets, "run": self.row | fields,
                 "log": None if log is None else dict(zip(LOG_SCHEMA.names, [self.run] + log))}
        written = staging / f".{JOURNAL}.tmp"
        written.write_text(json.dumps(entry))
        os.replace(written, staging / JOURNAL)
        if self.pipeline is None:
            self.apply(entry, staging)
        else:
            self.pipeline.commit(lambda: self.apply(entry, staging))

    def apply(self, entry: dict, staging) -> None:
        """Carry out a commit's journal ``entry`` (again, after a crash: every part is
        idempotent), then remove ``staging`` and the journal in it."""
        for target in entry["targets"]:
            if (staging / f"target={target}").exists():
                self.db.engine.warehouse.publish(staging / f"target={target}", target)
        self.row = entry["run"]
        runs = [r for r in rows(self.db, core.RUNS, RUN_SCHEMA) if r["run"] != self.run]
        write_rows(self.db, core.RUNS, RUN_SCHEMA, runs + [self.row])
        if entry["log"] is not None:
            done = (self.run, entry["log"]["epoch"])
            logged = [r for r in rows(self.db, core.LOG, LOG_SCHEMA) if (r["run"], r["epoch"]) != done]
            write_rows(self.db, core.LOG, LOG_SCHEMA, logged + [entry["log"]])
        shutil.rmtree(staging, ignore_errors=True)


def train(db, loss, params: Sequence, optimizer: Optimizer, epochs: int, *, run: str = "run", batches: int = 1,
          before_step: Callable[[int, int], None] | None = None,
          on_epoch: Callable[[int, float], None] | None = None, progress: bool | None = None) -> core.History:
    """``tra_sql.train.train`` on a Spark session (same arguments, same resumable runs). The
    training data (the stored tables the steps read and do not write) stays in the executors
    while it runs (``SparkEngine.keep_tables``), as a Spark user caches a model's inputs."""
    trainer = SparkTrainer(db, loss, params, optimizer, run, batches, pipelined=before_step is None,
                           epochs=epochs)
    try:
        return core.loop(trainer, epochs, before_step, on_epoch, progress)
    finally:
        trainer.release()
