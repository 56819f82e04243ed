"""How Spark's dialect writes a split aggregation (``SparkDialect.fuse``, ``lists_inputs``):
per-row partial results aggregated (``tra_reduce``), or each group's joined input tiles listed
into one aggregate (``tra_einsum_agg_<n>``, a grouped UDF for big groups), whichever moves fewer
bytes. The SQL that Spark would run, built without Spark; Spark's answers are compared with
NumPy's in ``test_spark.py::test_a_split_aggregation_listing_its_inputs_equals_numpy``."""

import re

import numpy as np
import pytest

import tra_sql
from tra_sql.backends.spark_sql import SparkDialect
from tra_sql.compile import passes
from tra_sql.compile.program import Program


def spark_sql(tensor, **dialect) -> str:
    """``tensor``'s program as Spark SQL (one query, plain CTEs)."""
    program = Program.compile(tensor.node)
    return SparkDialect(**dialect).render(program.query(materialized=False))[0]


def kernels(text: str) -> list[str]:
    return sorted(re.findall(r"(TRA_\w+)\(", text))


def put(db, name, shape, tile):
    return db.from_numpy(name, np.random.default_rng(5).standard_normal(shape), tile=tile)


@pytest.mark.parametrize("tiles, listed", [
    (((8, 4), (4, 8)), True),  # a row's tiles: 64 elements, its partial product 64: listed
    (((8, 2), (2, 8)), True),  # 32 against 64
    (((8, 8), (8, 8)), False),  # 128 against 64: partial products, then their sum
    (((2, 8), (8, 2)), False),  # 32 against 4 (a gradient's shape: a small result of big inputs)
])
def test_a_split_sum_lists_its_inputs_when_they_hold_no_more_bytes_than_a_partial_product(tiles, listed):
    """A partial product leaves a Python worker, is shuffled and enters one again; a row's
    input tiles are shuffled once: listed whenever they hold no more bytes than the partial."""
    with tra_sql.connect() as db:
        a, b = put(db, "A", (8, 16), tiles[0]), put(db, "B", (16, 8), tiles[1])
        text = spark_sql(db.einsum("ij,jk->ik", a, b))
    assert kernels(text) == (["TRA_EINSUM_AGG_2"] if listed else ["TRA_CONTRACT_2", "TRA_REDUCE"])
    assert ("COLLECT_LIST(STRUCT(" in text) == listed


def test_a_csr_tile_counts_as_nothing_and_the_epilogue_comes_along():
    """A sparse adjacency's product with dense features (a GCN layer, bias and ReLU fused after
    it) lists its joined tiles: the CSR tile's nonzeros are not known and count as nothing, so
    the row holds the features' tile alone, the partial product's bytes. Its epilogue operand
    (the bias) is each group's ``ANY_VALUE``; over the group budget, the grouped UDF takes it as
    a column of every row."""
    with tra_sql.connect() as db:
        db.engine.con.execute("CREATE TABLE edges AS SELECT range AS dst, (range * 7) % 12 AS src, 1.0 AS w "
                              "FROM range(12)")
        adjacency = db.relation("edges", ("dst", "src"), "w", (12, 12), name="Adj", layout="csr", tile=(4, 4))
        features, bias = put(db, "H", (12, 3), (4, 3)), put(db, "b", (3,), None)
        layer = db.einsum("mh,h->mh", db.einsum("mn,nh->mh", adjacency, features), bias, join="greatest(x0 + x1, 0)")
        listed = spark_sql(layer)
        grouped = spark_sql(layer, limit=0)
        with passes.fusions(off={"contractions"}):
            partials = spark_sql(layer)
    assert "TRA_EINSUM_AGG_2_1(" in listed and "ANY_VALUE(y1.tile)" in listed and "TRA_REDUCE" not in listed
    assert re.search(r"TRA_EINSUM_GROUP_2_1\(.*, x1\.tile, ARRAY\(y1\.k0\), y1\.tile\) AS tile", grouped)
    assert "TRA_REDUCE_1(" in partials and "TRA_EINSUM_AGG" not in partials


def test_what_keeps_its_partial_results():
    """A split aggregation whose result is CSR (a sum sampled at a CSR relation's entries)
    keeps its partial results on Spark; DuckDB's dialect fuses a split sum of products its own
    way (one native aggregate), whatever Spark's would list."""
    with tra_sql.connect() as db:
        db.engine.con.execute("CREATE TABLE pattern AS SELECT range AS i, (range * 5) % 8 AS j, 1.0 AS w "
                              "FROM range(8)")
        mask = db.relation("pattern", ("i", "j"), "w", (8, 8), name="M", layout="csr", tile=(4, 8))
        a, b = put(db, "A", (8, 16), (4, 2)), put(db, "B", (16, 8), (2, 8))  # 24 elements against 32
        sampled = db.einsum("ij,ijk->ij", mask, put(db, "T", (8, 8, 6), (4, 8, 2)))
        product = db.einsum("ij,jk->ik", a, b)
        assert sampled.node.layout == "csr"
        assert "TRA_REDUCE(" in spark_sql(sampled) and "TRA_EINSUM_AGG" not in spark_sql(sampled)
        assert "TRA_EINSUM_AGG_2(" in spark_sql(product)
        assert "TRA_CONTRACT_AGG_FLOAT64(" in product.sql() and "TRA_EINSUM_AGG" not in product.sql()


def test_the_listing_keeps_the_steps_hints():
    """The two SELECTs become one with both's Spark hints: the small weights read whole by every
    task of the join (``SHUFFLE_REPLICATE_NL``, the inner SELECT's) and the small result
    coalesced into one partition (``COALESCE(1)``, the outer's)."""
    with tra_sql.connect() as db:
        x, w = put(db, "X", (8, 16), (8, 2)), put(db, "W", (16, 8), (2, 8))
        p = db.einsum("ij,jk->ik", x, w)
        program = Program.compile(db.einsum("ik,ik->ik", p, p).node)  # P, read twice: a view of its own
        text = SparkDialect(replicate=1 << 20).steps(program).text()
    assert "TRA_EINSUM_AGG_2" in text and "TRA_REDUCE" not in text
    assert re.search(r"SELECT /\*\+ SHUFFLE_REPLICATE_NL\(\w+\), COALESCE\(1\) \*/ x0\.k0 AS k0, x1\.k1 AS k1, "
                     r"TRA_EINSUM_AGG_2", text)


def test_a_small_step_listing_a_big_relations_tiles_is_exchanged():
    """A listed aggregation computes its products after its exchange, in its own tasks: a small
    result (a GCN layer, 12x3) listing a big relation's tiles (the adjacency: CSR, its size not
    known) is computed in the aggregation's partitions and then exchanged into one
    (``REPARTITION(1)``), not coalesced into one task that every executor reading it would run.
    Aggregating partial products instead (``contractions`` off), the products come before the
    exchange: coalesced."""
    with tra_sql.connect() as db:
        db.engine.con.execute("CREATE TABLE edges AS SELECT range AS dst, (range * 7) % 12 AS src, 1.0 AS w "
                              "FROM range(12)")
        adjacency = db.relation("edges", ("dst", "src"), "w", (12, 12), name="Adj", layout="csr", tile=(4, 4))
        features = put(db, "H", (12, 3), (4, 3))
        layer = db.einsum("mh,mh->mh", *[db.einsum("mn,nh->mh", adjacency, features)] * 2)  # read twice: a view
        program = Program.compile(layer.node)
        listed = SparkDialect(replicate=1 << 20).steps(program).text()
        with passes.fusions(off={"contractions"}):
            partials = SparkDialect(replicate=1 << 20).steps(program).text()
    assert re.search(r"SELECT /\*\+ SHUFFLE_REPLICATE_NL\(x1\), REPARTITION\(1\) \*/ x0\.k0 AS k0, x1\.k1 AS k1, "
                     r"TRA_EINSUM_AGG_2\(", listed)
    assert "REPARTITION" not in partials and re.search(r"COALESCE\(1\) \*/ k0 AS k0, k1 AS k1, TRA_REDUCE\(", partials)
