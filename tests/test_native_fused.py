"""The fused contraction aggregate (udfs/native/fused.py): split sums of BLAS products equal
NumPy and the Arrow path over random shapes and tilings (ragged, split contractions, batched,
transposed forms), the SQL really calls it (no per-row partial products), bad tiles and bad
calls by hand raise and the process survives, DuckDB's threads combine its states, and the
planner prices it (no list(), a state per group)."""

from types import SimpleNamespace

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tra_sql import catalog
from tra_sql.catalog import TensorInfo
from tra_sql.compile.dialect import DUCKDB
from tra_sql.compile.program import Program
from tra_sql.decompose.cost import Budget, Constants, fusible, op_cost
from tra_sql.decompose.problem import extract
from tra_sql.engines import staged
from tra_sql.udfs.native import loader

pytestmark = pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")

FORMS = ["ij,jk->ik", "ji,jk->ik", "ij,kj->ik", "ij,jk->ki", "bij,bjk->bik", "ij,j->i", "ijk,kl->ijl"]


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """Native kernels here, also when the suite runs with TRA_SQL_KERNELS=arrow."""
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")


def _product(db, spec, arrays, tilings, tag):
    tensors = [db.from_numpy(f"{tag}{m}", a, t, replace=True) for m, (a, t) in enumerate(zip(arrays, tilings))]
    return db.einsum(spec, *tensors)


def _assert_fused(product, dtype):
    sql = product.sql().lower()
    assert f"tra_contract_agg_{np.dtype(dtype).name}(" in sql
    assert "tra_contract_2(" not in sql and "tra_reduce" not in sql and "array_agg" not in sql


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=st.sampled_from(FORMS), dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_split_products_equal_numpy_and_the_arrow_path(native, arrow, spec, dtype, data):
    inputs, output = spec.split("->")
    inputs = inputs.split(",")
    letters = sorted(set(spec) - set(",->"))
    contracted = sorted(set("".join(inputs)) - set(output))
    sizes = {c: data.draw(st.integers(2 if c in contracted else 1, 9), label=f"size {c}") for c in letters}
    tiles = {c: data.draw(st.integers(1, sizes[c] - 1 if c in contracted else sizes[c]), label=f"tile {c}")
             for c in letters}  # every contracted index split, ragged or not
    rng = np.random.default_rng(len(spec))
    arrays = [rng.standard_normal([sizes[c] for c in sub]).astype(dtype) for sub in inputs]
    tilings = [tuple(tiles[c] for c in sub) for sub in inputs]
    product = _product(native, spec, arrays, tilings, "n")
    _assert_fused(product, dtype)
    got = product.numpy()
    fallback = _product(arrow, spec, arrays, tilings, "a").numpy()
    expected = np.einsum(spec, *[a.astype(np.float64) for a in arrays])
    tol = 1e-4 if dtype == np.float32 else 1e-10
    assert got.dtype == dtype
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(got, fallback, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("tiles", [(2, 3, 3), (2, 1, 5)])  # a small contracted tile: the fused join + aggregate
def test_both_ways_of_a_split_sum_are_fused(native, tiles):
    """``partials_first`` picks partial products (out tile <= input tiles) or the fused join +
    aggregate (a skinny contracted tile): DuckDB's dialect writes either as the fused aggregate."""
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((4, 7)), rng.standard_normal((7, 5))
    product = native.einsum("ij,jk->ik", native.from_numpy("bx", x, tiles[:2], replace=True),
                            native.from_numpy("by", y, tiles[1:], replace=True))
    _assert_fused(product, np.float64)
    np.testing.assert_allclose(product.numpy(), x @ y, rtol=1e-12, atol=1e-12)


def test_the_sql_front_end_is_fused(native):
    """SQL statements with tensor functions run in DuckDB's dialect too: a query, EXPLAIN and
    CREATE TENSOR of a split sum of products use the fused aggregate."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 6))
    native.from_numpy("fx", x, (3, 3), replace=True)
    query = "SELECT * FROM einsum('ij,jk->ik', fx, fx)"
    shown = native.explain_sql(query).lower()
    assert "tra_contract_agg_float64(" in shown and "array_agg" not in shown
    native.sql(f"CREATE OR REPLACE TENSOR fp AS {query}")
    np.testing.assert_allclose(native.tensor("fp").numpy(), x @ x, rtol=1e-12, atol=1e-12)
    assert len(native.sql(query).fetchall()) == 4


def test_batched_with_the_contraction_split(native, arrow):
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((6, 5, 9)).astype(np.float32), rng.standard_normal((6, 9, 4)).astype(np.float32)
    for db in (native, arrow):
        product = db.einsum("bij,bjk->bik", db.from_numpy("qx", x, (2, 5, 4), replace=True),
                            db.from_numpy("qy", y, (2, 4, 4), replace=True))
        _assert_fused(product, np.float32)
        np.testing.assert_allclose(product.numpy(), np.matmul(x, y), rtol=1e-5, atol=1e-5)


def test_many_rows_of_one_group_on_two_threads(native):
    """130,000 products into one output tile: DuckDB aggregates on both threads and combines
    the two states (each tile of 8 bytes or fewer: inlined in its BLOB entry)."""
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((2, 130_000)).astype(np.float32), rng.standard_normal((130_000, 2)).astype(np.float32)
    product = native.einsum("ij,jk->ik", native.from_numpy("wide", x, (2, 1)), native.from_numpy("deep", y, (1, 2)))
    _assert_fused(product, np.float32)
    np.testing.assert_allclose(product.numpy(), x.astype(np.float64) @ y, rtol=1e-3, atol=1e-2)


def test_a_scalar_result(native):
    x = np.arange(10.0)
    product = native.einsum("i,i->", native.from_numpy("dx", x, (3,), replace=True),
                            native.from_numpy("dy", x, (3,), replace=True))
    _assert_fused(product, np.float64)
    np.testing.assert_allclose(product.numpy(), x @ x)


def test_staged_output_bands_are_fused(native, monkeypatch):
    """The staged executor's statements (here two bands of the output rows, each reading its
    operands in key ranges) go through the dialect too."""
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((8, 6)), rng.standard_normal((6, 4))
    product = native.einsum("ij,jk->ik", native.from_numpy("sx", x, (2, 2), replace=True),
                            native.from_numpy("sy", y, (2, 2), replace=True))
    stages = staged.DuckDBStages(native.engine)
    rendered = []
    render = stages.dialect.render
    monkeypatch.setattr(stages, "dialect", SimpleNamespace(materialized=True, render=lambda query: rendered.append(
        render(query)) or rendered[-1]))
    stages.create("_tra_stage_fused", 2)
    try:
        staged._run_bands(stages, product.node, "_tra_stage_fused", [2, 1, 1], [])
        tiles = native.engine.arrow('SELECT * FROM "_tra_stage_fused"')
    finally:
        stages.drop(["_tra_stage_fused"])
    assert len(rendered) == 2 and all("TRA_CONTRACT_AGG_FLOAT64(" in text for text, _ in rendered)
    info = TensorInfo("p", np.dtype(np.float64), (8, 4), (2, 2), "dense")
    np.testing.assert_allclose(catalog.assemble(info, tiles), x @ y, rtol=1e-12, atol=1e-12)


def _step(db):
    """A fused call's step literal (float32, ``ij,jk->ik``, 4x4 of 2x2 tiles)."""
    db.from_numpy("hx", np.ones((4, 4), np.float32), (2, 2), replace=True)
    db.from_numpy("hy", np.ones((4, 4), np.float32), (2, 2), replace=True)
    text, _ = DUCKDB.render(Program.compile(db.einsum("ij,jk->ik", "hx", "hy").node).query())
    return text.split("TRA_CONTRACT_AGG_FLOAT32('")[1].split("'")[0]


TILE = "'\\x00\\x00\\x80\\x3f\\x00\\x00\\x80\\x3f\\x00\\x00\\x80\\x3f\\x00\\x00\\x80\\x3f'::BLOB"  # four 1.0f


@pytest.mark.parametrize("step, keys0, tile0, keys1, message", [
    ("'not a step'", "[0, 0]", TILE, "[0, 0]", "the step of a fused contraction"),
    ("NULL", "[0, 0]", TILE, "[0, 0]", "is NULL"),
    (None, "[0, 0]", "'\\x01'::BLOB", "[0, 0]", "holds 1 bytes"),
    (None, "[5, 0]", TILE, "[0, 0]", "outside the tensor's tile grid"),
    (None, "[0]", TILE, "[0, 0]", "outside the tensor's tile grid"),
    (None, "[0, NULL]", TILE, "[0, 0]", "has NULL keys"),
    (None, "[0, 0]", "NULL", "[0, 0]", "is NULL"),
])
def test_calls_by_hand_raise_and_the_process_survives(native, step, keys0, tile0, keys1, message):
    step = step or f"'{_step(native)}'"
    sql = f"SELECT tra_contract_agg_float32({step}, [0, 0], {keys0}, {tile0}, {keys1}, {TILE})"
    with pytest.raises(duckdb.Error, match=message):
        native.engine.con.execute(sql).fetchall()
    good = f"SELECT tra_contract_agg_float32('{_step(native)}', [0, 0], [0, 0], {TILE}, [0, 0], {TILE})"
    assert len(native.engine.con.execute(good).fetchall()[0][0]) == 16


def test_a_step_of_another_dtype_is_refused(native):
    sql = f"SELECT tra_contract_agg_float64('{_step(native)}', [0, 0], [0, 0], {TILE}, [0, 0], {TILE})"
    with pytest.raises(duckdb.Error, match="another dtype"):
        native.engine.con.execute(sql).fetchall()


def test_a_shared_index_of_another_extent_is_refused(native):
    """A contracted key pointing at the ragged last tile on one side and a full tile on the
    other (only a call by hand can join them) would read past the shorter tile."""
    native.from_numpy("rx", np.ones((2, 3), np.float32), (2, 2), replace=True)
    native.from_numpy("ry", np.ones((3, 2), np.float32), (2, 2), replace=True)
    text, _ = DUCKDB.render(Program.compile(native.einsum("ij,jk->ik", "rx", "ry").node).query())
    step = text.split("TRA_CONTRACT_AGG_FLOAT32('")[1].split("'")[0]
    full = "'" + "\\x00" * 16 + "'::BLOB"
    ragged = "'" + "\\x00" * 8 + "'::BLOB"
    sql = f"SELECT tra_contract_agg_float32('{step}', [0, 0], [0, 0], {full}, [1, 0], {ragged})"
    with pytest.raises(duckdb.Error, match="differs in a shared index's extent"):
        native.engine.con.execute(sql).fetchall()


def test_gradients_through_fused_products_match_torch(native):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x, w = rng.standard_normal((6, 8)), rng.standard_normal((8, 3))
    X = native.from_numpy("gx", x, (3, 3), replace=True)
    W = native.from_numpy("gw", w, (3, 3), replace=True)
    loss = native.einsum("ik->", native.einsum("ij,jk->ik", X, W))
    gx, gw = native.grad(loss, [X, W])
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    (tx @ tw).sum().backward()
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_the_planner_prices_states_not_lists(native):
    x = native.from_numpy("px", np.ones((64, 64), np.float32), (8, 8), replace=True)
    y = native.from_numpy("py", np.ones((64, 64), np.float32), (8, 8), replace=True)
    op = extract(native.einsum("ij,jk->ik", x, y).node).ops[0]
    assert fusible(op)
    q = np.array([[8, 8, 8]])
    budget = Budget(workers=2, memory=1e9)
    listed, fused = op_cost(op, q, Constants(), budget), op_cost(op, q, Constants(fused=1), budget)
    assert fused.parts["list"][0] == 0 < listed.parts["list"][0]
    out = 64 * 64 * 4  # (and the smaller operand, the join's build side)
    # a state per thread and group, the build side, the result
    assert fused.working_set[0] == pytest.approx(out * 2 + out * Constants().mem_join + out)
    assert listed.working_set[0] > fused.working_set[0]
    assert fused.agg_bands[0] == 1 and fused.total[0] < listed.total[0]
    assert native.engine.constants().fused == 1
    joined = native.einsum("ij,jk->ik", x, y, join="x0 + x1")
    assert not fusible(extract(joined.node).ops[0])
