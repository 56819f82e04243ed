"""tra_sql on Spark against Spark MLlib's BlockMatrix and against tra_sql on DuckDB: one n×n
matmul (float32, tiles = blocks of b×b) and one epoch of a 2-layer GCN, all in the same run.

    python bench/bench_spark.py                       # 8192², blocks of 2048; GCN on 8192 nodes
    python bench/bench_spark.py --size 4096 --block 1024 --repeat 1 --only matmul
    python bench/bench_spark.py --only gcn --repeat 1 --gcn 100000 1000000 128 16 8 --no-dataframes

Spark runs on a standalone cluster started here (a master and two 1-core workers on
127.0.0.1, ``tra_sql.backends.standalone``); DuckDB runs in this process with 2 threads.
What each time covers (inputs already stored, warm-up run untimed):

- tra_sql DuckDB: ``C.store()``, the product computed into a table;
- tra_sql Spark: ``C.store()``, the product computed and written to the Parquet warehouse,
  and "compute only": the same SQL run into Spark's ``noop`` sink;
- MLlib: ``A.multiply(B)`` and ``count()`` of its blocks (compute only, nothing kept).
  MLlib's blocks are float64 DenseMatrix (it has no float32) multiplied by its JVM BLAS.

GCN: the same program (``db.relation`` over the adjacency table, copied from DuckDB to Spark
with ``transfer.copy``; cross-entropy; Adam) on both engines, ``--epochs`` epochs timed one by
one: the second epoch (the first compiles), and the median of the later half, once the JVMs'
just-in-time compilers have warmed up (a step runs Spark's interpreted expressions over a few
rows of tiles, so they warm over several steps: 7.8, 6.4, 5.0, 4.4, 4.1 s in epochs 2-6 of a run
on 2026-12-05). MLlib has no autodiff, so it runs only the epoch's matrix products (see
``mllib_gcn``), as many times, timed alike (its second run, the median of its later half). The
peer a Spark user would write: the same GCN by hand on Spark DataFrames (``bench_spark_df``:
long-format joins and sums, the backward pass by hand, Adam on the driver), checked against
tra_sql's losses and weights. Spark jobs are counted per epoch (one training step) for both.

The peers (MLlib, the DataFrames GCN) run in a Spark application of their own, after tra_sql's,
whose executors run under Spark's own Java options; tra_sql's run under the options tra_sql
starts its JVMs with (``spark.JAVA_OPTIONS``: C1 compilation only; MLlib's JVM BLAS needs C2's
vector intrinsics). The driver's JVM is this process's one, started by its first application:
``--java-defaults`` runs tra_sql under Spark's own options too (an A/B of those options; the
peers' driver then has Spark's own too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_spark_df  # noqa: E402
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.backends import spark_jobs, transfer  # noqa: E402
from tra_sql.backends.standalone import StandaloneCluster  # noqa: E402

SEED = 11
#: Spark's own Java options (no ``spark.JAVA_OPTIONS``), for the peers' application
SPARK_JAVA = {"spark.driver.extraJavaOptions": "", "spark.executor.extraJavaOptions": ""}


def spark_session(cluster, memory: str, java: dict | None = None):
    """A tra_sql Spark session on ``cluster``'s two 1-core workers with 2 GB of driver heap, its
    two executors started; ``java``: Java options over tra_sql's (``SPARK_JAVA``: Spark's own)."""
    db = tra_sql.connect(engine="spark", master=cluster.url, executor_memory=memory, executor_cores=1,
                         driver_memory="2g", config={"spark.cores.max": "2", "spark.sql.shuffle.partitions": "4",
                                                     **(java or {})})
    try:
        db.engine.wait_for_executors(2)
    except BaseException:
        db.close()
        raise
    return db


def block(seed: int, i: int, j: int, b: int) -> np.ndarray:
    """Block (i, j) of operand ``seed``: the same numbers on the driver and on executors."""
    return np.random.default_rng([seed, i, j]).standard_normal((b, b), dtype=np.float32)


def operand(seed: int, n: int, b: int) -> np.ndarray:
    out = np.empty((n, n), dtype=np.float32)
    for i in range(n // b):
        for j in range(n // b):
            out[i * b:(i + 1) * b, j * b:(j + 1) * b] = block(seed, i, j, b)
    return out


def check(result: np.ndarray, reference: np.ndarray, what: str) -> None:
    err = np.abs(result - reference).max() / np.abs(reference).max()
    if err > 1e-4:
        raise AssertionError(f"{what}: relative error {err:.2e}")


def bench_duckdb(a, b, block_size, reference, repeat) -> float:
    with tra_sql.connect(threads=2, memory_limit="6GB") as db:
        c = db.einsum("ij,jk->ik", db.from_numpy("A", a, tile=block_size), db.from_numpy("B", b, tile=block_size))
        seconds = median_time(lambda: c.store("C", replace=True), repeat)
        check(db.tensor("C").numpy(plan=False), reference, "tra_sql on DuckDB")
    return seconds


def mllib_operand(db, table: str, n: int, b: int):
    """Tensor ``table`` as an MLlib BlockMatrix of b×b float64 blocks, persisted (memory and
    disk) and materialized. The tiles are decoded into rows by an Arrow UDF and reassembled in
    SQL on the executors (MLlib's Python constructors would pickle every number)."""
    import pyarrow as pa
    from pyspark.ml.functions import array_to_vector
    from pyspark.mllib.linalg.distributed import IndexedRowMatrix
    from pyspark.mllib.util import MLUtils
    from pyspark.sql.functions import arrow_udf

    def tile_rows(tiles):
        data = np.concatenate([np.frombuffer(t, np.float32) for t in tiles.to_pylist()]).astype(np.float64)
        rows = pa.ListArray.from_arrays(pa.array(np.arange(len(data) // b + 1, dtype=np.int32) * b), pa.array(data))
        return pa.ListArray.from_arrays(pa.array(np.arange(len(tiles) + 1, dtype=np.int32) * b), rows)

    db.engine.spark.udf.register("bench_tile_rows", arrow_udf(tile_rows, "array<array<double>>"))
    # one tile of rows (b² doubles) at a time
    db.engine.spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1")
    frame = db.engine.spark.sql(f"""
        SELECT CAST(k0 * {b} + r AS BIGINT) AS index,
               flatten(transform(array_sort(collect_list(struct(k1, piece))), x -> x.piece)) AS values
        FROM (SELECT k0, k1, bench_tile_rows(tile) AS rows FROM {table}) LATERAL VIEW posexplode(rows) p AS r, piece
        GROUP BY k0, r""")
    frame = MLUtils.convertVectorColumnsFromML(frame.select("index", array_to_vector("values").alias("vector")))
    matrix = IndexedRowMatrix(frame, n, n).toBlockMatrix(b, b)
    java = matrix._java_matrix_wrapper._java_model
    java.persist(db.engine.spark.sparkContext._jvm.org.apache.spark.storage.StorageLevel.MEMORY_AND_DISK())
    java.blocks().count()
    db.engine.spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    return matrix


def mllib_check(sc, product, n: int, b: int, reference: np.ndarray) -> None:
    """MLlib's product times a random vector (in MLlib) against ``reference`` times it."""
    from pyspark.mllib.linalg import Matrices
    from pyspark.mllib.linalg.distributed import BlockMatrix

    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    parts = [((i, 0), Matrices.dense(b, 1, x[i * b:(i + 1) * b].astype(np.float64))) for i in range(n // b)]
    y = product.multiply(BlockMatrix(sc.parallelize(parts), b, 1, n, 1)).toLocalMatrix().toArray().ravel()
    check(y.astype(np.float32), reference @ x, "MLlib")


def bench_spark(cluster, a, b, block_size, reference, repeat, memory, java=None) -> tuple[float, float, float]:
    """tra_sql's product stored and computed only (Java options ``java`` over tra_sql's), then
    MLlib's in an application of its own (Spark's own Java options): seconds of each."""
    db = spark_session(cluster, memory, java)
    try:
        c = db.einsum("ij,jk->ik", db.from_numpy("A", a, tile=block_size), db.from_numpy("B", b, tile=block_size))
        store = median_time(lambda: c.store("C", replace=True), repeat)
        check(db.tensor("C").numpy(plan=False), reference, "tra_sql on Spark")
        def compute_only():
            with db.engine.frame(c.program()) as frame:
                frame.write.format("noop").mode("overwrite").save()

        compute = median_time(compute_only, repeat, warmup=0)
        print(f"tra_sql Spark: store {store:.2f} s, compute only {compute:.2f} s", flush=True)
    finally:
        db.close()
    db = spark_session(cluster, memory, SPARK_JAVA)
    try:
        sc, n = db.engine.spark.sparkContext, a.shape[0]
        db.from_numpy("A", a, tile=block_size)
        db.from_numpy("B", b, tile=block_size)
        ma, mb = mllib_operand(db, "A", n, block_size), mllib_operand(db, "B", n, block_size)
        product = ma.multiply(mb)  # the warm-up run, checked
        java = product._java_matrix_wrapper._java_model
        java.persist(sc._jvm.org.apache.spark.storage.StorageLevel.MEMORY_AND_DISK())
        java.blocks().count()
        mllib_check(sc, product, n, block_size, reference)
        java.blocks().unpersist(True)
        mllib = median_time(lambda: ma.multiply(mb)._java_matrix_wrapper._java_model.blocks().count(), repeat,
                            warmup=0)
        return store, compute, mllib
    finally:
        db.close()


# -- one GCN epoch -------------------------------------------------------------------------------
def gcn_data(n: int, e: int, f: int, c: int):
    """(dst, src, w) of the normalized adjacency with self loops, features, and labels."""
    rng = np.random.default_rng(SEED)
    links = np.unique(np.concatenate([rng.integers(0, n, (e, 2)), np.arange(n)[:, None].repeat(2, 1)]), axis=0)
    dst, src = links[:, 0], links[:, 1]
    degree = np.bincount(dst, minlength=n)
    return dst, src, 1 / np.sqrt(degree[dst] * degree[src]), rng.standard_normal((n, f)), \
        rng.integers(0, c, n)


def gcn_params(f: int, h: int, c: int) -> dict[str, np.ndarray]:
    """The GCN's initial weights (Glorot uniform) and biases."""
    rng = np.random.default_rng(1)
    return {"W1": (rng.uniform(-1, 1, (f, h)) * np.sqrt(6 / (f + h))), "b1": np.zeros(h),
            "W2": (rng.uniform(-1, 1, (h, c)) * np.sqrt(6 / (h + c))), "b2": np.zeros(c)}


def gcn_epoch(db, n: int, f: int, h: int, c: int, block: int, x, epochs: int = 2, run: str = "gcn") -> dict:
    """``epochs`` (at least 2) epochs of a 2-layer GCN with Adam (tables ``adj`` and ``labels`` in
    ``db``; the adjacency in CSR blocks of ``block``²): every epoch's seconds (``epochs``, each
    with its commit), the second epoch's ``seconds`` and ``window`` (its start and end, seconds
    since the Unix epoch), the ``losses``, ``W1``, and the second epoch's (one step's) Spark
    ``jobs``, classes Spark's code generator ``compiled`` in the driver's JVM
    (``spark_jobs.compiled``; 0 on DuckDB) and Python ``workers`` started and exited in it
    (``spark_jobs.python_workers``: (0, 0) when reused)."""
    from tra_sql.optim import Adam
    from tra_sql.train import cross_entropy

    a = db.relation("adj", ("dst", "src"), "w", (n, n), name="gA", tile=(block, block), layout="csr", replace=True)
    y = db.relation("labels", ("node", "label"), None, (n, c), name="gY", tile=(block, c), replace=True)
    xt = db.from_numpy("gX", x, tile=(block, f), replace=True)
    p = {k: db.from_numpy(f"g{k}", v, replace=True) for k, v in gcn_params(f, h, c).items()}
    hid = db.einsum("mh,h->mh", db.einsum("mn,nh->mh", a, db.einsum("nf,fh->nh", xt, p["W1"])), p["b1"],
                    join="greatest(x0 + x1, 0)")
    z = db.einsum("mc,c->mc", db.einsum("mn,nc->mc", a, db.einsum("nh,hc->nc", hid, p["W2"])), p["b2"],
                  join="x0 + x1")
    loss = cross_entropy(db, z, y, len(range(0, n, 10)))
    spark = db.engine.name == "spark"
    ends = [(time.perf_counter(),)]  # each epoch's end, jobs, compiled classes and Python workers then
    with spark_jobs.jobs(db.engine.spark) if spark else nullcontext() as jobs:
        history = db.train(loss, list(p.values()), Adam(lr=0.01), max(2, epochs), run=run, progress=False,
                       on_epoch=lambda *_: ends.append((time.perf_counter(), time.time(), jobs.count if jobs else 0,
                                                        spark_jobs.compiled(db.engine.spark) if spark else 0,
                                                        spark_jobs.python_workers() if spark else frozenset())))
    first, second = ends[1], ends[2]
    return {"epochs": [b[0] - a[0] for a, b in zip(ends, ends[1:])], "seconds": second[0] - first[0],
            "window": (first[1], second[1]), "losses": history.losses,
            "W1": db.tensor("gW1").numpy(), "jobs": second[2] - first[2], "compiled": second[3] - first[3],
            "workers": (len(second[4] - first[4]), len(first[4] - second[4]))}


def gcn_tables(duck, data) -> None:
    import pyarrow as pa

    dst, src, w, _, labels = data
    duck.engine.con.register("_adj", pa.table({"dst": dst, "src": src, "w": w}))
    duck.engine.con.execute("CREATE OR REPLACE TABLE adj AS FROM _adj").fetchall()
    duck.engine.con.register("_labels", pa.table({"node": np.arange(len(labels)), "label": labels}))
    duck.engine.con.execute("CREATE OR REPLACE TABLE labels AS SELECT * FROM _labels WHERE node % 10 = 0").fetchall()


def mllib_gcn(sc, data, n: int, f: int, h: int, c: int, b: int, runs: int) -> list[float]:
    """The matrix products of one GCN epoch in MLlib (forward A·(X·W1), A·(H·W2); backward
    Aᵀ·G, Hᵀ·(AᵀG), (AᵀG)·W2ᵀ, Aᵀ·G', Xᵀ·(AᵀG')), with the same block size and A in
    sparse blocks; the element-wise steps between them are left out (a lower bound on an
    MLlib epoch), ``runs`` times: the seconds of each. Checks A·(X·W1) against numpy."""
    from pyspark.mllib.linalg import Matrices
    from pyspark.mllib.linalg.distributed import BlockMatrix, CoordinateMatrix, MatrixEntry

    dst, src, w, x, _ = data
    level = sc._jvm.org.apache.spark.storage.StorageLevel.MEMORY_AND_DISK()

    def kept(matrix):
        matrix._java_matrix_wrapper._java_model.persist(level)
        matrix._java_matrix_wrapper._java_model.blocks().count()
        return matrix

    def dense(array, rows, cols):
        parts = [((i // rows, j // cols), Matrices.dense(*array[i:i + rows, j:j + cols].shape,
                                                         array[i:i + rows, j:j + cols].ravel(order="F")))
                 for i in range(0, array.shape[0], rows) for j in range(0, array.shape[1], cols)]
        return kept(BlockMatrix(sc.parallelize(parts, len(parts)), rows, cols, *array.shape))

    rng = np.random.default_rng(2)
    entries = sc.parallelize([MatrixEntry(int(i), int(j), float(v)) for i, j, v in zip(dst, src, w)], 8)
    a = kept(CoordinateMatrix(entries, n, n).toBlockMatrix(b, b))
    at = kept(a.transpose())
    xm, w1, w2 = dense(x, b, f), dense(rng.standard_normal((f, h)), f, h), \
        dense(rng.standard_normal((h, c)), h, c)
    w2t = kept(w2.transpose())
    xt = kept(xm.transpose())
    check(kept(a.multiply(xm.multiply(w1))).toLocalMatrix().toArray(),
          _adjacency_product(dst, src, w, x @ w1.toLocalMatrix().toArray()), "MLlib GCN")

    def epoch():
        hid = kept(a.multiply(kept(xm.multiply(w1))))
        z = kept(a.multiply(kept(hid.multiply(w2))))
        g2 = kept(at.multiply(z))
        kept(hid.transpose().multiply(g2))
        g1 = kept(at.multiply(kept(g2.multiply(w2t))))
        kept(xt.multiply(g1))

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        epoch()
        times.append(time.perf_counter() - start)
    return times


def _adjacency_product(dst, src, w, m: np.ndarray) -> np.ndarray:
    """A·m for the adjacency given as edges (no dense n×n matrix: the graph may be large)."""
    out = np.zeros_like(m)
    np.add.at(out, dst, w[:, None] * m[src])
    return out


def bench_gcn(cluster, n, e, f, h, c, block, memory, adaptive: bool = False,
              dataframes: bool = True, epochs: int = 8, java: dict | None = None) -> dict:
    """One GCN training run of ``epochs`` epochs on DuckDB and on Spark (same losses and
    weights; Java options ``java`` over tra_sql's), then in an application of their own (Spark's
    own Java options) the GCN by hand on DataFrames (two epochs) and MLlib's products
    (``epochs`` times): seconds by run, Spark jobs and Python workers of a step."""
    data = gcn_data(n, e, f, c)
    with tra_sql.connect(threads=2, memory_limit="6GB") as duck:
        gcn_tables(duck, data)
        ours = gcn_epoch(duck, n, f, h, c, block, data[3], epochs)
        db = spark_session(cluster, memory, java)
        try:
            if adaptive:
                db.engine.program_settings = {}  # as spark_jobs.adaptive
            for table in ("adj", "labels"):
                transfer.copy(duck, db, table, replace=True)
            spark = gcn_epoch(db, n, f, h, c, block, data[3], epochs)
            np.testing.assert_allclose(spark["losses"], ours["losses"], rtol=1e-4)
            check(spark["W1"], ours["W1"], "tra_sql GCN on Spark")
        finally:
            db.close()
        db = spark_session(cluster, memory, SPARK_JAVA)
        try:
            for table in ("adj", "labels"):
                transfer.copy(duck, db, table, replace=True)
            t_df = df_jobs = None
            if dataframes:
                t_df, df_losses, df_w1, df_jobs = bench_spark_df.two_epochs(
                    db.engine.spark, data[3], gcn_params(f, h, c), len(range(0, n, 10)))
                np.testing.assert_allclose(df_losses, ours["losses"][:2], rtol=1e-6)
                check(df_w1, gcn_epoch(duck, n, f, h, c, block, data[3], 2, run="gcn2")["W1"],
                      "the GCN on Spark DataFrames")
            t_mllib = mllib_gcn(db.engine.spark.sparkContext, data, n, f, h, c, block, max(2, epochs))
        finally:
            db.close()
    return {"duckdb": ours, "spark": spark, "mllib": t_mllib, "df": t_df, "df_jobs": df_jobs}


def steady(epochs: list[float]) -> float:
    """An epoch's time once the JVMs' compilers have warmed up: the median of the later half."""
    return statistics.median(epochs[len(epochs) // 2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2, help="timed runs after one warm-up (median)")
    parser.add_argument("--executor-memory", default="2g",
                        help="per executor (and worker); MLlib's 8192² operands need more than 2g")
    parser.add_argument("--only", nargs="*", default=["matmul", "gcn"], choices=["matmul", "gcn"])
    parser.add_argument("--gcn", type=int, nargs=5, default=(8192, 81920, 128, 16, 8),
                        metavar=("NODES", "EDGES", "FEATURES", "HIDDEN", "CLASSES"))
    parser.add_argument("--adaptive", action="store_true",
                        help="tra_sql's GCN under Spark's own settings (adaptive execution, broadcast joins: a job per "
                             "shuffle stage) instead of one Spark job per program (spark.ONE_JOB); for an A/B")
    parser.add_argument("--epochs", type=int, default=8,
                        help="GCN epochs trained on each engine (the later half's median is the steady epoch)")
    parser.add_argument("--no-dataframes", action="store_true",
                        help="skip the GCN by hand on DataFrames (long format: slow at 100k nodes)")
    parser.add_argument("--java-defaults", action="store_true",
                        help="tra_sql under Spark's own Java options, not its own (spark.JAVA_OPTIONS); for an A/B")
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    if "matmul" in args.only:
        bench_matmul(args)
    if "gcn" in args.only:
        n, e, f, h, c = args.gcn
        later = f"epochs {args.epochs // 2 + 1}-{args.epochs}"
        print(f"\nGCN epoch: {n} nodes, {e} random edges + self loops, {f} features, hidden {h}, {c} classes, "
              f"float64, adjacency in CSR {args.block}² tiles (MLlib: sparse blocks); tra_sql: {args.epochs} epochs "
              f"(forward, backward, Adam step, commit), the second one's time and the median of {later} (the JVMs' "
              f"compilers warm); MLlib's products run as often, timed alike", flush=True)
        with StandaloneCluster(workers=2, cores=1, memory=args.executor_memory) as cluster:
            t = bench_gcn(cluster, n, e, f, h, c, args.block, args.executor_memory, args.adaptive,
                          not args.no_dataframes, args.epochs, SPARK_JAVA if args.java_defaults else None)
        duck, spark, mllib = t["duckdb"], t["spark"], t["mllib"]
        by_hand = "" if t["df"] is None else \
            f"| the same GCN by hand on Spark DataFrames, one epoch | {t['df']:.2f} | | {t['df_jobs']} |\n"
        print(f"\n| run | second epoch s | median of {later} s | Spark jobs |\n|---|---|---|---|\n"
              f"| tra_sql on DuckDB (2 threads) | {duck['seconds']:.2f} | {steady(duck['epochs']):.2f} | |\n"
              f"| tra_sql on Spark (one step an epoch) | {spark['seconds']:.2f} | {steady(spark['epochs']):.2f} | "
              f"{spark['jobs']} |\n{by_hand}"
              f"| MLlib BlockMatrix, the epoch's 9 products only (float64) | {mllib[1]:.2f} | {steady(mllib):.2f} | |")
        print("tra_sql on Spark, every epoch: " + ", ".join(f"{s:.2f}" for s in spark["epochs"]) + " s")
        print("MLlib's products, every run: " + ", ".join(f"{s:.2f}" for s in mllib) + " s")
        print("tra_sql on Spark, the second epoch: {} Python workers started, {} exited".format(*spark["workers"]))
        versus = "" if t["df"] is None else f"tra_sql Spark / DataFrames by hand = {spark['seconds'] / t['df']:.2f}; "
        print(f"\nratios: tra_sql Spark / MLlib = {spark['seconds'] / mllib[1]:.2f} (second epoch / second run), "
              f"{steady(spark['epochs']) / steady(mllib):.2f} ({later}, both); {versus}"
              f"tra_sql Spark / tra_sql DuckDB = {steady(spark['epochs']) / steady(duck['epochs']):.2f} ({later})")


def bench_matmul(args) -> None:
    n, bs = args.size, args.block
    flops = 2 * n**3
    a, b = operand(SEED, n, bs), operand(SEED + 1, n, bs)
    start = time.perf_counter()
    reference = a @ b
    t_numpy = time.perf_counter() - start
    print(f"{n}×{n} float32 matmul, blocks {bs}×{bs}, median of {args.repeat} "
          f"after a warm-up; numpy a @ b once: {t_numpy:.2f} s\n", flush=True)
    t_duck = bench_duckdb(a, b, bs, reference, args.repeat)
    print(f"tra_sql DuckDB: {t_duck:.2f} s", flush=True)
    with StandaloneCluster(workers=2, cores=1, memory=args.executor_memory) as cluster:
        t_store, t_compute, t_mllib = bench_spark(cluster, a, b, bs, reference, args.repeat, args.executor_memory,
                                                  SPARK_JAVA if args.java_defaults else None)
    rows = [("numpy `a @ b` (2 BLAS threads, one run)", t_numpy), ("tra_sql on DuckDB (2 threads), store", t_duck),
            ("tra_sql on Spark, store", t_store), ("tra_sql on Spark, compute only (noop sink)", t_compute),
            ("MLlib BlockMatrix.multiply + count (float64)", t_mllib)]
    print("\n| run | s | GFLOP/s |\n|---|---|---|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.2f} | {flops / seconds / 1e9:.1f} |")
    print(f"\nratios: tra_sql Spark compute / MLlib = {t_compute / t_mllib:.2f}; "
          f"tra_sql Spark store / tra_sql DuckDB store = {t_store / t_duck:.2f}", flush=True)


if __name__ == "__main__":
    main()
