"""The Spark backend: the same programs, gradients and training steps on Spark SQL (local[2],
then a standalone master with two workers on 127.0.0.1) give DuckDB's (and numpy's) results;
tensors move between the engines; the planner's budget and constants come from the cluster;
a worker killed mid-query does not change the answer. Skipped without pyspark or Java."""

import os
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pyspark")
if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("the Spark tests need Java", allow_module_level=True)

import tra_sql  # noqa: E402
from tra_sql import graph, nn  # noqa: E402
from tra_sql.backends import spark_jobs, spark_pipeline, spark_sql, spark_train, transfer  # noqa: E402
from tra_sql.backends.spark import CODEGEN_CACHE, JAVA_OPTIONS, ONE_JOB, TILE_COPIES, UNIX_SOCKETS  # noqa: E402
from tra_sql.backends.standalone import StandaloneCluster  # noqa: E402
from tra_sql.optim import SGD, Adam  # noqa: E402
from tra_sql.tensor import Tensor  # noqa: E402
from tra_sql.train import Dropout, cross_entropy  # noqa: E402

SMALL = {"driver_memory": "1g", "config": {"spark.sql.shuffle.partitions": "2"}}


class Apps:
    """One Spark application per process: switching between local mode and the cluster stops
    the running one first."""

    def __init__(self):
        self.key, self.db = None, None

    def get(self, key, make):
        if self.key != key:
            self.close()
            self.key, self.db = key, make()
        return self.db

    def close(self):
        if self.db is not None:
            self.db.close()
        self.key, self.db = None, None


@pytest.fixture(scope="module")
def apps():
    manager = Apps()
    yield manager
    manager.close()


@pytest.fixture
def sdb(apps):
    return apps.get("local", lambda: tra_sql.connect(engine="spark", master="local[2]", **SMALL))


@pytest.fixture(scope="module")
def cluster(apps):
    with StandaloneCluster(workers=2, cores=1, memory="1g") as running:
        yield running
        apps.close()  # the application before its cluster


@pytest.fixture
def cdb(apps, cluster):
    def make():
        db = tra_sql.connect(engine="spark", master=cluster.url, executor_memory="512m", executor_cores=1,
                             driver_memory="1g", config={"spark.cores.max": "2", "spark.sql.shuffle.partitions": "2"})
        db.engine.wait_for_executors(2)
        return db
    return apps.get("cluster", make)


@pytest.fixture
def duck():
    db = tra_sql.connect()
    yield db
    db.close()


def arrays():
    rng = np.random.default_rng(7)
    return {"A": rng.standard_normal((37, 29)), "B": rng.standard_normal((29, 23)),
            "V": rng.standard_normal(23), "I": rng.integers(-5, 5, (9, 6)).astype(np.int64)}


def load(db, prefix: str):
    """The test tensors, stored in ``db`` under ``prefix``; tiles split the contraction."""
    data = arrays()
    tiles = {"A": (16, 8), "B": (8, 16), "V": 16, "I": (4, 4)}
    return {k: db.from_numpy(prefix + k, v, tile=tiles[k], replace=True) for k, v in data.items()}


def programs(db, t, full: bool = True):
    """The same programs on any engine: name -> lazy tensor. The first three are the cluster's;
    the rest cover every other op kind once (slice and concat, reshape, add, constants)."""
    out = {
        "matmul_split": db.einsum("ij,jk->ik", t["A"], t["B"]),
        "retile": t["A"].retile((10, 7)),
        "join_agg": db.einsum("ij,jk->ik", t["A"], t["B"], join="greatest(x0 + x1, 0)", agg="max"),
    }
    if full:
        out |= {
            "chain": db.einsum("ij,jk,k->i", t["A"], t["B"], t["V"]),
            "reduce": db.einsum("ij->", t["A"]),
            "ints": db.einsum("ij,kj->ik", t["I"], t["I"]),
            "concat_slice": db.concat([t["A"][:5], t["A"][30:]], axis=0),
            "reshape_add_full": db.add(t["B"].reshape(23, 29), db.full((23, 29), 2.0, tile=(8, 16))),
            "attention": attention(db, t["A"]),
            "layer_norm": nn.layer_norm(db, t["A"].retile((16, 29))),  # mean and variance inside one step
            "mlp": mlp(db, t),
        }
    return out


def attention(db, A):
    """softmax(0.1 A·Aᵀ)·A, one fused step (its softmax online over three key tiles)."""
    whole_rows = A.retile((16, 29))
    scores = db.einsum("qk,sk->qs", whole_rows, whole_rows)
    return db.einsum("qs,sv->qv", nn.softmax(db, scores, scale=0.1), A)


def mlp(db, t):
    """relu(A·B + V)·Bᵀ with row tiles of A and whole weights: one chained step."""
    weight = t["B"].retile((29, 23))
    return nn.mlp(db, t["A"].retile((16, 29)), [(weight, t["V"].retile((23,))), (weight.transpose(), None)])


def expected(full: bool = True):
    d = arrays()
    a, b = d["A"], d["B"]
    out = {"matmul_split": a @ b, "retile": a,
           "join_agg": np.maximum(a[:, :, None] + b[None], 0).max(axis=1)}
    if full:
        out |= {"chain": a @ b @ d["V"], "reduce": a.sum(), "ints": d["I"] @ d["I"].T,
                "concat_slice": np.concatenate([a[:5], a[30:]]), "reshape_add_full": b.reshape(23, 29) + 2.0}
        e = np.exp(0.1 * a @ a.T - (0.1 * a @ a.T).max(1, keepdims=True))
        out["attention"] = e / e.sum(1, keepdims=True) @ a
        out["layer_norm"] = (a - a.mean(1, keepdims=True)) / np.sqrt(a.var(1, keepdims=True) + 1e-5)
        out["mlp"] = np.maximum(a @ b + d["V"], 0) @ b.T
    return out


# -- local[2] ---------------------------------------------------------------------------------

def test_connect_and_budget(sdb):
    assert sdb.engine.name == "spark" and isinstance(sdb, tra_sql.Session)
    assert sdb.engine.budget() == (2, pytest.approx((2**30 - 300 * 2**20) * 0.6 / 2 / TILE_COPIES))  # the driver's
    assert sdb.engine.budget(4, "1GB") == (4, 1e9)


def test_programs_equal_duckdb(sdb, duck):
    want = expected()
    spark_programs = programs(sdb, load(sdb, "p"))
    assert "tra_attention_3" in sdb.engine.sql_text(spark_programs["attention"].program()).lower()
    assert "tra_chain_4" in sdb.engine.sql_text(spark_programs["mlp"].program()).lower()
    ours = {k: v.numpy() for k, v in spark_programs.items()}
    theirs = {k: v.numpy() for k, v in programs(duck, load(duck, "p")).items()}
    for k in want:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-12, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(ours[k], want[k], rtol=1e-10, atol=1e-10, err_msg=k)
    assert ours["ints"].dtype == np.int64


def test_grouped_aggregate_for_big_groups(sdb, duck):
    """Steps whose groups hold many tile (or partial result) bytes run as a grouped aggregate
    UDF; same results."""
    t, ref = load(sdb, "g"), programs(duck, load(duck, "g"), full=False)
    sdb.engine.group_bytes = 0
    try:
        for k in ("matmul_split", "join_agg"):
            step = programs(sdb, t, full=False)[k]
            assert re.search(r"TRA_(EINSUM|REDUCE)_GROUP(_2)?\(", sdb.engine.sql_text(step.program()))
            np.testing.assert_allclose(step.numpy(), ref[k].numpy(), rtol=1e-12, atol=1e-12, err_msg=k)
    finally:
        sdb.engine.group_bytes = spark_sql.GROUP_BYTES
    assert "COLLECT_LIST(" in sdb.engine.sql_text(programs(sdb, t, full=False)["matmul_split"].program())


def test_spark_sql_text(sdb):
    t = load(sdb, "q")
    text = sdb.engine.sql_text(t["A"].retile((10, 7)).reshape(37 * 29).program())
    assert "MATERIALIZED" not in text and "COLLECT_LIST(STRUCT(p.piece_origin" in text and " DIV " in text
    assert "AS MATERIALIZED" in t["A"].retile((10, 7)).reshape(37 * 29).sql("duckdb")


def persistent_rdds(db) -> set[int]:
    """Ids of the RDDs Spark keeps blocks of (local checkpoints among them)."""
    return set(db.engine.spark.sparkContext._jsc.getPersistentRDDs().keys())


def test_tensor_sql(sdb, duck):
    """The tensor SQL of DuckDB sessions on Spark: einsum/grad table functions in a lazy
    SELECT, CREATE TENSOR (join, agg, WHERE on keys, reading the tensor it replaces),
    tra_random, tra_from_elements and tra_elements (DuckDB's tensors and rows), DROP TENSOR,
    EXPLAIN; unknown tensors fail by name."""
    load(sdb, "s")
    d = arrays()
    a, b = d["A"], d["B"]
    rows = sdb.sql("SELECT count(*) AS n FROM einsum('ij,jk->ik', sA, sB) AS e WHERE e.k1 = 0").collect()
    assert rows[0]["n"] == 3
    assert not [v for v in sdb.engine.spark.catalog.listTables() if v.name.startswith("_tra_sql")]
    sdb.sql("""CREATE OR REPLACE TENSOR sC AS SELECT * FROM einsum('ij,jk->ik', sA, sB, "join" => 'x0 + x1',
                                                                    agg => 'max') WHERE k0 = 0;
               CREATE OR REPLACE TENSOR sC AS SELECT * FROM einsum('ij->ij', sC, "join" => 'x0 * 2')""")
    want = 2 * np.maximum.reduce(a[:, :, None] + b[None], axis=1)
    want[16:] = 0
    np.testing.assert_allclose(sdb.tensor("sC").numpy(), want, rtol=1e-12)
    sdb.sql("CREATE TENSOR IF NOT EXISTS sC AS SELECT * FROM sA")  # exists: nothing happens
    assert sdb.tensor("sC").shape == (37, 23)
    with pytest.raises(tra_sql.SQLError, match="exists already"):
        sdb.sql("CREATE TENSOR sC AS SELECT * FROM sA")
    persisted = persistent_rdds(sdb)
    sdb.sql("CREATE OR REPLACE TENSOR sG AS SELECT * FROM grad(einsum('ij,jk->', sA, sB), sA)")
    assert persistent_rdds(sdb) <= persisted  # CREATE TENSOR frees its checkpoints
    np.testing.assert_allclose(sdb.tensor("sG").numpy(), np.ones((37, 23)) @ b.T, rtol=1e-12)
    script = sdb.explain_sql("SELECT k0 FROM einsum('ij,jk->ik', sA, sB)")
    # (its split sum: each group's joined tiles listed, as they hold fewer bytes than a partial product)
    assert "computed first" in script and "TRA_EINSUM_AGG_2" in script and re.search(r"FROM\s+`?_tra_sql_", script)
    assert "_tra_sql_" in sdb.sql("EXPLAIN SELECT k0 FROM einsum('ij,jk->ik', sA, sB)").collect()[0][0]
    sdb.sql("DROP TENSOR sC; DROP TENSOR IF EXISTS sC")
    assert "sC" not in sdb.tensors()
    with pytest.raises(tra_sql.UnknownTensorError, match="'Nope'"):
        sdb.sql("SELECT * FROM einsum('ij->i', Nope)")
    elements = [(0, 1, 2.0), (3, 2, 5.0), (3, 2, 1.0), (4, 0, -1.0)]
    sdb.engine.spark.createDataFrame(elements, "i int, j int, v double").createOrReplaceTempView("elems")
    duck.engine.con.execute("CREATE TABLE elems (i INTEGER, j INTEGER, v DOUBLE)").fetchall()
    duck.engine.con.executemany("INSERT INTO elems VALUES (?, ?, ?)", elements)
    made = []
    for db in (sdb, duck):
        db.sql("""CREATE OR REPLACE TENSOR sR AS SELECT * FROM tra_random(shape => [5, 4], tile => [2, 3], seed => 7);
                  CREATE OR REPLACE TENSOR sE AS SELECT * FROM einsum('ij,jk->ik', sR,
                      tra_from_elements((SELECT j, i, v FROM elems), shape => [4, 5], tile => [3, 2],
                                        duplicates => 'sum'))""")
        made.append((db.tensor("sR").numpy(), db.tensor("sE").numpy()))
    for ours, theirs in zip(*made):
        np.testing.assert_array_equal(ours, theirs)
    rows = [sorted(tuple(r) for r in rel) for rel in (
        sdb.sql("SELECT i0, i1, value FROM tra_elements(sE) WHERE value <> 0").collect(),
        duck.sql("SELECT i0, i1, value FROM tra_elements(sE) WHERE value <> 0").fetchall())]
    assert rows[0] == rows[1] and len(rows[0]) == 15  # columns 0, 3 and 4 of sE
    sdb.engine.spark.catalog.dropTempView("elems")
    assert not [v for v in sdb.engine.spark.catalog.listTables() if v.name.startswith("_tra")]


def test_dropout_and_training_with_it_equal_duckdb(sdb, duck):
    """Dropout on Spark: masks of larger tiles are DuckDB's (drawn per tile key), 1x1 tiles
    are hashed per element (another hash than DuckDB's: uniform, reproducible per step); two
    SGD steps through a dropout layer, resampled before each, give DuckDB's losses."""
    ones = np.ones((12, 5))
    for db in (sdb, duck):
        db.from_numpy("dX", ones, tile=(4, 5), replace=True)
    drops = [Dropout(db, "dmask", (12, 5), p=0.5, tile=(4, 5), seed=3) for db in (sdb, duck)]
    masks = [d.apply(db.tensor("dX")).numpy() for d, db in zip(drops, (sdb, duck))]
    np.testing.assert_array_equal(masks[0], masks[1])
    assert set(np.unique(masks[0])) == {0.0, 2.0}
    single = Dropout(sdb, "dsingle", (30, 20), p=0.25, tile=(1, 1), seed=5)
    draws = sdb.tensor("dsingle").numpy()
    assert ((draws >= 0) & (draws < 1)).all() and 0.15 < (draws < 0.25).mean() < 0.35
    single.resample(1)
    assert (sdb.tensor("dsingle").numpy() != draws).any()
    single.resample(0)
    np.testing.assert_array_equal(sdb.tensor("dsingle").numpy(), draws)
    x, y, losses = np.random.default_rng(6).standard_normal((12, 5)), np.eye(3)[np.arange(12) % 3], []
    for db, drop in zip((sdb, duck), drops):
        X, Y = db.from_numpy("dlX", x, tile=(4, 5), replace=True), db.from_numpy("dlY", y, tile=(4, 3), replace=True)
        W = db.from_numpy("dlW", np.full((5, 3), 0.1), replace=True)
        loss = cross_entropy(db, db.einsum("nf,fc->nc", drop.apply(X), W), Y, 12)
        history = db.train(loss, [W], SGD(lr=0.5), 2, run="dl", progress=False,
                           before_step=lambda step, batch, d=drop: d.resample(step))
        losses.append(history.losses)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-12)
    assert losses[0][1] < losses[0][0]


def test_shared_steps_run_once_and_leave_nothing(sdb):
    """Every step is a temporary view; one read twice is a local checkpoint, so its UDF runs
    once in the plan. Views and checkpoint blocks are gone afterwards."""
    a = np.arange(12.0).reshape(3, 4)
    shared = sdb.einsum("ij,kj->ik", sdb.from_numpy("vA", a, replace=True), "vA")
    out = sdb.einsum("ik,ik->ik", shared, sdb.einsum("ij->ij", shared, join="x0 + 1"), join="x0 * x1")
    text = sdb.engine.sql_text(out.program())
    assert text.count("CREATE TEMPORARY VIEW") == 1  # the product; ``+ 1`` and the product chained
    persisted = persistent_rdds(sdb)
    with sdb.engine.frame(out.program()) as frame:  # the product runs in its checkpoint, which the chain reads twice
        plan = frame._jdf.queryExecution().executedPlan().toString()  # (the second read: the first's shuffle reused)
        assert plan.count("Scan ExistingRDD") + plan.count("ReusedExchange") == 2
        assert plan.count("ArrowEvalPython") == 1
    g = a @ a.T
    np.testing.assert_allclose(out.numpy(), g * (g + 1))
    assert not [t for t in sdb.engine.spark.catalog.listTables() if t.isTemporary]
    assert persistent_rdds(sdb) <= persisted


def test_store_catalog_and_drop(sdb):
    t = load(sdb, "s")
    c = sdb.einsum("ij,jk->ik", t["A"], t["B"]).store("sC", replace=True)
    assert c.name == "sC" and "sC" in sdb.tensors()
    np.testing.assert_allclose(sdb.tensor("sc").numpy(), arrays()["A"] @ arrays()["B"], rtol=1e-12)
    row = sdb.sql("SELECT * FROM tra_tensors WHERE name = 'sC'").collect()[0]
    assert (row.dtype, row.shape, row.tile_shape) == ("float64", [37, 23], [16, 16])
    types = dict(sdb.sql("SELECT * FROM sC").dtypes)
    assert types == {"k0": "int", "k1": "int", "tile": "binary"}
    with pytest.raises(tra_sql.TensorExistsError):
        sdb.from_numpy("sC", np.zeros(3))
    sdb.drop("sC")
    assert "sC" not in sdb.tensors() and not sdb.engine.spark.catalog.tableExists("sC")
    with pytest.raises(tra_sql.UnknownTensorError):
        sdb.tensor("sC")


def test_replacing_a_tensor_shows_its_new_tiles(sdb):
    """A replacement with the same catalog row keeps the Spark table (only its files change);
    one with a new geometry gets a new row and table. Spark SQL reads the new tiles either way."""
    sdb.from_numpy("rX", np.zeros((4, 4)), tile=2, replace=True)
    assert sdb.sql("SELECT count(*) AS n FROM rX").collect()[0].n == 4  # Spark lists the files
    sdb.einsum("ij->ij", sdb.from_numpy("rOnes", np.ones((4, 4)), tile=2, replace=True)).store("rX", replace=True)
    tiles = sdb.sql("SELECT tile FROM rX").collect()  # files of other names than the first's
    assert len(tiles) == 4 and sum(np.frombuffer(row.tile).sum() for row in tiles) == 16
    sdb.from_numpy("rX", np.arange(6.0), tile=(3,), replace=True)
    assert sdb.tensor("rX").shape == (6,)
    assert dict(sdb.sql("SELECT * FROM rX").dtypes) == {"k0": "int", "tile": "binary"}
    np.testing.assert_array_equal(sdb.einsum("i->i", "rX").numpy(), np.arange(6.0))


def test_warehouse_reopens(sdb):
    sdb.from_numpy("wX", np.arange(12.0).reshape(3, 4), tile=2, replace=True)
    sdb.engine.spark.sql("DROP TABLE wX")  # as if a new Spark application opened the warehouse
    again = tra_sql.connect(sdb.engine.warehouse.root, engine="spark", spark=sdb.engine.spark)
    np.testing.assert_array_equal(again.tensor("wX").numpy(), np.arange(12.0).reshape(3, 4))


def test_reopening_puts_back_a_table_a_crash_left_aside(sdb):
    """A crash between the two renames of a table's replacement (the old one moved aside, the
    new one not yet in place) loses nothing: the next session puts the old table back."""
    x = np.arange(12.0).reshape(3, 4)
    sdb.from_numpy("wY", x, tile=2, replace=True)
    sdb.from_numpy("wZ", x, tile=2, replace=True)
    staging = sdb.engine.warehouse.root / "_staging"
    staging.mkdir(exist_ok=True)
    sdb.engine.warehouse.path("wY").rename(staging / "0123.wy.old")
    shutil.copytree(sdb.engine.warehouse.path("wZ"), staging / "4567.wz.old")  # a leftover: wZ is in place
    again = tra_sql.connect(sdb.engine.warehouse.root, engine="spark", spark=sdb.engine.spark)
    np.testing.assert_array_equal(again.tensor("wY").numpy(), x)
    np.testing.assert_array_equal(again.tensor("wZ").numpy(), x)
    assert not list(staging.glob("*.old"))


def test_a_commit_cut_short_is_finished_on_resume(sdb, monkeypatch):
    """A crash while a training step is being published, after the first of its two tables,
    leaves the step half applied but its journal written: the next ``train`` of the run
    finishes that commit before going on, so no step is lost or applied twice."""
    loss, params, (x, y, w) = logistic_regression(sdb)
    steps, b = [], np.zeros(3)
    for _ in range(2):
        value, gw, gb = numpy_gradient(x, y, w, b)
        steps.append((value, w - 0.5 * gw, b - 0.5 * gb))
        w, b = steps[-1][1:]

    class Crash(Exception):
        pass

    publish, published = sdb.engine.warehouse.publish, []

    def crashing(directory, name):
        if len(published) == 3:  # the second step's second table
            raise Crash
        published.append(name)
        publish(directory, name)

    monkeypatch.setattr(sdb.engine.warehouse, "publish", crashing)
    with pytest.raises(Crash):
        sdb.train(loss, params, SGD(lr=0.5), 2, run="cut", progress=False)
    monkeypatch.undo()
    assert sorted(published[:2]) == ["lW", "lb"]  # step one, then half of step two:
    column = {"lW": 1, "lb": 2}
    done, undone = published[2], ({"lW", "lb"} - {published[2]}).pop()
    np.testing.assert_allclose(sdb.tensor(done).numpy(), steps[1][column[done]], rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(sdb.tensor(undone).numpy(), steps[0][column[undone]], rtol=1e-10, atol=1e-14)
    run = sdb.train(loss, params, SGD(lr=0.5), 2, run="cut", progress=False)
    assert run.epochs == 2 and run.steps == 2
    np.testing.assert_allclose(run.losses, [s[0] for s in steps], rtol=1e-10)
    np.testing.assert_allclose(sdb.tensor("lW").numpy(), steps[1][1], rtol=1e-10)
    np.testing.assert_allclose(sdb.tensor("lb").numpy(), steps[1][2], rtol=1e-10, atol=1e-14)
    assert not list((sdb.engine.warehouse.root / "_staging").glob("*/COMMIT.json"))


def test_udf_errors_keep_their_class(sdb):
    sdb.from_numpy("bad", np.ones((4, 4)), tile=2, replace=True)
    path = sdb.engine.warehouse.path("bad")
    table = pq.read_table(path)
    tiles = table.column("tile").to_pylist()
    tiles[0] = tiles[0][:-8]
    pq.write_table(table.set_column(2, "tile", pa.array(tiles, pa.large_binary())),
                           next(path.glob("*.parquet")))
    sdb.engine.spark.sql("REFRESH TABLE bad")
    with pytest.raises(tra_sql.CorruptTileError, match="bad"):
        sdb.einsum("ij,jk->ik", "bad", "bad").numpy()


def test_plan_uses_the_session_budget(sdb):
    t = load(sdb, "pl")
    c = sdb.einsum("ij,jk->ik", t["A"], t["B"])
    plan = sdb.plan(c)
    assert (plan.workers, plan.memory) == (2, pytest.approx((2**30 - 300 * 2**20) * 0.6 / 2 / TILE_COPIES))  # of 1g


def test_copy_between_duckdb_and_spark(sdb, duck, tmp_path):
    a = arrays()["A"].astype(np.float32)
    duck.from_numpy("cA", a, tile=(16, 8))
    duck.engine.con.execute("CREATE TABLE edges AS SELECT i AS dst, (i * 7) % 10 AS src, i / 2 AS w, 'e' || i AS label "
                     "FROM range(100) t(i)")
    transfer.copy(duck, sdb, "cA", replace=True)
    transfer.copy(duck, sdb, "edges", replace=True)
    np.testing.assert_array_equal(sdb.tensor("cA").numpy(), a)
    assert sdb.sql("SELECT count(*) AS n, sum(w) AS s FROM edges").collect()[0] == (100, 2475.0)
    sdb.einsum("ij,kj->ik", "cA", "cA").store("cG", replace=True)
    transfer.copy(sdb, duck, "cG")
    transfer.copy(sdb, duck, "edges", to="edges2")
    np.testing.assert_allclose(duck.tensor("cG").numpy(), a @ a.T, rtol=1e-4, atol=1e-4)
    assert duck.engine.con.execute("SELECT * FROM edges2 EXCEPT SELECT * FROM edges").fetchall() == []
    assert duck.engine.con.execute("SELECT count(*) FROM edges2").fetchall() == [(100,)]
    with pytest.raises(tra_sql.TensorExistsError):
        transfer.copy(sdb, duck, "cG")
    sparse = duck.relation("edges", ("dst", "src"), "w", (100, 10), name="cS", layout="csr", tile=(40, 10))
    transfer.copy(duck, sdb, "cS", replace=True)  # CSR tiles keep their layout both ways
    assert sdb.tensor("cS").node.layout == "csr"
    np.testing.assert_array_equal(sdb.tensor("cS").numpy(), sparse.numpy())
    transfer.copy(sdb, duck, "cS", to="cS2")
    assert duck.tensor("cS2").node.layout == "csr"
    np.testing.assert_array_equal(duck.tensor("cS2").numpy(), sparse.numpy())


def test_relation_and_sparse_gradient(sdb, duck):
    """relation() over a plain table (a copy on Spark), and a gradient through it."""
    rng = np.random.default_rng(3)
    dst, src = np.divmod(rng.choice(144, 30, replace=False), 12)
    w = rng.standard_normal(30)
    adjacency = np.zeros((12, 12))
    np.add.at(adjacency, (dst, src), w)
    x, w0 = rng.standard_normal((12, 5)), rng.standard_normal((5, 4))
    duck.engine.con.execute("CREATE TABLE redges AS SELECT * FROM (SELECT unnest(?) AS dst, unnest(?) AS src, "
                     "unnest(?) AS w)", [dst.tolist(), src.tolist(), w.tolist()]).fetchall()
    transfer.copy(duck, sdb, "redges", replace=True)
    grads = []
    for db in (sdb, duck):
        a = db.relation("redges", ("dst", "src"), "w", (12, 12), name="rA", replace=True)
        blocked = db.relation("redges", ("dst", "src"), "w", (12, 12), name="rB", tile=(5, 5), replace=True)
        np.testing.assert_allclose(a.numpy(), adjacency, rtol=1e-12)
        np.testing.assert_allclose(blocked.numpy(), adjacency, rtol=1e-12)
        weight = db.from_numpy("rW", w0, replace=True)
        h = db.einsum("mn,nf,fh->mh", a, db.from_numpy("rX", x, tile=(4, 5), replace=True), weight)
        grads.append(db.grad(db.einsum("mh,mh->", h, h), weight).numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12)
    np.testing.assert_allclose(grads[0], 2 * (adjacency @ x).T @ (adjacency @ x @ w0), rtol=1e-10)
    # a CSR relation on Spark: a ReLU layer over it, its gradient at W and at the entries
    c = sdb.relation("redges", ("dst", "src"), "w", (12, 12), name="rC", layout="csr", tile=(5, 12), replace=True)
    assert c.node.layout == "csr"
    with pytest.raises(tra_sql.SpecError, match="relation over 'redges': no column 'weight'"):
        sdb.relation("redges", ("dst", "src"), "weight", (12, 12), name="rD")
    with pytest.raises(tra_sql.UnknownTensorError, match="no table or view named 'nothere'"):
        sdb.relation("nothere", ("dst", "src"), "w", (12, 12), name="rD")
    weight = sdb.tensor("rW")
    h = sdb.einsum("mh,h->mh", sdb.einsum("mn,nf,fh->mh", c, sdb.tensor("rX"), weight),
                   sdb.from_numpy("rb", np.full(4, 0.1), replace=True), join="greatest(x0 + x1, 0)")
    g_w, g_c = sdb.grad(sdb.einsum("mh,mh->", h, h), [weight, c])
    pre = adjacency @ x @ w0 + 0.1
    dpre = 2 * np.maximum(pre, 0) * (pre > 0)
    np.testing.assert_allclose(g_w.numpy(), (adjacency @ x).T @ dpre, rtol=1e-10)
    np.testing.assert_allclose(g_c.numpy(), (dpre @ (x @ w0).T) * (adjacency != 0), rtol=1e-10)


def test_a_split_aggregation_listing_its_inputs_equals_numpy(sdb, duck):
    """A GCN layer on Spark, ReLU(A·(X·W) + b) over a CSR adjacency in 5x5 tiles: its split sum
    lists each group's joined tiles (``SparkDialect.fuse``) with the bias and ReLU after it, as
    one aggregate and, over the group budget, as the grouped UDF; a max over split products too.
    The layer, its gradients at W and at the adjacency's entries, and the max equal NumPy's."""
    rng = np.random.default_rng(3)  # (entries in each of the 3x3 tiles: no zero tiles to complete)
    dst, src = np.divmod(rng.choice(144, 30, replace=False), 12)
    w = rng.standard_normal(30)
    adjacency = np.zeros((12, 12))
    np.add.at(adjacency, (dst, src), w)
    x, w0, a, b = (rng.standard_normal(shape) for shape in ((12, 5), (5, 4), (6, 9), (9, 4)))
    duck.engine.con.execute("CREATE TABLE ledges AS SELECT * FROM (SELECT unnest(?) AS dst, unnest(?) AS src, "
                            "unnest(?) AS w)", [dst.tolist(), src.tolist(), w.tolist()]).fetchall()
    transfer.copy(duck, sdb, "ledges", replace=True)
    c = sdb.relation("ledges", ("dst", "src"), "w", (12, 12), name="lC", layout="csr", tile=(5, 5), replace=True)
    weight = sdb.from_numpy("lW", w0, replace=True)
    h = sdb.einsum("mh,h->mh", sdb.einsum("mn,nh->mh", c, sdb.einsum("nf,fh->nh", sdb.from_numpy(
        "lX", x, tile=(5, 5), replace=True), weight)), sdb.from_numpy("lbias", np.full(4, 0.1), replace=True),
        join="greatest(x0 + x1, 0)")
    g_w, g_c = sdb.grad(sdb.einsum("mh,mh->", h, h), [weight, c])
    top = sdb.einsum("ij,jk->ik", sdb.from_numpy("lA", a, tile=(3, 1), replace=True),
                     sdb.from_numpy("lB", b, tile=(1, 4), replace=True), agg="max", join="x0 * x1")
    pre = adjacency @ x @ w0 + 0.1
    dpre = 2 * np.maximum(pre, 0) * (pre > 0)
    try:
        for limit, form in ((spark_sql.GROUP_BYTES, "TRA_EINSUM_AGG_2"), (0, "TRA_EINSUM_GROUP_2")):
            sdb.engine.group_bytes = limit
            for tensor, epilogue in ((h, "_1("), (top, "(")):
                text = sdb.engine.sql_text(tensor.program())
                assert form + epilogue in text and "TRA_REDUCE" not in text
            np.testing.assert_allclose(h.numpy(), np.maximum(pre, 0), rtol=1e-10)
            np.testing.assert_allclose(g_w.numpy(), (adjacency @ x).T @ dpre, rtol=1e-10)
            np.testing.assert_allclose(g_c.numpy(), (dpre @ (x @ w0).T) * (adjacency != 0), rtol=1e-10)
            np.testing.assert_allclose(top.numpy(), (a[:, :, None] * b[None]).max(axis=1), rtol=1e-12)
    finally:
        sdb.engine.group_bytes = spark_sql.GROUP_BYTES


# -- a standalone cluster: a master and two workers on 127.0.0.1 -------------------------------

def test_cluster_equals_duckdb(cdb, duck):
    usable = (512 - 300) * 2**20 * 0.6 / TILE_COPIES  # of a 512m executor's heap, Spark's tasks' share (1 core each)
    assert cdb.engine.executors() == 2 and cdb.engine.budget() == (2, pytest.approx(usable))
    plan = cdb.plan(cdb.einsum("ij,jk->ik", *(cdb.from_numpy(f"k{n}", np.ones((64, 64)), replace=True)
                                               for n in "PQ")))
    assert (plan.workers, plan.memory) == (2, pytest.approx(usable))
    want = expected(full=False)
    theirs = {k: v.numpy() for k, v in programs(duck, load(duck, "k"), full=False).items()}
    for k, v in programs(cdb, load(cdb, "k"), full=False).items():
        np.testing.assert_allclose(v.numpy(), theirs[k], rtol=1e-12, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(theirs[k], want[k], rtol=1e-10, atol=1e-10, err_msg=k)


def test_calibrate_on_the_cluster(cdb):
    """The cost constants measured on the cluster's executors feed later plans."""
    consts = cdb.calibrate()
    assert consts.stmt > 1e-3 and consts.join_byte > 0 and consts.threads == 2 and consts.peak_flops > 1e8
    a = cdb.from_numpy("cal", np.ones((64, 64)), replace=True)
    assert cdb.plan(cdb.einsum("ij,jk->ik", a, a)).consts == consts


def logistic_regression(db):
    """Cross-entropy of a softmax regression on 40 samples (tiles split the rows): the loss,
    the parameters, and the numpy data."""
    rng = np.random.default_rng(5)
    x, y, w = rng.standard_normal((40, 8)), np.eye(3)[rng.integers(0, 3, 40)], rng.standard_normal((8, 3)) * 0.3
    xt, yt = db.from_numpy("lX", x, tile=(16, 8), replace=True), db.from_numpy("lY", y, tile=(16, 3), replace=True)
    params = [db.from_numpy("lW", w, tile=(4, 3), replace=True), db.from_numpy("lb", np.zeros(3), replace=True)]
    logits = db.einsum("nc,c->nc", db.einsum("nf,fc->nc", xt, params[0]), params[1], join="x0 + x1")
    return cross_entropy(db, logits, yt, 40), params, (x, y, w)


def numpy_gradient(x, y, w, b):
    z = x @ w + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    d = (p / p.sum(axis=1, keepdims=True) - y) / len(x)
    loss = -(y * (z - z.max(axis=1, keepdims=True) - np.log(p.sum(axis=1, keepdims=True)))).sum() / len(x)
    return loss, x.T @ d, d.sum(axis=0)


def test_the_jvms_tra_sql_starts_compile_with_c1_only(cdb):
    """The driver's JVM and the executors of an application on a standalone cluster run with
    ``JAVA_OPTIONS``."""
    jvm = cdb.engine.spark.sparkContext._jvm
    assert set(JAVA_OPTIONS.split()) <= set(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
                                            .getInputArguments())
    app = cdb.engine.spark.sparkContext.applicationId.encode()
    executors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in arguments and app in arguments:
            executors.append({a.decode() for a in arguments})
    assert len(executors) == 2 and all(set(JAVA_OPTIONS.split()) <= e for e in executors)


def test_executors_talk_to_their_python_workers_over_unix_sockets(cdb):
    """The executors of an application tra_sql starts reach their Python workers over Unix
    domain sockets (``UNIX_SOCKETS``): the workers' daemon was told so."""
    from pyspark.sql.functions import udf

    assert UNIX_SOCKETS.items() <= cdb.engine.conf.items()
    mode = udf(lambda _: os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED", "unset").lower(), "string",
               useArrow=False)
    rows = cdb.engine.spark.range(0, 4, numPartitions=2).select(mode("id").alias("mode")).distinct().collect()
    assert [row.mode for row in rows] == ["true"]


def test_a_training_step_compiles_its_classes_once(sdb):
    """Spark keeps a step's generated classes (``spark.CODEGEN_CACHE``; its default of 100
    evicted the GCN step's ~340 before the next step asked for them, and this step's first run
    compiles ~120): once a run's first step (planned over the tables) and second (planned while
    the first ran, over its result: ``spark_pipeline``) have compiled theirs, later steps of
    either kind compile none, and give numpy's gradient steps. Programs run without
    whole-stage code generation (set for the block only)."""
    spark = sdb.engine.spark
    assert spark.conf.get("spark.sql.codegen.cache.maxEntries") == str(CODEGEN_CACHE)
    loss, params, (x, y, w) = logistic_regression(sdb)
    first = spark_jobs.compiled(spark)
    sdb.train(loss, params, SGD(lr=0.5), 2, run="codegen", progress=False)
    assert spark_jobs.compiled(spark) > first  # the first steps compile what they need ...
    w, b = params[0].numpy(), params[1].numpy()
    before = spark_jobs.compiled(spark)
    sdb.train(loss, params, SGD(lr=0.5), 4, run="codegen", progress=False)
    assert spark_jobs.compiled(spark) == before  # ... and the next two reuse it
    for _ in range(2):
        _, gw, gb = numpy_gradient(x, y, w, b)
        w, b = w - 0.5 * gw, b - 0.5 * gb
    np.testing.assert_allclose(params[0].numpy(), w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), b, rtol=1e-10, atol=1e-14)
    with sdb.engine.frame(loss.program()):
        assert spark.conf.get("spark.sql.codegen.wholeStage") == "false"
    assert spark.conf.get("spark.sql.codegen.wholeStage") == "true"


def test_training_keeps_its_data_in_the_executors_while_it_runs(sdb):
    """The stored tables the steps read and do not write (the data, lX and lY) are kept in the
    executors while ``train`` runs, not the parameters, the optimizer's state or scalars, which
    each step rewrites; afterwards none is, but for a table the user kept before. Data
    replaced between steps is read anew: the second step follows numpy's on the new features."""
    spark = sdb.engine.spark
    loss, params, (x, y, w) = logistic_regression(sdb)
    x2 = np.random.default_rng(6).standard_normal(x.shape)
    spark.sql("CACHE TABLE lY")
    kept = []

    def before_step(step, batch):
        kept.append(sorted(t.lower() for t in sdb.tensors() if spark.catalog.isCached(f"`{t}`")))
        if step == 1:
            sdb.from_numpy("lX", x2, tile=(16, 8), replace=True)

    sdb.train(loss, params, SGD(lr=0.5), 2, run="kept", progress=False, before_step=before_step)
    assert kept == [["ly"], ["lx", "ly"]]
    assert [t.lower() for t in sdb.tensors() if spark.catalog.isCached(f"`{t}`")] == ["ly"]
    spark.sql("UNCACHE TABLE lY")
    b = np.zeros(3)
    for features in (x, x2):
        _, gw, gb = numpy_gradient(features, y, w, b)
        w, b = w - 0.5 * gw, b - 0.5 * gb
    np.testing.assert_allclose(params[0].numpy(), w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), b, rtol=1e-10, atol=1e-14)


def test_training_data_beyond_a_tasks_budget_is_read_from_its_files(sdb, monkeypatch):
    """Data that would not fit a task's tile budget is not kept in the executors (its memory
    is the tasks'): each step reads it from its files."""
    spark = sdb.engine.spark
    loss, params, _ = logistic_regression(sdb)
    assert sdb.engine.stored_bytes("lX") > 2560  # 40 x 8 doubles and Parquet's own bytes
    monkeypatch.setattr(sdb.engine, "budget", lambda *args, **kwargs: (2, 2560.0))
    kept = []
    sdb.train(loss, params, SGD(lr=0.5), 2, run="unkept", progress=False,
              before_step=lambda step, batch: kept.append([t for t in sdb.tensors()
                                                           if spark.catalog.isCached(f"`{t}`")]))
    assert kept == [[], []]


def test_a_training_step_is_one_spark_job(sdb):
    """A training step (forward, gradients, Adam: views shared by several steps) writes its
    results in one Spark job, and a program read back is one job too: the shared views are
    computed inside it, not in jobs of their own (Spark's status tracker), and its shuffles
    have one partition per 64 MiB of its largest relation. Under ``spark_jobs.adaptive``
    (Spark's own settings) the step's shuffle stages are jobs of their own."""
    spark = sdb.engine.spark
    loss, params, (x, y, _) = logistic_regression(sdb)
    sdb.train(loss, params, Adam(lr=0.1), 1, run="jobs", progress=False)
    with spark_jobs.jobs(spark) as step:
        history = sdb.train(loss, params, Adam(lr=0.1), 2, run="jobs", progress=False)
    assert history.steps == 2 and step.count == 1
    with spark_jobs.jobs(spark) as run:
        value, gw = loss.numpy(), sdb.grad(loss, params[:1])[0].numpy()
    assert run.count == 2  # one per numpy()
    with sdb.engine.frame(loss.program()) as frame:  # the settings of one job hold inside the block only
        assert spark.conf.get("spark.sql.adaptive.enabled") == "false"
        assert spark.conf.get("spark.sql.shuffle.partitions") == "1"
        assert frame.count() == 1
    assert [sdb.engine.shuffle_partitions(n) for n in (1, 64 << 20, (64 << 20) + 1, 1 << 40)] == [1, 1, 2, 2]
    want, want_gw, _ = numpy_gradient(x, y, params[0].numpy(), params[1].numpy())
    np.testing.assert_allclose(value, want, rtol=1e-10)
    np.testing.assert_allclose(gw, want_gw, rtol=1e-10, atol=1e-14)
    with spark_jobs.adaptive(sdb.engine), spark_jobs.jobs(spark) as own:
        assert sdb.train(loss, params, Adam(lr=0.1), 3, run="jobs", progress=False).steps == 3
    assert own.count > 1 and sdb.engine.program_settings == ONE_JOB
    assert [spark.conf.get(k) for k in ("spark.sql.adaptive.enabled", "spark.sql.shuffle.partitions")] == ["true", "2"]


def sgd_steps(x, y, w, b, rates):
    """numpy's SGD steps at learning rates ``rates`` (features ``x`` or, per step, a list)."""
    for step, lr in enumerate(rates):
        _, gw, gb = numpy_gradient(x[step] if isinstance(x, list) else x, y, w, b)
        w, b = w - lr * gw, b - lr * gb
    return w, b


def temporary_views(spark) -> list[str]:
    return [t.name for t in spark.catalog.listTables() if t.isTemporary]


def test_steps_are_planned_while_the_step_before_runs(sdb, monkeypatch):
    """Each step after a run's first is planned while the step before runs, reading that step's
    kept result (``spark_pipeline``), unless it is stale by the time it runs: a learning rate
    changed in ``on_epoch`` (other scalars to bind) or a table written there (features
    replaced) has the step planned again, which follows numpy on the new rate and features.
    A run leaves no view behind and its settings are put back."""
    taken = []
    take = spark_pipeline.Pipeline.take

    def recorded(self, key, args):
        prepared = take(self, key, args)
        taken.append((key[1], prepared is not None))
        return prepared

    monkeypatch.setattr(spark_pipeline.Pipeline, "take", recorded)
    spark = sdb.engine.spark
    views = temporary_views(spark)
    loss, params, (x, y, w) = logistic_regression(sdb)
    x2 = np.random.default_rng(8).standard_normal(x.shape)
    optimizer = SGD(lr=0.5)

    def on_epoch(epoch, _):
        if epoch == 1:
            optimizer.lr = 0.25
        if epoch == 3:
            sdb.from_numpy("lX", x2, tile=(16, 8), replace=True)

    sdb.train(loss, params, optimizer, 6, run="ahead", progress=False, on_epoch=on_epoch)
    assert taken == [(1, False), (2, True), (3, False), (4, True), (5, False), (6, True)]
    want_w, want_b = sgd_steps([x] * 4 + [x2] * 2, y, w, np.zeros(3), [0.5] * 2 + [0.25] * 4)
    np.testing.assert_allclose(params[0].numpy(), want_w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), want_b, rtol=1e-10, atol=1e-14)
    assert temporary_views(spark) == views and spark.conf.get("spark.sql.adaptive.enabled") == "true"


def test_a_schedules_bad_rate_stops_a_pipelined_run_before_that_step(sdb):
    """The rate of step 3 is bound while step 2 runs, to plan step 3 ahead: the schedule's
    negative rate there plans nothing ahead, and the error is raised by step 3 itself, after
    step 2 is committed (as on DuckDB); the run leaves no view behind."""
    spark = sdb.engine.spark
    views = temporary_views(spark)
    loss, params, (x, y, w) = logistic_regression(sdb)
    with pytest.raises(tra_sql.SpecError, match=r"lr of step 3 \(the schedule's value\) must be"):
        sdb.train(loss, params, SGD(lr=lambda step: 0.5 if step < 3 else -0.5), 4, run="sched", progress=False)
    assert [r["step"] for r in spark_train.rows(sdb, "tra_runs", spark_train.RUN_SCHEMA) if r["run"] == "sched"] == [2]
    want_w, _ = sgd_steps([x] * 2, y, w, np.zeros(3), [0.5] * 2)
    np.testing.assert_allclose(params[0].numpy(), want_w, rtol=1e-10, atol=1e-14)
    assert temporary_views(spark) == views


def test_minibatch_steps_planned_ahead_equal_duckdb(sdb, duck, monkeypatch):
    """With two batches each step is planned while the step before, of the other batch, runs
    (reading its new weights and Adam's moments): three epochs give DuckDB's losses, weights
    and moments."""
    taken = []
    take = spark_pipeline.Pipeline.take

    def recorded(self, key, args):
        prepared = take(self, key, args)
        taken.append((*key, prepared is not None))
        return prepared

    monkeypatch.setattr(spark_pipeline.Pipeline, "take", recorded)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    runs = []
    for db in (sdb, duck):
        xs = [db.from_numpy(f"mX{b}", x[b * 20:(b + 1) * 20], replace=True) for b in range(2)]
        ys = [db.from_numpy(f"my{b}", y[b * 20:(b + 1) * 20], replace=True) for b in range(2)]
        w = db.from_numpy("mw", np.zeros(3), replace=True)

        def loss(batch, db=db, xs=xs, ys=ys, w=w):
            pred = db.einsum("ni,i->n", xs[batch], w)
            return db.einsum("n,n->", pred, ys[batch], join="(x0 - x1) * (x0 - x1) / 20")

        runs.append(db.train(loss, [w], Adam(lr=0.1), 3, batches=2, run="mini", progress=False))
    assert taken == [(0, 1, False), (1, 2, True), (0, 3, True), (1, 4, True), (0, 5, True), (1, 6, True)]
    np.testing.assert_allclose(runs[0].losses, runs[1].losses, rtol=1e-12)
    for name in ("mw", "mini__m__mw", "mini__v__mw"):
        np.testing.assert_allclose(sdb.tensor(name).numpy(), duck.tensor(name).numpy(), rtol=1e-12, atol=1e-15)


def test_steps_whose_results_exceed_a_tasks_budget_are_not_planned_ahead(sdb, monkeypatch):
    """A step's results bigger than a task's tile budget are not kept for the next step
    (each of its input views would read them whole): its steps are planned one by one, over
    the tables, and are numpy's."""
    taken = []
    take = spark_pipeline.Pipeline.take
    monkeypatch.setattr(spark_pipeline.Pipeline, "take",
                        lambda self, key, args: taken.append(key) or take(self, key, args))
    loss, params, (x, y, w) = logistic_regression(sdb)
    monkeypatch.setattr(sdb.engine, "budget", lambda *args, **kwargs: (2, 100.0))  # lW alone: 192 bytes
    sdb.train(loss, params, SGD(lr=0.5), 2, run="unpiped", progress=False)
    assert taken == []
    want_w, want_b = sgd_steps(x, y, w, np.zeros(3), [0.5] * 2)
    np.testing.assert_allclose(params[0].numpy(), want_w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), want_b, rtol=1e-10, atol=1e-14)


def test_a_step_planned_ahead_whose_input_is_lost_runs_again_over_the_tables(sdb, monkeypatch):
    """If the kept result a step planned ahead reads is lost (its blocks freed here, as the
    loss of the executor holding them would), the step's job fails; the step is planned again
    over the tables the step before published, and runs: numpy's steps, nothing left behind."""
    lost = []
    take = spark_pipeline.Pipeline.take

    def losing(self, key, args):
        prepared = take(self, key, args)
        if prepared is not None and key[1] == 3:
            self.previous.result.unpersist(True)
            lost.append(key)
        return prepared

    monkeypatch.setattr(spark_pipeline.Pipeline, "take", losing)
    planned = []  # (step, over the tables?) of each plan made
    prepare = sdb.engine.prepare

    def recorded(steps, what, args=None, inputs=None, keep=None):
        if what.startswith("step "):
            planned.append((int(what.split()[1]), inputs is None))
        return prepare(steps, what, args, inputs, keep)

    monkeypatch.setattr(sdb.engine, "prepare", recorded)
    spark = sdb.engine.spark
    views = temporary_views(spark)
    loss, params, (x, y, w) = logistic_regression(sdb)
    history = sdb.train(loss, params, SGD(lr=0.5), 4, run="lost", progress=False)
    assert lost == [(0, 3)] and history.steps == 4
    # step 3's job failed: the plan of step 4 made beside it is dropped, step 3 planned again
    # over the tables and run, step 4 planned then
    assert planned == [(1, True), (2, False), (3, False), (4, False), (3, True), (4, True)]
    want_w, want_b = sgd_steps(x, y, w, np.zeros(3), [0.5] * 4)
    np.testing.assert_allclose(params[0].numpy(), want_w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), want_b, rtol=1e-10, atol=1e-14)
    assert temporary_views(spark) == views


def test_steps_read_once_are_subqueries_of_their_reader(sdb, monkeypatch):
    """A training step's steps that one other step reads are subqueries of it, not temporary
    views of their own (Spark would analyze each view, then its reader with it again): the
    views left are the steps read more than once, each a local checkpoint, but for the seed of
    the gradient, a constant tile written as a literal (no kernel), which its readers compute.
    While a program runs, Spark's call site names it (so Spark walks no stack for it)."""
    made = []
    union_steps = spark_sql.SparkDialect.union_steps
    monkeypatch.setattr(spark_sql.SparkDialect, "union_steps",
                        lambda self, program, *args: made.append((program, union_steps(self, program, *args)))
                        or made[-1][1])
    loss, params, (x, y, w) = logistic_regression(sdb)
    sdb.train(loss, params, SGD(lr=0.5), 1, run="inline", progress=False)
    ((program, steps),) = made
    assert steps.views and all(reads > 1 for _, _, reads in steps.views)
    assert len(steps.views) < len(program.ctes)  # the others are subqueries (here 7 views of 12 steps)
    assert "TRA_FILL" not in steps.text() and "X'000000000000F03F'" in steps.text()
    _, gw, gb = numpy_gradient(x, y, w, np.zeros(3))
    np.testing.assert_allclose(params[0].numpy(), w - 0.5 * gw, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), -0.5 * gb, rtol=1e-10, atol=1e-14)
    sc = sdb.engine.spark.sparkContext
    with sdb.engine.frame(loss.program()):
        site = sc.getLocalProperty("callSite.long")
    assert site == f"tra_sql: {loss.node.label}" and sc.getLocalProperty("callSite.long") is None


def test_an_optimizer_step_computes_its_results_in_one_projection(sdb, duck, monkeypatch):
    """Adam's new weights and moments of each parameter are one step on Spark (one projection
    of three kernels, rows by ``STACK``: ``spark_siblings``), and two steps leave the weights
    and both moments DuckDB's."""
    made = []
    union_steps = spark_sql.SparkDialect.union_steps
    monkeypatch.setattr(spark_sql.SparkDialect, "union_steps",
                        lambda self, *args: made.append(union_steps(self, *args)) or made[-1])
    for db in (sdb, duck):
        loss, params, _ = logistic_regression(db)
        db.train(loss, params, Adam(lr=0.1), 2, run="sib", progress=False)
    (steps,) = made
    assert steps.text().count("STACK(3, 'lW', k0, k1, tile0, 'sib__m__lW'") == 1
    assert steps.text().count("STACK(3, 'lb', k0,") == 1
    for name in ("lW", "lb", "sib__m__lW", "sib__v__lW", "sib__m__lb", "sib__v__lb"):
        np.testing.assert_allclose(sdb.tensor(name).numpy(), duck.tensor(name).numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="spark_jobs.python_workers reads /proc")
def test_training_steps_reuse_the_python_workers(sdb):
    """The steps after the first run their UDFs in the Python workers the first one started
    (``spark.python.worker.reuse``): none starts, none exits (``spark_jobs.python_workers``),
    and the steps are numpy's SGD steps."""
    loss, params, (x, y, w) = logistic_regression(sdb)
    sdb.train(loss, params, SGD(lr=0.5), 1, run="workers", progress=False)
    w, b = params[0].numpy(), params[1].numpy()
    before = spark_jobs.python_workers()
    sdb.train(loss, params, SGD(lr=0.5), 4, run="workers", progress=False)
    assert before and spark_jobs.python_workers() == before
    for _ in range(3):
        _, gw, gb = numpy_gradient(x, y, w, b)
        w, b = w - 0.5 * gw, b - 0.5 * gb
    np.testing.assert_allclose(params[0].numpy(), w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(params[1].numpy(), b, rtol=1e-10, atol=1e-14)


def test_cluster_gradient_and_training_equal_duckdb(cdb, duck):
    """A gradient and two SGD steps (one, then one more resuming the run) on the cluster:
    DuckDB's numbers, and numpy's."""
    (loss, params, (x, y, w)), (dloss, dparams, _) = logistic_regression(cdb), logistic_regression(duck)
    _, gw, gb = numpy_gradient(x, y, w, np.zeros(3))
    ours, theirs = [g.numpy() for g in cdb.grad(loss, params)], [g.numpy() for g in duck.grad(dloss, dparams)]
    for a, b, want in zip(ours, theirs, (gw, gb)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(a, want, rtol=1e-10, atol=1e-14)
    losses, b = [], np.zeros(3)
    for _ in range(2):
        value, gw, gb = numpy_gradient(x, y, w, b)
        losses.append(value)
        w, b = w - 0.5 * gw, b - 0.5 * gb
    runs = []
    for db, ps, lo in ((cdb, params, loss), (duck, dparams, dloss)):
        db.train(lo, ps, SGD(lr=0.5), 1, run="lr", progress=False)
        if db is cdb:
            with spark_jobs.jobs(cdb.engine.spark) as step:  # one job there too
                runs.append(db.train(lo, ps, SGD(lr=0.5), 2, run="lr", progress=False))
            assert step.count == 1
        else:
            runs.append(db.train(lo, ps, SGD(lr=0.5), 2, run="lr", progress=False))
        np.testing.assert_allclose(db.tensor("lW").numpy(), w, rtol=1e-10)
        np.testing.assert_allclose(db.tensor("lb").numpy(), b, rtol=1e-10, atol=1e-14)
    assert runs[0].epochs == runs[1].epochs == 2 and runs[0].steps == 2
    np.testing.assert_allclose(runs[0].losses, runs[1].losses, rtol=1e-12)
    np.testing.assert_allclose(runs[0].losses, losses, rtol=1e-10)


def test_worker_killed_mid_query(cdb, cluster):
    """Kill one worker (its executor and Python workers with it) while both workers run tasks
    of the slow stage of a matmul (8 tasks of 2 s over 2 cores): Spark reruns the lost task on
    the other worker, and the result is right."""
    def slow(tiles):  # pickled by value: the executors cannot import this test module
        time.sleep(2.0)
        return tiles

    from pyspark.sql.functions import arrow_udf
    cdb.engine.spark.udf.register("tra_test_slow", arrow_udf(slow, "binary"))
    t = load(cdb, "f")
    cdb.sql("CREATE OR REPLACE TEMPORARY VIEW f_slow AS SELECT k0, k1, tra_test_slow(tile) AS tile "
            "FROM (SELECT /*+ REPARTITION(8) */ * FROM fA)")
    a = t["A"]
    slow_a = Tensor(cdb, graph.Source(a.shape, a.dtype, a.tile, "f_slow"))
    product = cdb.einsum("ij,jk->ik", slow_a, t["B"])
    result, failure = [], []

    def run():
        try:
            result.append(product.numpy())
        except Exception as err:  # noqa: BLE001 - reported below
            failure.append(err)

    tracker = cdb.engine.spark.sparkContext.statusTracker()

    def stages():
        return [info for info in map(tracker.getStageInfo, tracker.getActiveStageIds()) if info is not None]

    query = threading.Thread(target=run)
    query.start()
    deadline = time.monotonic() + 120
    while not any(s.numTasks == 8 and s.numActiveTasks == 2 for s in stages()):  # one task on each worker
        assert query.is_alive() and time.monotonic() < deadline, \
            f"the slow stage never ran on both workers (query {'running' if query.is_alive() else 'ended'}: " \
            f"{failure or result and 'a result' or 'nothing yet'})"
        time.sleep(0.02)
    cluster.kill_worker(0)
    retried = False
    deadline = time.monotonic() + 240
    while query.is_alive() and time.monotonic() < deadline:
        retried |= any(s.numFailedTasks > 0 or s.currentAttemptId > 0 for s in stages())
        query.join(timeout=0.05)
    assert not query.is_alive() and not failure, failure
    np.testing.assert_allclose(result[0], arrays()["A"] @ arrays()["B"], rtol=1e-12)
    assert cdb.engine.executors() == 1
    assert retried, "no task was rerun"
