"""The native attention aggregate (udfs/native/attention.py) and the online-softmax body it
shares with the Arrow UDF (udfs/online_softmax.py): softmax(scale Q·K, mask)·V equals NumPy,
the Arrow path and torch SDPA over random shapes and tilings (several key tiles per output
tile, ragged, masked or not, fully masked rows, float32 and float64); the SQL is the same
text on both paths; merged states equal one fold; many key tiles on two threads; bad tiles
and bad calls by hand raise and the process survives."""

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql import nn
from tra_sql.compile import passes
from tra_sql.compile.dialect import DUCKDB
from tra_sql.compile.program import Program
from tra_sql.errors import CorruptTileError
from tra_sql.tensor import Tensor
from tra_sql.udfs import blas, cores, online_softmax
from tra_sql.udfs.native import loader
from tra_sql.udfs.protocol import Kernel

pytestmark = pytest.mark.skipif(loader.built() is None, reason="the native extension is not built")


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch):
    """Native kernels here, also when the suite runs with TRA_SQL_KERNELS=arrow."""
    monkeypatch.setenv("TRA_SQL_KERNELS", "native")


def reference(q, k, v, keep, scale):
    """softmax over s of scale * q·k where ``keep`` (the scores' trailing axes), times v; 0 for
    rows without a key."""
    S = np.einsum("bqhk,bshk->bhqs", q.astype(np.float64), k.astype(np.float64)) * scale
    S = np.where(keep, S, -np.inf)
    top = S.max(-1, keepdims=True)
    E = np.exp(S - np.where(np.isfinite(top), top, 0))
    total = E.sum(-1, keepdims=True)
    P = np.divide(E, total, out=np.zeros_like(E), where=total > 0)
    return np.einsum("bhqs,bshv->bqhv", P, v.astype(np.float64))


def attention(db, tag, arrays, tiles, scale):
    """The attention einsums (as ``nn.attention`` writes them) over tensors ``tag``q/k/v/m."""
    names = "qkvm"[: len(arrays)]
    Q, K, V, *M = (db.from_numpy(f"{tag}{n}", a, t, replace=True) for n, a, t in zip(names, arrays, tiles))
    S = db.einsum("Aqhk,Ashk->Ahqs", Q, K)
    return db.einsum("Ahqs,Ashv->Aqhv", nn.softmax(db, S, mask=M[0] if M else None, scale=scale), V)


def tolerance(dtype):
    return 2e-4 if dtype == np.float32 else 1e-10


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([np.float32, np.float64]), mask_rank=st.sampled_from([0, 2, 3, 4]), data=st.data())
def test_attention_equals_numpy_and_the_arrow_path(native, arrow, dtype, mask_rank, data):
    """Several key tiles per output tile (the update folds each), ragged tiles everywhere but
    the contracted head dimension (one tile, as the fusion needs); no mask, or a mask over the
    scores' trailing axes (q, s), (h, q, s) (broadcast over A) or (A, h, q, s), with a row that
    sees no key."""
    masked = bool(mask_rank)
    draw = lambda lo, hi, label: data.draw(st.integers(lo, hi), label=label)  # noqa: E731
    b, q, s, h, dk, dv = draw(1, 3, "b"), draw(1, 9, "q"), draw(2, 12, "s"), draw(1, 3, "h"), draw(1, 5, "dk"), \
        draw(1, 5, "dv")
    tq, ts, th, tb, tv = draw(1, q, "q tile"), draw(1, s - 1, "s tile"), draw(1, h, "h tile"), draw(1, b, "b tile"), \
        draw(1, dv, "dv tile")
    rng = np.random.default_rng(b * 1000 + q * 100 + s)
    arrays = [rng.standard_normal(shape).astype(dtype) for shape in [(b, q, h, dk), (b, s, h, dk), (b, s, h, dv)]]
    tiles = [(tb, tq, th, dk), (tb, ts, th, dk), (tb, ts, th, tv)]
    keep = np.ones((q, s), bool)
    if masked:
        keep = rng.random((b, h, q, s)[4 - mask_rank:]) > 0.4
        keep[..., q // 2, :] = False
        arrays.append(keep.astype(dtype))
        tiles.append((tb, th, tq, ts)[4 - mask_rank:])
    out = attention(native, "n", arrays, tiles, 0.7)
    sql = out.sql()
    assert f"TRA_ATTENTION_AGG_{np.dtype(dtype).name.upper()}_{len(arrays)}(" in sql and "ARRAY_AGG" not in sql
    fallback = attention(arrow, "n", arrays, tiles, 0.7)
    assert fallback.sql() == sql  # one text on both kernel paths
    got = out.numpy()
    tol = tolerance(dtype)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, reference(*arrays[:3], keep, 0.7), rtol=tol, atol=tol)
    np.testing.assert_allclose(got, fallback.numpy(), rtol=tol, atol=tol)
    if masked:
        assert not got[:, q // 2].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_causal_attention_equals_torch_sdpa(native, dtype):
    """``nn.attention``'s causal mask (a stored constant), key tiles of 8 of 24."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    b, q, h, d = 2, 24, 2, 8
    q_, k_, v_ = (rng.standard_normal((b, q, h, d)).astype(dtype) for _ in range(3))
    Q, K, V = (native.from_numpy(f"c{n}", a, (1, 8, h, d), replace=True) for n, a in zip("qkv", (q_, k_, v_)))
    S = native.einsum("Aqhk,Ashk->Ahqs", Q, K)
    mask = nn.causal_mask(native, q, q, dtype=np.dtype(dtype), tile=(8, 8))
    out = native.einsum("Ahqs,Ashv->Aqhv", nn.softmax(native, S, mask=mask, scale=d ** -0.5), V)
    assert "TRA_ATTENTION_AGG_" in out.sql()
    t = [torch.from_numpy(a.transpose(0, 2, 1, 3).copy()) for a in (q_, k_, v_)]
    want = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True).numpy().transpose(0, 2, 1, 3)
    np.testing.assert_allclose(out.numpy(), want, rtol=tolerance(dtype) * 10, atol=tolerance(dtype) * 10)


def test_the_arrow_udf_when_native_attention_is_switched_off(native):
    """``passes.fusions(off={"loops"})`` leaves ``tra_attention_<n>`` (the Arrow UDF) in a
    native session: the differential harness compares the two paths so."""
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(shape) for shape in [(1, 5, 2, 3), (1, 7, 2, 3), (1, 7, 2, 4)]]
    tiles = [(1, 5, 2, 3), (1, 3, 2, 3), (1, 3, 2, 4)]
    out = attention(native, "o", arrays, tiles, 0.5)
    with passes.fusions(off={"loops"}):
        sql = out.sql()
        off = out.numpy()
    assert "TRA_ATTENTION_3(" in sql and "TRA_ATTENTION_AGG" not in sql
    np.testing.assert_allclose(out.numpy(), off, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(off, reference(*arrays, np.ones((5, 7), bool), 0.5), rtol=1e-10, atol=1e-10)


def test_without_numpys_openblas_the_attention_runs_unfused(native, monkeypatch):
    """The kernel's body calls NumPy's bundled OpenBLAS; a NumPy built on another BLAS has none
    (``blas.FOUND`` false), and then the compiler leaves the attention's einsums unfused."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(shape) for shape in [(1, 5, 2, 3), (1, 7, 2, 3), (1, 7, 2, 4)]]
    out = attention(native, "u", arrays, [(1, 5, 2, 3), (1, 3, 2, 3), (1, 3, 2, 4)], 0.5)
    assert "TRA_ATTENTION" in out.sql()
    monkeypatch.setattr(blas, "FOUND", False)
    out = Tensor(native, out.node)  # a tensor's program is compiled once: compile it again, without the BLAS
    assert "TRA_ATTENTION" not in out.sql()
    np.testing.assert_allclose(out.numpy(), reference(*arrays, np.ones((5, 7), bool), 0.5), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merged_states_equal_one_fold(dtype):
    """The body's ``merge`` (the aggregate's combine): two states over halves of the keys,
    merged, equal one state over all of them; a side without weight (all masked) merges as 0."""
    rng = np.random.default_rng(5)
    B, R, S, D, C = 3, 150, 40, 4, 5  # more rows than a row block
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in [(B, R, D), (B, S, D), (B, S, C)])
    allowed = (rng.random((1, R, S)) > 0.3).astype(np.uint8)
    allowed[0, 7] = 0
    allowed[0, 9, :20] = 0  # a row with keys in the second half only

    def state(lo, hi):
        row_max, row_sum = np.full((B, R), -np.inf, dtype), np.zeros((B, R), dtype)
        acc = np.zeros((B, R, C), dtype)
        online_softmax.fold(q, np.ascontiguousarray(k[:, lo:hi]), np.ascontiguousarray(v[:, lo:hi]),
                            np.ascontiguousarray(allowed[:, :, lo:hi]), True, 0.5, row_max, row_sum, acc, cores.MUTEX)
        return row_max, row_sum, acc

    whole, first, second = state(0, S), state(0, 20), state(20, S)
    online_softmax.merge(*first, *second)
    for merged, one in zip(first, whole):
        np.testing.assert_allclose(merged, one, rtol=tolerance(dtype) * 10, atol=tolerance(dtype))
    out = np.empty((B, R, C), dtype)
    online_softmax.finish(first[1], first[2], out)
    keep = allowed[0].astype(bool)
    want = reference(q[:, :, None], k[:, :, None], v[:, :, None], keep, 0.5)[:, :, 0]
    np.testing.assert_allclose(out, want, rtol=tolerance(dtype) * 10, atol=tolerance(dtype) * 10)
    assert not out[:, 7].any()


def test_many_key_tiles_of_one_output_tile_on_two_threads(native):
    """130,000 key tiles (4 bytes each: inlined in their BLOB entries) into one output tile:
    DuckDB aggregates on both threads and combines the states."""
    rng = np.random.default_rng(4)
    n = 130_000
    q, k, v = rng.standard_normal((1, 2, 1, 1)), rng.standard_normal((1, n, 1, 1)), rng.standard_normal((1, n, 1, 1))
    arrays = [a.astype(np.float32) for a in (q, k, v)]
    out = attention(native, "w", arrays, [(1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)], 0.9)
    assert "TRA_ATTENTION_AGG_FLOAT32_3(" in out.sql()
    np.testing.assert_allclose(out.numpy(), reference(*arrays, np.ones((2, n), bool), 0.9), rtol=1e-3, atol=1e-4)


def _raw(db, tensor):
    """Run ``tensor``'s program as plain SQL (no check before it: only the kernels' own)."""
    program = Program.compile(tensor.node)
    db.engine.ensure_kernels(program.kernels)
    return db.engine.con.sql(program.sql()).fetchall()


@pytest.mark.parametrize("which", ["q", "k", "v", "m"])
@pytest.mark.parametrize("change, message", [("tile = NULL", "is NULL"),
                                             ("tile = '\\x01\\x02\\x03'::BLOB", "holds 3 bytes"),
                                             ("tile = tile || tile", "holds \\d+ bytes; its shape .* need")])
def test_corrupt_tiles_raise_and_the_process_survives(which, change, message):
    with tra_sql.connect() as db:
        rng = np.random.default_rng(8)
        arrays = [rng.standard_normal(shape).astype(np.float32) for shape in [(1, 4, 2, 3), (1, 6, 2, 3), (1, 6, 2, 2)]]
        arrays.append((rng.random((4, 6)) > 0.3).astype(np.float32))
        out = attention(db, "x", arrays, [(1, 2, 2, 3), (1, 3, 2, 3), (1, 3, 2, 2), (2, 3)], 0.5)
        want = out.numpy()
        db.engine.con.execute(f"UPDATE x{which} SET {change} WHERE k0 = 0")
        with pytest.raises(duckdb.Error, match=f"CorruptTileError: tile \\(0, [^)]*\\) of tensor 'x{which}' {message}"):
            _raw(db, out)
        with pytest.raises(CorruptTileError, match=f"x{which}"):
            out.numpy()
        restored = arrays["qkvm".index(which)]
        tile = [(1, 2, 2, 3), (1, 3, 2, 3), (1, 3, 2, 2), (2, 3)]["qkvm".index(which)]
        db.from_numpy(f"x{which}", restored, tile, replace=True)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def _step(db):
    """A native attention call's step literal (float32, no mask, one tile each)."""
    arrays = [np.ones(shape, np.float32) for shape in [(1, 2, 1, 1), (1, 2, 1, 1), (1, 2, 1, 1)]]
    out = attention(db, "h", arrays, [a.shape for a in arrays], 1.0)
    program = Program.compile(out.node)
    db.engine.ensure_kernels(program.kernels)  # the aggregates register with tra_attention_3
    text, _ = DUCKDB.render(program.query())
    return text.split("TRA_ATTENTION_AGG_FLOAT32_3('")[1].split("'")[0]


TILE = "'\\x00\\x00\\x80\\x3f\\x00\\x00\\x80\\x3f'::BLOB"  # two 1.0f


@pytest.mark.parametrize("function, step, keys, tile, message", [
    ("float32", "'not a step'", "[0, 0, 0, 0]", TILE, "the step of a native attention"),
    ("float32", "NULL", "[0, 0, 0, 0]", TILE, "is NULL"),
    ("float64", None, "[0, 0, 0, 0]", TILE, "another dtype"),
    ("float32", None, "[0, 1, 0, 0]", TILE, "outside the tensor's tile grid"),
    ("float32", None, "[0, 0, 0, 0]", "'\\x01'::BLOB", "holds 1 bytes"),
])
def test_calls_by_hand_raise_and_the_process_survives(native, function, step, keys, tile, message):
    good_step = _step(native)
    step = step or f"'{good_step}'"
    operands = f"{keys}, {tile}, [0, 0, 0, 0], {TILE}, [0, 0, 0, 0], {TILE}"
    with pytest.raises(duckdb.Error, match=message):
        native.engine.con.execute(f"SELECT tra_attention_agg_{function}_3({step}, [0, 0, 0, 0], {operands})").fetchall()
    good = (f"SELECT tra_attention_agg_float32_3('{good_step}', [0, 0, 0, 0], "
            f"{', '.join([f'[0, 0, 0, 0], {TILE}'] * 3)})")
    result = np.frombuffer(native.engine.con.execute(good).fetchall()[0][0], np.float32)
    np.testing.assert_allclose(result, [1.0, 1.0])


def test_a_step_of_another_arity_is_refused(native):
    """A step of Q, K, V passed to the function of four operands (a mask's) by hand."""
    step = _step(native)
    native.engine.ensure_kernels([Kernel("attention", 4)])
    operands = ", ".join([f"[0, 0, 0, 0], {TILE}"] * 3 + [f"[0, 0], {TILE}"])
    sql = f"SELECT tra_attention_agg_float32_4('{step}', [0, 0, 0, 0], {operands})"
    with pytest.raises(duckdb.Error, match="another number of operands"):
        native.engine.con.execute(sql).fetchall()


@pytest.mark.parametrize("v_sub, out_sub, v_shape", [("s", "", (7,)), ("sv", "v", (7, 2))])
def test_attention_without_query_rows(native, arrow, v_sub, out_sub, v_shape):
    """One query vector (no rows, no batch): a vector result, or a scalar one (rank 0)."""
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal(3), rng.standard_normal((7, 3)), rng.standard_normal(v_shape)
    results = []
    for db in (native, arrow):
        Q, K = db.from_numpy("rq", q, (3,), replace=True), db.from_numpy("rk", k, (3, 3), replace=True)
        V = db.from_numpy("rv", v, (3, *v_shape[1:]), replace=True)
        out = db.einsum(f"s,{v_sub}->{out_sub}", nn.softmax(db, db.einsum("k,sk->s", Q, K), scale=0.5), V)
        assert "TRA_ATTENTION_AGG_FLOAT64_3(" in out.sql()
        results.append(out.numpy())
    scores = k @ q * 0.5
    p = np.exp(scores - scores.max())
    want = np.tensordot(p / p.sum(), v, 1)
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, exp, rtol", [(np.float32, online_softmax._exp32, 3e-7),
                                              (np.float64, online_softmax._exp64, 1e-15)])
def test_the_bodys_exp(dtype, exp, rtol):
    """The vectorized exp of the weights: as NumPy's to a few ulp, exp(-inf) = 0, NaN stays NaN."""
    x = np.concatenate([-np.random.default_rng(1).random(10_000) * 80, [0.0, -np.inf, np.nan, -1e30]]).astype(dtype)
    got = x.copy()
    exp(got, dtype(0.5))
    want = np.exp((x - dtype(0.5)).astype(np.float64))  # of the difference as the body computes it
    np.testing.assert_allclose(got[:-4], want[:-4], rtol=rtol, atol=0)
    assert got[-4] == np.exp(dtype(-0.5)) and got[-3] == 0 and np.isnan(got[-2]) and got[-1] == 0
