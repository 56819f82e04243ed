"""Native placement aggregates (udfs/native/placement.py): re-tiling, slicing, concatenation,
reshapes and keyed sums over random shapes and ragged tilings equal NumPy and the Arrow path
(``tra_place`` over a list) and run as ``tra_place_agg`` / ``tra_place_add_<dtype>``; a piece
whose bytes, geometry or step are bad raises ``CorruptTileError`` (or the step's error) naming
what is wrong, and the process survives. Constant tiles (udfs/native/fill.py) are the Arrow
path's bytes, and keys outside the grid raise."""

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql.udfs.native import loader
from tra_sql.udfs.protocol import FILL, PLACEMENTS, FillStep, PlaceStep

pytestmark = pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """Native kernels here, also when the suite runs with TRA_SQL_KERNELS=arrow."""
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")


def _geometry(data, shape) -> dict:
    """Tilings, a slice and an axis for ``_programs``, drawn once for both sessions."""
    tiling = lambda label: tuple(data.draw(st.integers(1, n), label=f"{label} {d}") for d, n in enumerate(shape))
    starts = tuple(data.draw(st.integers(0, n - 1), label=f"start {d}") for d, n in enumerate(shape))
    stops = tuple(data.draw(st.integers(s + 1, n), label=f"stop {d}") for d, (s, n) in enumerate(zip(starts, shape)))
    return {"A": tiling("A tile"), "B": tiling("B tile"), "retile": tiling("retile"),
            "cut": tuple(slice(s, e) for s, e in zip(starts, stops)),
            "axis": data.draw(st.integers(0, len(shape) - 1), label="axis")}


def _programs(db, a, b, g):
    """(tensor, NumPy value) of each placement over ``a`` and ``b`` (one shape) stored as
    geometry ``g`` says; the keyed sum last (its sums in any order)."""
    A, B = db.from_numpy("A", a, g["A"], replace=True), db.from_numpy("B", b, g["B"], replace=True)
    out = [(A.retile(g["retile"]), a), (A[g["cut"]], a[g["cut"]]),
           (db.concat([A, B], axis=g["axis"]), np.concatenate([a, b], axis=g["axis"])),
           (A.reshape(a.size), a.reshape(-1))]
    if a.dtype.kind == "f":
        out.append((db.add(A, B, A), 2 * a + b))
    return out


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(["float32", "float64", "int64"]),
       shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), data=st.data())
def test_placements_equal_numpy_and_the_arrow_path(native, arrow, dtype, shape, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    a, b = (rng.standard_normal(shape) * 10).astype(dtype), (rng.standard_normal(shape) * 10).astype(dtype)
    if dtype != "int64":
        a.flat[0] = -0.0  # a negative zero keeps its sign
    g = _geometry(data, shape)
    results = {db is native: [(t.numpy(), want, t.sql().upper()) for t, want in _programs(db, a, b, g)]
               for db in (native, arrow)}
    for n, ((value, want, sql), (arrow_value, _, _)) in enumerate(zip(results[True], results[False])):
        assert "TRA_PLACE(" not in sql  # where it places, the aggregate does (the Arrow path: its macro)
        if n == 4:  # the keyed sum
            tolerance = 1e-5 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(value, want, rtol=tolerance, atol=tolerance)
            np.testing.assert_allclose(value, arrow_value, rtol=tolerance, atol=tolerance)
            continue
        np.testing.assert_array_equal(value, want)
        np.testing.assert_array_equal(np.signbit(value), np.signbit(want))
        np.testing.assert_array_equal(value, arrow_value)


@pytest.mark.parametrize("bad", [None, b"", b"\x00" * 8, b"\x00" * 100])
def test_a_bad_source_tile_raises_and_the_process_survives(native, bad):
    a = np.arange(6.0).reshape(2, 3)
    A = native.from_numpy("A", a, (2, 3), replace=True)
    moved = A.retile((1, 2))
    assert "TRA_PLACE_AGG(" in moved.sql().upper()
    native.engine.con.execute('UPDATE "A" SET tile = ?', [bad]).fetchall()
    what = "is NULL" if bad is None else f"holds {len(bad)} bytes; its shape \\(2, 3\\)"
    with pytest.raises(tra_sql.CorruptTileError, match=f"the tile of tensor 'A' at element \\(0, 0\\) {what}"):
        moved.numpy()
    native.engine.con.execute('UPDATE "A" SET tile = ?', [a.tobytes()]).fetchall()
    np.testing.assert_array_equal(moved.numpy(), a)


def test_hand_written_calls_with_bad_arguments_raise(native):
    """Every argument is checked before a byte is copied."""
    native.engine.ensure_kernels(PLACEMENTS)
    step = PlaceStep(("A",), ("float64",), "float64", (2, 3), (2, 3), False, False).encode()
    tile = np.arange(6.0).tobytes()
    call = "SELECT tra_place_agg(?, ?, ?, ?, ?, ?::BLOB)"
    good = [step, [0, 0], [0, 0], [2, 3], 0, tile]
    got = native.engine.con.execute(call, good).fetchall()[0][0]
    assert np.frombuffer(got, np.float64).tolist() == list(range(6))
    cases = {
        "output keys are NULL or outside": {1: [1, 0]},
        "output keys": {1: [0]},
        "NULL origin or shape, or one of another rank": {2: [0]},
        "another rank": {3: [2, 3, 1]},
        "names source 3, which the step does not have": {4: 3},
        "tensor 'A' at element \\(0, 0\\) holds 40 bytes; its shape \\(2, 3\\) needs 48": {5: tile[:40]},
        "holds 48 bytes; its shape \\(2, -3\\) needs -1": {3: [2, -3]},
        "is NULL": {5: None},
        "the step of a placement": {0: "not a step"},
        "dtypes differ": {0: PlaceStep(("A",), ("float32",), "float64", (2, 3), (2, 3), False, False).encode()},
        "another function's": {0: PlaceStep(("A",), ("float64",), "float64", (2, 3), (2, 3), False, True).encode()},
    }
    for message, changes in cases.items():
        args = [changes.get(i, v) for i, v in enumerate(good)]
        with pytest.raises(duckdb.Error, match=message):
            native.engine.con.execute(call, args).fetchall()
    assert native.engine.con.execute("SELECT 1").fetchall() == [(1,)]


def test_many_pieces_on_two_threads(native, rng):
    """A 3000 x 2000 re-tiling and keyed sum, DuckDB combining states across its threads."""
    a = rng.standard_normal((3000, 2000))
    A = native.from_numpy("A", a, (7, 2000), replace=True)
    np.testing.assert_array_equal(A.retile((1000, 3)).numpy(), a)
    np.testing.assert_allclose(native.add(A, A.retile((1000, 3))).numpy(), 2 * a, rtol=1e-15)


@pytest.mark.parametrize("dtype, value", [("float32", -0.0), ("float64", float("nan")), ("float32", 0.1),
                                          ("float64", -1.5), ("int32", -7), ("int64", 2**40)])
@pytest.mark.parametrize("shape, tile", [((), ()), ((5,), (2,)), ((3, 7, 2), (2, 3, 2)), ((4096,), (4096,))])
def test_constant_tiles_are_the_arrow_paths_bytes(native, arrow, dtype, value, shape, tile):
    if dtype.startswith("int") and np.iinfo(dtype).max < value:
        pytest.skip("the value does not fit the dtype")
    tiles = {}
    for db in (native, arrow):
        t = db.full(shape, value, dtype=dtype, tile=tile)
        expected = np.full(shape, value, dtype=dtype)
        np.testing.assert_array_equal(np.signbit(t.numpy()), np.signbit(expected))
        np.testing.assert_array_equal(t.numpy(), expected)
        tiles[db is native] = sorted(db.engine.con.execute(t.sql()).fetchall())
    assert tiles[True] == tiles[False]
    assert any(kind == "fill" for kind, _ in native.engine.native.plans)


def test_constant_tiles_at_bad_keys_raise(native):
    native.engine.ensure_kernels([FILL])
    step = FillStep("float64", (5, 3), (2, 3), 1.0).encode()
    got = native.engine.con.execute("SELECT tra_fill(?, ?)", [step, [2, 0]]).fetchall()[0][0]
    assert np.frombuffer(got, np.float64).tolist() == [1.0] * 3  # the ragged last row of tiles
    for keys in ([3, 0], [0, 1], [-1, 0], [0], [0, 0, 0], None, [0, None]):
        with pytest.raises(duckdb.Error, match="CorruptTileError: a constant tensor's output keys are NULL or "
                                               "outside its tile grid"):
            native.engine.con.execute("SELECT tra_fill(?, ?::BIGINT[])", [step, keys]).fetchall()
    assert native.engine.con.execute("SELECT 1").fetchall() == [(1,)]
