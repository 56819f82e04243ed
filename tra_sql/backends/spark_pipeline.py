"""Training steps on Spark, each planned while the step before runs (``Pipeline``).

The driver plans a step (its views' analysis, their checkpoints' physical plans, the final
query: ~0.9 s of a warm 8192-node GCN step's ~3 s) while the executors wait, then the step's job
runs (~2 s) while the driver waits. A pipelined trainer (``spark_train``) plans step n+1 in a
thread of its own while step n's job runs: step n's result (every target's rows) is kept as a
local checkpoint, and step n+1's input views (``Steps.inputs``) read its parameters and optimizer
state from it, not from the tables that step n's commit publishes afterwards. Everything else
step n+1 reads (the training data, the scalars bound as query parameters) is what the step
would read if planned after the commit.

A step planned ahead runs only if it is still the step to run: the same batch and step, the
same scalars bound (a learning rate changed in ``on_epoch`` makes them differ) and no table
written through the warehouse since it was planned but by the trainer's commits; otherwise it
is planned again, then, over the tables. If the job of a step planned ahead fails (an executor
that held the previous result's blocks was lost, say), the step is planned again over the
published tables and runs once more.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tra_sql.backends.spark import SparkEngine
from tra_sql.backends.spark_jobs import GROUP
from tra_sql.backends.spark_session import Prepared, call_site
from tra_sql.backends.spark_sql import Steps


@dataclass
class Ahead:
    """What a step was planned for: its ``(batch, step)``, the ``args`` bound, and the
    warehouse's writes by others than the trainer (``Pipeline.foreign``) when it was planned."""

    key: tuple[int, int]
    args: dict
    foreign: int


class Pipeline:
    """At most one step planned ahead, in a thread of its own; the kept result of the step
    before (``previous``), which the running step reads."""

    def __init__(self, engine: SparkEngine):
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tra_sql-plan")
        self.ahead: tuple[Ahead, Future] | None = None
        self.previous: Prepared | None = None
        self.own = 0  # writes to the warehouse by the trainer's commits (``commit``)

    @property
    def foreign(self) -> int:
        """Writes to the warehouse by others than the trainer's commits."""
        return self.engine.warehouse.generation - self.own

    def commit(self, write) -> None:
        """Run ``write()``, the trainer's commit, its writes to the warehouse counted as its own."""
        before = self.engine.warehouse.generation
        try:
            write()
        finally:
            self.own += self.engine.warehouse.generation - before

    def plan(self, key: tuple[int, int], steps: Steps, what: str, args: dict, result: Prepared,
             targets: dict[str, tuple[str, int]], keep) -> None:
        """Plan step ``key`` (``steps``, scalars ``args``, its result kept at storage level ``keep``)
        in the background, each input view over the rows of ``result``'s kept result whose
        target is ``targets[table]``'s (its name and rank). Jobs that Spark launches while it
        plans count with the caller's (its job group)."""
        spark = self.engine.spark
        group = spark.sparkContext.getLocalProperty(GROUP)

        def plan() -> Prepared:
            spark.sparkContext.setLocalProperty(GROUP, group)
            with call_site(spark, f"tra_sql: {what}"):
                return self.engine.prepare(steps, what, args, kept_inputs(spark, result, targets), keep)

        self.cancel()
        self.ahead = (Ahead(key, args, self.foreign), self.pool.submit(plan))

    def take(self, key: tuple[int, int], args: dict) -> Prepared | None:
        """Step ``key``'s plan, if it was planned ahead with ``args`` and nothing but the
        trainer's commits wrote to the warehouse since; else None (a plan that failed is made
        again by the caller, whose thread then raises its error)."""
        if self.ahead is None:
            return None
        ahead, future = self.ahead
        self.ahead = None
        try:
            prepared = future.result()
        except Exception:
            return None
        if ahead != Ahead(key, args, self.foreign):
            prepared.discard()
            return None
        return prepared

    def cancel(self) -> None:
        """Discard the step planned ahead, if any (waiting for its planning to end)."""
        if self.ahead is not None:
            _, future = self.ahead
            self.ahead = None
            try:
                future.result().discard()
            except Exception:  # its planning failed: nothing to discard
                pass

    def ran(self, prepared: Prepared | None) -> None:
        """The running step has ended: free the previous step's result, which it read, and keep
        ``prepared``'s (None: not kept) for the next."""
        if self.previous is not None:
            self.previous.release()
        self.previous = prepared

    def close(self) -> None:
        """Discard what is planned and kept, and end the thread."""
        self.cancel()
        self.ran(None)
        self.pool.shutdown()


def kept_inputs(spark, result: Prepared, targets: dict[str, tuple[str, int]]) -> dict:
    """Relations for input views (``SparkEngine.prepare``) over ``result``'s kept rows: for each
    table, the rows ``k0, ..., tile`` of its target ``targets[table]`` (its name and rank)."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    # the kept rows as a relation of no known size (Spark's internal ``internalCreateDataFrame``):
    # the checkpoint's own DataFrame carries its plan's size estimate, which each step would
    # multiply into the next one's (cross joins): a number of ever more digits, whose products
    # stalled the planner
    rows = DataFrame(spark._jsparkSession.internalCreateDataFrame(result.result, result.frame._jdf.schema(), False),
                     spark)
    return {table: rows.where(F.col("target") == F.lit(target)).select(*(f"k{d}" for d in range(rank)), "tile")
            for table, (target, rank) in targets.items()}
