"""Differential tests: random programs over the public API (``diffgen``) run on every path that
applies (unplanned, planned for random workers and memory, staged, each fusion switched off,
``numpy()``/``arrow()``/``store()``, native and Arrow kernels, Spark) and compared with a PyTorch reference computed
from the dense arrays. A failure prints the program as a runnable script (``note``) and the
path that disagreed; ``HYPOTHESIS_PROFILE=long pytest -m fuzz`` runs the long profile."""

from __future__ import annotations

import contextlib
import os
import shutil
import traceback

import numpy as np
import pytest
import torch
from diffgen import (
    COUNTS,
    FLOATS,
    HEADER,
    Program,
    Step,
    Var,
    csr_programs,
    einsum_programs,
    grad_programs,
    layer_programs,
    programs,
)
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import tra_sql
from tra_sql import nn
from tra_sql.compile import passes

SWITCHES = sorted(passes.FUSIONS)
ROOMY = ["1MB", "64MB", "1GB"]
TIGHT = ["4KB", "16KB", "64KB"]
#: The planner's documented refusal of a budget too small for the stored tiles.
REFUSED = "store it in smaller tiles"
fuzz = pytest.mark.fuzz
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")


def examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile (max_examples 100), scaled for other profiles."""
    return max(1, n * settings.default.max_examples // 100)


def scaled(n: int):
    return settings(max_examples=examples(n), suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.filter_too_much])


# -- comparing -------------------------------------------------------------------------------------

def tolerance(program: Program, dtype: str) -> float:
    if np.dtype(dtype).kind in "iu" and not program.dtypes & set(FLOATS):
        return 0.0
    return 2e-4 if "float32" in program.dtypes else 1e-9


def disagreement(got, want: np.ndarray, dtype: str, tol: float) -> str | None:
    """Why ``got`` is not ``want`` (shape, dtype, values), or None."""
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != np.dtype(dtype):
        return f"shape/dtype {got.shape} {got.dtype}, expected {want.shape} {dtype}"
    scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0)))  # an infinity must not excuse the rest
    bad = ~np.isclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale, equal_nan=True)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        return f"{int(bad.sum())} of {bad.size} elements differ; at {at}: got {got[at]!r}, expected {want[at]!r}"
    return None


def references(program: Program) -> dict[str, np.ndarray]:
    """The reference value of every output, as float64 arrays (programs whose values would
    overflow their integer dtype or lose float64 exactness are rejected, and so are gradients
    of an infinite loss, whose values mean nothing)."""
    env = program.reference()
    gradients = any(name.startswith("d") for name in program.outputs)
    out = {}
    for name in program.outputs:
        value = env[name].detach().numpy()
        big = 2**31 if program.var(name).dtype == "int32" else 1e12
        exact = np.dtype(program.var(name).dtype).kind in "iu"  # an integer result overflowed if infinite
        if (np.isnan(value).any() or ((gradients or exact) and not np.isfinite(value).all())
                or np.abs(value[np.isfinite(value)]).max(initial=0) >= big):
            assume(False)
        out[name] = value
    return out


def run_paths(program: Program, db, paths: list[str], namespace: dict | None = None) -> None:
    """Build ``program`` in ``db``, run each path (statements assigning ``got``, ``{v}`` the
    output) on every output and compare with the reference; one assertion listing every
    disagreement, with the program as a runnable script."""
    wants = references(program)
    if currently_in_test_context():
        note(program.snippet())
    env = program.build(db, namespace)
    failures = []
    COUNTS["programs"] += 1
    for name in program.outputs:
        var = program.var(name)
        for path in paths:
            code = path.replace("{v}", name)
            try:
                exec(code, env)  # noqa: S102
            except Exception as err:  # noqa: BLE001 - every engine error is a finding, but the documented refusal
                if REFUSED in str(err):
                    COUNTS["refused"] += 1
                    continue
                failures.append((code, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}"))
                continue
            COUNTS["paths"] += 1
            why = disagreement(env["got"], wants[name], var.dtype, tolerance(program, var.dtype))
            if why:
                failures.append((code, why))
    if failures:
        report = "\n".join(f"--- {code}\n    {why}" for code, why in failures)
        raise AssertionError(f"{len(failures)} path(s) disagree with the reference:\n{report}\n\n"
                             f"=== repro ===\n{program.snippet(failures[0][0])}")


@st.composite
def duckdb_paths(draw, program: Program) -> list[str]:
    """Every path of one output: as written, through arrow() and store(), as a training step's
    root (its one query and its statements), through the SQL front end (its einsums as SQL),
    under a roomy and a tight (staged) plan for random workers, and with each fusion off that
    changes its SQL."""
    w = [draw(st.integers(1, 4)) for _ in range(3)]
    roomy, tight = draw(st.sampled_from(ROOMY)), draw(st.sampled_from(TIGHT))
    return [
        "got = {v}.numpy(plan=False)",
        "got = {v}.numpy()",
        "got = dense({v}, {v}.arrow())",
        'got = {v}.store("{v}_stored").numpy(plan=False)',
        "got = dense({v}, stepped({v}, fused=True))",
        "got = dense({v}, stepped({v}, fused=False))",
        "got = via_sql({v})",
        f'got = {{v}}.numpy(plan=db.plan({{v}}, workers={w[0]}, memory="{roomy}"))',
        f'plan = db.plan({{v}}, workers={w[1]}, memory="{tight}")\ngot = dense({{v}}, {{v}}.arrow(plan=plan))',
        f'got = {{v}}.store("{{v}}_planned", plan=db.plan({{v}}, workers={w[2]}, memory="{tight}")).numpy(plan=False)',
    ] + [f"with tra_sql.compile.passes.fusions(off={{{name!r}}}):\n    got = {{v}}.numpy(plan=False)"
         for name in SWITCHES]


def prune_fusions(program: Program, db, paths: list[str]) -> list[str]:
    """``paths`` without the fusion switches that leave every output's SQL as it is."""
    env = program.build(db)
    kept = []
    for path in paths:
        if "fusions(off=" in path:
            name = path.split("{'")[1].split("'")[0]
            sqls = [env[v].sql() for v in program.outputs]
            with passes.fusions(off={name}):
                if [env[v].sql() for v in program.outputs] == sqls:
                    continue
        kept.append(path)
    return kept


@contextlib.contextmanager
def arrow_kernels():
    """Sessions opened inside run the Arrow UDF kernels, not the native ones."""
    before = os.environ.get("TRA_SQL_KERNELS")
    os.environ["TRA_SQL_KERNELS"] = "arrow"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRA_SQL_KERNELS"]
        else:
            os.environ["TRA_SQL_KERNELS"] = before


#: Paths each program runs on the Arrow kernels under the ``ci`` profile (drawn from those that
#: are not fusion switches; every one of them under the ``long`` profile).
ARROW_SAMPLE = 3


def differential(data, program: Program) -> None:
    """Every path of ``program`` (``duckdb_paths``) on the default (native) kernels, then those
    that are not fusion switches (the kernels do not depend on a fusion) on the Arrow kernels:
    all of them under the ``long`` profile, a drawn sample of ``ARROW_SAMPLE`` under ``ci``
    (the native and Arrow kernels are also compared op by op in tests/test_native*.py)."""
    paths = data.draw(duckdb_paths(program))
    with tra_sql.connect() as probe:
        paths = prune_fusions(program, probe, paths)
    arrow = [p for p in paths if "fusions(off=" not in p]
    if PROFILE != "long":
        arrow = data.draw(st.lists(st.sampled_from(arrow), min_size=1, max_size=ARROW_SAMPLE, unique=True))
    with tra_sql.connect() as db:
        run_paths(program, db, paths)
    with arrow_kernels(), tra_sql.connect() as db:
        assert db.engine.kernels == "arrow"
        run_paths(program, db, [f"# TRA_SQL_KERNELS=arrow\n{p}" for p in arrow])


# -- the fuzz tests ---------------------------------------------------------------------------------

@fuzz
@scaled(40)
@given(st.data())
def test_random_extended_einsums(data):
    """One einsum: random specs (repeated indices, broadcasting, full reductions), joins, aggs,
    dtypes, ragged tiles, absent tiles, on every DuckDB path."""
    program = data.draw(einsum_programs())
    differential(data, program)


@fuzz
@scaled(40)
@given(st.data())
def test_random_programs(data):
    """DAGs of einsums, keyed sums, retile/slice/concat/transpose/reshape and fills."""
    program = data.draw(programs())
    differential(data, program)


@fuzz
@scaled(20)
@given(st.data())
def test_random_nn_layers(data):
    """tra_sql.nn layers (linear, softmax with masks, norms, attention) inside random programs."""
    program = data.draw(layer_programs())
    differential(data, program)


@fuzz
@scaled(15)
@given(st.data())
def test_random_gradients_against_torch_autograd(data):
    """db.grad of a random scalar loss of a random program, against torch.autograd."""
    program = data.draw(grad_programs())
    differential(data, program)


@fuzz
@scaled(20)
@given(st.data())
def test_random_csr_products(data):
    """CSR relations in products (message passing, sums, sampled products) and their gradients."""
    program = data.draw(csr_programs())
    differential(data, program)


# -- Spark --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    pytest.importorskip("pyspark", reason="the Spark sample needs pyspark")
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.skip("the Spark sample needs Java")
    db = tra_sql.connect(str(tmp_path_factory.mktemp("warehouse")), engine="spark", master="local[2]",
                         driver_memory="1g", config={"spark.sql.shuffle.partitions": "2"})
    yield db
    db.close()


@fuzz
@scaled(4)
@given(data=st.data())
def test_random_programs_on_spark(spark, data):
    """A small sample of random programs (no absent tiles: they are deleted in DuckDB SQL) on
    Spark local[2]: numpy(), arrow() and store(), through the SQL front end, as a training step's
    root (its one job; planned as usual, and planned ahead over a kept copy of its inputs),
    unplanned and under a tight (staged) plan, and with split aggregations as the lowering chose
    them (``contractions`` off: no listing of joined inputs, ``SparkDialect.fuse``)."""
    program = data.draw(programs(absent=False, ops=(1, 3)))
    paths = ["got = {v}.numpy(plan=False)", "got = dense({v}, {v}.arrow())",
             'got = {v}.store("{v}_stored").numpy(plan=False)', "got = via_sql({v})",
             "got = dense({v}, spark_stepped({v}))", "got = dense({v}, spark_stepped({v}, ahead=True))",
             'plan = db.plan({v}, workers=2, memory="16KB")\ngot = dense({v}, {v}.arrow(plan=plan))',
             'got = {v}.store("{v}_planned", plan=db.plan({v}, workers=2, memory="16KB")).numpy(plan=False)',
             "with tra_sql.compile.passes.fusions(off={'contractions'}):\n    got = {v}.numpy(plan=False)"]
    try:
        run_paths(program, spark, paths)
    finally:
        for name in spark.tensors():
            spark.drop(name)


# -- fusion switches ----------------------------------------------------------------------------------

def _fusion_case(db, name: str):
    """A program that ``Program.compile`` fuses by fusion ``name``, and the SQL text that shows it."""
    rng = np.random.default_rng(7)

    def put(label, shape, tile=None):
        return db.from_numpy(label, rng.uniform(-2, 2, shape), tile=tile)

    if name == "attention":
        q, k, v = put("Q", (6, 4), (3, 4)), put("K", (5, 4), (5, 4)), put("V", (5, 3), (5, 3))
        probs = nn.softmax(db, db.einsum("qd,sd->qs", q, k), scale=0.5)
        return db.einsum("qs,sv->qv", probs, v), "TRA_ATTENTION"
    if name == "prologue":
        return nn.layer_norm(db, put("X", (5, 4), (2, 4))), "TRA_LOOP_CHAIN_1("  # (its prologue's chain reads X alone)
    if name == "epilogue":
        x, w, b = put("X", (5, 4), (2, 2)), put("W", (4, 3), (2, 3)), put("B", (3,))
        return db.einsum("bh,h->bh", db.einsum("bi,ih->bh", x, w), b, join="greatest(x0 + x1, 0)"), '"epilogue"'
    if name == "chain":
        x = put("X", (6, 4), (3, 4))
        layers = [(put("W1", (4, 5)), put("B1", (5,))), (put("W2", (5, 2)), put("B2", (2,)))]
        return nn.mlp(db, x, layers), "TRA_LOOP_CHAIN_"
    if name == "contractions":  # a split sum of BLAS products: one fused aggregate on DuckDB
        return db.einsum("ij,jk->ik", put("A", (4, 6), (4, 2)), put("B", (6, 4), (2, 4))), "TRA_CONTRACT_AGG"
    if name == "loops":  # a per-row step over dense float tiles: the native loop kernel on DuckDB
        return db.einsum("ij,ij->ij", put("A", (4, 6), (2, 3)), put("B", (4, 6), (2, 3)), join="x0 - x1"), "TRA_LOOP_"
    # (max: the two ways of aggregating stay visible, where DuckDB's dialect fuses a sum of products)
    if name == "partials":  # a partial product per joined row is smaller than its two input tiles
        return db.einsum("ij,jk->ik", put("A", (4, 6), (4, 2)), put("B", (6, 4), (2, 4)), agg="max"), "TRA_REDUCE"
    return db.einsum("ij,jk->ik", put("A", (8, 6), (8, 1)), put("B", (6, 8), (1, 8)), agg="max"), "TRA_EINSUM_AGG"


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switched_off_fusion_changes_the_sql_not_the_numbers(name):
    with tra_sql.connect() as db:
        result, shown = _fusion_case(db, name)
        assert shown in result.sql()
        want = result.numpy(plan=False)
        with passes.fusions(off={name}):
            assert shown not in result.sql()
            got = result.numpy(plan=False)
        assert shown in result.sql()  # switched on again on leaving
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("off", [{"bogus"}, {"partials", "agg_inputs"}])
def test_fusions_refuses_unknown_names_and_both_ways_of_aggregating(off):
    with pytest.raises(ValueError, match="fusions"), passes.fusions(off=off):
        pass


# -- bugs the harness found (regression tests) -------------------------------------------------

def test_gradient_of_a_tensor_with_absent_tiles_under_a_plan(db):
    A = db.from_numpy("A", np.ones((2, 5)), tile=(1, 3))
    db.engine.con.execute('DELETE FROM "A" WHERE k0 = 0 AND k1 = 0')
    (dA,) = db.grad(db.einsum("a->", A.reshape(10)), [A])
    want = np.array([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=float)
    np.testing.assert_array_equal(dA.numpy(plan=False), want)
    np.testing.assert_array_equal(dA.numpy(plan=db.plan(dA, workers=1, memory="1GB")), want)


def test_banded_contraction_of_a_tensor_with_absent_tiles(db):
    a = np.arange(1.0, 9.0).reshape(2, 2, 2)
    A = db.from_numpy("A", a, tile=(1, 1, 1))
    B = db.from_numpy("B", a[:, 0, :], tile=(1, 1))
    db.engine.con.execute('DELETE FROM "A" WHERE k0 = 0 AND k1 = 0 AND k2 = 0')
    db.engine.con.execute('DELETE FROM "B" WHERE k0 = 0 AND k1 = 0')
    a[0, 0, 0] = 0
    E = db.einsum("ab,acb->bc", B, A)
    plan = db.plan(E, workers=1, memory="1MB")
    assert plan.staged
    np.testing.assert_array_equal(E.numpy(plan=plan), np.einsum("ab,acb->bc", a[:, 0, :], a))


def test_a_staged_plan_of_a_csr_product(db):
    db.engine.con.execute("CREATE TABLE E AS SELECT * FROM (VALUES (0, 0, 0.5)) AS t(r, c, v)")
    R = db.relation("E", ("r", "c"), "v", (1, 2), name="R", layout="csr")
    h = np.arange(4.0).reshape(2, 2)
    E = db.einsum("vu,uf->vf", R, db.from_numpy("H", h, tile=(1, 1)))
    np.testing.assert_array_equal(E.numpy(plan=db.plan(E, workers=1, memory="4KB")), 0.5 * h[:1])


def test_a_banded_sum_over_a_csr_relation(db):
    db.engine.con.execute("CREATE TABLE E AS SELECT * FROM (VALUES (0, 0, 0.5), (0, 1, 0.5)) AS t(r, c, v)")
    R = db.relation("E", ("r", "c"), "v", (2, 2), name="R", tile=(1, 1), layout="csr")
    E = db.einsum("vu->v", R)
    np.testing.assert_array_equal(E.numpy(plan=db.plan(E, workers=1, memory="1MB")), [1.0, 0.0])


def test_a_plan_where_nothing_fits_the_budget_still_runs(db):
    """Found by the harness: the DAG search returned no assignment when every one was over the
    budget (make_plan raised TypeError); now it plans, as on a tree, and runs staged."""
    rng = np.random.default_rng(0)
    X = db.from_numpy("X", rng.uniform(-2, 2, (2, 3, 5)), tile=(1, 3, 5))
    M = db.from_numpy("M", np.maximum(rng.uniform(0, 1, (2, 3, 5)) > 0.4, np.arange(5) == 0).astype(float),
                      tile=(1, 1, 2))
    P = nn.softmax(db, X, mask=M)
    S = db.from_numpy("S", np.asarray(0.5))
    Y = db.einsum(",,abc->cab", S, S, X, join="CASE WHEN x2 > x0 THEN x0 ELSE x0 - 0.25 END", agg="max")
    Z = db.einsum("abc,def,ebc->becadf", P, Y, P, join="2")
    plan = db.plan(Z, workers=3, memory="4KB")
    assert plan.staged
    np.testing.assert_array_equal(Z.store("Z", plan=plan).numpy(plan=False), np.full(Z.shape, 2.0))


def test_gradient_of_a_float32_tensor_is_float32(db):
    W = db.from_numpy("W", np.ones((2, 2), dtype=np.float32))
    (dW,) = db.grad(db.einsum("ij,ij->", W, db.from_numpy("X", np.ones((2, 2)))), [W])
    assert dW.dtype == np.float32


def test_arrow_under_a_plan_is_tiled_as_the_tensor(db):
    E = db.einsum("a->a", db.full((2,), 2.5, tile=(1,)))
    tiles = E.arrow(plan=db.plan(E, workers=1, memory="4KB"))
    got = tra_sql.catalog.assemble(tra_sql.catalog.TensorInfo("E", E.dtype, E.shape, E.tile), tiles)
    np.testing.assert_array_equal(got, [2.5, 2.5])


# -- the harness itself ---------------------------------------------------------------------------

def a_row_max(offset: float) -> Program:
    """``max_j greatest(A[i, j], 5)`` with a reference that is off by ``offset``."""
    a = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    program = Program(outputs=["E"])
    program.steps.append(Step(Var("A", (3, 4), "float64"), 'A = db.from_numpy("A", np.arange(12.0).reshape(3, 4), '
                                                            "tile=(2, 3))", lambda env: a))
    program.steps.append(Step(Var("E", (3,), "float64"), 'E = db.einsum("ij->i", A, join="greatest(x0, 5)", agg="max")',
                              lambda env: a.clamp(min=5).amax(1) + offset))
    return program


def test_the_harness_passes_a_right_result_and_reports_a_wrong_one_with_a_runnable_repro():
    with tra_sql.connect() as db:
        run_paths(a_row_max(0.0), db, ["got = {v}.numpy(plan=False)"])
    with tra_sql.connect() as db, pytest.raises(AssertionError, match="=== repro ===") as caught:
        run_paths(a_row_max(1e-6), db, ["got = {v}.numpy(plan=False)"])
    script = str(caught.value).split("=== repro ===\n")[1]
    namespace: dict = {}
    exec(script, namespace)  # noqa: S102 - the repro runs on its own
    np.testing.assert_array_equal(namespace["got"], [5.0, 7.0, 11.0])


def test_an_infinity_in_the_reference_does_not_excuse_the_other_elements():
    assert disagreement(np.array([np.inf, 1.0]), np.array([np.inf, 2.0]), "float64", 1e-9)
    assert disagreement(np.array([np.inf, 2.0]), np.array([np.inf, 2.0]), "float64", 1e-9) is None


def test_gradient_with_respect_to_a_scalar_without_its_tile_is_kept_at_its_keys(db):
    """Found by the long run: the seed counted as within the loss's tiles although the loss had
    none, so the keys-only mask was skipped and the gradient was 1 instead of 0."""
    A = db.from_numpy("A", np.asarray(0.5))
    db.engine.con.execute('DELETE FROM "A" WHERE true')
    (dA,) = db.grad(db.einsum("->", A.transpose()), [A])
    np.testing.assert_array_equal(dA.numpy(plan=False), 0.0)


def test_an_attention_gradient_through_the_sql_front_end_on_two_threads():
    """Found by run 8 of the long profile: ``via_sql`` stored a node once per use, so the
    query read copies that the fusions computed in different kernels (rounding differently),
    and the max gradient's tie test (the recomputed join equal to the maximum) matched none:
    NaN; the other gradient's text exceeded DuckDB's expression depth. A node is now written
    once, and the compiler merges identical nodes (``compile.common``)."""
    with tra_sql.connect(threads=2) as db:
        env = {"db": db, "np": np, "nn": nn}
        exec(compile(HEADER.split("db = ")[0], "<harness>", "exec"), env)  # noqa: S102 - the harness's via_sql
        rng = [np.random.default_rng(1687 + i) for i in range(5)]
        A = [db.from_numpy(f"A{i}", r.uniform(-2, 2, shape), tile=tile) for i, (r, shape, tile) in enumerate(zip(
            rng, [(2, 3, 4), (4, 1, 2), (4, 1, 2), (4, 1, 2), (1, 2, 3)],
            [(1, 3, 1), (1, 1, 2), (3, 1, 2), (4, 1, 1), (1, 2, 2)]))]
        M = nn.attention(db, A[0], nn.AttentionWeights(Wq=A[1], Wk=A[2], Wv=A[3], Wo=A[4]), causal=False)
        N = nn.layer_norm(db, M)
        E = db.einsum("abc->", db.add(N, N), join="greatest(x0, (x0 / 2))", agg="max")
        for grad in db.grad(E, [A[0], A[1]]):
            want = grad.numpy(plan=False)
            for _ in range(3):
                np.testing.assert_allclose(env["via_sql"](grad), want, rtol=1e-6, atol=1e-12)
