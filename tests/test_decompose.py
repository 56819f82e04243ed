"""EinDecomp: the DP against exhaustive search and the presets, memory limits, and plans
executed in the engine against numpy."""

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest

import tra_sql
from tra_sql import graph, nn
from tra_sql.decompose import Constants, graphs, make_plan
from tra_sql.decompose import calibrate as cal
from tra_sql.decompose.choose import AUTO_MIN_BYTES, auto
from tra_sql.engines import staged
from tra_sql.graph import Source

# per-row and per-statement costs high enough that the memory limit and the overheads
# pull in different directions
CONSTS = Constants(row=1e-4, stmt=1e-3, blas_call=1e-4)
REL = 1e-9


def _random_tree(rng: random.Random):
    """A chain of 1-3 einsum steps (contractions, element-wise joins, broadcasts) over small
    stored inputs with random tilings: a tree, since every step's output feeds only the next."""
    sizes = {c: rng.choice([4, 6, 8, 12, 16]) for c in "abcdefg"}

    def leaf(sub):
        shape = tuple(sizes[c] for c in sub)
        return Source(shape, np.dtype("float64"), tuple(rng.choice([n, max(1, n // 2)]) for n in shape), "L" + sub)

    node, sub = leaf("ab"), "ab"
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["contract", "join", "broadcast"])
        if kind == "contract":
            c = rng.choice([x for x in "cdefg" if x not in sub])
            out = sub[:-1] + c
            node, sub = graph.einsum(f"{sub},{sub[-1]}{c}->{out}", [node, leaf(sub[-1] + c)], ["x", "y"]), out
        elif kind == "join":
            node = graph.einsum(f"{sub},{sub}->{sub}", [node, leaf(sub)], ["x", "y"], join="x0 + x1")
        else:
            node = graph.einsum(f"{sub},{sub[0]}->{sub}", [node, leaf(sub[0])], ["x", "y"], join="x0 * x1")
    return node


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_exhaustive_on_random_trees(seed):
    rng = random.Random(seed)
    root = _random_tree(rng)
    plan = make_plan(root, rng.choice([1, 2, 3]), rng.choice([1e9, 12000, 6000]), CONSTS, base=(1, 2, 3),
                     exhaustive_limit=1e7)
    assert plan.stats.tree
    best = next(y for y in plan.yardsticks if y.name == "exhaustive")
    assert best.assign is not None
    if np.isinf(best.cost):
        assert np.isinf(plan.cost)
    else:
        assert plan.cost == pytest.approx(best.cost, rel=REL)


GRAPHS = {  # inputs in 32 KiB tiles: readable under any of the memory limits below
    "matrix chain": lambda: graphs.matrix_chain(leaf=graphs.shape_leaf(max_tile_bytes=32768)),
    "MLP": lambda: graphs.mlp(leaf=graphs.shape_leaf(max_tile_bytes=32768)),
    "transformer block": lambda: graphs.transformer_block(leaf=graphs.shape_leaf(max_tile_bytes=32768)),
    "LLaMA-shaped decoder (4 layers)": lambda: graphs.llama_decoder(
        layers=4, leaf=graphs.shape_leaf(max_tile_bytes=32768)),
}


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("workers, memory", [(2, 16e9), (3, 2e8), (2, 1e8)])
def test_dp_never_worse_than_a_preset(name, workers, memory):
    plan = make_plan(GRAPHS[name](), workers, memory, Constants())
    assert np.isfinite(plan.cost)
    for y in plan.yardsticks:
        if y.assign is not None and np.isfinite(y.cost):
            assert plan.cost <= y.cost * (1 + REL), (y.name, y.cost, plan.cost)
    text = plan.explain()
    assert "yardsticks" in text and "data parallel" in text and "Megatron" in text


def test_small_memory_forces_splits_and_presets_scale_up():
    plan = make_plan(graphs.mlp(batch=8192, leaf=graphs.shape_leaf(max_tile_bytes=32768)), 2, 1e8, Constants())
    assert any(max(op.parts.values()) > 1 for op in plan.ops)
    none = next(y for y in plan.yardsticks if y.name == "no split")
    assert np.isinf(none.cost)


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("memory", [16e9, 2e8, 1e8])
def test_plans_respect_the_memory_limit(name, memory):
    plan = make_plan(GRAPHS[name](), 2, memory, Constants(), yardsticks=False)
    for op in plan.ops:
        assert op.piece <= memory
        assert op.working_set / op.bands <= 2 * memory


def test_a_source_in_big_tiles_is_unreadable_under_a_small_budget():
    with pytest.raises(tra_sql.ShapeError, match="store it in smaller tiles"):
        make_plan(graphs.mlp(), 2, 2e7, Constants())


def test_llama_graph_shapes():
    root = graphs.llama_decoder(layers=2)
    plan = make_plan(root, 2, 4e9, Constants(), yardsticks=False)
    assert root.shape == (2048, 4096) and len(plan.ops) == 2 * 23
    assert "hqs" in {op.label.split("->")[-1].split()[0] for op in plan.ops}


# -- executing plans ----------------------------------------------------------------------

def _program(db, rng, case):
    """A small multi-step program over stored tensors, its numpy.einsum reference."""
    if case == "chain":
        arrays = [rng.random(s) for s in ((30, 20), (20, 25), (25, 12))]
        tiles = [(7, 20), (5, 6), (25, 12)]
        ts = [db.from_numpy(f"M{i}", a, tile=t, replace=True) for i, (a, t) in enumerate(zip(arrays, tiles))]
        return db.einsum("ij,jk,kl->il", *ts), arrays[0] @ arrays[1] @ arrays[2]
    if case == "shared":  # a DAG: A feeds two steps, the second reads the first's output too
        A, B = rng.random((24, 24)), rng.random((24, 10))
        tA, tB = db.from_numpy("A", A, tile=(5, 24), replace=True), db.from_numpy("B", B, tile=(24, 3), replace=True)
        S = db.einsum("ij,jk->ik", tA, tA)
        return db.einsum("ij,jk,ik->ik", S, tB, db.einsum("ij,jk->ik", tA, tB)), np.einsum(
            "ij,jk,ik->ik", A @ A, B, A @ B)
    X, W = rng.random((3, 16, 8)), rng.random((8, 5))
    tX, tW = db.from_numpy("X", X, tile=(1, 16, 8), replace=True), db.from_numpy("W", W, tile=(3, 5), replace=True)
    return db.einsum("bij,jk->ik", tX, tW), np.einsum("bij,jk->ik", X, W)


@pytest.mark.parametrize("case", ["chain", "shared", "batched"])
@pytest.mark.parametrize("workers, memory", [(2, 1e9), (3, 12000), (2, 6000)])
def test_executing_a_plan_matches_numpy(db, case, workers, memory):
    rng = np.random.default_rng(0)
    result, expected = _program(db, rng, case)
    plan = make_plan(result.node, workers, memory, CONSTS, base=(1, 2, 3, 5), yardsticks=False)
    np.testing.assert_allclose(result.numpy(plan=plan), expected, rtol=1e-10)
    stored = result.store("planned", replace=True, plan=plan)
    np.testing.assert_allclose(stored.numpy(), expected, rtol=1e-10)
    assert not [t for t in db.engine.con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
                if t[0].startswith("_tra_stage")]


def test_tight_memory_runs_in_bands_with_partial_sums(db):
    rng = np.random.default_rng(1)
    A, B = rng.random((40, 64)), rng.random((64, 30))
    C = db.einsum("ij,jk->ik", db.from_numpy("A", A, tile=(10, 16)), db.from_numpy("B", B, tile=(16, 10)))
    plan = make_plan(C.node, 1, 80000, CONSTS, base=(1, 2, 4), yardsticks=False)
    assert plan.staged and max(op.bands for op in plan.ops) > 1
    np.testing.assert_allclose(C.store("C", plan=plan).numpy(), A @ B, rtol=1e-10)


def test_out_of_core_bands_read_tiles_by_key_and_accumulate(tmp_path, monkeypatch):
    """Inputs whose scans do not fit run one contracted tile per statement: read through a
    key index, rekeyed to an unsplit contraction, adding the previous bands' partial sum; the
    statements of a BLAS product's bands run on one DuckDB thread (the kernel's BLAS uses every
    core), and the settings are restored after."""
    rng = np.random.default_rng(4)
    A, B = rng.standard_normal((64, 1024)), rng.standard_normal((1024, 48))
    threads = []
    insert = staged.DuckDBStages.insert
    monkeypatch.setattr(staged.DuckDBStages, "insert", lambda self, table, query: (
        threads.append(self.engine.setting("threads")), insert(self, table, query)))
    with tra_sql.connect(str(tmp_path / "ooc.duckdb"), threads=2) as db:
        C = db.einsum("ij,jk->ik", db.from_numpy("A", A, tile=(64, 128)), db.from_numpy("B", B, tile=(128, 48)))
        plan = db.plan(C, workers=2, memory="300KB")
        assert plan.ops[0].parts == {"i": 1, "j": 8, "k": 1} and plan.ops[0].bands == 8
        np.testing.assert_allclose(C.store("C", plan=plan).numpy(), A @ B, rtol=1e-10)
        assert threads == [1] * 8 and db.engine.setting("threads") == 2
        indexes = {r[0] for r in db.engine.con.execute("SELECT index_name FROM duckdb_indexes()").fetchall()}
        assert {"_tra_ix_A_k1", "_tra_ix_B_k0"} <= indexes
        assert not db.engine.con.execute("SELECT table_name FROM duckdb_tables() WHERE table_name LIKE '_tra_stage%'"
                                  ).fetchall()
        assert db.engine.con.execute("SELECT current_setting('disabled_optimizers')").fetchall()[0][0] == ""


def test_planned_extended_einsum_matches_the_program_as_written(db):
    rng = np.random.default_rng(2)
    x = db.from_numpy("x", rng.standard_normal((32, 12)), tile=(8, 12))
    layers = [(db.from_numpy(f"W{n}", rng.standard_normal((12, 12)), tile=(6, 6)),
               db.from_numpy(f"b{n}", rng.standard_normal(12), tile=(12,))) for n in range(3)]
    y = nn.mlp(db, x, layers)
    plan = make_plan(y.node, 2, 8000, CONSTS, base=(1, 2, 4), yardsticks=False)
    np.testing.assert_allclose(y.numpy(plan=plan), y.numpy(plan=False), rtol=1e-10)


def test_session_plan_api(db):
    rng = np.random.default_rng(3)
    A = db.from_numpy("A", rng.random((64, 48)), tile=(16, 16))
    B = db.from_numpy("B", rng.random((48, 32)), tile=(16, 16))
    C = db.einsum("ij,jk->ik", A, B)
    plan = db.plan(C, workers=3, memory="2MB")
    assert plan.workers == 3 and plan.memory == 2e6
    assert "Plan for" in plan.explain() and plan.explain("dot").startswith("digraph plan {")
    assert set(plan.breakdown()) >= {"kernel", "join", "repartition"}
    np.testing.assert_allclose(C.numpy(plan=plan), A.numpy() @ B.numpy(), rtol=1e-10)
    np.testing.assert_allclose(C.arrow(plan=plan).num_rows, len(C.arrow(plan=plan)))
    with pytest.raises(tra_sql.TraError, match="another tensor"):
        db.einsum("ij->ji", A).numpy(plan=plan)
    with pytest.raises(tra_sql.SpecError):
        db.plan(C, memory="lots")


def test_auto_plan_leaves_small_programs_alone(db):
    A = db.from_numpy("A", np.ones((8, 8)), tile=(2, 2))
    C = db.einsum("ij,jk->ik", A, A)
    assert auto(C) is None and AUTO_MIN_BYTES > 8 * 8 * 8
    np.testing.assert_allclose(C.numpy(), np.full((8, 8), 8.0))


def test_calibration_is_stored_and_used(db, monkeypatch):
    monkeypatch.setattr(cal, "kernels", lambda: {"peak_flops": 5e10, "half_flops": 1e6, "elem": 1e-9,
                                                 "copy_byte": 1e-10})
    monkeypatch.setattr(cal, "engine", lambda probe, threads, kern: {"stmt": 0.003, "row": 2e-5, "list_byte": 1e-9})
    consts = db.calibrate()
    assert consts.stmt == 0.003 and consts.peak_flops == 5e10
    assert db.engine.constants() == consts
    A = db.from_numpy("A", np.ones((8, 8)))
    assert db.plan(db.einsum("ij,jk->ik", A, A)).consts == consts


def test_planned_keyed_sums_add_their_sources(db, rng):
    """The planner's rebuild kept a keyed sum's sources but dropped ``add``: ``db.add(A, A)``
    under a plan came back as ``A``."""
    a, b = rng.standard_normal((6, 5)), rng.standard_normal((6, 5))
    A, B = db.from_numpy("A", a, tile=(2, 2)), db.from_numpy("B", b, tile=(3, 5))
    total = db.add(db.einsum("ij,ij->ij", A, B), A)
    plan = db.plan(total, workers=2, memory="1GB")
    np.testing.assert_allclose(total.numpy(plan=plan), a * b + a, rtol=1e-12)
    twice = db.add(A, A)
    np.testing.assert_allclose(twice.numpy(plan=db.plan(twice, workers=3, memory="1GB")), 2 * a)


def test_planned_gradient_with_a_keyed_sum_fan_out(db):
    """The fan-out of a gradient over a relation with empty blocks is a keyed sum; planned, it
    must still add up (it was off by up to 1.99)."""
    torch = pytest.importorskip("torch")
    db.engine.con.execute("CREATE TABLE pts AS SELECT * FROM (VALUES (0, 1, 1.5), (3, 2, -2.0)) t(i, j, v)").fetchall()
    E = db.relation("pts", keys=("i", "j"), value="v", shape=(4, 4), tile=(2, 2))
    X = np.arange(16.0).reshape(4, 4) / 10
    x = db.from_numpy("x", X, tile=(2, 2))
    y = db.einsum("ij,ij->ij", E, x)
    (gx,) = db.grad(db.einsum("ij,ij->", y, db.einsum("ij->ij", y, join="tanh(x0)")), [x])
    tx = torch.tensor(X, requires_grad=True)
    ty = torch.tensor(E.numpy()) * tx
    (ty * torch.tanh(ty)).sum().backward()
    np.testing.assert_allclose(gx.numpy(plan=db.plan(gx, workers=2, memory="1GB")), tx.grad.numpy(), atol=1e-12)


def test_failed_staged_plan_raises_a_tra_error_and_leaves_no_stage_table(db):
    """A corrupt tile met inside a staged plan is a ``TraError``; neither the step's table
    (created inside ``materialize``) nor a band's accumulator is left behind."""
    rng = np.random.default_rng(1)
    A, B = rng.random((40, 64)), rng.random((64, 30))
    C = db.einsum("ij,jk->ik", db.from_numpy("A", A, tile=(10, 16)), db.from_numpy("B", B, tile=(16, 10)))
    plan = make_plan(C.node, 1, 80000, CONSTS, base=(1, 2, 4), yardsticks=False)
    assert plan.staged and max(op.bands for op in plan.ops) > 1
    db.engine.con.execute('UPDATE "A" SET tile = tile[1:5] WHERE k0 = 3 AND k1 = 2').fetchall()  # truncated
    with pytest.raises(tra_sql.TraError):
        C.store("C", plan=plan)
    tables = [t for (t,) in db.engine.con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
    assert "C" not in tables and not [t for t in tables if t.startswith("_tra_stage")]


def test_calibration_measured_for_real_plans_correctly(db):
    """The calibration run as a user runs it (no stand-ins), then a plan under its constants."""
    consts = db.calibrate()
    measured = dataclasses.asdict(consts)
    assert consts.peak_flops > 0 and all(np.isfinite(v) and v >= 0 for v in measured.values()), measured
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((48, 40)), rng.standard_normal((40, 24))
    C = db.einsum("ij,jk->ik", db.from_numpy("A", a, tile=(16, 8)), db.from_numpy("B", b, tile=(8, 24)))
    plan = db.plan(C, workers=2, memory="20KB")
    assert plan.consts == consts
    np.testing.assert_allclose(C.numpy(plan=plan), a @ b, rtol=1e-10)


def test_plan_explains_itself_in_every_format_it_names(db, monkeypatch):
    A = db.from_numpy("A", np.ones((8, 8)), tile=(4, 4))
    plan = db.plan(db.einsum("ij,jk->ik", A, A), workers=2, memory="1GB")
    assert plan.explain().startswith("Plan for") and plan.explain("dot").startswith("digraph")
    described = json.loads(plan.explain("json"))
    assert described["workers"] == 2 and described["ops"][0]["parts"]
    with pytest.raises(tra_sql.SpecError, match="'png'"):
        plan.explain("png")
    if shutil.which("dot"):
        assert "<svg" in plan.explain("svg")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(tra_sql.TraError, match="install Graphviz"):
        plan.explain("svg")


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_plan_for_no_workers_is_an_error(db, workers):
    A = db.from_numpy("A", np.ones((8, 8)), tile=(4, 4))
    with pytest.raises(tra_sql.SpecError, match="workers"):
        db.plan(db.einsum("ij,jk->ik", A, A), workers=workers)
