"""Ordinary tables viewed as sparse tensor relations (views, no copies)."""

import numpy as np
import pytest

import tra_sql
from tra_sql import relations


@pytest.fixture
def edges(db):
    db.engine.con.execute("CREATE TABLE edges (dst INTEGER, src INTEGER, w DOUBLE)").fetchall()
    db.engine.con.execute("INSERT INTO edges VALUES (0, 1, 0.5), (1, 2, 2.0), (3, 0, -1.0), (2, 2, NULL), "
                   "(9, 0, 5.0)").fetchall()
    return db


def test_relation_is_a_view_of_the_table(edges):
    db = edges
    E = db.relation("edges", keys=("dst", "src"), value="w", shape=(4, 4))
    assert E.name == "edges_dst_src" and E.shape == (4, 4) and E.tile == (1, 1)
    views = db.engine.con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'edges_dst_src'").fetchall()
    assert views[0][0] == 1
    expected = np.zeros((4, 4))
    expected[0, 1], expected[1, 2], expected[3, 0] = 0.5, 2.0, -1.0   # NULL and out-of-shape rows left out
    np.testing.assert_array_equal(E.numpy(), expected)
    db.engine.con.execute("INSERT INTO edges VALUES (2, 3, 4.0)").fetchall()  # no copy: the view sees new rows
    expected[2, 3] = 4.0
    np.testing.assert_array_equal(E.numpy(), expected)
    x = db.from_numpy("x", np.arange(4.0))
    np.testing.assert_allclose(db.einsum("ij,j->i", E, x).numpy(), expected @ np.arange(4.0))


def test_relation_options(edges):
    db = edges
    A = db.relation("edges", ("dst", "src"), name="adjacency")       # value None: 1.0 per row
    assert A.shape == (10, 3)
    assert A.numpy().sum() == 5
    db.engine.con.execute("INSERT INTO edges VALUES (0, 1, 0.25)").fetchall()
    D = db.relation("edges", ("dst", "src"), "w", (4, 4), name="summed", sum_duplicates=True, dtype="float32")
    assert D.dtype == np.float32 and D.numpy()[0, 1] == pytest.approx(0.75)
    assert D.arrow().num_rows == 3
    B = db.relation("edges", ("dst", "src"), "w", (4, 4), name="blocked", tile=(3, 3))
    assert B.tile == (3, 3) and B.arrow().num_rows == 2                  # blocks (0, 0) and (1, 0)
    np.testing.assert_allclose(B.numpy(), D.numpy())
    v = db.relation("edges", "src", "w", (4,), name="by_src", sum_duplicates=True)
    np.testing.assert_allclose(v.numpy(), [4.0, 0.75, 2.0, 0.0])


def test_relation_errors_and_drop(edges):
    db = edges
    db.relation("edges", ("dst", "src"), "w", (4, 4))
    with pytest.raises(tra_sql.TensorExistsError):
        db.relation("edges", ("dst", "src"), "w", (4, 4))
    db.relation("edges", ("dst", "src"), "w", (5, 5), replace=True)
    assert db.tensor("edges_dst_src").shape == (5, 5)
    with pytest.raises(tra_sql.ShapeError):
        db.relation("edges", ("dst", "src"), "w", (4,), name="bad")
    with pytest.raises(tra_sql.SpecError):
        db.relation("edges", ("dst", "src"), "w", (4, 4), name="ints", dtype="int64")
    db.engine.con.execute("CREATE TABLE empty (a INTEGER)").fetchall()
    with pytest.raises(tra_sql.ShapeError, match="empty"):
        db.relation("empty", "a")
    with pytest.raises(tra_sql.UnknownTensorError, match="no table or view named 'edgez'"):
        db.relation("edgez", ("dst", "src"))
    for keys, value in ((("dst", "source"), "w"), (("dst", "src"), "weight")):  # shape given or not: checked
        with pytest.raises(tra_sql.SpecError, match=r"relation over 'edges': no column '(source|weight)' "
                                                    r"\(it has dst, src, w\)"):
            db.relation("edges", keys, value, name="cols")
        with pytest.raises(tra_sql.SpecError, match="no column"):
            db.relation("edges", keys, value, (4, 4), name="cols")
    assert db.relation("EDGES", ("DST", "Src"), "W", (4, 4), name="cased").shape == (4, 4)  # as SQL: any case
    relations.drop_relation(db, "edges_dst_src")
    assert "edges_dst_src" not in db.tensors()
    with pytest.raises(tra_sql.UnknownTensorError):
        relations.drop_relation(db, "edges_dst_src")


def test_relation_in_a_database_file(tmp_path):
    path = str(tmp_path / "rel.duckdb")
    with tra_sql.connect(path) as db:
        db.engine.con.execute("CREATE TABLE ratings AS SELECT * FROM (VALUES (0, 0, 4.0), (1, 2, 3.0)) "
                              "t(u, i, r)").fetchall()
        db.relation("ratings", ("u", "i"), "r", (2, 3))
    with tra_sql.connect(path) as db:
        relations.ensure_udfs(db)  # the view calls tra_pack, registered per connection
        np.testing.assert_array_equal(db.tensor("ratings_u_i").numpy(), [[4, 0, 0], [0, 0, 3]])


def test_features_keyed_by_id_join_dense_weights(db, rng):
    feats = rng.standard_normal((6, 4)) * (rng.random((6, 4)) < 0.5)
    rows = [(i, j, float(feats[i, j])) for i in range(6) for j in range(4) if feats[i, j]]
    db.engine.con.execute("CREATE TABLE feats (node INTEGER, feature INTEGER, value DOUBLE)").fetchall()
    db.engine.con.executemany("INSERT INTO feats VALUES (?, ?, ?)", rows)
    X = db.relation("feats", ("node", "feature"), "value", (6, 4), tile=(4, 4))
    W = db.from_numpy("W", rng.standard_normal((4, 3)))
    np.testing.assert_allclose(db.einsum("nf,fh->nh", X, W).numpy(), feats @ W.numpy())
