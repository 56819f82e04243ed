"""CSR tiles: sparse matrices kept as their nonzeros, and sparse-dense products over them."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql.udfs import sparse


def edge_table(db, rng, shape, nnz, name="edges"):
    """A table of ``nnz`` random (dst, src, w) rows, duplicates included; and its dense sum."""
    dst, src = rng.integers(0, shape[0], nnz), rng.integers(0, shape[1], nnz)
    w = rng.standard_normal(nnz)
    db.engine.con.register("_rows", pa.table({"dst": dst, "src": src, "w": w}))
    db.engine.con.execute(f'CREATE OR REPLACE TABLE "{name}" AS SELECT * FROM _rows').fetchall()
    db.engine.con.unregister("_rows")
    dense = np.zeros(shape)
    np.add.at(dense, (dst, src), w)
    return dense


def test_encode_decode_roundtrip(rng):
    rows, cols = rng.integers(0, 5, 12), rng.integers(0, 7, 12)
    values = rng.standard_normal(12).astype(np.float32)
    buf = sparse.encode(rows, cols, values, (5, 7))
    assert len(buf) == sparse.nbytes(5, 12, 4)
    tile = sparse.CSRTile.decode(buf, (5, 7), np.dtype(np.float32))
    expected = np.zeros((5, 7), np.float32)
    np.add.at(expected, (rows, cols), values)
    decoded = np.zeros((5, 7), np.float32)
    np.add.at(decoded, (np.repeat(np.arange(5), np.diff(tile.indptr)), tile.indices), tile.data)
    np.testing.assert_allclose(decoded, expected, rtol=1e-6)
    assert sparse.CSRTile.decode(buf[:-4], (5, 7), np.dtype(np.float32)) is None
    assert sparse.CSRTile.decode(buf, (5, 6), np.dtype(np.float32)) is None or cols.max() < 6


def test_csr_relation_and_store(db, rng, tmp_path):
    dense = edge_table(db, rng, (50, 40), 300)
    A = db.relation("edges", ("dst", "src"), "w", (50, 40), name="A", layout="csr", tile=(16, 40))
    assert A.tile == (16, 40) and A.node.layout == "csr" and A.arrow().num_rows == 4
    np.testing.assert_allclose(A.numpy(), dense)
    stored = A.store("A_stored")
    assert stored.node.layout == "csr"
    assert db.sql("SELECT layout FROM tra_tensors WHERE name = 'A_stored'").fetchall() == [("csr",)]
    np.testing.assert_allclose(stored.numpy(), dense)


@pytest.mark.parametrize("spec", ["vu,uf->vf", "vu,vf->uf", "vu,fu->fv", "vu,ufg->gvf", "vu,v->u", "uv,ufg->vgf"])
def test_sparse_dense_products(db, rng, spec):
    shape = (37, 29)
    dense = edge_table(db, rng, shape, 200)
    A = db.relation("edges", ("dst", "src"), "w", shape, name="A", layout="csr", tile=(10, 29))
    sub = spec.split(",")[1].split("-")[0]
    sizes = dict(zip(spec[:2], shape)) | {"f": 6, "g": 3}
    x = rng.standard_normal([sizes[c] for c in sub])
    X = db.from_numpy("X", x, tile=tuple(max(1, sizes[c] // 2) for c in sub))
    Y = db.einsum(spec, A, X)
    assert '"layouts":["csr","dense"]' in Y.sql()
    np.testing.assert_allclose(Y.numpy(), np.einsum(spec, dense, x), rtol=1e-10, atol=1e-10)


def test_other_einsums_run_over_the_entries(db, rng):
    """Elements that are not entries take no part (as absent rows of a relation do not); a
    result subscripted like the CSR operand has its entries."""
    dense = edge_table(db, rng, (12, 9), 40)
    A = db.relation("edges", ("dst", "src"), "w", (12, 9), name="A", layout="csr", tile=(5, 4))
    b = rng.standard_normal((12, 9))
    B = db.from_numpy("B", b, tile=(5, 4))
    count = np.zeros((12, 9))
    np.add.at(count, tuple(np.array(db.sql("SELECT dst, src FROM edges").fetchall()).T), 1)
    np.testing.assert_allclose(db.einsum("ab->ba", A).numpy(), dense.T)
    np.testing.assert_allclose(db.einsum("ab,ab->a", A, B).numpy(), (dense * b).sum(1))
    top = db.einsum("ab,ab->ab", A, B, join="greatest(x0, x1)")
    assert top.node.layout == "csr"
    # each entry (duplicates too) gives max(w, b); the result's entries add up when assembled
    expected = np.zeros((12, 9))
    for (r, c, w) in db.sql("SELECT dst, src, w FROM edges").fetchall():
        expected[r, c] += max(w, b[r, c])
    np.testing.assert_allclose(top.numpy(), expected)
    np.testing.assert_allclose(db.einsum("ab,ab->", A, B, join="x1").numpy(), (count * b).sum())
    sampled = db.einsum("ab,ac,bc->ab", A, B[:, :3], B[:9, :3], join="x1 * x2")   # a sampled product
    np.testing.assert_allclose(sampled.numpy(), (count > 0) * count * (b[:, :3] @ b[:9, :3].T))


def test_an_epilogue_over_a_csr_operand_runs_at_its_entries(db, rng):
    """A product whose element-wise consumer joins a CSR relation laid out otherwise (so the
    consumer is dense and fused into the product) gives, at the entries, the product plus the
    entry, and zero elsewhere: the same as the two steps run apart."""
    dense = edge_table(db, rng, (9, 9), 20)
    A = db.relation("edges", ("dst", "src"), "w", (9, 9), name="A", layout="csr", tile=(4, 4))
    x, w = rng.standard_normal((9, 5)), rng.standard_normal((5, 9))
    product = db.einsum("ik,kj->ij", db.from_numpy("X", x, tile=(4, 5)), db.from_numpy("W", w, tile=(5, 4)))
    fused = db.einsum("ij,ji->ij", product, A, join="x0 + x1")
    assert fused.node.layout == "dense" and '"epilogue"' in fused.program().sql()
    count = np.zeros((9, 9))
    np.add.at(count, tuple(np.array(db.sql("SELECT dst, src FROM edges").fetchall()).T), 1)
    expected = np.where(count.T > 0, count.T * (x @ w) + dense.T, 0)  # each entry (duplicates too) once
    np.testing.assert_allclose(fused.numpy(), expected, atol=1e-12)


def test_csr_operands_must_share_their_entries(db, rng):
    edge_table(db, rng, (6, 6), 10)
    A = db.relation("edges", ("dst", "src"), "w", (6, 6), name="A", layout="csr")
    B = db.relation("edges", ("dst", "src"), None, (6, 6), name="B", layout="csr")
    np.testing.assert_allclose(db.einsum("ab,ab->ab", A, B, join="x0 * x1").numpy(), A.numpy())
    db.engine.con.execute("CREATE TABLE other AS SELECT (dst + 1) % 6 AS dst, src, w FROM edges").fetchall()
    C = db.relation("other", ("dst", "src"), "w", (6, 6), name="C", layout="csr")
    with pytest.raises(tra_sql.ShapeError, match="different nonzero patterns"):
        db.einsum("ab,ab->ab", A, C, join="x0 * x1").numpy()
    with pytest.raises(tra_sql.ShapeError, match="subscripted alike"):
        db.einsum("ab,ba->ab", A, B, join="x0 * x1").numpy()


def test_gradient_through_a_csr_product(db, rng):
    dense = edge_table(db, rng, (30, 30), 120)
    A = db.relation("edges", ("dst", "src"), "w", (30, 30), name="A", layout="csr")
    x, w = rng.standard_normal((30, 5)), rng.standard_normal((5, 4))
    X, W = db.from_numpy("X", x), db.from_numpy("W", w)
    H = db.einsum("vu,uf,fg->vg", A, X, W)
    loss = db.einsum("vg,vg->", H, H)
    (grad,) = db.grad(loss, [W])
    expected = 2 * (dense @ x).T @ (dense @ x @ w)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-9)


def test_gradients_through_a_csr_product_with_every_tile(db, rng):
    """An adjacency with a tile at every key: its product's dense tiles are all present, so
    the backward needs no key filters, and the two gradients reaching H add in a join."""
    dense = edge_table(db, rng, (30, 30), 120)
    A = db.relation("edges", ("dst", "src"), "w", (30, 30), name="A", layout="csr", tile=(10, 30))
    x, w, b = rng.standard_normal((30, 5)), rng.standard_normal((5, 4)), rng.standard_normal(4)
    W, B = db.from_numpy("W", w), db.from_numpy("B", b)
    pre = db.einsum("vu,uf,fg->vg", A, db.from_numpy("X", x), W)
    H = db.einsum("vg,g->vg", pre, B, join="greatest(x0 + x1, 0)")
    ctx = db.gradient_context()
    assert ctx.complete(A.node) and not ctx.dense(A.node) and ctx.dense(pre.node)
    loss = db.einsum("vg,vg->", H, db.einsum("vg->vg", H, join="tanh(x0)"))  # H read twice
    dW, dB = db.grad(loss, [W, B])
    assert "TRA_PLACE" not in dW.sql() and "TRA_PLACE" not in dB.sql()
    ax = dense @ x
    h = np.maximum(ax @ w + b, 0)
    g = (np.tanh(h) + h * (1 - np.tanh(h) ** 2)) * (h > 0)  # d(h tanh h)/dh through the ReLU
    np.testing.assert_allclose(dW.numpy(), ax.T @ g, rtol=1e-9)
    np.testing.assert_allclose(dB.numpy(), g.sum(0), rtol=1e-9)


def test_gradient_of_relu_over_a_csr_product_with_absent_tiles(db, rng):
    """A GCN layer whose adjacency lacks a row block: the product has no tiles there, and the
    bias + ReLU reads them as zeros (``tra_sql.absent``), as NumPy does on the dense arrays;
    so do its gradients."""
    dense = edge_table(db, rng, (30, 30), 120)
    db.engine.con.execute("DELETE FROM edges WHERE dst BETWEEN 10 AND 19").fetchall()
    dense[10:20] = 0
    A = db.relation("edges", ("dst", "src"), "w", (30, 30), name="A", layout="csr", tile=(10, 30))
    x, w, b = rng.standard_normal((30, 5)), rng.standard_normal((5, 4)), rng.standard_normal(4)
    W, B = db.from_numpy("W", w), db.from_numpy("B", b)
    pre = db.einsum("vu,uf,fg->vg", A, db.from_numpy("X", x), W)
    H = db.einsum("vg,g->vg", pre, B, join="greatest(x0 + x1, 0)")
    dW, dB = db.grad(db.einsum("vg->", H, join="x0 * x0"), [W, B])
    h = np.maximum(dense @ x @ w + b, 0)
    np.testing.assert_allclose(H.numpy(), h, rtol=1e-12)
    np.testing.assert_allclose(dW.numpy(), (dense @ x).T @ (2 * h), rtol=1e-9)
    np.testing.assert_allclose(dB.numpy(), (2 * h).sum(0), rtol=1e-9)


def test_gradient_of_a_sampled_product_exists_at_the_entries(db, rng):
    """A CSR operand the join does not read still restricts the gradient to its entries."""
    edge_table(db, rng, (8, 7), 20)
    M = db.relation("edges", ("dst", "src"), None, (8, 7), name="M", layout="csr")
    mask = M.numpy()
    p, q = rng.standard_normal((8, 3)), rng.standard_normal((7, 3))
    P, Q = db.from_numpy("P", p), db.from_numpy("Q", q)
    dot = db.einsum("ui,uk,ik->ui", M, P, Q, join="x1 * x2")
    loss = db.einsum("ui->", dot)
    dP, dQ = db.grad(loss, [P, Q])
    np.testing.assert_allclose(loss.numpy(), (mask * (p @ q.T)).sum())
    np.testing.assert_allclose(dP.numpy(), mask @ q)
    np.testing.assert_allclose(dQ.numpy(), mask.T @ p)


def test_csr_errors(db, rng):
    edge_table(db, rng, (10, 10), 30)
    with pytest.raises(tra_sql.ShapeError, match="two key columns"):
        db.relation("edges", ("dst",), "w", (10,), name="bad", layout="csr")
    with pytest.raises(tra_sql.SpecError, match="layout"):
        db.relation("edges", ("dst", "src"), "w", (10, 10), name="bad", layout="coo")
    A = db.relation("edges", ("dst", "src"), "w", (10, 10), name="A", layout="csr", tile=(5, 10))
    X = db.from_numpy("X", np.ones((10, 3)), tile=(3, 3))
    with pytest.raises(tra_sql.ShapeError, match="csr"):
        A.retile((2, 2))
    assert db.einsum("vu,uf->vf", A, X).node.operands[0] is A.node    # X is re-tiled, not A
    db.engine.con.execute("CREATE TABLE broken AS SELECT k0, k1, tile[:20] AS tile FROM A").fetchall()
    db.engine.con.execute("INSERT INTO tra_tensors VALUES ('broken', 'float64', [10, 10], [5, 10], 'csr')").fetchall()
    with pytest.raises(tra_sql.CorruptTileError, match="'broken' is not a CSR tile"):
        db.einsum("vu,uf->vf", db.tensor("broken"), X).numpy()
    with pytest.raises(tra_sql.CorruptTileError, match="'broken'"):
        db.tensor("broken").numpy()


def test_csr_tensors_in_sql(db, rng):
    dense = edge_table(db, rng, (6, 5), 12)
    db.relation("edges", ("dst", "src"), "w", (6, 5), name="A", layout="csr")
    db.from_numpy("X", np.ones((5, 2)))
    db.sql("CREATE TENSOR S AS SELECT * FROM A")
    assert db.tensor("S").node.layout == "csr"
    np.testing.assert_allclose(db.tensor("S").numpy(), dense)
    db.sql("CREATE TENSOR Y AS SELECT * FROM einsum('vu,uf->vf', S, X)")
    np.testing.assert_allclose(db.tensor("Y").numpy(), dense @ np.ones((5, 2)))
    with pytest.raises(tra_sql.SQLError, match="dense tiles"):
        db.sql("SELECT * FROM tra_elements(S)")


def test_catalog_without_layout_column_is_upgraded(tmp_path):
    path = str(tmp_path / "old.duckdb")
    import duckdb
    con = duckdb.connect(path)
    con.execute("CREATE TABLE tra_tensors (name VARCHAR PRIMARY KEY, dtype VARCHAR NOT NULL, "
                "shape BIGINT[] NOT NULL, tile_shape BIGINT[] NOT NULL)").fetchall()
    con.execute("CREATE TABLE v (k0 INTEGER, tile BLOB)").fetchall()
    con.execute("INSERT INTO v VALUES (0, ?)", [np.arange(3.0).tobytes()]).fetchall()
    con.execute("INSERT INTO tra_tensors VALUES ('v', 'float64', [3], [3])").fetchall()
    con.close()
    db = tra_sql.connect(path)
    np.testing.assert_array_equal(db.tensor("v").numpy(), np.arange(3.0))
    db.close()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_csr_products(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    rows, cols, feats = (data.draw(st.integers(1, 23)) for _ in range(3))
    spec = data.draw(st.sampled_from(["vu,uf->vf", "vu,vf->uf", "vu,fu->vf", "vu,vf->fu"]))
    tile = (data.draw(st.integers(1, rows)), data.draw(st.integers(1, cols)))
    dtype = data.draw(st.sampled_from(["float32", "float64"]))
    with tra_sql.connect() as db:
        dense = edge_table(db, rng, (rows, cols), data.draw(st.integers(0, 3 * rows)))
        A = db.relation("edges", ("dst", "src"), "w", (rows, cols), name="A", layout="csr", tile=tile, dtype=dtype)
        sub = spec.split(",")[1].split("-")[0]
        sizes = {"v": rows, "u": cols, "f": feats}
        x = rng.standard_normal([sizes[c] for c in sub])
        X = db.from_numpy("X", x, tile=tuple(data.draw(st.integers(1, sizes[c])) for c in sub))
        expected = np.einsum(spec, dense.astype(dtype).astype(np.float64), x)
        np.testing.assert_allclose(db.einsum(spec, A, X).numpy(), expected, rtol=1e-4, atol=1e-4)
