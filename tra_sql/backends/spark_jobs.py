"""Counting the Spark jobs that a block of driver code launches (``jobs``): the benchmark's
"jobs per step" and the tests that bound it. Job counts are deterministic, unlike times.
``one_job`` runs a block's programs one Spark job each."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tra_sql.backends.spark import ONE_JOB

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
def one_job(engine) -> Iterator[None]:
    """Inside the block, each program ``engine`` (a ``SparkEngine``) runs is one Spark job
    (``spark.ONE_JOB``'s settings); its settings before are put back on exit."""
    before = engine.program_settings
    engine.program_settings = {**before, **ONE_JOB}
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
