"""tra_sql on Spark against Spark MLlib's BlockMatrix.multiply and against tra_sql on DuckDB:
one n×n matmul (float32, tiles = blocks of b×b), all three in the same run.

    python bench/bench_spark.py                       # 8192², blocks of 2048
    python bench/bench_spark.py --size 4096 --block 1024 --repeat 1

Spark runs on a standalone cluster started here (a master and two 1-core workers on
127.0.0.1, ``tra_sql.backends.standalone``); DuckDB runs in this process with 2 threads.
What each time covers (inputs already stored, warm-up run untimed):

- tra_sql DuckDB: ``C.store()``, the product computed into a table;
- tra_sql Spark: ``C.store()``, the product computed and written to the Parquet warehouse,
  and "compute only": the same SQL run into Spark's ``noop`` sink;
- MLlib: ``A.multiply(B)`` and ``count()`` of its blocks (compute only, nothing kept).
  MLlib's blocks are float64 DenseMatrix (it has no float32) multiplied by its JVM BLAS.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.backends.standalone import StandaloneCluster  # noqa: E402

SEED = 11


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


def mllib_operand(sc, seed: int, n: int, b: int):
    """Operand ``seed`` as an MLlib BlockMatrix of float64 blocks made on the executors,
    persisted (memory and disk) and materialized."""
    from pyspark.mllib.linalg import Matrices
    from pyspark.mllib.linalg.distributed import BlockMatrix

    keys = [(i, j) for i in range(n // b) for j in range(n // b)]
    blocks = sc.parallelize(keys, len(keys)).map(
        lambda ij: (ij, Matrices.dense(b, b, block(seed, ij[0], ij[1], b).T.astype(np.float64).ravel())))
    matrix = BlockMatrix(blocks, b, b, n, n)
    java = matrix._java_matrix_wrapper._java_model
    java.persist(sc._jvm.org.apache.spark.storage.StorageLevel.MEMORY_AND_DISK())
    java.blocks().count()
    return matrix


def mllib_check(sc, product, n: int, b: int, reference: np.ndarray) -> None:
    """MLlib's product times a random vector (in MLlib) against ``reference`` times it."""
    from pyspark.mllib.linalg import Matrices
    from pyspark.mllib.linalg.distributed import BlockMatrix

    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    parts = [((i, 0), Matrices.dense(b, 1, x[i * b:(i + 1) * b].astype(np.float64))) for i in range(n // b)]
    y = product.multiply(BlockMatrix(sc.parallelize(parts), b, 1, n, 1)).toLocalMatrix().toArray().ravel()
    check(y.astype(np.float32), reference @ x, "MLlib")


def bench_spark(cluster, a, b, block_size, reference, repeat, memory) -> tuple[float, float, float]:
    db = tra_sql.connect(engine="spark", master=cluster.url, executor_memory=memory, executor_cores=1,
                         driver_memory="2g", config={"spark.cores.max": "2", "spark.sql.shuffle.partitions": "4"})
    try:
        db.wait_for_executors(2)
        c = db.einsum("ij,jk->ik", db.from_numpy("A", a, tile=block_size), db.from_numpy("B", b, tile=block_size))
        store = median_time(lambda: c.store("C", replace=True), repeat)
        check(db.tensor("C").numpy(plan=False), reference, "tra_sql on Spark")
        compute = median_time(lambda: db.frame(c.program()).write.format("noop").mode("overwrite").save(), repeat,
                              warmup=0)
        sc, n = db.spark.sparkContext, a.shape[0]
        ma, mb = mllib_operand(sc, SEED, n, block_size), mllib_operand(sc, SEED + 1, n, block_size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2, help="timed runs after one warm-up (median)")
    parser.add_argument("--executor-memory", default="2g", help="per executor (and worker)")
    args = parser.parse_args()
    n, bs = args.size, args.block
    flops = 2 * n**3
    a, b = operand(SEED, n, bs), operand(SEED + 1, n, bs)
    start = time.perf_counter()
    reference = a @ b
    t_numpy = time.perf_counter() - start
    print(f"machine: {machine()}\n{n}×{n} float32 matmul, blocks {bs}×{bs}, median of {args.repeat} "
          f"after a warm-up; numpy a @ b once: {t_numpy:.2f} s\n", flush=True)
    t_duck = bench_duckdb(a, b, bs, reference, args.repeat)
    print(f"tra_sql DuckDB: {t_duck:.2f} s", flush=True)
    with StandaloneCluster(workers=2, cores=1, memory=args.executor_memory) as cluster:
        t_store, t_compute, t_mllib = bench_spark(cluster, a, b, bs, reference, args.repeat, args.executor_memory)
    rows = [("numpy `a @ b` (2 BLAS threads, one run)", t_numpy), ("tra_sql on DuckDB (2 threads), store", t_duck),
            ("tra_sql on Spark, store", t_store), ("tra_sql on Spark, compute only (noop sink)", t_compute),
            ("MLlib BlockMatrix.multiply + count (float64)", t_mllib)]
    print("\n| run | s | GFLOP/s |\n|---|---|---|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.2f} | {flops / seconds / 1e9:.1f} |")
    print(f"\nratios: tra_sql Spark compute / MLlib = {t_compute / t_mllib:.2f}; "
          f"tra_sql Spark store / tra_sql DuckDB store = {t_store / t_duck:.2f}")


if __name__ == "__main__":
    main()
