"""Tensor relations: tiles, ragged boundaries, dtypes, Arrow, persistence in a file."""

import duckdb
import numpy as np
import pytest

import tra_sql


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_round_trip_ragged(db, rng, dtype):
    array = (rng.standard_normal((13, 7, 5)) * 10).astype(dtype)
    t = db.from_numpy("T", array, tile=(4, 3, 5))
    assert t.shape == (13, 7, 5) and t.tile == (4, 3, 5) and t.dtype == np.dtype(dtype)
    rows = db.engine.con.execute('SELECT count(*), max(octet_length(tile)) FROM "T"').fetchall()[0]
    assert rows == (4 * 3 * 1, 4 * 3 * 5 * np.dtype(dtype).itemsize)
    np.testing.assert_array_equal(db.tensor("T").numpy(), array)


@pytest.mark.parametrize("tile", [(13, 7), (4, 7), (13, 3), (4, 3)])
def test_fetched_arrays_are_writable_and_their_own(db, rng, tile):
    """Tiles that already lie in the array's order (a tiling of the first dimension, every
    tile there, in key order) become the array without a copy; the array is writable and
    stays right when the result it came from is gone, whatever order the rows came in."""
    array = rng.standard_normal((13, 7))
    t = db.einsum("ij->ij", db.from_numpy("T", array, tile=tile))
    tiles = t.arrow()
    for rows in (tiles, tiles.take(np.arange(tiles.num_rows)[::-1])):
        got = tra_sql.catalog.assemble(tra_sql.catalog.TensorInfo("T", t.dtype, t.shape, t.tile), rows)
        np.testing.assert_array_equal(got, array)
        got[0, 0] = 99.0
        assert got[0, 0] == 99.0
    del tiles, rows
    fetched = t.numpy()
    assert fetched.flags.writeable and fetched.flags.c_contiguous
    assert fetched.flags.owndata == (tile[1] < 7)  # in place where the tiles lie in order
    fetched += 1
    db.einsum("ij->ij", db.tensor("T")).numpy()  # other results do not reuse its memory
    np.testing.assert_array_equal(fetched, array + 1)


def test_tiles_are_c_order_bytes_with_integer_keys(db):
    array = np.arange(12, dtype=np.float64).reshape(3, 4)
    db.from_numpy("M", array, tile=(2, 3))
    rows = db.engine.con.execute('SELECT k0, k1, tile FROM "M" ORDER BY k0, k1').fetchall()
    assert [(k0, k1) for k0, k1, _ in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    np.testing.assert_array_equal(np.frombuffer(rows[1][2], np.float64).reshape(2, 1), array[0:2, 3:4])
    np.testing.assert_array_equal(np.frombuffer(rows[2][2], np.float64).reshape(1, 3), array[2:3, 0:3])
    types = dict(db.engine.con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                "WHERE table_name = 'M'").fetchall())
    assert types == {"k0": "INTEGER", "k1": "INTEGER", "tile": "BLOB"}


def test_catalog_row(db):
    db.from_numpy("A", np.zeros((5, 3), np.float32), tile=(2, 3))
    assert db.engine.con.execute("SELECT * FROM tra_tensors").fetchall() == [("A", "float32", [5, 3], [2, 3], "dense")]
    assert db.tensors() == ["A"]


def test_scalar_tensor_and_default_tile(db):
    db.from_numpy("s", np.float64(2.5))
    assert db.tensor("s").numpy() == 2.5 and db.tensor("s").shape == ()
    big = db.from_numpy("big", np.zeros((3000, 1000)))
    assert np.prod(big.tile) <= 1 << 20


def test_tile_larger_than_tensor_is_clamped(db):
    t = db.from_numpy("v", np.arange(5.0), tile=(100,))
    assert t.tile == (5,)


def test_arrow_out_and_in(db, rng):
    array = rng.standard_normal((6, 5))
    tiles = db.from_numpy("A", array, tile=(4, 2)).arrow()
    assert tiles.column_names == ["k0", "k1", "tile"] and tiles.num_rows == 6
    copy = db.from_arrow("B", tiles, shape=(6, 5), tile=(4, 2), dtype="float64")
    np.testing.assert_array_equal(copy.numpy(), array)


def test_retile_in_sql(db, rng):
    array = rng.standard_normal((11, 9))
    t = db.from_numpy("A", array, tile=(4, 4))
    moved = t.retile((3, 5))
    assert "tra_place" in moved.sql().lower()
    assert moved.tile == (3, 5)
    np.testing.assert_array_equal(moved.numpy(), array)
    np.testing.assert_array_equal(moved.store("B").numpy(), array)
    assert db.engine.con.execute('SELECT count(*) FROM "B"').fetchall()[0][0] == 4 * 2


def test_replace(db):
    db.from_numpy("A", np.ones(3))
    with pytest.raises(tra_sql.TensorExistsError, match="'A'"):
        db.from_numpy("A", np.ones(3))
    db.from_numpy("A", np.zeros(4), replace=True)
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.zeros(4))


def test_drop(db):
    db.from_numpy("A", np.ones(3))
    db.drop("A")
    assert db.tensors() == []
    with pytest.raises(tra_sql.UnknownTensorError):
        db.drop("A")


def test_persists_in_file_and_opens_in_plain_duckdb(tmp_path, rng):
    path = str(tmp_path / "t.duckdb")
    a, b = rng.standard_normal((9, 4)), rng.standard_normal((4, 6))
    with tra_sql.connect(path) as db:
        A = db.from_numpy("A", a, tile=(4, 3))
        B = db.from_numpy("B", b, tile=(3, 4))
        db.einsum("ij,jk->ik", A, B).store("C")
    with tra_sql.connect(path, threads=1, memory_limit="1GB") as db:
        assert db.tensors() == ["A", "B", "C"]
        np.testing.assert_allclose(db.tensor("C").numpy(), a @ b)
    con = duckdb.connect(path, read_only=True)
    assert con.execute('SELECT count(*) FROM "C"').fetchall()[0][0] == 3 * 2
    assert con.execute("SELECT shape FROM tra_tensors WHERE name = 'C'").fetchall() == [([9, 6],)]
    con.close()


def test_read_only_session_reads_tensors(tmp_path):
    path = str(tmp_path / "t.duckdb")
    with tra_sql.connect(path) as db:
        db.from_numpy("A", np.arange(4.0))
    with tra_sql.connect(path, read_only=True) as db:
        np.testing.assert_array_equal(db.tensor("A").numpy(), np.arange(4.0))


def test_lazy_until_run(db):
    A = db.from_numpy("A", np.ones((2, 2)))
    C = db.einsum("ij,jk->ik", A, A)
    assert db.tensors() == ["A"]
    assert "JOIN" in C.sql()
    assert C.name is None and "einsum" in repr(C)


def test_names_are_case_insensitive_like_sql(db):
    db.from_numpy("Weights", np.ones(2))
    assert db.tensor("weights").name == "Weights"
    with pytest.raises(tra_sql.TensorExistsError, match="case-insensitive"):
        db.from_numpy("WEIGHTS", np.ones(2))
    db.drop("WEIGHTS")
    assert db.tensors() == []
