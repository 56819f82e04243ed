"""Native loop kernels (``tra_loop_<n>``, udfs/native/loops.py and contract.KERNEL): dense float
steps with any join and aggregation, any number of operands, scalars and broadcast operands,
with or without an element-wise epilogue, equal NumPy and the Arrow path; the SQL calls the
native kind and an out-of-scope step still runs through Arrow; corrupt tiles of an n-ary
step's operand and of an epilogue's operand raise CorruptTileError and the process survives;
two DuckDB threads."""

import re

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql import nn
from tra_sql.compile.program import Program
from tra_sql.errors import CorruptTileError
from tra_sql.udfs.contract import native_loop
from tra_sql.udfs.native import loader
from tra_sql.udfs.protocol import EinsumStep, Kernel

pytestmark = pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")

PER_ROW_UDF = re.compile(r"tra_einsum_\d+\(\s*'([^']*)'", re.I)  # an Arrow per-row call and its step
#: (join, its NumPy form) per operand count
JOINS = {
    1: [("exp(x0)", lambda x: np.exp(x)), ("greatest(x0, 0.0)", lambda x: np.maximum(x, 0.0))],
    2: [(None, lambda x, y: x * y), ("x0 - x1", lambda x, y: x - y), ("greatest(x0, x1)", np.maximum),
        ("x0 * CASE WHEN x1 > 0.0 THEN 1 ELSE 0 END", lambda x, y: x * (y > 0))],
    3: [(None, lambda x, y, z: x * y * z), ("x0 * x1 + x2", lambda x, y, z: x * y + z)],
}
SPECS = ["ij->i", "ij->", "ij,ij->", "ij->ji", "ij,jk->ik", "ij,ij->ij", "ij,j->ij", "ij,jk->ki", "i,j->ij", ",ij->ij",
         "ij,jk,k->i", "ij,ij,->ij", "ijk,ik->ij"]
AGGS = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """Native kernels here, also when the suite runs with TRA_SQL_KERNELS=arrow."""
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")


def expected(spec: str, join, agg: str, arrays: list[np.ndarray]) -> np.ndarray:
    """The einsum on NumPy: every operand broadcast over all indices, joined, aggregated."""
    inputs, output = spec.split("->")
    inputs = inputs.split(",")
    letters = sorted(set("".join(inputs)))
    views = []
    for sub, a in zip(inputs, arrays):
        a = a.astype(np.float64)
        order = sorted(sub, key=letters.index)
        a = np.transpose(a, [sub.index(c) for c in order]) if sub else a
        views.append(a.reshape([a.shape[order.index(c)] if c in sub else 1 for c in letters]))
    joined = join(*views)
    joined = np.broadcast_to(joined, np.broadcast_shapes(*(v.shape for v in views)))
    aggregated = tuple(d for d, c in enumerate(letters) if c not in output)
    kept = [c for c in letters if c in output]
    result = AGGS[agg](joined, axis=aggregated) if aggregated else joined
    return np.transpose(result, [kept.index(c) for c in output]) if output else result


def _tensors(db, arrays, tilings, tag):
    return [db.from_numpy(f"{tag}{m}", a, t, replace=True) for m, (a, t) in enumerate(zip(arrays, tilings))]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=st.sampled_from(SPECS), agg=st.sampled_from(sorted(AGGS)), dtype=st.sampled_from([np.float32, np.float64]),
       data=st.data())
def test_loops_equal_numpy_and_the_arrow_path(native, arrow, spec, agg, dtype, data):
    inputs = spec.split("->")[0].split(",")
    join, numpy_join = data.draw(st.sampled_from(JOINS[len(inputs)]), label="join")
    letters = sorted(set(spec) - set(",->"))
    sizes = {c: data.draw(st.integers(1, 7), label=f"size {c}") for c in letters}
    tiles = {c: data.draw(st.integers(1, sizes[c]), label=f"tile {c}") for c in letters}
    rng = np.random.default_rng(len(spec))
    arrays = [rng.uniform(0.5, 1.5, [sizes[c] for c in sub]).astype(dtype) for sub in inputs]
    tilings = [tuple(tiles[c] for c in sub) for sub in inputs]
    results = []
    for db, tag in ((native, "n"), (arrow, "a")):
        result = db.einsum(spec, *_tensors(db, arrays, tilings, tag), join=join, agg=agg)
        sql = result.sql()
        if db is native:  # every per-row step a native loop computes is native (a product BLAS
            # reads only after a copy stays with the Arrow UDF's np.matmul: ``native_loop``)
            steps = [EinsumStep.decode(text) for text in PER_ROW_UDF.findall(sql)]
            assert not any(native_loop(step) for step in steps), sql
        results.append(result.numpy())
    want = expected(spec, numpy_join, agg, arrays)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    assert results[0].dtype == dtype
    np.testing.assert_allclose(results[0], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(results[0], results[1], rtol=tol, atol=tol)


EPILOGUES = [("greatest(x0 + x1, 0.0)", lambda h, b: np.maximum(h + b, 0.0)), ("x0 + x1", lambda h, b: h + b),
             ("x0 * CASE WHEN x1 > 0.0 THEN 1 ELSE 0 END", lambda h, b: h * (b > 0))]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(epilogue=st.sampled_from(EPILOGUES), dtype=st.sampled_from([np.float32, np.float64]),
       loop=st.booleans(), data=st.data())
def test_products_with_an_epilogue(native, arrow, epilogue, dtype, loop, data):
    """``relu(x @ w + b)`` and the like: the product (BLAS, or with ``loop`` a loop kernel: an
    index summed in one operand only) and the element-wise epilogue over a broadcast operand in
    one native call."""
    join, numpy_join = epilogue
    sizes = {c: data.draw(st.integers(1, 9), label=f"size {c}") for c in "Akio"}
    tiles = {c: data.draw(st.integers(1, sizes[c]), label=f"tile {c}") for c in "Ao"} | \
        {"i": sizes["i"], "k": sizes["k"]}
    rng = np.random.default_rng(5)
    x = rng.standard_normal((sizes["A"], sizes["k"], sizes["i"]) if loop else (sizes["A"], sizes["i"])).astype(dtype)
    w = rng.standard_normal((sizes["i"], sizes["o"])).astype(dtype)
    b = rng.standard_normal(sizes["o"]).astype(dtype)
    spec = "Aki,io->Ao" if loop else "Ai,io->Ao"
    results = []
    for db, tag in ((native, "n"), (arrow, "a")):
        X = db.from_numpy(f"{tag}x", x, tuple(tiles[c] for c in spec.split(",")[0]), replace=True)
        W = db.from_numpy(f"{tag}w", w, (tiles["i"], tiles["o"]), replace=True)
        B = db.from_numpy(f"{tag}b", b, (tiles["o"],), replace=True)
        out = db.einsum("Ao,o->Ao", db.einsum(spec, X, W), B, join=join)
        sql = out.sql().lower()
        if db is native:
            assert "tra_loop_3(" in sql and not PER_ROW_UDF.search(sql), sql
        results.append(out.numpy())
    product = (x.astype(np.float64).sum(1) if loop else x.astype(np.float64)) @ w
    want = numpy_join(product, b.astype(np.float64))
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(results[0], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(results[0], results[1], rtol=tol, atol=tol)


def test_adams_update_with_scalar_operands(native):
    """Six operands, two of them scalars (``''``): Adam's element-wise update."""
    rng = np.random.default_rng(6)
    p, g, m, v = (rng.uniform(0.1, 1.0, (10, 6)).astype(np.float32) for _ in range(4))
    lr, eps = np.float32(0.01), np.float32(1e-8)
    tensors = [native.from_numpy(f"adam{k}", a, (4, 6), replace=True) for k, a in enumerate((p, g, m, v))]
    tensors += [native.from_numpy("lr", np.array(lr)), native.from_numpy("eps", np.array(eps))]
    out = native.einsum("ab,ab,ab,ab,,->ab", *tensors, join="x0 - x4 * x2 / (sqrt(x3) + x5) + 0.0 * x1")
    assert "tra_loop_6(" in out.sql().lower()
    np.testing.assert_allclose(out.numpy(), p - lr * m / (np.sqrt(v) + eps), rtol=1e-6)


def test_out_of_scope_steps_stay_arrow_udfs(native):
    """Integer tiles and mixed dtypes keep ``tra_einsum_<n>``; a product BLAS reads only after
    a copy keeps the Arrow UDF's ``np.matmul``."""
    x = np.arange(12).reshape(3, 4)
    ints = native.einsum("ij,ij->ij", native.from_numpy("ix", x), native.from_numpy("iy", x), join="x0 + x1")
    assert PER_ROW_UDF.search(ints.sql().lower()) and "tra_loop_" not in ints.sql().lower()
    np.testing.assert_array_equal(ints.numpy(), 2 * x)
    mixed = native.einsum("ij,ij->ij", native.from_numpy("fx", x.astype(np.float32)),
                          native.from_numpy("dx", x.astype(np.float64)), join="x0 - x1")
    assert "tra_loop_" not in mixed.sql().lower()
    np.testing.assert_array_equal(mixed.numpy(), np.zeros((3, 4)))
    a = np.random.default_rng(7).standard_normal((3, 4, 5))
    copy = native.einsum("ijk,jl->ilk", native.from_numpy("t3", a), native.from_numpy("t2", a[0]))
    assert "tra_loop_" not in copy.sql().lower()
    np.testing.assert_allclose(copy.numpy(), np.einsum("ijk,jl->ilk", a, a[0]), rtol=1e-10)


def test_the_scope(native):
    step = EinsumStep(("ij", "jk"), "ik", {"i": 2, "j": 2, "k": 2}, {"i": 2, "j": 2, "k": 2},
                      ("float32", "float32"), "float32", ("x", "y"), join="x0 - x1")
    assert native_loop(step)
    assert not native_loop(EinsumStep(**{**step.__dict__, "dtypes": ("float32", "float64")}))
    assert not native_loop(EinsumStep(**{**step.__dict__, "layouts": ("csr", "dense"), "out_layout": "csr"}))
    assert not native_loop(EinsumStep(**{**step.__dict__, "dtypes": ("int64",) * 2, "out_dtype": "int64"}))


def _raw(db, tensor):
    """Run ``tensor``'s program as plain SQL (no check before it: only the kernels' own)."""
    program = Program.compile(tensor.node)
    db.engine.ensure_kernels(program.kernels)
    return db.engine.con.sql(program.sql().lower()).fetchall()


CORRUPTIONS = [("tile = NULL", "is NULL"), ("tile = '\\x01\\x02\\x03'::BLOB", "holds 3 bytes"),
               ("tile = tile || tile", "holds {twice} bytes; its shape \\({shape}\\) and dtype float32 need {once}")]


@pytest.mark.parametrize("change, message", CORRUPTIONS)
@pytest.mark.parametrize("which", ["operand", "epilogue"])
def test_corrupt_tiles_raise_and_the_process_survives(change, message, which):
    """A bad tile of the third operand of a loop or of the epilogue's bias."""
    with tra_sql.connect() as db:
        rng = np.random.default_rng(8)
        x, w, s, b = (rng.standard_normal(shape).astype(np.float32) for shape in [(6, 5), (5, 4), (5,), (4,)])
        db.from_numpy("x", x, (4, 5))
        db.from_numpy("w", w, (5, 4))
        db.from_numpy("s", s, (5,))
        db.from_numpy("b", b, (4,))
        if which == "operand":
            out, name, nbytes, shape = db.einsum("Ai,io,i->Ao", "x", "w", "s", join="x0 * x1 - x2"), "s", 20, "5"
        else:
            out, name, nbytes, shape = db.einsum("Ao,o->Ao", db.einsum("Ai,io->Ao", "x", "w"), "b",
                                                 join="greatest(x0 + x1, 0.0)"), "b", 16, "4"
        assert "tra_loop_3(" in out.sql().lower()
        want = out.numpy()
        db.engine.con.execute(f"UPDATE {name} SET {change} WHERE k0 = 0")
        message = message.format(twice=2 * nbytes, once=nbytes, shape=shape)
        with pytest.raises(duckdb.Error, match=f"CorruptTileError: tile \\(0\\) of tensor '{name}' {message}"):
            _raw(db, out)
        with pytest.raises(CorruptTileError):
            out.numpy()
        db.from_numpy(name, {"s": s, "b": b}[name], (5,) if name == "s" else (4,), replace=True)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def test_a_shared_index_of_another_extent_raises(native):
    """Tiles joined on an index must agree on its extent (a call written by hand: the ragged
    last tile of ``j`` on one side, a full one on the other)."""
    step = EinsumStep(("ij", "j"), "ij", {"i": 2, "j": 3}, {"i": 2, "j": 2}, ("float32",) * 2, "float32",
                      ("m", "v"), join="x0 + x1")
    four = "'\\x00\\x00\\x80\\x3f'::BLOB"
    eight = f"{four} || {four}"
    native.engine.ensure_kernels([Kernel("loop", 2)])
    good = f"SELECT tra_loop_2('{step.encode()}', [0, 1], [0, 1], {eight}, [1], {four})"
    assert native.engine.con.execute(good).fetchall()[0][0] == np.full(2, 2.0, np.float32).tobytes()
    bad = f"SELECT tra_loop_2('{step.encode()}', [0, 1], [0, 1], {eight}, [0], {eight})"
    outside = f"SELECT tra_loop_2('{step.encode()}', [0, 1], [0, 1], {eight}, [7], {four})"
    with pytest.raises(duckdb.Error, match="CorruptTileError: tile \\(7\\) of tensor 'v' is outside"):
        native.engine.con.execute(outside).fetchall()
    with pytest.raises(duckdb.Error, match="CorruptTileError: tile \\(0\\) of tensor 'v' differs in a shared "
                                           "index's extent from the tile of 'm'"):
        native.engine.con.execute(bad).fetchall()
    assert native.engine.con.execute("SELECT 1").fetchall() == [(1,)]


def test_many_rows_on_two_threads(native):
    """130,000 row tiles of an element-wise loop with a broadcast operand: both threads."""
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((130_000, 2)).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    out = native.einsum("ij,j->ij", native.from_numpy("tall", x, (1, 2), replace=True),
                        native.from_numpy("row", y, replace=True), join="greatest(x0 * x1, 0.0)")
    assert "tra_loop_2(" in out.sql().lower()
    np.testing.assert_allclose(out.numpy(), np.maximum(x * y, 0.0), rtol=1e-6)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_chains_equal_numpy_and_the_arrow_path(native, arrow, dtype, data):
    """An MLP's layers at inference (``nn.mlp``: a chain of BLAS products, bias epilogues and
    ReLUs) in one ``tra_loop_chain_<n>`` call per row tile."""
    n, f, h, c = (data.draw(st.integers(1, 9), label=label) for label in ("rows", "features", "hidden", "classes"))
    rows = data.draw(st.integers(1, n), label="row tile")
    rng = np.random.default_rng(10)
    x = rng.standard_normal((n, f)).astype(dtype)
    weights = [rng.standard_normal(shape).astype(dtype) for shape in [(f, h), (h,), (h, c), (c,)]]
    results = []
    for db, tag in ((native, "n"), (arrow, "a")):
        w1, b1, w2, b2 = (db.from_numpy(f"{tag}mlp{k}", w, replace=True) for k, w in enumerate(weights))
        out = nn.mlp(db, db.from_numpy(f"{tag}mlpx", x, (rows, f), replace=True), [(w1, b1), (w2, b2)])
        sql = out.sql().lower()
        assert "tra_loop_chain_" in sql, sql  # (on both paths: the Arrow path's is the tra_chain_<n> UDF)
        results.append(out.numpy())
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)
    want = np.maximum(x.astype(np.float64) @ w1 + b1, 0) @ w2 + b2
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(results[0], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(results[0], results[1], rtol=tol, atol=tol)


@pytest.mark.parametrize("change, message", CORRUPTIONS)
def test_a_corrupt_leaf_of_a_chain_raises(change, message):
    with tra_sql.connect() as db:
        rng = np.random.default_rng(11)
        x, w1, b1, w2, b2 = (rng.standard_normal(s).astype(np.float32) for s in [(6, 4), (4, 5), (5,), (5, 2), (2,)])
        put = db.from_numpy
        layers = [(put("w1", w1), put("b1", b1)), (put("w2", w2), put("b2", b2))]
        out = nn.mlp(db, db.from_numpy("x", x, (3, 4)), layers)
        assert "tra_loop_chain_" in out.sql().lower()
        want = out.numpy()
        db.engine.con.execute(f"UPDATE b1 SET {change} WHERE k0 = 0")
        message = message.format(twice=40, once=20, shape="5")
        with pytest.raises(duckdb.Error, match=f"CorruptTileError: tile \\(0\\) of tensor 'b1' {message}"):
            _raw(db, out)
        with pytest.raises(CorruptTileError):
            out.numpy()
        db.from_numpy("b1", b1, replace=True)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([np.float32, np.float64]), affine=st.booleans(), data=st.data())
def test_steps_with_a_prologue_run_as_native_chains(native, arrow, dtype, affine, data):
    """Layer norm (a step whose mean and variance operands its prologue computes) as one
    ``tra_loop_chain_<n>`` call per row tile (``contract.prologue_chain``)."""
    n, f = data.draw(st.integers(1, 9), label="rows"), data.draw(st.integers(1, 9), label="features")
    rows = data.draw(st.integers(1, n), label="row tile")
    rng = np.random.default_rng(12)
    x, g, c = rng.standard_normal((n, f)).astype(dtype), rng.standard_normal(f).astype(dtype), \
        rng.standard_normal(f).astype(dtype)
    results = []
    for db, tag in ((native, "n"), (arrow, "a")):
        extra = [db.from_numpy(f"{tag}g", g, replace=True), db.from_numpy(f"{tag}c", c, replace=True)] if affine else []
        out = nn.layer_norm(db, db.from_numpy(f"{tag}lx", x, (rows, f), replace=True), *extra)
        sql = out.sql().lower()
        assert "tra_loop_chain_" in sql and '"prologue"' not in sql and not PER_ROW_UDF.search(sql), sql
        results.append(out.numpy())
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    want = want * g + c if affine else want
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(results[0], want, rtol=tol, atol=tol)
    np.testing.assert_allclose(results[0], results[1], rtol=tol, atol=tol)


def test_a_chain_over_many_rows_on_two_threads(native):
    """130,000 row tiles through a two-layer chain: both threads, each with its step buffers."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((130_000, 2)).astype(np.float32)
    w1, b1, w2, b2 = (rng.standard_normal(s).astype(np.float32) for s in [(2, 3), (3,), (3, 2), (2,)])
    put = native.from_numpy
    layers = [(put("cw1", w1, replace=True), put("cb1", b1, replace=True)),
              (put("cw2", w2, replace=True), put("cb2", b2, replace=True))]
    out = nn.mlp(native, put("ctall", x, (1, 2), replace=True), layers)
    assert "tra_loop_chain_" in out.sql().lower()
    np.testing.assert_allclose(out.numpy(), np.maximum(x @ w1 + b1, 0) @ w2 + b2, rtol=1e-5, atol=1e-5)
