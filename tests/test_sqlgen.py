"""The generated SQL genuinely does the work: joins on tile keys, tile UDFs, GROUP BY."""

import numpy as np
import pytest
import sqlglot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql import nn
from tra_sql.compile import chain, passes
from tra_sql.compile.program import Program
from tra_sql.tensor import Tensor
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
    # DuckDB: one fused aggregate, each joined tile pair's product added into its output tile
    assert "TRA_CONTRACT_AGG_FLOAT64(" in sql and "GROUP BY x0.k0, x1.k1" in sql and "TRA_REDUCE" not in sql
    with passes.fusions(off={"contractions"}):
        sql = flat(db.einsum("ij,jk->ik", A, B))
    # else one partial product per joined tile pair, then only the partials are aggregated (a whole-tile reduction)
    assert "TRA_CONTRACT_2(" in sql and "TRA_REDUCE_SUM_FLOAT64(" in sql and "GROUP BY k0, k1" in sql
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).numpy(), np.full((6, 4), 6.0))


def test_split_outer_contraction_aggregates_the_inputs(db):
    """Where the output tile holds more bytes than a joined row's input tiles, the inputs go
    through list() and the kernel runs per group."""
    A = db.from_numpy("A", np.ones((6, 6)), tile=(6, 1))
    B = db.from_numpy("B", np.ones((4, 6)), tile=(4, 1))
    C = db.einsum("ij,kj->ik", A, B)
    assert "TRA_CONTRACT_AGG_FLOAT64(" in flat(C)  # DuckDB: the fused aggregate either way
    with passes.fusions(off={"contractions"}):
        sql = flat(C)
    assert "TRA_EINSUM_AGG_2(" in sql and "ARRAY_AGG({'keys0': [x0.k0, x0.k1], 'tile0': x0.tile" in sql
    np.testing.assert_allclose(C.numpy(), np.full((6, 4), 6.0))


def test_unsplit_contraction_has_no_group_by(db):
    A = db.from_numpy("A", np.ones((6, 6)), tile=(3, 6))
    B = db.from_numpy("B", np.ones((6, 4)), tile=(6, 4))
    sql = flat(db.einsum("ij,jk->ik", A, B))
    assert "TRA_CONTRACT_2(" in sql and "GROUP BY" not in sql and "JOIN" in sql


def test_diagonal_is_a_key_filter(db):
    X = db.from_numpy("X", np.ones((6, 6)), tile=(2, 2))
    sql = flat(db.einsum("ii->i", X))
    assert "WHERE x0.k1 = x0.k0" in sql


def test_mismatched_tiling_is_retiled_in_sql(db):
    A = db.from_numpy("A", np.ones((6, 6)), tile=(3, 3))
    B = db.from_numpy("B", np.ones((6, 4)), tile=(2, 4))
    C = db.einsum("ij,jk->ik", A, B)
    sql = flat(C)
    assert "TRA_PLACE_AGG(" in sql and "RANGE(0, 2)" in sql
    assert C.tile == (3, 4)


def test_multi_operand_follows_pairwise_path(db):
    ts = [db.from_numpy(n, np.ones((4, 4)), tile=(2, 2)) for n in "ABCD"]
    C = db.einsum("ij,jk,kl,lm->im", *ts)
    sql = flat(C)
    assert sql.count("TRA_CONTRACT_AGG") == 3 and "AS MATERIALIZED" in sql
    np.testing.assert_allclose(C.numpy(), np.full((4, 4), 64.0))


def test_shared_subexpression_computed_once(db):
    A = db.from_numpy("A", np.eye(3) * 2, tile=(2, 2))
    S = db.einsum("ij,jk->ik", A, A)
    T = db.einsum("ij,jk->ik", S, S)
    assert flat(T).count("TRA_CONTRACT_AGG") == 2
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
    assert flat(total).count("TRA_CONTRACT_AGG_FLOAT64(") == 1
    np.testing.assert_allclose(total.numpy(), np.eye(3) * 8)


def test_identical_nodes_are_merged_before_fusion(db):
    """Built twice, a product is still one step: neither copy is fused into its own consumer
    (which would compute it twice, in two kernels that may round differently)."""
    A = db.from_numpy("A", np.arange(9.0).reshape(3, 3) / 7, tile=(2, 2))
    left, right = (db.einsum("ij,jk->ik", A, A) for _ in range(2))
    total = db.einsum("ij,ij->ij", db.einsum("ij->ij", left, join="x0 + 1"), right, join="x0 * x1")
    sql = flat(total)
    assert sql.count("TRA_CONTRACT_AGG_FLOAT64(") == 1 and '"epilogue"' not in sql
    a = np.arange(9.0).reshape(3, 3) / 7
    np.testing.assert_allclose(total.numpy(), (a @ a + 1) * (a @ a), rtol=1e-12)


def test_nodes_differing_in_any_field_are_not_merged(db):
    A = db.from_numpy("A", np.arange(6.0).reshape(2, 3), tile=(1, 3))
    parts = [db.einsum("ij->ij", A, join="x0 + 1"), db.einsum("ij->ij", A, join="x0 + 2"),
             db.full((2, 3), 0.0), db.full((2, 3), -0.0), db.retile(A, (2, 1)), db.retile(A, (1, 1))]
    total = db.add(*parts)
    merged = Program.compile(total.node).merged
    assert len({id(merged[id(part.node)]) for part in parts}) == len(parts)
    a = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(total.numpy(), 4 * a + 3)


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
            calls = sum(sql.count(kind) for kind in ("TRA_EINSUM", "TRA_LOOP_", "TRA_CONTRACT"))
            assert calls == 1 and '"epilogue"' in sql
        np.testing.assert_allclose(H.numpy(), np.maximum(x @ w + bias, 0), rtol=1e-12, atol=1e-12)


def test_shared_contraction_is_not_fused(db):
    A = db.from_numpy("A", np.eye(3) * 2, tile=(2, 2))
    S = db.einsum("ij,jk->ik", A, A)
    T = db.einsum("ij,ij->ij", db.einsum("ij->ij", S, join="x0 + 1"), S, join="x0 * x1")
    assert '"epilogue"' not in flat(T)
    np.testing.assert_allclose(T.numpy(), (np.eye(3) * 4 + 1) * np.eye(3) * 4)


def mlp(db, x, widths, rng, tiles=None):
    """``nn.mlp`` over ``x`` with random weights (ReLU between layers; ``tiles``: each weight's
    tiling, whole by default) and its NumPy value."""
    layers, ref = [], x.numpy()
    for n, (a, b) in enumerate(zip(widths, widths[1:])):
        w, bias = rng.standard_normal((a, b)), rng.standard_normal(b)
        tile = tiles[n] if tiles else (a, b)
        layers.append((db.from_numpy(f"W{n}", w, tile=tile), db.from_numpy(f"b{n}", bias, tile=tile[1:])))
        ref = ref @ w + bias
        ref = np.maximum(ref, 0) if n < len(widths) - 2 else ref
    return nn.mlp(db, x, layers), ref


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 6), min_size=3, max_size=5), st.integers(1, 9), st.data())
def test_contraction_chain_is_one_step(widths, batch, data):
    """An MLP at inference: each layer's matmul reads the previous layer's activation, which
    nothing else reads; with whole weights every layer runs in one step, one kernel call per
    batch tile (ragged ones too), and no activation becomes a relation."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    with tra_sql.connect() as db:
        X = db.from_numpy("X", rng.standard_normal((batch, widths[0])),
                          tile=(data.draw(st.integers(1, batch)), widths[0]))
        Y, ref = mlp(db, X, widths, rng)
        sql = flat(Y)
        assert sql.count(f"TRA_LOOP_CHAIN_{2 * (len(widths) - 1) + 1}(") == 1
        assert "TRA_EINSUM" not in sql and "MATERIALIZED" not in sql
        np.testing.assert_allclose(Y.numpy(), ref, rtol=1e-10, atol=1e-10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 6), min_size=3, max_size=4), st.integers(1, 6), st.data())
def test_mlp_under_any_weight_tiling(widths, batch, data):
    """Whatever the tiling, the MLP's value is NumPy's (chained where the tiling allows it)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    tile = lambda *dims: tuple(data.draw(st.integers(1, n)) for n in dims)
    with tra_sql.connect() as db:
        X = db.from_numpy("X", rng.standard_normal((batch, widths[0])), tile=tile(batch, widths[0]))
        Y, ref = mlp(db, X, widths, rng, [tile(a, b) for a, b in zip(widths, widths[1:])])
        np.testing.assert_allclose(Y.numpy(), ref, rtol=1e-10, atol=1e-10)


def test_chain_reads_its_operand_in_any_position(db):
    rng = np.random.default_rng(3)
    a, b, c = rng.standard_normal((4, 3, 5)), rng.standard_normal((4, 5, 2)), rng.standard_normal((6, 2))
    A, B, C = db.from_numpy("A", a, tile=(3, 3, 5)), db.from_numpy("B", b, tile=(3, 5, 2)), db.from_numpy("C", c)
    T = db.einsum("bij,bjk->bik", A, B)
    U = db.einsum("lk,bik->bil", C, T)
    assert flat(U).count("TRA_LOOP_CHAIN_3(") == 1
    np.testing.assert_allclose(U.numpy(), np.einsum("lk,bik->bil", c, a @ b))


def test_chain_stops_where_a_step_would_be_repeated_or_shared(db):
    """No chain when the intermediate is read twice, when the next contraction splits the
    index it sums over, or when it splits an index the intermediate lacks (each intermediate
    tile would be computed once per such tile)."""
    rng = np.random.default_rng(4)
    x, w, v = rng.standard_normal((6, 4)), rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    X, W = db.from_numpy("X", x, tile=(3, 4)), db.from_numpy("W", w)
    H = db.einsum("bi,ih->bh", X, W)
    shared = db.einsum("bh,hk->bk", H, db.from_numpy("V", v))
    both = db.einsum("bk,bh->bkh", shared, H)
    split_sum = db.einsum("bh,hk->bk", db.einsum("bi,ih->bh", X, db.from_numpy("Wh", w, tile=(4, 2))),
                          db.from_numpy("Vh", v, tile=(2, 3)))
    split_out = db.einsum("bh,hk->bk", H, db.from_numpy("Vk", v, tile=(5, 2)))
    assert flat(both).count("TRA_CONTRACT_2(") == 1  # H a step of its own (``shared`` and ``both`` chained)
    for program in (split_sum, split_out):
        assert "CHAIN_" not in flat(program)
    h = x @ w
    np.testing.assert_allclose(both.numpy(), np.einsum("bk,bh->bkh", h @ v, h))
    np.testing.assert_allclose(split_sum.numpy(), h @ v)
    np.testing.assert_allclose(split_out.numpy(), h @ v)


def test_chain_with_too_many_input_bytes_per_call_stays_steps(db, monkeypatch):
    """Each joined row carries every weight's tile: past ``CHAIN_CALL_BYTES`` per kernel call,
    the layers run as steps."""
    rng = np.random.default_rng(5)
    X = db.from_numpy("X", rng.standard_normal((8, 4)), tile=(2, 4))
    Y, ref = mlp(db, X, [4, 6, 3], rng)
    per_row = (2 * 4 + 4 * 6 + 6 + 6 * 3 + 3) * 8
    monkeypatch.setattr(chain, "CHAIN_CALL_BYTES", 4 * per_row)
    assert "TRA_LOOP_CHAIN_5(" in flat(Y)
    monkeypatch.setattr(chain, "CHAIN_CALL_BYTES", 4 * per_row - 1)
    Y = Tensor(db, Y.node)  # a tensor's program is compiled once: compile it again, under the new limit
    assert "CHAIN_" not in flat(Y)
    np.testing.assert_allclose(Y.numpy(), ref)


@pytest.mark.parametrize("rows", [6, 7])  # uniform row tiles (one batched kernel call per step), ragged ones
def test_element_wise_steps_and_reductions_chain_too(db, rows):
    """A join, a max over a single-tile index and a join again: one chained step."""
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((rows, 5)), rng.standard_normal(5)
    X, W = db.from_numpy("X", x, tile=(3, 5)), db.from_numpy("W", w)
    top = db.einsum("ij,j->i", db.einsum("ij->ij", X, join="tanh(x0)"), W, join="x0 * x1", agg="max")
    out = db.einsum("i->i", top, join="exp(x0)")
    sql = flat(out)
    assert sql.count("TRA_LOOP_CHAIN_2(") == 1 and "MATERIALIZED" not in sql
    np.testing.assert_allclose(out.numpy(), np.exp((np.tanh(x) * w).max(axis=1)))


def test_a_tensor_compiles_and_renders_once_and_reads_its_tables_when_run(db, monkeypatch):
    """``numpy()`` again compiles and renders nothing (the DAG under a tensor never changes);
    the SQL reads the tables when it runs, so new values of the same geometry are used; a
    tensor replaced by another tiling or dtype makes the old handle stale (``StaleTensorError``
    before anything runs), and an einsum over the tensor as it is now compiles afresh."""
    from tra_sql.compile.dialect import Dialect
    from tra_sql.compile.program import Program

    calls = {"compile": 0, "render": 0}
    compile_, render = Program.compile.__func__, Dialect.render

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Program, "compile", classmethod(counted("compile", compile_)))
    monkeypatch.setattr(Dialect, "render", counted("render", render))
    a, b = np.arange(24.0).reshape(4, 6), np.ones((6, 5))
    A, B = db.from_numpy("A", a, tile=(2, 3)), db.from_numpy("B", b, tile=(3, 5))
    C = db.einsum("ij,jk->ik", A, B, join="tanh(x0 / 24) * x1")
    np.testing.assert_allclose(C.numpy(), np.tanh(a / 24) @ b)
    first = dict(calls)
    np.testing.assert_allclose(C.numpy(), np.tanh(a / 24) @ b)
    assert calls == first and first == {"compile": 1, "render": 1}
    db.from_numpy("A", -a, tile=(2, 3), replace=True)  # same geometry: the same SQL reads the new tiles
    np.testing.assert_allclose(C.numpy(), np.tanh(-a / 24) @ b)
    assert calls == first
    sql = C.program().sql(pretty=False)
    with passes.fusions(off={"loops", "contractions"}):  # other fusions: compiled and rendered again
        other = C.program().sql(pretty=False)
        np.testing.assert_allclose(C.numpy(), np.tanh(-a / 24) @ b)
    assert other != sql and C.program().sql(pretty=False) == sql and calls == {"compile": 2, "render": 2}
    db.from_numpy("A", a.astype(np.float32), tile=(4, 6), replace=True)
    with pytest.raises(tra_sql.StaleTensorError, match="'A' was replaced"):
        C.numpy()
    D = db.einsum("ij,jk->ik", db.tensor("A"), B, join="tanh(x0 / 24) * x1")
    assert D.tile == (4, 5) and D.dtype == np.float64
    np.testing.assert_allclose(D.numpy(), np.tanh(a / 24) @ b)


def test_tile_joins_run_without_duckdbs_caching_operators(db):
    """A join's output of under 64 rows would be appended to a cache chunk, every tile in it
    copied (``engines.duckdb.no_tile_copies``): tra_sql's connection switches that off, and
    the results are the same either way."""
    assert db.engine.con.execute("SELECT current_setting('enable_caching_operators')").fetchall() == [(False,)]
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((6, 8)), rng.standard_normal((8, 4))
    C = db.einsum("ij,jk->ik", db.from_numpy("A", a, tile=(2, 4)), db.from_numpy("B", b, tile=(4, 4)))
    without = C.numpy()
    db.engine.con.execute("SET enable_caching_operators = true")
    np.testing.assert_array_equal(C.numpy(), without)
    np.testing.assert_allclose(without, a @ b, rtol=1e-12)
