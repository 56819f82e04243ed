"""Bad input raises a TraError subclass that names the culprit and leaves nothing behind."""

import numpy as np
import pytest

import tra_sql


@pytest.fixture
def ab(db):
    A = db.from_numpy("A", np.ones((4, 3)), tile=(2, 2))
    B = db.from_numpy("B", np.ones((3, 5)), tile=(2, 2))
    return A, B


@pytest.mark.parametrize("spec", ["ij,jk->i k->", "ij,j1->i", "ij,jk->ii", "ij,jk->iz", "ij,jk>ik",
                                  "i...j...,jk->ik", "ij,jk->..."])
def test_malformed_spec(db, ab, spec):
    with pytest.raises(tra_sql.SpecError, match="einsum spec"):
        db.einsum(spec, *ab)


def test_spec_must_be_string(db, ab):
    with pytest.raises(tra_sql.SpecError):
        db.einsum(3, *ab)


def test_operand_count(db, ab):
    with pytest.raises(tra_sql.ShapeError, match="names 3 operand.*got 2"):
        db.einsum("ij,jk,kl->il", *ab)


def test_rank_mismatch_names_operand(db, ab):
    with pytest.raises(tra_sql.ShapeError, match="'B' has rank 2"):
        db.einsum("ij,j->i", *ab)


def test_size_mismatch_names_index(db, ab):
    with pytest.raises(tra_sql.ShapeError, match="index 'j' has size 3 in 'A' but 5 in 'B'"):
        db.einsum("ij,kj->ik", *ab)


def test_unknown_tensor(db, ab):
    with pytest.raises(tra_sql.UnknownTensorError, match="'nope'"):
        db.einsum("ij,jk->ik", "A", "nope")
    with pytest.raises(tra_sql.UnknownTensorError):
        db.einsum("ij->i", 42)


def test_unsupported_dtype(db):
    with pytest.raises(tra_sql.DTypeError, match="complex128"):
        db.from_numpy("Z", np.ones(3, dtype=np.complex128))
    with pytest.raises(tra_sql.DTypeError):
        db.from_numpy("S", np.array(["a", "b"]))
    # not dtypes at all (NumPy reads the first as a record format and raises ValueError): found by
    # test_fuzz_sql_statements, which put an einsum spec in tra_random's dtype
    for name in ("ij,jk->ik", "nonsense"):
        with pytest.raises(tra_sql.DTypeError, match=f"dtype '{name}' is not one of"):
            db.full((2,), 1.0, dtype=name)
        with pytest.raises(tra_sql.DTypeError, match=f"dtype '{name}' is not one of"):
            db.sql(f"SELECT * FROM tra_random(shape => [2], dtype => '{name}')")
    assert db.tensors() == []


def test_bad_names_and_tiles(db):
    with pytest.raises(tra_sql.SpecError, match="not a valid tensor name"):
        db.from_numpy("drop table x", np.ones(3))
    with pytest.raises(tra_sql.ShapeError, match="tile"):
        db.from_numpy("A", np.ones((3, 3)), tile=(2,))
    with pytest.raises(tra_sql.ShapeError, match="tile"):
        db.from_numpy("A", np.ones((3, 3)), tile=(0, 1))
    with pytest.raises(tra_sql.ShapeError, match="empty"):
        db.from_numpy("A", np.ones((0, 3)))
    assert db.tensors() == []


def _corrupt(db, table):
    db.engine.con.execute(f"UPDATE \"{table}\" SET tile = '\\x00\\x01'::BLOB WHERE k0 = 1 AND k1 = 0").fetchall()


def test_corrupt_tile_in_kernel(db, ab):
    _corrupt(db, "A")
    with pytest.raises(tra_sql.CorruptTileError, match=r"tile \(1, 0\) of tensor 'A' holds 2 bytes"):
        db.einsum("ij,jk->ik", *ab).numpy()


def test_corrupt_tile_on_read(db, ab):
    _corrupt(db, "A")
    with pytest.raises(tra_sql.CorruptTileError, match="'A'"):
        db.tensor("A").numpy()
    db.engine.con.execute("UPDATE \"B\" SET tile = NULL WHERE k0 = 1 AND k1 = 0").fetchall()
    with pytest.raises(tra_sql.CorruptTileError, match="NULL"):
        db.tensor("B").numpy()


def test_failed_store_leaves_nothing(db, ab):
    _corrupt(db, "B")
    with pytest.raises(tra_sql.CorruptTileError):
        db.einsum("ij,jk->ik", *ab).store("C")
    assert db.tensors() == ["A", "B"]
    assert db.engine.con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'C'").fetchall() == [(0,)]


def test_failed_replace_keeps_old(db, ab):
    db.einsum("ij,jk->ik", *ab).store("C")
    _corrupt(db, "A")
    with pytest.raises(tra_sql.CorruptTileError):
        db.einsum("ij,jk->ik", *ab).store("C", replace=True)
    np.testing.assert_array_equal(db.tensor("C").numpy(), np.full((4, 5), 3.0))


def test_store_over_plain_table_refused(db, ab):
    db.engine.con.execute("CREATE TABLE C (x INTEGER)").fetchall()
    with pytest.raises(tra_sql.TensorExistsError, match="'C'"):
        db.einsum("ij,jk->ik", *ab).store("C")


def test_all_errors_are_tra_errors():
    for cls in (tra_sql.SpecError, tra_sql.ShapeError, tra_sql.DTypeError, tra_sql.UnknownTensorError,
                tra_sql.CorruptTileError, tra_sql.TensorExistsError, tra_sql.ExecutionError,
                tra_sql.SessionClosedError, tra_sql.StaleTensorError):
        assert issubclass(cls, tra_sql.TraError)


def test_a_closed_session_and_its_tensors_say_so(tmp_path):
    db = tra_sql.connect(str(tmp_path / "t.duckdb"))
    A = db.from_numpy("A", np.ones((4, 3)), tile=(2, 2))
    db.close()
    db.close()  # again: nothing
    assert repr(db).endswith("t.duckdb> (closed)>")
    for use in (A.numpy, db.tensors, lambda: db.sql("SELECT 1"), lambda: db.einsum("ij->i", A).numpy(),
                lambda: db.from_numpy("B", np.ones(3)), lambda: A.store("C")):
        with pytest.raises(tra_sql.SessionClosedError, match=r"the session on <tra_sql DuckDB database .*t\.duckdb> "
                                                             r"is closed"):
            use()
    with tra_sql.connect(str(tmp_path / "t.duckdb")) as again:  # the database itself is as it was
        np.testing.assert_array_equal(again.tensor("A").numpy(), np.ones((4, 3)))


def test_a_handle_to_a_replaced_tensor_is_stale_not_misread(db):
    """Replacing a tensor under its name with one of another dtype (same bytes per tile) made an
    old handle read the new int64 tiles as float64: a wrong answer without an error."""
    A = db.from_numpy("A", np.arange(16.0).reshape(4, 4), tile=(2, 2))
    rows = db.einsum("ij->i", A)
    db.from_numpy("A", np.arange(16).reshape(4, 4) * 7, tile=(2, 2), replace=True)
    mixed = db.einsum("ij,ij->i", db.tensor("A"), A)  # the new handle first: the stale one is still seen
    for use in (A.numpy, rows.numpy, A.arrow, lambda: rows.store("R"), lambda: rows.numpy(plan=db.plan(rows)),
                mixed.numpy):
        with pytest.raises(tra_sql.StaleTensorError, match=r"tensor 'A' was replaced .* now int64 \(4, 4\) in tiles "
                                                           r"of \(2, 2\) \(dense\), the handle's float64"):
            use()
    assert "R" not in db.tensors()
    np.testing.assert_array_equal(db.tensor("A").numpy(), np.arange(16).reshape(4, 4) * 7)  # a new handle reads it
    db.from_numpy("A", np.arange(16.0).reshape(4, 4) + 1, tile=(2, 2), replace=True)  # the same geometry: not stale
    np.testing.assert_array_equal(rows.numpy(), (np.arange(16.0).reshape(4, 4) + 1).sum(axis=1))


def test_operand_from_other_session(ab):
    with tra_sql.connect() as other:
        with pytest.raises(tra_sql.TraError, match="another session"):
            other.einsum("ij->i", ab[0])


def test_import_beyond_memory_limit_is_an_execution_error_and_leaves_nothing(tmp_path):
    db = tra_sql.connect(str(tmp_path / "small.duckdb"), memory_limit="2MB")
    with pytest.raises(tra_sql.ExecutionError, match="storing 'X'.*Out of Memory"):
        db.from_numpy("X", np.ones((2048, 512), np.float32), tile=(256, 512))
    assert "X" not in db.tensors()
    assert not db.engine.con.execute("SELECT * FROM duckdb_tables() WHERE table_name = 'X'").fetchall()
