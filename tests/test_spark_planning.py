"""Plans on Spark (local[2]): staged and banded plans, out-of-core bands that accumulate,
a planned gradient and the automatic plan of ``numpy()`` give numpy's answers, in a few
Spark jobs per stage, and leave no stage table behind. Skipped without pyspark or Java."""

import os
import re
import shutil

import numpy as np
import pytest

pytest.importorskip("pyspark")
if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("the Spark tests need Java", allow_module_level=True)

import tra_sql  # noqa: E402
from tra_sql import nn  # noqa: E402
from tra_sql.backends import spark_jobs  # noqa: E402
from tra_sql.decompose import Constants, choose, make_plan  # noqa: E402

CONSTS = Constants(row=1e-4, stmt=1e-3, blas_call=1e-4)


@pytest.fixture(scope="module")
def sdb():
    db = tra_sql.connect(engine="spark", master="local[2]", driver_memory="1g",
                         config={"spark.sql.shuffle.partitions": "2"})
    yield db
    db.close()


def stage_tables(db) -> list[str]:
    return [t.name for t in db.engine.spark.catalog.listTables() if t.name.startswith("_tra_stage")] + \
        [p.name for p in db.engine.warehouse.root.iterdir() if p.name.startswith("_tra_stage")]


def test_banded_plan_with_partial_sums(sdb):
    rng = np.random.default_rng(1)
    A, B = rng.random((40, 64)), rng.random((64, 30))
    C = sdb.einsum("ij,jk->ik", sdb.from_numpy("A", A, tile=(10, 16), replace=True),
                   sdb.from_numpy("B", B, tile=(16, 10), replace=True))
    plan = make_plan(C.node, 1, 80000, CONSTS, base=(1, 2, 4), yardsticks=False)
    assert plan.staged and max(op.bands for op in plan.ops) > 1
    np.testing.assert_allclose(C.store("C", plan=plan, replace=True).numpy(), A @ B, rtol=1e-10)
    np.testing.assert_allclose(C.numpy(plan=plan), A @ B, rtol=1e-10)
    assert not stage_tables(sdb)


def test_out_of_core_bands_accumulate(sdb):
    """One contracted tile per band, each adding the partial sum of the bands before."""
    rng = np.random.default_rng(4)
    A, B = rng.standard_normal((16, 256)), rng.standard_normal((256, 12))
    C = sdb.einsum("ij,jk->ik", sdb.from_numpy("oA", A, tile=(16, 32), replace=True),
                   sdb.from_numpy("oB", B, tile=(32, 12), replace=True))
    plan = sdb.plan(C, workers=2, memory="20KB")
    assert plan.staged and plan.ops[0].parts["j"] > 1 and plan.ops[0].bands > 1
    with spark_jobs.jobs(sdb.engine.spark) as jobs:
        got = C.numpy(plan=plan)
    np.testing.assert_allclose(got, A @ B, rtol=1e-10)
    assert jobs.count <= 3 * plan.ops[0].bands + 4  # a band, its sum with the last: a job each
    assert not stage_tables(sdb)


def test_planned_mlp_and_gradient(sdb):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    X, W, b = rng.standard_normal((32, 12)), rng.standard_normal((12, 12)), rng.standard_normal(12)
    x = sdb.from_numpy("px", X, tile=(8, 12), replace=True)
    w, bias = sdb.from_numpy("pW", W, tile=(6, 6), replace=True), sdb.from_numpy("pb", b, tile=(12,), replace=True)
    y = nn.mlp(sdb, x, [(w, bias), (w, bias)])
    plan = make_plan(y.node, 2, 8000, CONSTS, base=(1, 2, 4), yardsticks=False)
    np.testing.assert_allclose(y.numpy(plan=plan), y.numpy(plan=False), rtol=1e-10)
    (gw,) = sdb.grad(sdb.einsum("ij,ij->", y, y), [w])
    tx, tw, tb = (torch.tensor(v, requires_grad=v is W) for v in (X, W, b))
    hidden = torch.relu(tx @ tw + tb)
    out = hidden @ tw + tb
    (out * out).sum().backward()
    gplan = make_plan(gw.node, 2, 8000, CONSTS, base=(1, 2, 4), yardsticks=False)
    assert gplan.staged
    np.testing.assert_allclose(gw.numpy(plan=gplan), tw.grad.numpy(), rtol=1e-9)
    assert not stage_tables(sdb)


def test_numpy_plans_automatically_on_spark(sdb, monkeypatch):
    """``numpy()`` plans a program whose tiling as written does not fit the executors'
    memory (here: 12 KB per core, less than one joined row of its tiles, and inputs counted
    big from 1 KB)."""
    rng = np.random.default_rng(5)
    A, B = rng.standard_normal((16, 256)), rng.standard_normal((256, 12))
    C = sdb.einsum("ij,jk->ik", sdb.from_numpy("aA", A, tile=(16, 64), replace=True),
                   sdb.from_numpy("aB", B, tile=(64, 12), replace=True))
    monkeypatch.setattr(choose, "AUTO_MIN_BYTES", 1024)
    monkeypatch.setattr(sdb.engine, "budget", lambda workers=None, memory=None: (2, 12e3))
    plan = choose.auto(C)
    assert plan is not None and plan.staged
    np.testing.assert_allclose(C.numpy(), A @ B, rtol=1e-10)
    assert not stage_tables(sdb)


def test_features_bigger_than_a_task_under_the_planners_tiling(sdb):
    """Features four times a task's memory (a budget forced to 96 KB per task, two tasks): on
    Spark, whose scans stream and whose shuffles spill, the planner tiles the first layer's
    product so that a task holds one joined row (DuckDB's model, where a statement holds what
    it scans, finds no finite plan); an MLP training step over the features stored in those
    tiles gives DuckDB's losses and weights."""
    from tra_sql.optim import Adam
    from tra_sql.train import cross_entropy

    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((1024, 48)), np.eye(4)[rng.integers(0, 4, 1024)]
    w1, w2 = rng.standard_normal((48, 16)) * 0.2, rng.standard_normal((16, 4)) * 0.2
    memory = 96e3
    assert x.nbytes > 4 * memory
    probe = sdb.einsum("nf,fh->nh", sdb.zeros(x.shape, "float64", x.shape), sdb.zeros(w1.shape, "float64", w1.shape))
    plan = sdb.plan(probe, workers=2, memory=memory)
    assert np.isfinite(plan.cost) and plan.model.budget.spills
    assert not np.isfinite(make_plan(probe.node, 2, memory, sdb.engine.constants() or Constants()).cost)
    tile = (plan.ops[0].tile["n"], plan.ops[0].tile["f"])
    assert plan.ops[0].piece <= memory and tile[0] < len(x)
    runs = []
    with tra_sql.connect() as duck:
        for db in (sdb, duck):
            xt = db.from_numpy("bX", x, tile=tile, replace=True)
            yt = db.from_numpy("bY", y, tile=(tile[0], 4), replace=True)
            params = [db.from_numpy("bW1", w1, tile=(tile[1], 16), replace=True),
                      db.from_numpy("bb1", np.zeros(16), replace=True),
                      db.from_numpy("bW2", w2, replace=True), db.from_numpy("bb2", np.zeros(4), replace=True)]
            hid = db.einsum("nh,h->nh", db.einsum("nf,fh->nh", xt, params[0]), params[1], join="greatest(x0 + x1, 0)")
            z = db.einsum("nc,c->nc", db.einsum("nh,hc->nc", hid, params[2]), params[3], join="x0 + x1")
            history = db.train(cross_entropy(db, z, yt, len(x)), params, Adam(lr=0.01), 2, run="big", progress=False)
            runs.append((history.losses, [p.numpy() for p in params]))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-10)
    for ours, theirs in zip(runs[0][1], runs[1][1]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-13)


def features_gradient(db, prefix: str, rows: int):
    """``g = Xᵀ·h``, ``h = relu(X·W + b)`` over ``rows`` x 12 features in four row tiles (stored
    under ``prefix``): the lazy ``g`` and ``h``, and numpy's."""
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((rows, 12)), rng.standard_normal((12, 6)), rng.standard_normal(6)
    xt = db.from_numpy(f"{prefix}X", x, tile=(rows // 4, 12), replace=True)
    h = db.einsum("nh,h->nh", db.einsum("nf,fh->nh", xt, db.from_numpy(f"{prefix}W", w, replace=True)),
                  db.from_numpy(f"{prefix}b", b, replace=True), join="greatest(x0 + x1, 0)")
    hidden = np.maximum(x @ w + b, 0)
    return db.einsum("nh,nf->fh", h, xt), h, x.T @ hidden, hidden


def test_a_small_relation_in_from_is_read_whole_by_a_big_joins_tasks(sdb, monkeypatch):
    """A gradient contracted with the features (``nh,nf->fh``: the gradient in ``FROM``, the
    features past a task's tile budget) does not shuffle the features: the gradient, within
    the budget, is read whole by each task of the join (``SHUFFLE_REPLICATE_NL`` on the
    ``FROM`` side, one partition, kept as a view), and the hidden layer, small but computed from
    the features, is computed in their partitions and exchanged into one (``REPARTITION(1)``),
    not coalesced into one task. numpy's answers."""
    from tra_sql.backends.spark_sql import SparkDialect

    g, h, want, hidden = features_gradient(sdb, "f", 400)
    dialect = SparkDialect(sdb.engine.group_bytes, 25_000)  # h's 19,200 bytes fit, x's 38,400 do not
    monkeypatch.setattr(sdb.engine, "sql_dialect", lambda: dialect)
    steps = dialect.steps(g.program())
    assert re.search(r"SHUFFLE_REPLICATE_NL\(x0\).*FROM \(SELECT /\*\+ COALESCE\(1\) \*/ \* FROM `_tra_\w+`\) AS x0 "
                     r"JOIN `fX` AS x1", steps.text())
    ((_, h_view, _),) = steps.views
    assert "REPARTITION(1)" in h_view and "FROM `fX`" in h_view
    with sdb.engine.frame(g.program()) as frame:
        plan = frame._jdf.queryExecution().executedPlan().toString()
    assert "SortMergeJoin" not in plan
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(h.numpy(), hidden, rtol=1e-12)


def test_small_relations_are_not_shuffled(sdb, monkeypatch):
    """A join's right side within a task's tile budget is read whole by each task of the join
    (``SHUFFLE_REPLICATE_NL``: a cartesian product, no exchange), a step whose result is that
    small is one partition (``COALESCE(1)``) and a view replicated into a join is kept (read
    twice); with no budget nothing is hinted and every kept view goes to disk. numpy's answers
    either way, and the query settings hold Arrow batches to a task's budget."""
    from tra_sql.backends.spark import BATCH_BYTES
    from tra_sql.backends.spark_sql import SparkDialect

    g, h, want, hidden = features_gradient(sdb, "r", 40)
    hinted = sdb.engine.sql_dialect().steps(g.program())
    assert hinted.text().count("SHUFFLE_REPLICATE_NL(") == 3 and "COALESCE(1)" in hinted.text()
    assert not hinted.big
    with sdb.engine.frame(g.program()) as frame:
        plan = frame._jdf.queryExecution().executedPlan().toString()
    assert plan.count("CartesianProduct") == 3 and "SortMergeJoin" not in plan
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(h.numpy(), hidden, rtol=1e-12)

    plain = SparkDialect(sdb.engine.group_bytes, 0)
    unhinted = plain.steps(g.program())
    assert "SHUFFLE_REPLICATE_NL" not in unhinted.text() and "COALESCE" not in unhinted.text()
    assert unhinted.big == {name for name, _, _ in unhinted.views}
    monkeypatch.setattr(sdb.engine, "sql_dialect", lambda: plain)
    np.testing.assert_allclose(g.numpy(), want, rtol=1e-12)
    assert sdb.engine.query_settings()[BATCH_BYTES] == str(int(sdb.engine.budget()[1]))
