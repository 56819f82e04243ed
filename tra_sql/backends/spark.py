"""Spark SQL as the engine (``SparkEngine``): ``tra_sql.connect(engine="spark", master=...)``.

The pipeline is DuckDB's: the same lazy graph, the same ``Program`` of sqlglot expressions
rendered in Spark's dialect (``COLLECT_LIST(STRUCT(...))`` for ``ARRAY_AGG({...})``, ``DIV`` for
``//``, plain CTEs), the same tile kernels registered as scalar Arrow UDFs. Tensor relations
are Parquet tables in a warehouse directory (``tra_sql.backends.warehouse``).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
from sqlglot import exp

from tra_sql import errors
from tra_sql.backends import spark_calibrate, spark_udfs
from tra_sql.backends.spark_session import Prepared, call_site, settings
from tra_sql.backends.spark_sql import GROUP_BYTES, SparkDialect, Steps
from tra_sql.backends.spark_staged import SparkStages
from tra_sql.backends.warehouse import ROW_GROUP_BYTES, Warehouse, quote, tile_schema, write_parquet
from tra_sql.catalog import TensorInfo
from tra_sql.compile.program import Program
from tra_sql.decompose.cost import Constants, parse_bytes
from tra_sql.engines import staged
from tra_sql.engines.base import Engine
from tra_sql.errors import ExecutionError, TraError

#: One kernel thread per task: Spark runs one task per core.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
LOOPBACK = ("127.0.0.1", "localhost")
RESERVED = 300 << 20  # of an executor's heap, Spark's own (the rest times spark.memory.fraction: the tasks')
#: A task holds each tile it works on up to this many times at once in its executor's heap (the
#: rows around each Python UDF and their Arrow batches, the rows made of the results, a Parquet
#: row group and the batch decoded from it, sort and shuffle buffers). Measured on 512m
#: executors (127 MiB per task) with Arrow batches of a task's budget, 8 MiB row groups and big
#: checkpoints on disk, an MLP step over 256 MiB of features lost no executor with 8 MiB
#: feature tiles (joined rows of 9.3 MiB: at most 13.7 copies) and lost four (retried) with
#: 16 MiB ones (18.3 MiB: more than 7): bench/bench_spark_memory.py --metrics.
TILE_COPIES = 16
#: Settings under which a program runs as one Spark job (``SparkEngine.steps``; the default,
#: ``spark_jobs.adaptive`` for Spark's own): adaptive execution runs every shuffle stage as a
#: job of its own, and each broadcast join and each runtime Bloom filter (a scalar subquery) is
#: a job too; without them the plan's stages run in the one job of its action, shared views
#: computed once inside it. Without adaptive execution nothing coalesces small shuffles after
#: the fact, so each program's shuffles get the partitions its data need
#: (``SparkEngine.shuffle_partitions``). A union of results that each have one partition (a
#: training step's, its small relations coalesced: ``spark_sql``) keeps a task per result
#: instead of becoming one task.
ONE_JOB = {"spark.sql.adaptive.enabled": "false", "spark.sql.autoBroadcastJoinThreshold": "-1",
           "spark.sql.optimizer.runtime.bloomFilter.enabled": "false", "spark.sql.unionOutputPartitioning": "false"}
PARTITIONS = "spark.sql.shuffle.partitions"
#: Generated classes Spark keeps (``spark.sql.codegen.cache.maxEntries``, a static setting:
#: the session's start): Spark compiles Java for each operator and expression of a query, and
#: one GCN training step needs ~340 classes. Spark's default cache of 100 evicted them before
#: the next step asked for the same ones, so every step compiled them all again (~20 ms each
#: in Janino on the driver and on every executor, 6-9 s of CPU per step on ``local[2]``;
#: ``bench/bench_spark_stages.py`` counts them). With room for them, steps after the first
#: compile none.
CODEGEN_CACHE = 2048
#: Settings every program's query runs under, below ``program_settings``: no whole-stage code
#: generation. A step's operators see a few rows of tiles each, where interpreted evaluation
#: costs nothing measurable, while whole-stage code is compiled per stage (~200 of the GCN
#: step's ~340 classes): a program run once compiles ~140 instead.
INTERPRETED = {"spark.sql.codegen.wholeStage": "false"}
#: The bytes of rows in one Arrow batch to or from a Python worker: a program's batches hold a
#: task's tile budget (``SparkEngine.budget``; at least one row), since Spark holds a batch's
#: rows several times over in the heap (the queue of rows awaiting their results, their
#: projections, the rows made of the results).
BATCH_BYTES = "spark.sql.execution.arrow.maxBytesPerBatch"
#: Java options of the driver and executors tra_sql starts (``spark.driver.extraJavaOptions``,
#: ``spark.executor.extraJavaOptions``; a ``config`` that sets one replaces it): just-in-time
#: compilation by HotSpot's C1 compiler only. A training step plans a query of ~180 operators
#: through Catalyst and runs interpreted expressions over a few rows of tiles: the C2 compiler
#: was the driver's busiest single thread over 12 steps of the 8192-node GCN. With C1 alone
#: the driver's JVM used 0.9-1.0 s of CPU a step, against 1.7-2.0 s in steps 12-15 and 1.0-1.5 s
#: in steps 36-39, and the median of steps 21-40 took 1.63 against 1.90 s on two cores
#: (bench/RESULTS.md).
JAVA_OPTIONS = "-XX:+IgnoreUnrecognizedVMOptions -XX:TieredStopAtLevel=1"
#: Every tile a kernel reads or writes crosses the socket between an executor and its Python
#: worker (a 100k-node GCN step: ~380 MB in, ~60 MB out). tra_sql's applications use Unix
#: domain sockets for it, not TCP over the loopback (Spark's default; Spark 4.1+): that GCN's
#: steady epoch used 6% less CPU in four alternated pairs, median 3.90 s against 4.12 s over TCP
#: (bench/RESULTS.md). A ``config`` may set it back to ``"false"``.
UNIX_SOCKETS = {"spark.python.unix.domain.socket.enabled": "true"}


DUCKDB_ONLY = ("this is a Spark session: the feature you used (transactions, check, execute) runs on "
               "DuckDB only")


class DuckDBOnlyError(ExecutionError):
    """A DuckDB-only feature was used on a Spark session."""


def jvm_bytes(text: str) -> float:
    """A JVM memory size (``512m``, ``2g``; binary units, bytes if bare) in bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", str(text).lower())
    if not match:
        raise errors.SpecError(f"cannot read {text!r} as a JVM memory size (e.g. '512m', '2g')")
    return float(int(match.group(1)) << (10 * " kmgt".index(match.group(2) or " ")))


def _start(master, app_name, root: Path, driver_memory, executor_memory, executor_cores, config: dict):
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkContext._active_spark_context
    if active is not None:
        raise TraError(f"a Spark application ({active.master}) is running in this process: close its "
                       f"session first, or pass it as connect(engine='spark', spark=...)")
    settings = {
        "spark.master": master, "spark.app.name": app_name, "spark.driver.memory": driver_memory,
        "spark.executor.memory": executor_memory, "spark.sql.warehouse.dir": str(root),
        "spark.pyspark.python": sys.executable, "spark.pyspark.driver.python": sys.executable,
        "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.log.level": "ERROR",
        "spark.sql.shuffle.partitions": "8", "spark.sql.execution.arrow.useLargeVarTypes": "true",
        "spark.hadoop.parquet.block.size": str(ROW_GROUP_BYTES),  # the row groups Spark writes
        # collect_list of tiles: sort-based aggregation holds one group at a time and spills;
        # the hash aggregate holds every group's list at once and runs out of heap on MB tiles
        "spark.sql.execution.useObjectHashAggregateExec": "false",
        "spark.sql.codegen.cache.maxEntries": str(CODEGEN_CACHE),
        "spark.driver.extraJavaOptions": JAVA_OPTIONS, "spark.executor.extraJavaOptions": JAVA_OPTIONS,
        **UNIX_SOCKETS,
    }
    if executor_cores is not None:
        settings["spark.executor.cores"] = str(executor_cores)
    if master.startswith("local") or any(f"//{host}:" in master for host in LOOPBACK):
        settings["spark.driver.host"] = settings["spark.driver.bindAddress"] = "127.0.0.1"
    for var in THREAD_ENV:
        settings[f"spark.executorEnv.{var}"] = "1"
    if os.environ.get("TRA_SQL_CACHE_DIR"):
        settings["spark.executorEnv.TRA_SQL_CACHE_DIR"] = os.environ["TRA_SQL_CACHE_DIR"]
    settings.update({k: str(v) for k, v in config.items()})
    builder = SparkSession.builder
    for k, v in settings.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(settings["spark.log.level"])
    # PySpark takes the Python of the UDF workers from $PYSPARK_PYTHON (else "python3"), not
    # from spark.pyspark.python, when the driver is a plain Python process.
    spark.sparkContext.pythonExec = os.environ.get("PYSPARK_PYTHON", settings["spark.pyspark.python"])
    return spark


class SparkEngine(Engine):
    """Tensor relations in a Spark warehouse; programs run as Spark SQL. ``connect(engine=
    "spark", ...)`` opens one (``open``). Relations are copies (tensor tables); what Spark
    does not run (transactions, ``check``, ``execute``) raises ``DuckDBOnlyError``; staged plans
    run through ``spark_staged``."""

    name: ClassVar[str] = "spark"
    dialect: ClassVar[str] = "spark"
    staged: ClassVar[bool] = True
    spills: ClassVar[bool] = True

    def __init__(self, spark, root: Path, *, owns: bool = True, temporary: bool = False):
        super().__init__()
        self.spark = spark
        #: the application's Spark settings (static: read once, not on every program's ``budget``)
        self.conf: dict[str, str] = dict(spark.sparkContext.getConf().getAll())
        self.warehouse = Warehouse(root, spark)
        self._owns = owns
        self._temporary = temporary
        #: fused join + aggregate steps whose groups hold more tile bytes than this run as a
        #: grouped aggregate UDF (bounded memory) instead of over a list per group
        self.group_bytes = GROUP_BYTES
        self._constants: Constants | None = None  # measured by ``calibrate()``
        #: SQL settings programs run under, over the session's own (``ONE_JOB``: one job each;
        #: ``{}``: Spark's own, see ``spark_jobs.adaptive``)
        self.program_settings: dict[str, str] = dict(ONE_JOB)

    @classmethod
    def open(cls, warehouse: str | os.PathLike | None = None, *, master: str = "local[2]", app_name: str = "tra_sql",
             driver_memory: str = "1g", executor_memory: str = "1g", executor_cores: int | None = None,
             config: dict | None = None, spark=None) -> SparkEngine:
        """Spark for tra_sql. ``master``: ``local[N]`` or ``spark://host:port``; ``warehouse``:
        the directory holding the tensor tables (a temporary one, removed on ``close()``, if
        None or ``":memory:"``); ``config``: more Spark settings. ``spark``: use this running
        ``pyspark.sql.SparkSession`` instead of starting one (it is not stopped on ``close()``;
        its static settings are its own, and Arrow large binary types are switched on in it)."""
        try:
            import pyspark  # noqa: F401
        except ImportError:
            raise TraError("engine='spark' needs pyspark and Java 17: pip install pyspark==4.3.0") from None
        temporary = warehouse in (None, ":memory:")
        root = Path(tempfile.mkdtemp(prefix="tra_spark_") if temporary else os.fspath(warehouse)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        owns = spark is None
        if owns:
            spark = _start(master, app_name, root, driver_memory, executor_memory, executor_cores, dict(config or {}))
        spark.conf.set("spark.sql.execution.arrow.useLargeVarTypes", "true")
        try:
            return cls(spark, root, owns=owns, temporary=temporary)
        except BaseException:
            if owns:
                spark.stop()
            raise

    def close(self) -> None:
        if self._owns:
            self.spark.stop()
        if self._temporary:
            shutil.rmtree(self.warehouse.root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<tra_sql Spark session {self.spark.sparkContext.master} warehouse={self.warehouse.root}>"

    def register_kernels(self, kernels: list) -> None:
        spark_udfs.register(self.spark, kernels)

    def translate(self, err: BaseException, what: str) -> TraError:
        return spark_udfs.translate(err, what)

    # -- programs and statements --------------------------------------------------------
    def sql_text(self, program: Program) -> str:
        """The Spark SQL this engine runs for ``program`` (see ``spark_sql``)."""
        return self.sql_dialect().steps(program).text()

    def sql_dialect(self) -> SparkDialect:
        """The dialect programs are written in: groups over ``group_bytes`` as grouped
        aggregates, relations that fit a task's tile budget (``budget``) not shuffled, small
        unions of results in a task per executor core."""
        slots, budget = self.budget()
        return SparkDialect(self.group_bytes, budget, slots)

    @contextmanager
    def steps(self, steps: Steps, what: str, args: dict[str, bytes] | None = None, inputs: dict | None = None):
        """The (lazy) DataFrame of ``steps``' final query (its named parameters bound to
        ``args``; its input views over ``inputs``' relations or their tables) while its views
        exist (``prepare``). An action on it inside the block is one Spark job
        (``program_settings``: the checkpoints are computed inside it), its Arrow batches a
        task's tile budget (``BATCH_BYTES``). On exit the views are dropped, the checkpoints'
        blocks freed and the settings put back."""
        with settings(self.spark, self.step_settings(steps)), call_site(self.spark, f"tra_sql: {what}"):
            prepared = self.prepare(steps, what, args, inputs)
            try:
                yield prepared.frame
            finally:
                prepared.close()

    def step_settings(self, steps: Steps) -> dict[str, str]:
        """The SQL settings ``steps`` run under (``query_settings``, and without adaptive
        execution the shuffle partitions its data need)."""
        values = self.query_settings()
        adaptive = values.get("spark.sql.adaptive.enabled", self.spark.conf.get("spark.sql.adaptive.enabled"))
        if adaptive == "false" and steps.nbytes and PARTITIONS not in values:
            values[PARTITIONS] = str(self.shuffle_partitions(steps.nbytes))
        return values

    def query_settings(self) -> dict[str, str]:
        """The SQL settings a program's or a relation's query runs under: ``program_settings``
        over Arrow batches of a task's tile budget (``BATCH_BYTES``) and ``INTERPRETED``."""
        return {BATCH_BYTES: str(max(1, int(self.budget()[1]))), **INTERPRETED, **self.program_settings}

    def shuffle_partitions(self, nbytes: int) -> int:
        """Partitions of every shuffle of a program whose largest relation holds ``nbytes``,
        when adaptive execution (which would coalesce them after each stage, a job each) is
        off: one per advisory partition size (``spark.sql.adaptive.advisoryPartitionSizeInBytes``,
        64 MiB), at most ``spark.sql.shuffle.partitions``. Each task of a stage that calls a
        kernel costs a Python UDF's start; most of a step's shuffles carry a few tiles."""
        advisory = jvm_bytes(self.spark.conf.get("spark.sql.adaptive.advisoryPartitionSizeInBytes", "64m"))
        return max(1, min(int(self.spark.conf.get(PARTITIONS)), math.ceil(nbytes / advisory)))

    def prepare(self, steps: Steps, what: str, args: dict[str, bytes] | None = None, inputs: dict | None = None,
                keep=None) -> Prepared:
        """Plan ``steps`` under the session's settings as they are (``step_settings`` is the
        caller's to set): each input view over the DataFrame ``inputs`` gives for its table
        (lower-case name), else over the table; each view a temporary view, one read more than
        once a lazy local checkpoint (computed once, when first read, and kept by the
        executors, on disk if it is ``big``: in their heaps a checkpoint takes the memory the
        tasks need; a cached plan would instead carry its whole lineage into every plan that
        reads it); the final query's DataFrame, a lazy local checkpoint too at storage level
        ``keep`` if one is given (its rows are then read again after the action that computes
        them, until ``Prepared.release``)."""
        from pyspark import StorageLevel

        self.ensure_kernels(steps.kernels)
        prepared = Prepared(self)
        try:
            for table, view in steps.inputs.items():
                frame = (inputs or {}).get(table)
                (self.spark.table(quote(table)) if frame is None else frame).createOrReplaceTempView(view)
                prepared.views.append(view)
            for name, sql, reads in steps.views:
                frame = self.spark.sql(sql, args=args)
                if reads > 1:
                    kept = StorageLevel.DISK_ONLY if name in steps.big else None
                    frame = frame.localCheckpoint(eager=False, storageLevel=kept)
                    prepared.checkpoints.append(frame._jdf.queryExecution().logical().rdd())
                frame.createOrReplaceTempView(name)
                prepared.views.append(name)
            prepared.frame = self.spark.sql(steps.final, args=args)
            if keep is not None:
                prepared.frame = prepared.frame.localCheckpoint(eager=False, storageLevel=keep)
                prepared.result = prepared.frame._jdf.queryExecution().logical().rdd()
        except Exception as err:
            prepared.discard()
            raise spark_udfs.translate(err, f"planning {what}") from None
        return prepared

    def drop_view(self, name: str) -> None:
        """Drop temporary view ``name`` from the session's catalog. ``spark.catalog.dropTempView``
        would first analyze the view's whole plan again, to uncache it: tra_sql's views are
        never cached."""
        self.spark._jsparkSession.sessionState().catalog().dropTempView(name)

    def frame(self, program: Program):
        """A context manager: ``program`` as a (lazy) Spark DataFrame with columns ``k0..``
        (INT) and ``tile``, valid inside the ``with`` block."""
        return self.steps(self.sql_dialect().steps(program), program.root.label)

    def run(self, program: Program) -> pa.Table:
        with self.frame(program) as frame:
            try:
                return frame.toArrow()
            except Exception as err:
                raise spark_udfs.translate(err, f"computing {program.root.label}") from None

    def store(self, info: TensorInfo, program: Program, replace: bool = False) -> None:
        with self.frame(program) as frame:
            self._write(info, lambda: frame, replace)

    def store_query(self, info: TensorInfo, query: exp.Select, replace: bool = False) -> None:
        with settings(self.spark, self.query_settings()):
            self._write(info, lambda: self.spark.sql(query.sql(dialect=self.dialect)), replace)

    def _write(self, info: TensorInfo, frame, replace: bool) -> None:
        """Write the DataFrame ``frame()`` as tensor ``info.name`` (Spark's errors as ``TraError``s)."""
        try:
            rows = frame()
            self.warehouse.create(info.name, lambda d: rows.write.parquet(str(d)), info, replace)
        except TraError:
            raise
        except Exception as err:
            raise spark_udfs.translate(err, f"storing '{info.name}'") from None

    def import_tiles(self, info: TensorInfo, tiles: pa.Table, replace: bool = False) -> None:
        tiles = tiles.cast(tile_schema(len(info.shape)))
        self.warehouse.create(info.name, lambda d: write_parquet(tiles, d), info, replace)

    def create_relation(self, info: TensorInfo, select: exp.Select, replace: bool = False) -> None:
        """A relation on Spark is a copy: ``select`` written as a tensor table (later changes
        to the table it reads do not show)."""
        self.store_query(info, select, replace)

    def query(self, sql: str, params=None):
        return self.spark.sql(sql, args=params)

    def rows(self, sql: str, params=None) -> list[tuple]:
        return [tuple(row) for row in self.spark.sql(sql, args=params).collect()]

    def arrow(self, sql: str) -> pa.Table:
        return self.spark.sql(sql).toArrow()

    def execute(self, sql: str, params=None):
        raise DuckDBOnlyError(DUCKDB_ONLY)

    def transaction(self):
        raise DuckDBOnlyError(DUCKDB_ONLY)

    def run_staged(self, root, plan):
        return staged.computed(SparkStages(self), root, plan)

    # -- the catalog --------------------------------------------------------------------
    def lookup(self, name: str) -> TensorInfo:
        return self.warehouse.lookup(name)

    def catalog_row(self, name: str) -> TensorInfo | None:
        return self.warehouse.entry(name)

    def tensors(self) -> list[str]:
        return self.warehouse.tensors()

    def drop(self, name: str) -> None:
        self.warehouse.drop(self.warehouse.lookup(name).name)

    def check(self, repair: bool = False):
        raise DuckDBOnlyError(DUCKDB_ONLY)

    def tile_count(self, table: str) -> int:
        """Rows (tiles) of table ``table``: from the Parquet footers of a warehouse table, else
        counted by Spark."""
        files = list(self.warehouse.path(table).glob("*.parquet"))
        if files:
            return sum(pq.read_metadata(f).num_rows for f in files)
        return self.spark.table(quote(table)).count()

    def stored_bytes(self, table: str) -> int:
        """Bytes of table ``table``'s Parquet files in the warehouse."""
        return sum(f.stat().st_size for f in self.warehouse.path(table).glob("*.parquet"))

    def keep_tables(self, names) -> set[str]:
        """Keep tables ``names`` in the executors (in memory, else on their disks) from their
        next read on, and return those this call started keeping (not those the session already
        kept): a training run's data, which every step reads. A replacement published later
        (``Warehouse``: ``REFRESH TABLE``) is kept in its place."""
        started = set()
        for name in names:
            if not self.spark.catalog.isCached(quote(name)):
                self.spark.sql(f"CACHE LAZY TABLE {quote(name)} OPTIONS ('storageLevel' 'MEMORY_AND_DISK')")
                started.add(name)
        return started

    def release_tables(self, names) -> None:
        """Stop keeping tables ``names`` (``keep_tables``) in the executors."""
        for name in names:
            self.spark.sql(f"UNCACHE TABLE IF EXISTS {quote(name)}")

    # -- cluster resources, for the planner ---------------------------------------------
    def memory_limit(self) -> int | None:
        return None  # the executors' memory is not this process's

    def executors(self) -> int:
        """Executors registered now (local mode: 1, the driver)."""
        sc = self.spark.sparkContext
        if sc.master.startswith("local"):
            return 1
        return max(0, len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1)

    def wait_for_executors(self, count: int, timeout: float = 60.0) -> None:
        """Block until ``count`` executors have registered."""
        deadline = time.monotonic() + timeout
        while self.executors() < count:
            if time.monotonic() > deadline:
                raise ExecutionError(f"only {self.executors()} of {count} Spark executors registered "
                                     f"within {timeout:.0f} s")
            time.sleep(0.2)

    def budget(self, workers: int | None = None, memory=None) -> tuple[int, float]:
        """(workers, bytes per worker) for EinDecomp: the total executor cores (``local[N]``:
        N) and the memory Spark lets an executor's tasks use (its heap, local: the driver's,
        less Spark's reserved 300 MiB, times ``spark.memory.fraction``) over its cores, in
        bytes of tiles (over ``TILE_COPIES``)."""
        conf = self.conf
        master = conf.get("spark.master", "local[*]")
        local = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master)
        if local:
            n = local.group(1)
            cores = 1 if n is None else (os.cpu_count() or 1) if n == "*" else int(n)
            per_executor, heap = cores, conf.get("spark.driver.memory", "1g")
        else:
            per_executor, executors = int(conf.get("spark.executor.cores", "0")), self.executors()
            cores = executors * per_executor if per_executor and executors else \
                self.spark.sparkContext.defaultParallelism
            per_executor = per_executor or max(1, cores // max(1, executors))
            heap = conf.get("spark.executor.memory", "1g")
        if memory is not None:
            return int(workers or cores), parse_bytes(memory)
        usable = (jvm_bytes(heap) - RESERVED) * float(conf.get("spark.memory.fraction", "0.6"))
        return int(workers or cores), max(usable, 0.0) / per_executor / TILE_COPIES

    def constants(self) -> Constants | None:
        return self._constants

    def calibrate(self, session) -> Constants:
        """Measure the planner's cost constants on this application's executors (see
        ``spark_calibrate``); later plans of this session use them."""
        self._constants = spark_calibrate.calibrate(session)
        return self._constants
