"""CREATE TENSOR over any query of tiles: joins with ordinary tables, CTEs, unions, filters;
geometry from the tensors read or WITH (...) options; rows checked, all or nothing."""

import numpy as np
import pytest

import tra_sql
from tra_sql.errors import ShapeError, SpecError, SQLError

X = np.arange(30.0).reshape(6, 5)


@pytest.fixture
def db():
    with tra_sql.connect() as session:
        session.from_numpy("X", X, tile=(2, 2))
        session.sql("CREATE TABLE keep AS SELECT 0 AS k UNION ALL SELECT 2")
        yield session


def rows(*blocks):
    out = np.zeros_like(X)
    for b in blocks:
        out[2 * b : 2 * b + 2] = X[2 * b : 2 * b + 2]
    return out


@pytest.mark.parametrize("query", [
    "SELECT X.* FROM X JOIN keep ON X.k0 = keep.k",
    "WITH kept AS (SELECT * FROM X WHERE k0 IN (SELECT k FROM keep)) SELECT * FROM kept",
    "SELECT * FROM X WHERE k0 = 0 UNION ALL SELECT * FROM X WHERE k0 = 2",
    "SELECT k1, tile, k0 FROM X WHERE k0 <> 1 ORDER BY k0",
    "SELECT * FROM einsum('ij->ij', X) WHERE tile IS NOT NULL AND k0 IN (0, 2)",
])
def test_any_query_of_tiles(db, query):
    db.sql(f"CREATE TENSOR K AS {query}")
    k = db.tensor("K")
    assert (k.shape, k.tile, k.dtype) == ((6, 5), (2, 2), np.float64)
    np.testing.assert_array_equal(k.numpy(), rows(0, 2))
    np.testing.assert_array_equal(db.einsum("ij->j", k).numpy(), rows(0, 2).sum(axis=0))


def test_options_give_the_geometry(db):
    db.sql("""CREATE TENSOR H WITH (shape := [2, 3], dtype := 'float32', tile := [1, 2]) AS
              SELECT * FROM (VALUES (0, 1, '\\x00\\x00\\x80\\x3f'::BLOB),
                                    (1, 0, '\\x00\\x00\\x00\\x40\\x00\\x00\\x40\\x40'::BLOB))
              AS t(k0, k1, tile)""")
    h = db.tensor("H")
    assert (h.shape, h.tile, h.dtype) == ((2, 3), (1, 2), np.float32)
    np.testing.assert_array_equal(h.numpy(), [[0, 0, 1], [2, 3, 0]])


def test_replace_reading_itself_and_explain(db):
    text = "CREATE OR REPLACE TENSOR X AS SELECT X.* FROM X JOIN keep ON X.k0 = keep.k"
    assert "rows checked" in db.explain_sql(text) and "X" in db.tensors()
    db.sql(text)
    np.testing.assert_array_equal(db.tensor("X").numpy(), rows(0, 2))
    assert not [t for t in db.sql("SELECT table_name FROM duckdb_tables()").fetchall() if "_tra_new" in t[0]]


@pytest.mark.parametrize("query, error, message", [
    ("SELECT * FROM X JOIN keep ON X.k0 = keep.k", SQLError, "columns k0, k1, tile .* got k0, k1, tile, k"),
    ("SELECT k0::VARCHAR AS k0, k1, tile FROM X", SQLError, "key column k0 is string"),
    ("SELECT k0, k1, 1 AS tile FROM X", SQLError, "column tile is int32, not a BLOB"),
    ("SELECT * FROM X UNION ALL SELECT * FROM X WHERE k0 = 2", SQLError, r"tile \(2, 0\) is stored 2 times"),
    ("SELECT k0 + 1 AS k0, k1, tile FROM X", ShapeError, r"outside the grid \(3, 3\)"),
    ("SELECT k0, k1, NULL::BLOB AS tile FROM X", SQLError, "is NULL"),
    ("SELECT NULL::INTEGER AS k0, k1, tile FROM X", SQLError, "NULL key"),
    # a ragged edge tile (row block 2 of a 6-row tensor is 2 rows; column block 2 is 1 column)
    ("SELECT k0, k1, CASE WHEN k1 = 2 THEN tile || tile ELSE tile END AS tile FROM X", ShapeError,
     r"tile \(0, 2\) holds 32 bytes; shape \(2, 1\) and dtype float64 need 16"),
    ("SELECT k0, k1, tile FROM X WHERE k0 = 0 UNION ALL SELECT k0, k1, tile FROM "
     "einsum('ij->ij', X, \"join\" => 'x0 * 2') WHERE k0 = 2", None, None),
])
def test_wrong_rows_are_refused_and_nothing_is_written(db, query, error, message):
    before = db.tensors()
    if error is None:
        db.sql(f"CREATE TENSOR K AS {query}")
        np.testing.assert_array_equal(db.tensor("K").numpy()[4:], 2 * X[4:])
        return
    with pytest.raises(error, match=message):
        db.sql(f"CREATE TENSOR K AS {query}")
    assert db.tensors() == before
    assert db.sql("SELECT count(*) FROM duckdb_tables() WHERE lower(table_name) LIKE '%k'").fetchall() == [(0,)]


def test_geometry_must_be_known(db):
    db.from_numpy("Y", np.ones((6, 4)))
    with pytest.raises(SQLError, match=r"shapes \(6, 5\), \(6, 4\); give WITH \(shape := \[...\]\)"):
        db.sql("CREATE TENSOR K AS SELECT * FROM X UNION ALL SELECT * FROM Y")
    with pytest.raises(SQLError, match="reads no tensor; give WITH"):
        db.sql("CREATE TENSOR K AS SELECT 0 AS k0, ''::BLOB AS tile")
    with pytest.raises(SpecError, match="CREATE TENSOR has no option 'size'"):
        db.sql("CREATE TENSOR K WITH (size := [2]) AS SELECT * FROM X")
    with pytest.raises(SQLError, match="not one of"):
        db.sql("CREATE TENSOR K WITH (layout := 'coo') AS SELECT * FROM X")
    assert "K" not in db.tensors()
