"""Native kernels through DuckDB's C API (udfs/native): the BLAS tile product equals NumPy and
the Arrow path over random shapes, tilings (ragged, inlined tiles of 12 bytes or less) and
dtypes; corrupt tiles raise CorruptTileError and the process survives; several DuckDB threads;
the fallbacks to Arrow UDFs."""

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql.compile.program import Program
from tra_sql.engines.duckdb import DuckDBEngine
from tra_sql.errors import CorruptTileError, SpecError
from tra_sql.session import Session
from tra_sql.udfs.native import loader

pytestmark = pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")

FORMS = ["ij,jk->ik", "ji,jk->ik", "ij,kj->ik", "ij,jk->ki", "bij,bjk->bik", "ij,j->i", "i,j->ij", "ijk,kl->ijl"]


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """Native kernels here, also when the suite runs with TRA_SQL_KERNELS=arrow."""
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")


def _operands(spec, sizes, tiles, dtype, rng):
    inputs = spec.split("->")[0].split(",")
    arrays = [rng.standard_normal([sizes[c] for c in sub]).astype(dtype) for sub in inputs]
    return inputs, arrays, [tuple(tiles[c] for c in sub) for sub in inputs]


def _run(db, spec, arrays, tilings, tag):
    tensors = [db.from_numpy(f"{tag}{m}", a, t, replace=True) for m, (a, t) in enumerate(zip(arrays, tilings))]
    result = db.einsum(spec, *tensors)
    return result, result.numpy()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=st.sampled_from(FORMS), dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_products_equal_numpy_and_the_arrow_path(native, arrow, spec, dtype, data):
    letters = sorted(set(spec) - set(",->"))
    sizes = {c: data.draw(st.integers(1, 9), label=f"size {c}") for c in letters}
    tiles = {c: data.draw(st.integers(1, sizes[c]), label=f"tile {c}") for c in letters}
    inputs, arrays, tilings = _operands(spec, sizes, tiles, dtype, np.random.default_rng(len(spec)))
    result, got = _run(native, spec, arrays, tilings, "n")
    sql = result.sql().lower()
    split = any(tiles[c] < sizes[c] for c in set("".join(inputs)) - set(spec.split("->")[1]))
    assert (f"tra_contract_agg_{np.dtype(dtype).name}(" if split else "tra_contract_2(") in sql
    _, fallback = _run(arrow, spec, arrays, tilings, "a")
    expected = np.einsum(spec, *[a.astype(np.float64) for a in arrays])
    tol = 1e-4 if dtype == np.float32 else 1e-10
    assert got.dtype == dtype
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(got, fallback, rtol=tol, atol=tol * 10)


def test_many_rows_on_two_threads(native):
    """Over one row group (122,880 rows) DuckDB runs the pipeline on both threads; every tile is
    inlined (8 and 12 bytes)."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((130_000, 2)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    got = native.einsum("ij,jk->ik", native.from_numpy("tall", x, (1, 2)), native.from_numpy("small", y)).numpy()
    np.testing.assert_allclose(got, x @ y, rtol=1e-5, atol=1e-5)


def _raw(db, tensor):
    """Run ``tensor``'s program as plain SQL (no check before it: only the kernels' own)."""
    program = Program.compile(tensor.node)
    db.engine.ensure_kernels(program.kernels)
    return db.engine.con.sql(program.sql()).fetchall()


CORRUPTIONS = [
    ("tile = NULL", "is NULL"),
    ("tile = ''::BLOB", "holds 0 bytes"),
    ("tile = '\\x01\\x02\\x03'::BLOB", "holds 3 bytes"),
    ("tile = tile || tile", "holds {twice} bytes; its shape \\(16, {j}\\) and dtype float32 need {once}"),
]


@pytest.mark.parametrize("j, kernel, absent", [(20, "tra_contract_2(", "tra_contract_agg"),
                                               (18, "tra_contract_agg_float32(", "tra_contract_2(")],
                         ids=["product", "fused aggregate"])
@pytest.mark.parametrize("change, message", CORRUPTIONS)
def test_corrupt_tiles_raise_and_the_process_survives(change, message, j, kernel, absent):
    with tra_sql.connect() as db:
        rng = np.random.default_rng(2)
        x, y = rng.standard_normal((30, 20)).astype(np.float32), rng.standard_normal((20, 10)).astype(np.float32)
        db.from_numpy("x", x, (16, j))  # j = 18: the contraction is split, so the fused aggregate runs it
        db.from_numpy("y", y, (j, 10))
        product = db.einsum("ij,jk->ik", "x", "y")  # (looking a tensor up checks its keys and NULL tiles)
        sql = product.sql().lower()
        assert kernel in sql and absent not in sql
        db.engine.con.execute(f"UPDATE x SET {change} WHERE k0 = 0 AND k1 = 0")
        message = message.format(twice=2 * 64 * j, once=64 * j, j=j)
        with pytest.raises(duckdb.Error, match=f"CorruptTileError: tile \\(0, 0\\) of tensor 'x' {message}"):
            _raw(db, product)
        with pytest.raises(CorruptTileError, match="'x'.*tile \\(0, 0\\)|tile \\(0, 0\\) of tensor 'x'"):
            product.numpy()
        db.from_numpy("x", x, (16, j), replace=True)
        np.testing.assert_allclose(db.einsum("ij,jk->ik", "x", "y").numpy(), x @ y, rtol=1e-5, atol=1e-5)


def test_a_key_outside_the_grid_raises():
    with tra_sql.connect() as db:
        db.from_numpy("x", np.ones((4, 4), np.float32), (2, 2))
        db.from_numpy("y", np.ones((4, 4), np.float32), (2, 2))
        product = db.einsum("ij,jk->ik", "x", "y")
        db.engine.con.execute("UPDATE x SET k0 = 7 WHERE k0 = 1 AND k1 = 1")
        with pytest.raises(duckdb.Error, match="CorruptTileError: tile \\(7, 1\\) of tensor 'x' is outside"):
            _raw(db, product)


def test_a_connection_without_unsigned_extensions_uses_arrow():
    with Session(DuckDBEngine(duckdb.connect())) as db:
        assert db.engine.kernels == "arrow"
        x = np.arange(12.0).reshape(3, 4)
        np.testing.assert_allclose(db.einsum("ij,jk->ik", db.from_numpy("x", x, (2, 2)),
                                             db.from_numpy("y", x.T.copy(), (2, 2))).numpy(), x @ x.T)


def test_an_unbuilt_extension_uses_arrow(monkeypatch):
    monkeypatch.setattr(loader, "built", lambda: None)
    with tra_sql.connect() as db:
        assert db.engine.kernels == "arrow"


def test_the_footer_is_duckdbs_534_bytes():
    footer = loader.footer("linux_amd64")
    assert len(footer) == 534 and footer.startswith(b"\x00\x93\x04\x10duckdb_signature\x80\x04")
    assert footer[22 + 7 * 32: 22 + 7 * 32 + 1] == b"4"  # the magic value, the last field


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(agg=st.sampled_from(["sum", "max", "min", "prod"]), dtype=st.sampled_from([np.float32, np.float64]),
       data=st.data())
def test_tile_reductions_equal_numpy_and_the_arrow_path(native, arrow, agg, dtype, data):
    sizes = {c: data.draw(st.integers(1, 8), label=f"size {c}") for c in "ijk"}
    tiles = {c: data.draw(st.integers(1, sizes[c]), label=f"tile {c}") for c in "ijk"}
    inputs, arrays, tilings = _operands("ij,jk->ik", sizes, tiles, dtype, np.random.default_rng(3))
    results = []
    for db, tag in ((native, "n"), (arrow, "a")):
        tensors = [db.from_numpy(f"{tag}{m}", a, t, replace=True) for m, (a, t) in enumerate(zip(arrays, tilings))]
        product = db.einsum("ij,jk->ik", *tensors, agg=agg)
        sql = product.program().sql().lower()
        if tiles["j"] < sizes["j"] and "tra_einsum_agg" not in sql:  # (a split sum: the fused aggregate)
            assert f"tra_{'contract_agg' if agg == 'sum' else 'reduce_' + agg}_{np.dtype(dtype).name}(" in sql
        results.append(product.numpy())
    products = arrays[0].astype(np.float64)[:, :, None] * arrays[1].astype(np.float64)[None, :, :]
    expected = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[agg](products, axis=1)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(results[0], expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(results[0], results[1], rtol=tol, atol=tol)


def test_a_max_over_many_partials_on_two_threads(native):
    """130,000 partial products of one output tile: DuckDB aggregates on both threads and
    combines the states."""
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((2, 130_000)).astype(np.float32), rng.standard_normal((130_000, 2)).astype(np.float32)
    product = native.einsum("ij,jk->ik", native.from_numpy("wide", x, (2, 1)), native.from_numpy("deep", y, (1, 2)),
                            agg="max")
    assert "tra_reduce_max_float32(" in product.program().sql().lower()
    expected = np.max(x[:, :, None] * y[None, :, :], axis=1)
    np.testing.assert_allclose(product.numpy(), expected, rtol=1e-6)


def test_max_keeps_nan(native):
    x = np.array([[1.0, np.nan], [2.0, 3.0]])
    product = native.einsum("ij,jk->ik", native.from_numpy("xn", x, (2, 1), replace=True),
                            native.from_numpy("yn", np.ones((2, 2)), (1, 2), replace=True), agg="max")
    np.testing.assert_array_equal(product.numpy(), [[np.nan, np.nan], [3.0, 3.0]])


@pytest.mark.parametrize("second, message", [("NULL", "is NULL"),
                                             ("'\\x01\\x02\\x03\\x04\\x05\\x06\\x07\\x08'::BLOB", "differ in size")])
def test_bad_partials_raise_in_the_aggregate(native, second, message):
    sql = (f"SELECT tra_reduce_sum_float32('', [0], t) FROM (VALUES ('\\x01\\x02\\x03\\x04'::BLOB), ({second})) v(t)")
    with pytest.raises(duckdb.Error, match=f"CorruptTileError: .*{message}"):
        native.engine.con.execute(sql).fetchall()
    assert native.engine.con.execute("SELECT 1").fetchall() == [(1,)]


def test_a_null_key_raises():
    with tra_sql.connect() as db:
        db.from_numpy("x", np.ones((4, 4), np.float32), (2, 2))
        db.from_numpy("y", np.ones((4, 4), np.float32), (2, 4))
        product = db.einsum("ij,jk->ik", "x", "y")
        db.engine.con.execute("UPDATE x SET k0 = NULL WHERE k0 = 1 AND k1 = 1")
        with pytest.raises(duckdb.Error, match="CorruptTileError: a tile of tensor 'x' has NULL keys"):
            _raw(db, product)


def test_an_unknown_kernel_choice_is_refused(monkeypatch):
    monkeypatch.setenv("TRA_SQL_KERNELS", "fast")
    with pytest.raises(SpecError, match="TRA_SQL_KERNELS='fast'"):
        tra_sql.connect()
