"""Extended einsum: custom join expressions and sum/max/min/prod aggregation."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql.udfs.expr import join_code

JOINS = {
    1: [("x0", lambda a: a), ("abs(x0)", np.abs), ("exp(x0)", np.exp), ("greatest(x0, 0)", lambda a: np.maximum(a, 0)),
        ("CASE WHEN x0 > 1 THEN x0 ELSE 0.5 * x0 END", lambda a: np.where(a > 1, a, 0.5 * a)),
        ("sigmoid(x0)", lambda a: 1 / (1 + np.exp(-a))), ("tanh(x0) + sqrt(x0)", lambda a: np.tanh(a) + np.sqrt(a))],
    2: [("x0 + x1", np.add), ("x0 - x1", np.subtract), ("greatest(x0 + x1, 2)", lambda a, b: np.maximum(a + b, 2)),
        ("exp(x0 - x1)", lambda a, b: np.exp(a - b)), ("least(x0, x1)", np.minimum),
        ("pow(x0 - x1, 2)", lambda a, b: (a - b) ** 2), ("ln(x0) * log(x1)", lambda a, b: np.log(a) * np.log10(b))],
    3: [("x0 * x1 + x2", lambda a, b, c: a * b + c),
        ("greatest(x0, x1, x2)", lambda a, b, c: np.maximum(np.maximum(a, b), c))],
}
REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def reference(inputs, output, arrays, fn, agg):
    """Extended einsum in NumPy: broadcast every operand over all indices, join, reduce."""
    indices = list(dict.fromkeys("".join(inputs) + output))
    sizes = {c: n for sub, a in zip(inputs, arrays) for c, n in zip(sub, a.shape)}
    views = []
    for sub, a in zip(inputs, arrays):
        unique = "".join(dict.fromkeys(sub))
        diagonal = np.einsum(f"{sub}->{unique}", a)
        ordered = np.transpose(diagonal, [unique.index(c) for c in indices if c in unique])
        views.append(ordered.reshape([sizes[c] if c in unique else 1 for c in indices]))
    joined = np.broadcast_to(fn(*views), [sizes[c] for c in indices])
    axes = tuple(i for i, c in enumerate(indices) if c not in output)
    reduced = REDUCE[agg](joined, axis=axes) if axes else joined
    kept = [c for c in indices if c in output]
    return np.transpose(reduced, [kept.index(c) for c in output])


@st.composite
def cases(draw):
    n = draw(st.integers(1, 3))
    sizes = {c: draw(st.integers(1, 5)) for c in "abcd"}
    subs = ["".join(draw(st.sampled_from("abcd")) for _ in range(draw(st.integers(0, 3)))) for _ in range(n)]
    used = sorted(set("".join(subs)))
    output = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
    tiles = [tuple(draw(st.integers(1, sizes[c])) for c in sub) for sub in subs]
    join = draw(st.sampled_from(JOINS[n]))
    return subs, output, sizes, tiles, join, draw(st.sampled_from(sorted(REDUCE))), draw(st.integers(0, 2**31))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_extended_einsum_matches_reference(case):
    subs, output, sizes, tiles, (join, fn), agg, seed = case
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(0.5, 1.5, [sizes[c] for c in sub]) for sub in subs]
    spec = ",".join(subs) + "->" + output
    expected = reference(subs, output, arrays, fn, agg)
    with tra_sql.connect() as db:
        operands = [db.from_numpy(f"t{m}", a, tile=t) for m, (a, t) in enumerate(zip(arrays, tiles))]
        got = db.einsum(spec, *operands, join=join, agg=agg).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


def test_softmax_in_three_einsums(db, rng):
    x = rng.standard_normal((7, 9)) * 30
    X = db.from_numpy("X", x, tile=(3, 4))
    m = db.einsum("ij->i", X, agg="max")
    s = db.einsum("ij,i->i", X, m, join="exp(x0 - x1)")
    p = db.einsum("ij,i,i->ij", X, m, s, join="exp(x0 - x1) / x2")
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(p.numpy(), e / e.sum(axis=1, keepdims=True), rtol=1e-12)


def test_integer_operands_with_join_compute_in_float(db):
    X = db.from_numpy("X", np.array([[1, 2], [3, 4]], dtype=np.int32))
    half = db.einsum("ij->i", X, join="x0 / 2")
    assert half.dtype == np.float64
    np.testing.assert_array_equal(half.numpy(), [1.5, 3.5])
    np.testing.assert_array_equal(db.einsum("ij->j", X, agg="max").numpy(), [3, 4])


def test_infinity_and_erf_constants():
    assert join_code("'-inf'::DOUBLE", 1) == "(-math.inf)"
    assert join_code("erf(x0)", 1) == "math.erf(x0)"


@pytest.mark.parametrize("join, message", [
    ("foo(x0)", "unknown function foo"),
    ("sigmoid(x0, x1)", "takes 1 argument"),
    ("x0 + x3", "refers to x3 but the einsum has 2 operand"),
    ("y + 1", "unknown name 'y'"),
    ("x0 +", "does not parse"),
    ("'a'", "not a number"),
    ("substring(x0, 1)", "not supported"),
])
def test_bad_join_expressions(db, join, message):
    A = db.from_numpy("A", np.ones((2, 2)))
    with pytest.raises(tra_sql.SpecError, match=message):
        db.einsum("ij,jk->ik", A, A, join=join)


def test_bad_aggregate(db):
    A = db.from_numpy("A", np.ones(2))
    with pytest.raises(tra_sql.SpecError, match="agg='avg'"):
        db.einsum("i->", A, agg="avg")


def test_tanh_is_duckdbs_within_4_ulp(db):
    """``tanh`` (``functions.TANH``: exp and, below 0.3, a Taylor polynomial, in float64) gives
    what DuckDB's own ``tanh`` of a DOUBLE gives within 4 ulp, with the same signed zeros,
    limits and NaN, on float64 and float32 tiles (a float32 tile's result rounded once)."""
    rng = np.random.default_rng(0)
    scales = [1e-300, 1e-20, 1e-9, 1e-4, 0.05, 0.2, 0.29, 0.31, 0.5, 1, 3, 10, 19, 25, 400, 1e300]
    values = np.concatenate([rng.standard_normal(2000) * s for s in scales]
                            + [np.linspace(-1, 1, 4001), [0.0, -0.0, 0.3, -0.3, np.inf, -np.inf, np.nan]])
    for dtype in (np.float64, np.float32):
        x = np.clip(values, -1e38, 1e38).astype(dtype)
        rows = db.engine.con.execute("SELECT tanh(v) FROM (SELECT unnest(?::DOUBLE[]) AS v, generate_subscripts(?, 1) "
                                     "AS i) ORDER BY i", [x.tolist(), x.tolist()]).fetchall()
        want = np.array([np.nan if r[0] is None else r[0] for r in rows]).astype(dtype)
        got = db.einsum("i->i", db.from_numpy(f"v_{dtype.__name__}", x, tile=(4096,)), join="tanh(x0)").numpy()
        finite = np.isfinite(want)
        np.testing.assert_array_max_ulp(got[finite], want[finite], maxulp=4 if dtype == np.float64 else 1)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
