"""One GCN epoch written by hand against Spark DataFrames, as a Spark user would write it
without tra_sql: matrices in long format (row, column, value), each product a join and a
``groupBy().sum()``, the sparse adjacency as its edge table, the backward pass derived by hand,
the small gradients collected and Adam applied on the driver. ``bench_spark.py`` runs it beside
tra_sql's epoch (same data, initial weights and optimizer) and checks its losses and weights
against tra_sql's."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def long(spark, m: np.ndarray, row: str = "r") -> DataFrame:
    """``m`` as rows (``row``, k, v)."""
    r, k = np.indices(m.shape)
    return spark.createDataFrame(pa.table({row: r.ravel(), "k": k.ravel(), "v": m.ravel()}))


def dense(frame: DataFrame, shape: tuple[int, int], row: str) -> np.ndarray:
    """A small long-format matrix collected to the driver."""
    out = np.zeros(shape)
    for r in frame.collect():
        out[r[row], r["k"]] = r["v"]
    return out


def times(spark, m: DataFrame, w: np.ndarray) -> DataFrame:
    """``m`` (node, k, v) times the small matrix ``w``: a join on k and a sum."""
    wt = long(spark, w, "j").withColumnRenamed("k", "o").withColumnRenamed("v", "w")
    return (m.join(F.broadcast(wt), m.k == wt.j).groupBy("node", F.col("o").alias("k"))
            .agg(F.sum(F.col("v") * F.col("w")).alias("v")))


def spmm(edges: DataFrame, m: DataFrame, transpose: bool = False) -> DataFrame:
    """A·m (Aᵀ·m) for the adjacency given as edges (dst, src, w): out[dst] = Σ w · m[src]."""
    to, frm = ("src", "dst") if transpose else ("dst", "src")
    return (edges.join(m, edges[frm] == m.node).groupBy(F.col(to).alias("node"), "k")
            .agg(F.sum(F.col("w") * F.col("v")).alias("v")))


def plus(m: DataFrame, b: np.ndarray, relu: bool) -> DataFrame:
    v = F.col("v") + F.array(*[F.lit(float(x)) for x in b])[F.col("k")]
    return m.withColumn("v", F.greatest(v, F.lit(0.0)) if relu else v)


class GCN:
    """The 2-layer GCN of ``bench_spark.gcn_epoch`` with Adam(lr) on DataFrames."""

    def __init__(self, spark, edges: DataFrame, labels: DataFrame, x: np.ndarray, params: dict, count: int,
                 lr: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8):
        self.spark, self.edges, self.labels, self.count = spark, edges.cache(), labels.cache(), count
        self.x = long(spark, x, "node").cache()
        self.p = {k: v.copy() for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0

    def epoch(self) -> float:
        """One forward and backward pass and an Adam step; the loss."""
        p, f, h, c = self.p, *self.p["W1"].shape, self.p["W2"].shape[1]
        hid = plus(spmm(self.edges, times(self.spark, self.x, p["W1"])), p["b1"], relu=True).cache()
        z = plus(spmm(self.edges, times(self.spark, hid, p["W2"])), p["b2"], relu=False)
        z = z.join(self.labels, "node")  # the labeled rows: only they reach the loss
        stats = z.groupBy("node").agg(F.max("v").alias("top"))
        z = z.join(stats, "node")
        lse = z.groupBy("node").agg((F.first("top") + F.log(F.sum(F.exp(F.col("v") - F.col("top"))))).alias("lse"))
        z = z.join(lse, "node").cache()
        loss = z.where(F.col("k") == F.col("label")).agg(F.sum(F.col("lse") - F.col("v"))).first()[0] / self.count
        onehot = F.when(F.col("k") == F.col("label"), 1.0).otherwise(0.0)
        dz = z.select("node", "k", ((F.exp(F.col("v") - F.col("lse")) - onehot) / self.count).alias("v")).cache()
        g2 = spmm(self.edges, dz, transpose=True).cache()
        hid_j = hid.withColumnRenamed("k", "j").withColumnRenamed("v", "h")
        grads = {"b2": self._column_sums(dz, c),
                 "W2": dense(hid_j.join(g2, "node").groupBy(F.col("j").alias("r"), "k")
                             .agg(F.sum(F.col("h") * F.col("v")).alias("v")), (h, c), "r")}
        dh = times(self.spark, g2, p["W2"].T)
        dp = (dh.join(hid.where(F.col("v") > 0).select("node", "k"), ["node", "k"])).cache()
        g1 = spmm(self.edges, dp, transpose=True)
        x_j = self.x.withColumnRenamed("k", "j").withColumnRenamed("v", "x")
        grads["b1"] = self._column_sums(dp, h)
        grads["W1"] = dense(x_j.join(g1, "node").groupBy(F.col("j").alias("r"), "k")
                            .agg(F.sum(F.col("x") * F.col("v")).alias("v")), (f, h), "r")
        for frame in (hid, z, dz, g2, dp):
            frame.unpersist()
        self._adam(grads)
        return loss

    def _column_sums(self, m: DataFrame, n: int) -> np.ndarray:
        out = np.zeros(n)
        for r in m.groupBy("k").agg(F.sum("v").alias("v")).collect():
            out[r["k"]] = r["v"]
        return out

    def _adam(self, grads: dict) -> None:
        """PyTorch's Adam on the driver (the parameters are small)."""
        self.t += 1
        b1, b2 = self.betas
        for k, g in grads.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * g
            self.v[k] = b2 * self.v[k] + (1 - b2) * g * g
            step = self.lr / (1 - b1 ** self.t)
            self.p[k] = self.p[k] - step * self.m[k] / (np.sqrt(self.v[k]) / np.sqrt(1 - b2 ** self.t) + self.eps)


def two_epochs(spark, x: np.ndarray, params: dict, count: int) -> tuple[float, list[float], np.ndarray, int]:
    """Two epochs over the warehouse tables ``adj`` and ``labels``: the second's seconds, both
    losses, W1 after them, and the second epoch's Spark jobs."""
    from tra_sql.backends import spark_jobs

    model = GCN(spark, spark.table("adj"), spark.table("labels"), x, params, count)
    losses = [model.epoch()]
    with spark_jobs.jobs(spark) as jobs:
        start = time.perf_counter()
        losses.append(model.epoch())
        seconds = time.perf_counter() - start
    return seconds, losses, model.p["W1"], jobs.count
