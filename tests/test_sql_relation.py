"""tra_relation(...): an ordinary table viewed as a tensor operand from SQL (db.relation's
options, nothing copied), in einsum and grad, against NumPy and db.relation."""

import numpy as np
import pytest

import tra_sql
from tra_sql.errors import ShapeError, SpecError, SQLError

EDGES = [(0, 1, 2.0), (1, 2, 3.0), (2, 0, -1.0), (3, 3, 0.5), (1, 2, 1.0)]
W = np.arange(12.0).reshape(4, 3) - 4


def dense(edges=EDGES, n=4):
    a = np.zeros((n, n))
    for s, d, w in edges:
        a[s, d] += w
    return a


@pytest.fixture
def db():
    with tra_sql.connect() as session:
        session.sql("CREATE TABLE edges (src INTEGER, dst INTEGER, w DOUBLE)")
        session.sql("INSERT INTO edges VALUES " + ", ".join(map(str, EDGES)))
        session.from_numpy("W", W, tile=(2, 3))
        yield session


def product(db, options: str) -> np.ndarray:
    db.sql(f"""CREATE OR REPLACE TENSOR Y AS SELECT * FROM einsum('vu,uf->vf',
               tra_relation(edges, keys => ['src', 'dst'], value => 'w'{options}), W)""")
    return db.tensor("Y").numpy()


@pytest.mark.parametrize("options", ["", ", shape => [4, 4]", ", layout => 'csr'", ", tile => [2, 2]",
                                     ", layout => 'csr', tile => [2, 4]", ", sum_duplicates => true",
                                     ", dtype => 'float32'"])
def test_sparse_dense_product_matches_numpy(db, options):
    np.testing.assert_allclose(product(db, options), dense() @ W, rtol=1e-6)


def test_same_as_the_python_api(db):
    python = db.relation("edges", ["src", "dst"], "w", layout="csr", name="R")
    in_sql = db.sql("SELECT k0, k1 FROM tra_relation('edges', keys => ['src', 'dst'], value => 'w', "
                    "layout => 'csr') ORDER BY ALL").fetchall()
    assert in_sql == db.sql("SELECT k0, k1 FROM R ORDER BY ALL").fetchall()
    np.testing.assert_allclose(product(db, ", layout => 'csr'"), db.einsum("vu,uf->vf", python, "W").numpy())


def test_reads_the_table_where_it_is_used(db):
    """Nothing is copied: a row added to the table shows in the next statement."""
    np.testing.assert_allclose(product(db, ", shape => [4, 4]"), dense() @ W)
    db.sql("INSERT INTO edges VALUES (3, 0, 10.0)")
    np.testing.assert_allclose(product(db, ", shape => [4, 4]"), dense([*EDGES, (3, 0, 10.0)]) @ W)
    assert not [t for (t,) in db.sql("SELECT table_name FROM duckdb_tables()").fetchall() if "relation" in t]


def test_no_value_is_one_per_row_and_vectors(db):
    rows = db.sql("SELECT * FROM tra_elements(einsum('u->', tra_relation(edges, keys => ['dst'], "
                  "value => NULL, shape => [4])))").fetchall()
    assert rows == [(5.0,)]


def test_grad_through_a_relation(db):
    db.sql("""CREATE TENSOR G AS SELECT * FROM grad(einsum('vu,uf->', tra_relation(edges, keys => ['src', 'dst'],
              value => 'w', layout => 'csr'), W, "join" => 'pow(x0 * x1, 2)'), W)""")
    # d/dW_uf sum_v,u,f (A_vu W_uf)^2 over the rows (entries) of the relation
    expected = np.zeros_like(W)
    for _src, d, w in EDGES:
        expected[d] += 2 * w * w * W[d]
    np.testing.assert_allclose(db.tensor("G").numpy(), expected)


@pytest.mark.parametrize("call, error, message", [
    ("tra_relation(edges)", SpecError, "keys =>"),
    ("tra_relation(edges, keys => ['src'], colour => 1)", SpecError, "no option 'colour'"),
    ("tra_relation(edges, keys => ['src', 'dst'], layout => 'coo')", SpecError, "layout 'coo'"),
    ("tra_relation(edges, keys => ['src'], layout => 'csr')", ShapeError, "two key columns"),
    ("tra_relation(edges, keys => ['src'], shape => [4, 4])", ShapeError, "1 key columns but shape"),
    ("tra_relation(edges, keys => ['src'], dtype => 'int32')", SpecError, "floating point"),
    ("tra_relation(1 + 1, keys => ['src'])", SQLError, "not a table name"),
    ("tra_relation(edges, keys => ['src'], sum_duplicates => 1)", SpecError, "true or false"),
])
def test_bad_calls(db, call, error, message):
    with pytest.raises(error, match=message):
        db.sql(f"CREATE TENSOR Z AS SELECT * FROM {call}")
    assert "Z" not in db.tensors()
