"""Counting the Spark jobs that a block of driver code launches (``jobs``): the benchmark's
"jobs per step" and the tests that bound it. Job counts are deterministic, unlike times."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

GROUP = "spark.jobGroup.id"


@dataclass
class Jobs:
    """The jobs launched inside a ``jobs`` block (``count`` is final once the block exits)."""

    group: str
    count: int = 0


@contextmanager
def jobs(spark) -> Iterator[Jobs]:
    """Count the Spark jobs this thread launches inside the block: they run in a job group of
    their own (the thread's group before is put back), counted by Spark's status tracker."""
    sc = spark.sparkContext
    before = sc.getLocalProperty(GROUP)
    group = f"tra_sql_jobs_{uuid.uuid4().hex[:12]}"
    counted = Jobs(group=group)
    sc.setLocalProperty(GROUP, group)
    try:
        yield counted
    finally:
        sc.setLocalProperty(GROUP, before)
        counted.count = len(sc.statusTracker().getJobIdsForGroup(group))
