"""Counting the Spark jobs that a block of driver code launches (``jobs``): the benchmark's
"jobs per step" and the tests that bound it. Job counts are deterministic, unlike times, and
so are the classes Spark's code generator compiles (``compiled``) and the Python workers that
run the UDFs (``python_workers``: a reused worker keeps its PID).
``adaptive`` runs a block's programs under Spark's own settings (a job per shuffle stage)
instead of one Spark job each (``spark.ONE_JOB``, the default)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

GROUP = "spark.jobGroup.id"


@dataclass
class Jobs:
    """The jobs of Spark job group ``group`` (the ones launched inside a ``jobs`` block)."""

    sc: object
    group: str

    @property
    def count(self) -> int:
        """Jobs launched so far (final once the block exits)."""
        return len(self.sc.statusTracker().getJobIdsForGroup(self.group))


@contextmanager
def adaptive(engine) -> Iterator[None]:
    """Inside the block, the programs ``engine`` (a ``SparkEngine``) runs take Spark's own
    settings (adaptive execution, broadcast joins, runtime Bloom filters), not ``ONE_JOB``'s;
    its settings before are put back on exit. For A/B comparisons."""
    before = engine.program_settings
    engine.program_settings = {}
    try:
        yield
    finally:
        engine.program_settings = before


@contextmanager
def jobs(spark) -> Iterator[Jobs]:
    """Count the Spark jobs this thread launches inside the block: they run in a job group of
    their own (the thread's group before is put back), counted by Spark's status tracker."""
    sc = spark.sparkContext
    before = sc.getLocalProperty(GROUP)
    sc.setLocalProperty(GROUP, f"tra_sql_jobs_{uuid.uuid4().hex[:12]}")
    try:
        yield Jobs(sc, sc.getLocalProperty(GROUP))
    finally:
        sc.setLocalProperty(GROUP, before)


def compiled(spark) -> int:
    """Classes Spark's code generator has compiled in the driver's JVM so far (its
    ``CodegenMetrics``; in local mode the tasks run there too): a program run again with its
    classes still cached (``spark.CODEGEN_CACHE``) adds none."""
    metrics = spark.sparkContext._jvm.org.apache.spark.metrics.source.CodegenMetrics
    return int(metrics.METRIC_COMPILATION_TIME().getCount())


def python_workers() -> frozenset[int]:
    """The PIDs of the PySpark Python workers alive now under this process: the processes a
    ``pyspark.daemon`` forked, where the daemon descends from this process (local mode's, or
    the executors' of a ``StandaloneCluster`` started here). Read from ``/proc`` (Linux; empty
    elsewhere). A step that reuses its workers leaves this set as it was."""
    parents, daemons = {}, set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"pyspark.daemon" in f.read():
                    daemons.add(int(entry))
        except (OSError, ValueError):  # not a process, or one that has exited
            continue

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return frozenset(pid for pid in daemons if parents[pid] in daemons and ours(pid))
