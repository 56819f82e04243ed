"""The SQL frontend: einsum(...) and friends in SQL, CREATE/DROP TENSOR, errors."""

import numpy as np
import pytest

import tra_sql
from tra_sql.errors import (
    ExecutionError,
    ShapeError,
    SpecError,
    SQLError,
    TensorExistsError,
    UnknownTensorError,
)
from tra_sql.frontend.rewrite import Rewriter


@pytest.fixture
def ab(db, rng):
    a = rng.standard_normal((5, 4))
    b = rng.standard_normal((4, 3))
    db.from_numpy("A", a, (2, 3))
    db.from_numpy("B", b, (2, 2))
    return a, b


def elements(db, sql: str, shape, dtype=np.float64) -> np.ndarray:
    """A dense array from the (i0, ..., value) rows of ``sql``."""
    out = np.zeros(shape, dtype=dtype)
    for *index, value in db.sql(sql).fetchall():
        out[tuple(index)] = value
    return out


# -- einsum in SQL ------------------------------------------------------------------------
def test_create_tensor_from_einsum(db, ab):
    a, b = ab
    assert db.sql("CREATE TENSOR C AS SELECT * FROM einsum('ij,jk->ik', A, B)") is None
    c = db.tensor("C")
    assert c.shape == (5, 3) and c.dtype == np.float64
    np.testing.assert_allclose(c.numpy(), a @ b)


def test_select_einsum_is_a_tensor_relation(db, ab):
    a, b = ab
    relation = db.sql("SELECT * FROM einsum('ij,jk->ik', A, B)")
    assert relation.columns == ["k0", "k1", "tile"]
    table = relation.to_arrow_table()
    info = tra_sql.catalog.TensorInfo("C", np.dtype("float64"), (5, 3), (2, 2))
    np.testing.assert_allclose(tra_sql.catalog.assemble(info, table), a @ b)
    assert len(relation.fetchall()) == 3 * 2


@pytest.mark.parametrize("arrow", ["=>", ":="])
def test_options_in_both_syntaxes(db, rng, arrow):
    h, bias = rng.standard_normal((6, 4)), rng.standard_normal(4)
    db.from_numpy("H", h, (4, 2))
    db.from_numpy("b", bias, (2,))
    db.sql(f"""CREATE TENSOR R AS SELECT * FROM einsum('bh,h->bh', H, b,
               "join" {arrow} 'greatest(x0 + x1, 0)')""")
    np.testing.assert_allclose(db.tensor("R").numpy(), np.maximum(h + bias, 0))
    db.sql(f"CREATE TENSOR M AS SELECT * FROM einsum('bh->b', H, agg {arrow} 'max')")
    np.testing.assert_allclose(db.tensor("M").numpy(), h.max(axis=1))
    db.sql(f"""CREATE TENSOR S AS SELECT * FROM einsum('bh,bh->b', H, H,
               "agg" {arrow} 'min', "join" {arrow} 'x0 - x1 * 2')""")
    np.testing.assert_allclose(db.tensor("S").numpy(), (-h).min(axis=1))


def test_issue_example_with_where_on_keys(db, rng):
    h, bias = rng.standard_normal((10, 3)), rng.standard_normal(3)
    db.from_numpy("H", h, (2, 3))
    db.from_numpy("b", bias)
    rows = db.sql("""SELECT k0, k1 FROM einsum('bh,h->bh', H, b, "join" => 'greatest(x0 + x1, 0)')
                     WHERE k0 < 4 ORDER BY k0""").fetchall()
    assert rows == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_composes_with_plain_tables_and_ctes(db, ab):
    a, b = ab
    db.sql("CREATE TABLE labels (id INTEGER, label VARCHAR)")
    db.sql("INSERT INTO labels VALUES (0, 'top'), (2, 'bottom')")
    rows = db.sql("""
        WITH product AS (SELECT * FROM einsum('ij,jk->ik', A, B))
        SELECT l.label, p.k1, len(tra_tile_values(p.tile, 'float64')) AS n
        FROM product AS p JOIN labels AS l ON l.id = p.k0
        ORDER BY l.label, p.k1""").fetchall()
    assert rows == [("bottom", 0, 2), ("bottom", 1, 1), ("top", 0, 4), ("top", 1, 2)]
    joined = db.sql("""SELECT e.i0, e.i1, e.value FROM tra_elements(einsum('ij,jk->ik', A, B)) AS e
                       JOIN labels ON labels.id = e.i0 WHERE e.i1 = 2 ORDER BY e.i0""").fetchall()
    c = a @ b
    assert [r[:2] for r in joined] == [(0, 2), (2, 2)]
    np.testing.assert_allclose([r[2] for r in joined], [c[0, 2], c[2, 2]])


def test_two_einsums_in_one_statement(db, ab):
    a, b = ab
    rows = db.sql("""SELECT s.k0, len(tra_tile_values(s.tile, 'float64')) AS n
                     FROM einsum('ij->i', A) AS s JOIN einsum('ij,jk->i', A, B) AS p ON s.k0 = p.k0
                     ORDER BY s.k0""").fetchall()
    assert rows == [(0, 2), (1, 2), (2, 1)]
    total = elements(db, "SELECT * FROM tra_elements(einsum('ij,jk->i', A, B))", (5,))
    np.testing.assert_allclose(total, (a @ b).sum(axis=1))


def test_nested_einsum_and_operand_forms(db, ab, rng):
    a, b = ab
    v = rng.standard_normal(3)
    db.from_numpy("v", v)
    db.sql("CREATE TENSOR y AS SELECT * FROM einsum('ik,k->i', einsum('ij,jk->ik', A, 'B'), V)")
    np.testing.assert_allclose(db.tensor("y").numpy(), a @ b @ v)
    db.sql("""CREATE TENSOR t AS SELECT * FROM einsum('ij->ji', a)""")  # names are case-insensitive
    np.testing.assert_allclose(db.tensor("t").numpy(), a.T)


def test_three_operands_and_integers(db):
    x = np.arange(6, dtype=np.int64).reshape(2, 3)
    db.from_numpy("X", x, (1, 2))
    db.sql("CREATE TENSOR G AS SELECT * FROM einsum('ij,kj,kl->il', X, X, X)")
    assert db.tensor("G").dtype == np.int64
    np.testing.assert_array_equal(db.tensor("G").numpy(), x @ x.T @ x)


# -- CREATE / DROP TENSOR -----------------------------------------------------------------
def test_create_or_replace_if_not_exists_and_drop(db, ab):
    a, b = ab
    db.sql("CREATE TENSOR C AS SELECT * FROM einsum('ij,jk->ik', A, B)")
    with pytest.raises(SQLError, match="CREATE OR REPLACE TENSOR"):
        db.sql("CREATE TENSOR C AS SELECT * FROM A")
    db.sql("CREATE TENSOR IF NOT EXISTS C AS SELECT * FROM A")
    assert db.tensor("C").shape == (5, 3)
    db.sql("CREATE OR REPLACE TENSOR C AS SELECT * FROM einsum('ij->ji', A)")
    np.testing.assert_allclose(db.tensor("C").numpy(), a.T)
    assert db.sql("DROP TENSOR C") is None
    assert "C" not in db.tensors()
    assert db.sql("DROP TENSOR IF EXISTS C") is None
    with pytest.raises(UnknownTensorError, match="'C'"):
        db.sql("DROP TENSOR C")


def test_create_from_stored_tensor_with_where_keeps_shape(db, ab):
    a, _ = ab
    db.sql("CREATE TENSOR top AS SELECT * FROM A AS x WHERE x.k0 < 1 AND k1 IN (SELECT 0)")
    top = db.tensor("top")
    assert top.shape == a.shape and top.tile == (2, 3)
    expected = np.zeros_like(a)
    expected[:2, :3] = a[:2, :3]
    np.testing.assert_allclose(top.numpy(), expected)


def test_create_or_replace_reading_itself(db, ab):
    a, _ = ab
    db.sql("""CREATE OR REPLACE TENSOR A AS SELECT * FROM einsum('ij,ij->ij', A, A,
              "join" => 'x0 - 0.5 * x1')""")
    np.testing.assert_allclose(db.tensor("A").numpy(), 0.5 * a)
    assert "_tra_new_A" not in {r[0] for r in db.sql("SELECT table_name FROM duckdb_tables()").fetchall()}


@pytest.mark.parametrize("query", [
    "SELECT * FROM A JOIN B ON A.k0 = B.k0",
    "SELECT * FROM tra_elements(A)",
    "SELECT * FROM A WHERE k2 = 0",
    "SELECT * FROM A, B",
])
def test_create_tensor_rejects_other_queries(db, ab, query):
    with pytest.raises(tra_sql.TraError, match="statement 1"):
        db.sql(f"CREATE TENSOR Z AS {query}")
    assert "Z" not in db.tensors()


def test_create_tensor_is_all_or_nothing(db):
    with pytest.raises(ShapeError, match=r"element \(5, 0\) is outside the shape \(2, 2\)"):
        db.sql("CREATE TENSOR Z AS SELECT * FROM tra_from_elements((SELECT 5, 0, 1.0), shape => [2, 2])")
    assert "Z" not in db.tensors()
    assert db.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'Z'").fetchall() == [(0,)]


# -- tensors from SQL values and back -----------------------------------------------------
def test_tra_random(db):
    db.sql("CREATE TENSOR R AS SELECT * FROM tra_random(shape => [5, 3], tile => [2, 2], seed => 7)")
    db.sql("CREATE TENSOR S AS SELECT * FROM tra_random([5, 3], tile => [2, 2], seed => 7)")
    db.sql("CREATE TENSOR N AS SELECT * FROM tra_random([400], seed => 1, dist => 'normal', dtype => 'float32')")
    r = db.tensor("R").numpy()
    assert db.tensor("R").tile == (2, 2) and r.shape == (5, 3)
    assert ((r >= 0) & (r < 1)).all() and len(np.unique(r)) == r.size
    np.testing.assert_array_equal(r, db.tensor("S").numpy())
    n = db.tensor("N")
    assert n.dtype == np.float32 and abs(float(n.numpy().mean())) < 0.2 and n.numpy().min() < 0


def test_tra_from_elements(db):
    db.sql("CREATE TABLE edges (src INTEGER, dst INTEGER, w DOUBLE)")
    db.sql("INSERT INTO edges VALUES (0, 1, 2.0), (2, 0, 1.5), (2, 0, 1.0), (1, 1, -1.0)")
    db.sql("CREATE TENSOR E AS SELECT * FROM tra_from_elements(edges, shape => [3, 2], tile => [2, 2], "
           "duplicates => 'sum')")
    np.testing.assert_array_equal(db.tensor("E").numpy(), [[0, 2], [0, -1], [2.5, 0]])
    db.sql("""CREATE TENSOR V AS SELECT * FROM tra_from_elements(
              (VALUES (1, 7), (3, 9)), shape => [4], dtype => 'int32')""")
    assert db.tensor("V").dtype == np.int32
    np.testing.assert_array_equal(db.tensor("V").numpy(), [0, 7, 0, 9])
    rows = db.sql("SELECT * FROM einsum('ij,j->i', tra_from_elements(edges, shape => [3, 2], duplicates => 'sum'), "
                  "tra_from_elements((SELECT range, 1.0 FROM range(2)), shape => [2], tile => [1]))")
    assert len(rows.fetchall()) == 1


def test_tra_elements_matches_numpy(db, rng):
    for shape, tile in [((7,), (3,)), ((5, 4), (2, 3)), ((3, 4, 5), (2, 3, 2))]:
        x = rng.standard_normal(shape)
        db.from_numpy("X", x, tile, replace=True)
        np.testing.assert_array_equal(elements(db, "SELECT * FROM tra_elements(X)", shape), x)
    big = np.array([[2**62 + 1, -3], [5, 2**40]], dtype=np.int64)
    db.from_numpy("I", big, (1, 2))
    rows = db.sql("SELECT * FROM tra_elements(I) ORDER BY ALL").fetchall()
    assert rows == sorted([(0, 0, 2**62 + 1), (0, 1, -3), (1, 0, 5), (1, 1, 2**40)])


def test_tra_elements_skips_absent_tiles_and_tile_values(db):
    db.sql("""CREATE TENSOR D AS SELECT * FROM tra_from_elements((VALUES (0, 0, 1.0), (3, 3, 4.0)),
              shape => [4, 4], tile => [2, 2])""")
    assert db.sql("SELECT count(*) FROM tra_elements(D)").fetchall() == [(8,)]
    values = db.sql("SELECT tra_tile_values(tile, 'float64') FROM D WHERE k0 = 1").fetchall()
    assert values == [([0.0, 0.0, 0.0, 4.0],)]
    assert db.sql("SELECT tra_tile_ints(NULL, 'int32')").fetchall() == [(None,)]


# -- statements, passthrough, EXPLAIN, execute --------------------------------------------
def test_plain_sql_passes_through_unchanged(db, monkeypatch):
    def refuse(*_):
        raise AssertionError("plain SQL must not be parsed by sqlglot")

    monkeypatch.setattr(Rewriter, "parse", refuse)
    assert db.sql("FROM range(4) SELECT sum(range) AS s").fetchall() == [(6,)]
    assert db.sql("SELECT 'einsum(' AS s; SELECT 2 AS t").fetchall() == [(2,)]
    assert db.sql("SELECT ? + 1 AS x", params=[41]).fetchall() == [(42,)]
    with pytest.raises(ExecutionError, match="nosuch"):
        db.sql("SELECT * FROM nosuch")


def test_multiple_statements_run_in_order(db, ab):
    a, b = ab
    result = db.sql("""
        CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1), (2);
        CREATE TENSOR C AS SELECT * FROM einsum('ij,jk->ik', A, B);
        SELECT count(*) FROM t; SELECT count(*) AS n FROM C""")
    assert result.fetchall() == [(6,)]
    np.testing.assert_allclose(db.tensor("C").numpy(), a @ b)


def test_explain(db, ab):
    text = db.explain_sql("SELECT * FROM einsum('ij,jk->ik', A, B); SELECT 1")
    assert "tra_contract" in text.lower() and text.rstrip().endswith("SELECT 1;")
    rows = db.sql("EXPLAIN SELECT * FROM einsum('ij,jk->ik', A, B)").fetchall()
    assert len(rows) == 1 and "tra_contract" in rows[0][0].lower()
    analyzed = db.sql("EXPLAIN ANALYZE SELECT * FROM einsum('ij->i', A)").fetchall()
    assert analyzed[0][0] == "analyzed_plan" and "Total Time" in analyzed[0][1]
    assert "CREATE TABLE" in db.explain_sql("CREATE TENSOR Q AS SELECT * FROM A")
    assert "Q" not in db.tensors()


def test_execute_with_parameters(db, ab):
    a, b = ab
    cursor = db.execute("SELECT k0, k1 FROM einsum('ij,jk->ik', A, B) WHERE k0 = ? ORDER BY k1", [2])
    assert cursor.fetchall() == [(2, 0), (2, 1)]
    assert db.execute("SELECT 40 + ?", [2]).fetchall() == [(42,)]


# -- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("sql, error, fragment", [
    ("SELECT * FROM einsum('ij,jk->ik', A, Z)", UnknownTensorError, "no tensor named 'Z'"),
    ("SELECT * FROM einsum('ij,jk->iz', A, B)", SpecError, "output index 'z'"),
    ("SELECT * FROM einsum('ij,jk->ik', A, A)", ShapeError, "index 'j'"),
    ("SELECT * FROM einsum('ij,jk->ik', A, B, jion => 'x0')", SpecError, "no option 'jion'"),
    ("SELECT * FROM einsum('ij,jk->ik', A, B, \"join\" => 'x0 + x9')", SpecError, "x9"),
    ("SELECT * FROM einsum('ij,jk->ik', A, B, agg := 'mean')", SpecError, "agg='mean'"),
    ("SELECT * FROM einsum('ij,jk->ik', A, B, agg := max)", SpecError, "string literal"),
    ("SELECT * FROM einsum('ij,jk->ik', A, 3)", SQLError, "not a tensor name"),
    ("SELECT * FROM tra_random(shape => [2, 0])", ShapeError, "empty dimension"),
    ("SELECT * FROM tra_random(shape => [2], dist => 'cauchy')", SpecError, "dist"),
])
def test_errors_name_statement_and_call(db, ab, sql, error, fragment):
    with pytest.raises(error) as info:
        db.sql(sql)
    message = str(info.value)
    assert fragment in message
    assert message.startswith("statement 1 `SELECT * FROM ")
    call = sql[sql.index("FROM ") + 5 :]
    assert f"in {call.split('(')[0]}(" in message
    assert isinstance(info.value, tra_sql.TraError)


def test_error_in_later_statement_names_it(db, ab):
    with pytest.raises(UnknownTensorError, match=r"^statement 3 `SELECT \* FROM einsum\('ij->i', nope\)`"):
        db.sql("SELECT 1; CREATE TABLE t AS SELECT 1 AS x; SELECT * FROM einsum('ij->i', nope); SELECT 2")
    assert db.sql("SELECT x FROM t").fetchall() == [(1,)]


@pytest.mark.parametrize("sql, fragment", [
    ("SELECT * FROM einsum('ij->i' A)", "syntax error"),
    ("SELECT einsum('ij->i', A)", "is a table function"),
    ("SELEC 1", "syntax error"),
    ("CREATE TENSOR AS SELECT * FROM A", "CREATE [OR REPLACE] TENSOR"),
    ("DROP TENSOR A B", "DROP TENSOR [IF EXISTS] name"),
    ("SELECT * FROM tra_elements(A, B)", "takes one tensor"),
])
def test_malformed_sql(db, ab, sql, fragment):
    with pytest.raises(SQLError, match="statement") as info:
        db.sql(sql)
    assert fragment in str(info.value)


@pytest.mark.parametrize("sql, error, fragment", [
    ("SELECT * FROM einsum('ij->i', A, \"join\" => 'x0 +')", SpecError, "'x0 +' does not parse: Required"),
    ("SELECT * FROM einsum('ij->i', A, \"join\" => 'CASE')", SpecError, "does not parse: Expected END after CASE"),
    ("SELECT * FROM einsum('ij->i', A) WHERE (k0 = 1", SQLError, "syntax error at line 1, column 46"),
    ("SELECT * FROM einsum('ij->i', tra_random)", UnknownTensorError, "tra_random is a table function, not a "
                                                                      "tensor: call it, tra_random(...)"),
    ("CREATE TENSOR T AS SELECT * FROM TRA_FROM_ELEMENTS", UnknownTensorError, "TRA_FROM_ELEMENTS is a table "
                                                                               "function"),
])
def test_error_messages_are_plain_text(db, ab, sql, error, fragment):
    """No ANSI escape codes (sqlglot underlines the token with them), and a table function
    written without its parentheses is named as a function, not looked up as a tensor."""
    with pytest.raises(error) as info:
        db.sql(sql)
    assert fragment in str(info.value) and "\x1b" not in str(info.value)
    with pytest.raises(SpecError) as info:
        db.einsum("ij->i", "A", join="x0 +")
    assert "\x1b" not in str(info.value)


def test_existing_table_needs_replace(db, ab):
    db.sql("CREATE TABLE plain AS SELECT 1 AS x")
    with pytest.raises(SQLError, match="exists already"):
        db.sql("CREATE TENSOR plain AS SELECT * FROM A")
    db.sql("CREATE OR REPLACE TENSOR plain AS SELECT * FROM A")
    assert "plain" in db.tensors()
    assert issubclass(TensorExistsError, tra_sql.TraError)


def test_grad_in_sql(db):
    w = np.arange(6.0).reshape(2, 3)
    x = np.linspace(-1, 1, 6).reshape(3, 2)
    db.from_numpy("W", w, tile=(1, 2))
    db.from_numpy("X", x)
    db.sql("""CREATE TENSOR dW AS SELECT * FROM grad(einsum('ij,jk->', W, X, "join" => 'pow(x0 * x1, 2)'), W)""")
    # d/dW_ij of sum_ijk (W_ij X_jk)^2 = sum_k 2 W_ij X_jk^2
    np.testing.assert_allclose(db.tensor("dW").numpy(), 2 * w * (x**2).sum(axis=1))
    with pytest.raises(tra_sql.TraError, match="grad"):
        db.sql("SELECT * FROM grad(W)")
