"""The generated SQL genuinely does the work: joins on tile keys, tile UDFs, GROUP BY."""

import numpy as np
import sqlglot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql.udfs.contract import TileEinsum


def flat(tensor) -> str:
    return tensor.program().sql(pretty=False)


def test_split_contraction_joins_and_groups(db):
    A = db.from_numpy("A", np.ones((6, 6)), tile=(3, 3))
    B = db.from_numpy("B", np.ones((6, 4)), tile=(3, 4))
    sql = flat(db.einsum("ij,jk->ik", A, B))
    tree = sqlglot.parse_one(sql, read="duckdb")
    join = tree.find(sqlglot.exp.Join)
    assert join is not None and join.args["on"].sql() == "x1.k0 = x0.k1"
    # one partial product per joined tile pair, then only the partials are aggregated
    assert "TRA_EINSUM_2(" in sql and "TRA_REDUCE(" in sql and "ARRAY_AGG(tile)" in sql and "GROUP BY k0, k1" in sql
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).numpy(), np.full((6, 4), 6.0))


def test_split_outer_contraction_aggregates_the_inputs(db):
    """Where the output tile holds more bytes than a joined row's input tiles, the inputs go
    through list() and the kernel runs per group."""
    A = db.from_numpy("A", np.ones((6, 6)), tile=(6, 1))
    B = db.from_numpy("B", np.ones((4, 6)), tile=(4, 1))
    C = db.einsum("ij,kj->ik", A, B)
    sql = flat(C)
    assert "TRA_EINSUM_AGG_2(" in sql and "ARRAY_AGG({'keys0': [x0.k0, x0.k1], 'tile0': x0.tile" in sql
    np.testing.assert_allclose(C.numpy(), np.full((6, 4), 6.0))


def test_unsplit_contraction_has_no_group_by(db):
    A = db.from_numpy("A", np.ones((6, 6)), tile=(3, 6))
    B = db.from_numpy("B", np.ones((6, 4)), tile=(6, 4))
    sql = flat(db.einsum("ij,jk->ik", A, B))
    assert "TRA_EINSUM_2(" in sql and "GROUP BY" not in sql and "JOIN" in sql


def test_diagonal_is_a_key_filter(db):
    X = db.from_numpy("X", np.ones((6, 6)), tile=(2, 2))
    sql = flat(db.einsum("ii->i", X))
    assert "WHERE x0.k1 = x0.k0" in sql


def test_mismatched_tiling_is_retiled_in_sql(db):
    A = db.from_numpy("A", np.ones((6, 6)), tile=(3, 3))
    B = db.from_numpy("B", np.ones((6, 4)), tile=(2, 4))
    C = db.einsum("ij,jk->ik", A, B)
    sql = flat(C)
    assert "TRA_PLACE(" in sql and "RANGE(0, 2)" in sql
    assert C.tile == (3, 4)


def test_multi_operand_follows_pairwise_path(db):
    ts = [db.from_numpy(n, np.ones((4, 4)), tile=(2, 2)) for n in "ABCD"]
    C = db.einsum("ij,jk,kl,lm->im", *ts)
    sql = flat(C)
    assert sql.count("TRA_REDUCE(") == 3 and "AS MATERIALIZED" in sql
    np.testing.assert_allclose(C.numpy(), np.full((4, 4), 64.0))


def test_shared_subexpression_computed_once(db):
    A = db.from_numpy("A", np.eye(3) * 2, tile=(2, 2))
    S = db.einsum("ij,jk->ik", A, A)
    T = db.einsum("ij,jk->ik", S, S)
    assert flat(T).count("TRA_REDUCE(") == 2
    np.testing.assert_allclose(T.numpy(), np.eye(3) * 16)


def test_explain_lists_steps(db):
    A = db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
    text = db.einsum("ij,jk->ik", A, A).explain()
    assert "einsum ij,jk->ik" in text and "tile=(2, 2)" in text and "SELECT" in text


def test_contractions_route_to_blas():
    assert TileEinsum(("ij", "jk"), "ik")._matmul_layout is not None
    assert TileEinsum(("bij", "bjk"), "bik")._matmul_layout is not None
    assert TileEinsum(("ij", "jk"), "ik", agg="max")._matmul_layout is None
    assert TileEinsum(("ii", "ik"), "ik")._matmul_layout is None


def test_identical_subprograms_are_merged(db):
    A = db.from_numpy("A", np.eye(3) * 2, tile=(2, 2))
    left = db.einsum("ij,jk->ik", A, A)
    right = db.einsum("ij,jk->ik", A, A)
    total = db.einsum("ij,ij->ij", left, right, join="x0 + x1")
    assert flat(total).count("TRA_REDUCE(") == 1
    np.testing.assert_allclose(total.numpy(), np.eye(3) * 8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 7), st.integers(1, 7), st.integers(1, 7), st.data())
def test_elementwise_epilogue_is_fused_into_the_contraction(b, i, h, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x, w, bias = rng.standard_normal((b, i)), rng.standard_normal((i, h)), rng.standard_normal(h)
    tile = lambda *dims: tuple(data.draw(st.integers(1, n)) for n in dims)
    with tra_sql.connect() as db:
        X, W, B = db.from_numpy("X", x, tile=tile(b, i)), db.from_numpy("W", w, tile=tile(i, h)), \
            db.from_numpy("B", bias, tile=tile(h))
        H = db.einsum("bh,h->bh", db.einsum("bi,ih->bh", X, W), B, join="greatest(x0 + x1, 0)")
        sql = flat(H)
        if H.tile[1] == W.tile[1]:  # no re-tiling between the steps: one fused step
            assert sql.count("TRA_EINSUM") == 1 and '"epilogue"' in sql
        np.testing.assert_allclose(H.numpy(), np.maximum(x @ w + bias, 0), rtol=1e-12, atol=1e-12)


def test_shared_contraction_is_not_fused(db):
    A = db.from_numpy("A", np.eye(3) * 2, tile=(2, 2))
    S = db.einsum("ij,jk->ik", A, A)
    T = db.einsum("ij,ij->ij", db.einsum("ij->ij", S, join="x0 + 1"), S, join="x0 * x1")
    assert '"epilogue"' not in flat(T)
    np.testing.assert_allclose(T.numpy(), (np.eye(3) * 4 + 1) * np.eye(3) * 4)
