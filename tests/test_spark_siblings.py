"""Sibling results of a training step in one Spark step (``backends.spark_siblings``), and the
union of a step's results in few tasks: the SQL that Spark would run, built without Spark.
Spark's answers are compared with DuckDB's in
``test_spark.py::test_an_optimizer_step_computes_its_results_in_one_projection``."""

import re

import numpy as np
from sqlglot import exp, parse_one

import tra_sql
from tra_sql import train as core
from tra_sql.backends.spark_sql import EXCHANGED, SparkDialect, _big_reads
from tra_sql.compile.program import Program
from tra_sql.optim import Adam
from tra_sql.udfs.protocol import Kernel


def adam_step(db):
    """A softmax regression's Adam step: its compiled program and its results (the loss, each
    parameter, each parameter's two moments)."""
    rng = np.random.default_rng(3)
    x = db.from_numpy("X", rng.standard_normal((40, 8)), tile=(16, 8))
    y = db.from_numpy("Y", np.eye(3)[rng.integers(0, 3, 40)], tile=(16, 3))
    w = db.from_numpy("W", rng.standard_normal((8, 3)), tile=(4, 3))
    b = db.from_numpy("b", np.zeros(3))
    loss = core.cross_entropy(db, db.einsum("nc,c->nc", db.einsum("nf,fc->nc", x, w), b, join="x0 + x1"), y, 40)
    step = core.Trainer(db, loss, [w, b], Adam(lr=0.1), "r", 1).plan(0)
    return Program.compile(*step.nodes.values()), step.nodes


def stacked(text: str) -> list[list[str]]:
    """The targets of each ``STACK`` in ``text``, in order."""
    return [re.findall(r"'([\w]+)'", call) for call in re.findall(r"STACK\((.*?)\) AS \(target", text, re.S)]


def test_an_optimizers_results_are_one_step_with_their_shared_relations_read_once():
    """Adam's new weights and moments of a parameter join the same tiles: with every relation
    complete they are one step (three kernels in one projection, rows by ``STACK``), and the
    gradient they share is read there once, a subquery instead of a view and a checkpoint."""
    with tra_sql.connect() as db:
        program, results = adam_step(db)
        dialect = SparkDialect(replicate=1 << 20)
        apart = dialect.union_steps(program, results)
        merged = dialect.union_steps(program, results, db.engine.completeness())
    assert stacked(apart.text()) == []
    assert stacked(merged.text()) == [["W", "r__m__W", "r__v__W"], ["b", "r__m__b", "r__v__b"]]
    assert len(merged.views) == len(apart.views) - 2  # each gradient was a view read three times
    assert merged.kernels == apart.kernels
    calls = r"TRA_\w+\("
    assert len(re.findall(calls, merged.text())) == len(re.findall(calls, apart.text()))


def test_results_joining_a_relation_that_may_lack_tiles_stay_apart():
    """A relation without a tile at some key would drop rows of the results merged with it:
    the results of a parameter whose first moment lost a tile keep their three steps; the
    other parameter's are merged. (A parameter lacking a tile would keep both apart: every
    gradient is computed from it.)"""
    with tra_sql.connect() as db:
        program, results = adam_step(db)
        db.engine.con.execute('DELETE FROM "r__m__W" WHERE k0 = 1')
        merged = SparkDialect(replicate=1 << 20).union_steps(program, results, db.engine.completeness())
    assert stacked(merged.text()) == [["b", "r__m__b", "r__v__b"]]


def test_results_merge_while_a_row_fits_a_tasks_tile_budget():
    """A merged step's row holds every tile its members join and make: W's (four 4x3 float64
    tiles joined, two scalars, three made: 688 bytes) is over a 500-byte budget and stays
    apart, b's (184 bytes) is merged."""
    with tra_sql.connect() as db:
        program, results = adam_step(db)
        merged = SparkDialect(replicate=500).union_steps(program, results, db.engine.completeness())
    assert stacked(merged.text()) == [["b", "r__m__b", "r__v__b"]]


def test_a_small_steps_results_run_in_a_task_per_executor_core():
    """The union of a step's results is coalesced into as many partitions as the executors run
    tasks at once, not a task per result, when its results fit a task's tile budget and it reads
    nothing over that budget other than through an exchange: every relation fits (the largest,
    the features, holds 2,560 bytes), or the features (over the budget) are read only by a step
    exchanged into one partition and by an aggregation. A union whose results do not fit (W,
    192 bytes, over a 100-byte budget), or with the slots unknown, keeps a task per result."""
    def final(dialect):
        with tra_sql.connect() as db:
            program, results = adam_step(db)
            return dialect.union_steps(program, results, db.engine.completeness()).final

    assert final(SparkDialect(replicate=2560, slots=2)).startswith("SELECT /*+ COALESCE(2) */ target")
    assert final(SparkDialect(replicate=2559, slots=2)).startswith("SELECT /*+ COALESCE(2) */ target")
    assert "COALESCE(2)" not in final(SparkDialect(replicate=100, slots=2))
    assert "COALESCE(2)" not in final(SparkDialect(replicate=1 << 20))


def test_a_small_step_of_big_inputs_is_exchanged_into_one_partition():
    """A step whose result fits a task's tile budget is one partition: coalesced from its inputs
    (``COALESCE(1)``) when they are small too or reached through an aggregation's exchange (the
    gradient Xᵀ·G summed over X's row tiles), and computed in its inputs' partitions and then
    exchanged (``REPARTITION(1)``) when it reads a relation over the budget, here the features
    (2,560 bytes over 2,559) in X·W: one partition coalesced from them was computed in one task,
    and again by every executor reading it."""
    with tra_sql.connect() as db:
        program, results = adam_step(db)
        steps = SparkDialect(replicate=2559, slots=2).union_steps(program, results, db.engine.completeness())
        views = {name[len(steps.prefix):]: sql for name, sql, _ in steps.views}
        fits = SparkDialect(replicate=2560).union_steps(program, results, db.engine.completeness())
    assert "FROM `X`" in views["_t2"] and "REPARTITION(1)" in views["_t2"]  # X·W
    assert "JOIN `X`" in views["_t9"] and "COALESCE(1) */ k0" in views["_t9"]  # Xᵀ·G
    assert "COALESCE(1) */ x0.k0" in views["_t3"]  # the max of X·W
    assert "REPARTITION" not in fits.text() and fits.text().count("FROM `X`") == 2


def test_what_a_query_reads_other_than_through_an_exchange():
    """``_big_reads``: a relation outside the small ones, read directly or through a join, but
    not through an aggregation (Spark exchanges its input) of tiles computed before it, or a
    step exchanged into one partition; a table function (``RANGE``) is no relation."""
    small = {"w"}
    assert _big_reads(parse_one("SELECT * FROM x JOIN w ON TRUE"), small)
    assert not _big_reads(parse_one("SELECT * FROM w JOIN RANGE(0, 2) AS r(o) ON TRUE"), small)
    assert not _big_reads(parse_one("SELECT k, COLLECT_LIST(t) FROM x GROUP BY k"), small)
    assert not _big_reads(parse_one("SELECT * FROM w JOIN (SELECT SUM(t) AS t FROM x) AS g ON TRUE"), small)
    listing = parse_one("SELECT k, TRA_EINSUM_AGG_2(m, k, COLLECT_LIST(t)) FROM x GROUP BY k")
    listing.find(exp.Anonymous).meta["kernel"] = Kernel("einsum_agg", 2)  # its products come after the exchange
    assert _big_reads(listing, small) and not _big_reads(listing, {"x"})
    listing.find(exp.Anonymous).meta["kernel"] = Kernel("attention", 3)  # so does an attention's
    assert _big_reads(listing, small)
    exchanged = parse_one("SELECT * FROM w JOIN (SELECT t FROM x) AS s ON TRUE")
    assert _big_reads(exchanged, small)
    exchanged.find(exp.Subquery).this.meta[EXCHANGED] = True
    assert not _big_reads(exchanged, small)
