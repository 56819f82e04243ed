"""``Tensor.astype`` (``tra_sql.ops.cast``): values against NumPy over ragged tilings for every
dtype pair, casts inside larger programs, gradients against PyTorch, planned runs, absent
tiles, Spark, and the errors (bad dtype, CSR operand, corrupt tile, NaN to int); the native
kernel against the Arrow UDF, bit for bit, and its checks of every argument."""

import os
import shutil

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tra_sql
from tra_sql import CorruptTileError, DTypeError, ShapeError
from tra_sql.ops.cast import Cast
from tra_sql.udfs.cast import CAST, CastStep
from tra_sql.udfs.native import loader

DTYPES = ["float32", "float64", "int32", "int64"]


def values(rng, shape, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)  # both signs, fractions: truncation shows


@st.composite
def cases(draw):
    shape = tuple(draw(st.integers(1, 7)) for _ in range(draw(st.integers(0, 3))))
    tile = tuple(draw(st.integers(1, n)) for n in shape)
    return shape, tile, draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31))


@given(cases())
def test_values_match_numpy_astype(case):
    shape, tile, source, target, seed = case
    x = values(np.random.default_rng(seed), shape, source)
    with tra_sql.connect() as db:
        t = db.from_numpy("x", x, tile=tile).astype(target)
        got = t.numpy()
    assert t.dtype == np.dtype(target) and t.tile == tile and got.dtype == np.dtype(target)
    np.testing.assert_array_equal(got, x.astype(target))


@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("target", DTYPES)
def test_every_dtype_pair(db, rng, source, target):
    x = values(rng, (5, 7), source)
    t = db.from_numpy("x", x, tile=(2, 3)).astype(target)
    assert isinstance(t.node, Cast) == (source != target)  # the same dtype: the node itself
    np.testing.assert_array_equal(t.numpy(), x.astype(target))


def test_cast_in_larger_programs(db, rng):
    a, b = rng.standard_normal((6, 5)), rng.integers(-3, 4, (5, 4)).astype("int32")
    A, B = db.from_numpy("A", a, tile=(4, 2)), db.from_numpy("B", b, tile=(3, 3))
    over_cast = db.einsum("ij,jk->ik", A.astype("float32"), B.astype("float32"))   # an einsum over casts
    assert over_cast.dtype == np.float32
    np.testing.assert_allclose(over_cast.numpy(), a.astype("float32") @ b.astype("float32"), rtol=1e-5)
    of_einsum = db.einsum("ij,jk->ik", A, B).astype("int64")                          # a cast of an einsum
    np.testing.assert_array_equal(of_einsum.numpy(), (a @ b).astype("int64"))
    chained = A.astype("float32").astype("float64").T
    np.testing.assert_array_equal(chained.numpy(), a.astype("float32").astype("float64").T)


def test_gradient_through_a_cast_matches_torch(db, rng):
    w, x = rng.standard_normal((4, 6)), rng.standard_normal((6, 3))
    W, X = db.from_numpy("W", w, tile=(3, 4)), db.from_numpy("X", x, tile=(4, 2))
    h = db.einsum("ij,jk->ik", W.astype("float32"), X.astype("float32"))
    loss = db.einsum("ik->", h, join="x0 * x0")
    dW, dX = db.grad(loss, [W, X])
    assert dW.dtype == np.float64 and dW.tile == W.tile
    tw, tx = (torch.tensor(v, requires_grad=True) for v in (w, x))
    torch_loss = ((tw.float() @ tx.float()) ** 2).sum()
    gw, gx = torch.autograd.grad(torch_loss, [tw, tx])
    np.testing.assert_allclose(dW.numpy(), gw.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dX.numpy(), gx.numpy(), rtol=1e-4, atol=1e-4)


def test_no_gradient_into_or_through_integers(db, rng):
    w = rng.standard_normal((3, 4))
    W, N = db.from_numpy("W", w, tile=(2, 2)), db.from_numpy("N", rng.integers(0, 5, (3, 4)), tile=(2, 2))
    loss = db.einsum("ij,ij->", W.astype("int64").astype("float64"), N.astype("float64"))
    np.testing.assert_array_equal(db.grad(loss, W).numpy(), np.zeros_like(w))  # truncation: no gradient
    with pytest.raises(DTypeError, match="'N'"):
        db.grad(loss, N)


def test_planned_execution_matches(db, rng):
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    A, B = db.from_numpy("A", a, tile=(7, 30)), db.from_numpy("B", b, tile=(30, 3))
    out = db.einsum("ij,jk->ik", db.einsum("ij,jk->ik", A, B).astype("float32"), B.T.astype("float32"))
    expected = ((a @ b).astype("float32") @ b.T.astype("float32"))
    for plan in (db.plan(out, workers=4, memory="64KB"), db.plan(out)):
        np.testing.assert_allclose(out.numpy(plan=plan), expected, rtol=1e-4)


def test_absent_tiles_stay_zeros(db, rng):
    a = rng.standard_normal((5, 6))
    A = db.from_numpy("A", a, tile=(2, 4))
    db.engine.con.execute('DELETE FROM "A" WHERE (k0 = 1 AND k1 = 0) OR k0 = 2').fetchall()
    a[2:4, 0:4] = 0
    a[4:, :] = 0
    cast = A.astype("float32")
    assert cast.arrow().num_rows == 3                                    # absent tiles stay absent
    np.testing.assert_array_equal(cast.numpy(), a.astype("float32"))
    total = db.einsum("ij->", cast, join="x0 + 1")                       # zeros where tiles are absent
    np.testing.assert_allclose(total.numpy(), (a.astype("float32") + 1).sum(), rtol=1e-5)


def test_bad_dtypes_name_the_tensor(db):
    X = db.from_numpy("X", np.ones((2, 2)))
    for bad in ("float16", "complex128", "not a dtype"):
        with pytest.raises(DTypeError, match=f"'X'.*{bad!r}"):
            X.astype(bad)


def test_csr_operand_is_refused(db, rng):
    db.engine.con.register("_rows", pa.table({"dst": [0, 2], "src": [1, 3], "w": [1.0, 2.0]}))
    db.engine.con.execute('CREATE TABLE edges AS SELECT * FROM _rows').fetchall()
    A = db.relation("edges", ("dst", "src"), "w", (4, 4), name="A", layout="csr", tile=(2, 4))
    with pytest.raises(ShapeError, match="cast float64 -> float32 needs dense tiles.*'?A'? is stored csr"):
        A.astype("float32")


def test_corrupt_tile_names_tensor_and_tile(db):
    db.from_numpy("A", np.arange(16.0).reshape(4, 4), tile=(2, 2))
    db.engine.con.execute('UPDATE "A" SET tile = unhex(substr(hex(tile), 1, 10)) WHERE k0 = 1 AND k1 = 0').fetchall()
    with pytest.raises(CorruptTileError, match=r"tile \(1, 0\) of tensor 'A' holds 5 bytes"):
        db.tensor("A").astype("float32").numpy()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.0**31])
def test_float_without_an_int_value_raises(db, bad):
    x = np.zeros((3, 3))
    x[2, 1] = bad
    X = db.from_numpy("X", x, tile=(2, 2))
    with pytest.raises(DTypeError, match=r"tile \(1, 0\) of tensor 'X'.*int32"):
        X.astype("int32").numpy()
    edge = np.array([-(2.0**31) - 0.5, 2.0**31 - 0.5])                    # truncate into range: fine
    np.testing.assert_array_equal(db.from_numpy("E", edge).astype("int32").numpy(), edge.astype("int32"))


@pytest.mark.skipif(not shutil.which("java") and not os.environ.get("JAVA_HOME"), reason="Spark needs Java")
def test_spark_matches_duckdb(rng):
    pytest.importorskip("pyspark")
    a = rng.standard_normal((5, 4)) * 10
    with tra_sql.connect(engine="spark", master="local[2]", driver_memory="1g",
                         config={"spark.sql.shuffle.partitions": "2"}) as sdb:
        A = sdb.from_numpy("A", a, tile=(2, 3))
        np.testing.assert_array_equal(A.astype("int32").numpy(), a.astype("int32"))
        out = sdb.einsum("ij,jk->ik", A.astype("int32").astype("float32"), A.T.astype("float32"))
        expected = a.astype("int32").astype("float32") @ a.T.astype("float32")
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e300 to float32: inf
@pytest.mark.parametrize("source", DTYPES)
@pytest.mark.parametrize("target", DTYPES)
def test_native_casts_are_the_arrow_paths_bytes(native, arrow, source, target):
    """The native kernel (udfs/native/cast.py) writes what the Arrow UDF does: -0.0 and NaN
    kept, float64 to float32 rounded to nearest, integers wrapped, floats truncated."""
    if source == target:
        pytest.skip("no cast")
    rng = np.random.default_rng(3)
    edges = {"f": [-0.0, 0.1, -2.5, 1e-40], "i": [2**31 - 1, -(2**31), 7, -7, 0]}[np.dtype(source).kind]
    if source == "float64":
        edges += [2.0**31 - 0.5, -(2.0**31) - 0.5]  # truncated into int32's range
    if np.dtype(source).kind == "f" and target in ("float32", "float64"):
        edges += [np.nan, np.inf, 1e300 if source == "float64" else 1e30]
    if source == "int64":
        edges += [2**40 + 3, -(2**53) - 1]
    x = np.concatenate([np.array(edges), values(rng, 35, "float64")]).astype(source)[:35].reshape(5, 7)
    tiles = {}
    for db in (native, arrow):
        t = db.from_numpy("x", x, tile=(2, 3), replace=True).astype(target)
        got = t.numpy()
        np.testing.assert_array_equal(got.view(np.uint8), x.astype(target).view(np.uint8))  # bit for bit
        tiles[db is native] = sorted(db.engine.con.execute(t.sql()).fetchall())
    assert tiles[True] == tiles[False]
    assert any(kind == "cast" for kind, _ in native.engine.native.plans)


@pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")
def test_native_cast_checks_every_argument(native):
    native.engine.ensure_kernels([CAST])
    step = CastStep("A", "float64", "int32", (5, 3), (2, 3)).encode()
    call = "SELECT tra_cast(?, ?::BIGINT[], ?::BLOB)"
    good = np.arange(3.0).tobytes()
    got = native.engine.con.execute(call, [step, [2, 0], good]).fetchall()[0][0]
    assert got == np.arange(3, dtype="int32").tobytes()
    for keys in ([3, 0], [0, 1], [0], None):
        with pytest.raises(duckdb.Error, match="CorruptTileError: a tile of tensor 'A' has NULL keys or keys outside"):
            native.engine.con.execute(call, [step, keys, good]).fetchall()
    with pytest.raises(duckdb.Error, match=r"CorruptTileError: tile \(2, 0\) of tensor 'A' is NULL"):
        native.engine.con.execute(call, [step, [2, 0], None]).fetchall()
    for short in (b"", good[:5], good[:20]):
        with pytest.raises(duckdb.Error, match=rf"tile \(2, 0\) of tensor 'A' holds {len(short)} bytes; its shape "
                                               "needs 24"):
            native.engine.con.execute(call, [step, [2, 0], short]).fetchall()
    with pytest.raises(duckdb.Error, match=r"DTypeError: tile \(2, 0\) of tensor 'A' holds NaN, an infinity or a "
                                           "value outside int32's range: it cannot be cast to int32"):
        native.engine.con.execute(call, [step, [2, 0], np.array([0, np.nan, 1]).tobytes()]).fetchall()
    assert native.engine.con.execute("SELECT 1").fetchall() == [(1,)]
