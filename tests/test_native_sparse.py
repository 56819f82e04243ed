"""Native CSR products (udfs/native/sparse.py behind contract.KERNEL): a CSR tile times a dense
tile both ways (``vu,uf->vf``, ``vu,vf->uf``), with or without an element-wise epilogue, f32 and
f64, ragged tilings and empty tiles, equal NumPy and the Arrow path and run as ``tra_loop_<n>``;
products the CSR bodies do not take stay Arrow UDFs; a CSR tile whose bytes are not a CSR tile
of its extents raises ``CorruptTileError`` naming the tensor, and the process survives."""

import struct

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql.udfs import sparse
from tra_sql.udfs.native import loader
from tra_sql.udfs.protocol import EinsumStep, Kernel

pytestmark = pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")

PRODUCTS = {"vu,uf->vf": "vf,f->vf", "vu,vf->uf": "uf,f->uf"}  # the product, its bias epilogue


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """Native kernels here, also when the suite runs with TRA_SQL_KERNELS=arrow."""
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")


def _csr(db, name: str, dense: np.ndarray, tile, dtype: str):
    """A stored CSR tensor of ``dense``'s nonzeros, tiled ``tile``."""
    rows, cols = np.nonzero(dense)
    db.engine.con.register("_entries", pa.table({"r": rows, "c": cols, "w": dense[rows, cols]}))
    db.engine.con.execute(f'CREATE OR REPLACE TABLE "{name}_entries" AS SELECT * FROM _entries').fetchall()
    db.engine.con.unregister("_entries")
    view = db.relation(f"{name}_entries", ("r", "c"), "w", dense.shape, name=f"{name}_view", layout="csr",
                       tile=tile, dtype=dtype, replace=True)
    return view.store(name, replace=True)


def _program(db, spec, A, x, b, epilogue: bool):
    y = db.einsum(spec, A, x)
    return db.einsum(PRODUCTS[spec], y, b, join="greatest(x0 + x1, 0.0)") if epilogue else y


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=st.sampled_from(sorted(PRODUCTS)), dtype=st.sampled_from(["float32", "float64"]),
       epilogue=st.booleans(), data=st.data())
def test_csr_products_equal_numpy_and_the_arrow_path(native, arrow, spec, dtype, epilogue, data):
    rows, cols, feats = (data.draw(st.integers(1, 19), label=n) for n in ("rows", "cols", "feats"))
    density = data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]), label="density")
    rng = np.random.default_rng(rows * 400 + cols * 20 + feats)
    dense = np.where(rng.random((rows, cols)) < density, rng.standard_normal((rows, cols)), 0.0).astype(dtype)
    tile = (data.draw(st.integers(1, rows), label="tile v"), data.draw(st.integers(1, cols), label="tile u"))
    contracted = 0 if spec == "vu,vf->uf" else 1
    x = rng.standard_normal((dense.shape[contracted], feats)).astype(dtype)
    b = rng.standard_normal(feats).astype(dtype)
    want = np.einsum(spec, dense.astype(np.float64), x.astype(np.float64))
    if epilogue:
        want = np.maximum(want + b, 0.0)
    tile_f = data.draw(st.integers(1, feats), label="tile f")
    results = {}
    for db in (native, arrow):  # the SQL is the same: tra_loop_<n> is the Arrow UDF on the Arrow path
        A = _csr(db, "A", dense, tile, dtype)
        X = db.from_numpy("X", x, (tile[contracted], tile_f), replace=True)
        B = db.from_numpy("B", b, (X.tile[1],), replace=True)
        out = _program(db, spec, A, X, B, epilogue)
        if tile[contracted] == dense.shape[contracted]:  # a split sum may aggregate the joined tiles instead
            assert "tra_loop_" in out.sql().lower()
        results[db is native] = out.numpy()
    tolerance = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(results[True], want, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(results[True], results[False], rtol=tolerance, atol=tolerance)


def test_products_the_csr_bodies_do_not_take_stay_arrow_udfs(native, rng):
    """Another layout of the dense operand, mixed dtypes, or a join: the Arrow UDF, same answer."""
    dense = np.where(rng.random((7, 5)) < 0.4, rng.standard_normal((7, 5)), 0.0)
    A = _csr(native, "A", dense, (3, 5), "float64")
    x = rng.standard_normal((5, 4))
    cases = [(native.einsum("vu,fu->vf", A, native.from_numpy("Xt", x.T.copy(), (4, 5))), dense @ x),
             (native.einsum("vu,uf->vf", A, native.from_numpy("X32", x.astype(np.float32), (5, 4))), dense @ x)]
    for out, want in cases:
        assert "tra_loop_" not in out.sql().lower()
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
    step = EinsumStep(("vu", "uf"), "vf", {"v": 7, "u": 5, "f": 4}, {"v": 7, "u": 5, "f": 4},
                      ("float64",) * 2, "float64", ("A", "X"), layouts=("csr", "dense"))
    assert sparse.native_product(step) == (0, False)
    assert sparse.native_product(EinsumStep(**{**step.__dict__, "join": "x0 + x1"})) is None
    assert sparse.native_product(EinsumStep(**{**step.__dict__, "output": "fv"})) is None
    assert sparse.native_product(EinsumStep(**{**step.__dict__, "inputs": ("vu", "vf"), "output": "uf"})) == (0, True)


def _csr_bytes(indptr, indices, data) -> bytes:
    indices = np.asarray(indices, np.int32).tobytes()
    return (np.asarray(indptr, np.int64).tobytes() + indices + b"\x00" * (-len(indices) % 8)
            + np.asarray(data, np.float32).tobytes())


# tile (0, 0) of a 2 x 3 float32 CSR tensor; each a way its bytes are not a CSR tile of that shape
BAD_TILES = {
    "NULL": None,
    "empty": b"",
    "short of its row pointers": b"\x00" * 12,
    "truncated data": _csr_bytes([0, 1, 2], [0, 2], [1.0, 2.0])[:-4],
    "a first row pointer other than 0": _csr_bytes([1, 1, 2], [0, 2], [1.0, 2.0]),
    "descending row pointers": _csr_bytes([0, 2, 1], [0], [1.0]),
    "a column outside the tile": _csr_bytes([0, 1, 2], [0, 3], [1.0, 2.0]),
    "a negative column": _csr_bytes([0, 1, 1], [-1], [1.0]),
    "a huge entry count": struct.pack("<3q", 0, 0, 2**62),
}


@pytest.mark.parametrize("what", sorted(BAD_TILES))
def test_bad_csr_bytes_raise_and_the_process_survives(what):
    with tra_sql.connect() as db:
        dense = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]], np.float32)
        A = _csr(db, "A", dense, (2, 3), "float32")
        X = db.from_numpy("X", np.ones((3, 2), np.float32), (3, 2))
        out = db.einsum("vu,uf->vf", A, X)
        assert "tra_loop_2(" in out.sql().lower()
        np.testing.assert_allclose(out.numpy(), dense @ np.ones((3, 2)))
        db.engine.con.execute('UPDATE "A" SET tile = ?', [BAD_TILES[what]]).fetchall()
        message = "is NULL" if what == "NULL" else "is not a CSR tile of shape \\(2, 3\\) and dtype float32"
        with pytest.raises(tra_sql.CorruptTileError, match=f"tile \\(0, 0\\) of tensor 'A' {message}"):
            out.numpy()
        db.engine.con.execute('UPDATE "A" SET tile = ?', [_csr_bytes([0, 1, 2], [0, 2], [1.0, 2.0])]).fetchall()
        np.testing.assert_allclose(out.numpy(), dense @ np.ones((3, 2)))


def test_many_csr_tiles_on_two_threads(native, rng):
    """Row tiles of a 4000 x 3000 CSR matrix in both products, DuckDB calling the kernel from
    both threads."""
    dense = np.where(rng.random((4000, 3000)) < 0.002, rng.standard_normal((4000, 3000)), 0.0).astype(np.float32)
    A = _csr(native, "A", dense, (100, 3000), "float32")
    x, y = rng.standard_normal((3000, 8)).astype(np.float32), rng.standard_normal((4000, 8)).astype(np.float32)
    X, Y = native.from_numpy("X", x, (3000, 8), replace=True), native.from_numpy("Y", y, (100, 8), replace=True)
    np.testing.assert_allclose(native.einsum("vu,uf->vf", A, X).numpy(), dense @ x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(native.einsum("vu,vf->uf", A, Y).numpy(), dense.T @ y, rtol=1e-4, atol=1e-4)


def test_a_hand_written_call_with_bad_keys_raises(native):
    """The step's plan checks the CSR operand's keys and the shared index's extent too."""
    step = EinsumStep(("vu", "uf"), "vf", {"v": 2, "u": 3, "f": 1}, {"v": 2, "u": 3, "f": 1},
                      ("float32",) * 2, "float32", ("A", "X"), layouts=("csr", "dense"))
    tile = _csr_bytes([0, 1, 2], [0, 2], [1.0, 2.0])
    ones = np.ones(3, np.float32).tobytes()
    native.engine.ensure_kernels([Kernel("loop", 2)])
    call = f"SELECT tra_loop_2('{step.encode()}', [0, 0], ?, ?::BLOB, [0, 0], ?::BLOB)"
    got = native.engine.con.execute(call, [[0, 0], tile, ones]).fetchall()[0][0]
    assert np.frombuffer(got, np.float32).tolist() == [1.0, 2.0]
    with pytest.raises(duckdb.Error, match="tile \\(1, 0\\) of tensor 'A' is outside"):
        native.engine.con.execute(call, [[1, 0], tile, ones]).fetchall()
    with pytest.raises(duckdb.Error, match="tensor 'X' holds 8 bytes"):
        native.engine.con.execute(call, [[0, 0], tile, ones[:8]]).fetchall()
    assert native.engine.con.execute("SELECT 1").fetchall() == [(1,)]
