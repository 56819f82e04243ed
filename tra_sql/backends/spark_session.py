"""What a Spark program holds in the session while it is planned and run: SQL settings
(``settings``), the thread's call site (``call_site``), and a planned program's views,
checkpoints and kept result (``Prepared``, made by ``SparkEngine.prepare``)."""

from __future__ import annotations

from contextlib import contextmanager

#: Spark's thread-local properties that name the call site (``call_site``)
CALL_SITE = ("callSite.short", "callSite.long")


@contextmanager
def settings(spark, values: dict[str, str]):
    """The session's SQL settings ``values`` while the block runs (then as they were)."""
    before = {k: spark.conf.get(k, None) for k in values}
    for k, v in values.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


@contextmanager
def call_site(spark, text: str):
    """``text`` as Spark's call site of the RDDs, queries and jobs that this thread makes inside
    the block (the thread's own put back after it). Without one, Spark walks the JVM's stack
    for each RDD it creates (``SparkContext.getCallSite``), hundreds per training step."""
    sc = spark.sparkContext
    before = {key: sc.getLocalProperty(key) for key in CALL_SITE}
    for key in CALL_SITE:
        sc.setLocalProperty(key, text)
    try:
        yield
    finally:
        for key, value in before.items():
            sc.setLocalProperty(key, value)


class Prepared:
    """A planned program (``SparkEngine.prepare``): its final query's ``frame``, valid until
    ``close`` drops its ``views`` and frees its ``checkpoints``; with a kept ``result`` (the
    frame's own checkpoint), readable until ``release``."""

    def __init__(self, engine):
        self.engine = engine
        self.frame = None
        self.views: list[str] = []
        self.checkpoints: list = []  # the views' local checkpoints (JVM RDDs)
        self.result = None  # the final frame's local checkpoint (a JVM RDD), if kept

    def close(self) -> None:
        """Drop the views and free their checkpoints' blocks (the kept result stays)."""
        for name in self.views:
            self.engine.drop_view(name)
        for rdd in self.checkpoints:
            rdd.unpersist(False)
        self.views, self.checkpoints = [], []

    def release(self) -> None:
        """Free the kept result's blocks."""
        if self.result is not None:
            self.result.unpersist(False)
            self.result = None

    def discard(self) -> None:
        """Drop the views and free every block: checkpoints and kept result."""
        self.close()
        self.release()
