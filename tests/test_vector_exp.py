"""The vectorizable ``exp`` (``udfs.vector_exp``) that loop kernels, tanh, sigmoid and the
online softmax compute with: as libm's to a few ulp over the whole range, the same limits."""

import numba
import numpy as np
import pytest

from tra_sql.udfs.vector_exp import exp32, exp64


@numba.njit
def _exp64_of(x, out):
    for i in range(len(x)):
        out[i] = exp64(x[i])


@numba.njit
def _exp32_of(x, out):
    for i in range(len(x)):
        out[i] = exp32(x[i])


SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan]


@pytest.mark.parametrize("dtype, kernel, low, high, maxulp", [
    (np.float64, _exp64_of, -760.0, 720.0, 3), (np.float32, _exp32_of, -110.0, 95.0, 1)])
def test_exp_is_libms_within_a_few_ulp_from_underflow_to_overflow(dtype, kernel, low, high, maxulp):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(low, high, 100_000), rng.uniform(-2, 2, 100_000), SPECIAL]).astype(dtype)
    got = np.empty_like(x)
    kernel(x, got)
    with np.errstate(over="ignore", under="ignore"):
        want = np.exp(x.astype(np.float64)).astype(dtype)  # libm's, float32 rounded once
    normal = np.isfinite(want) & (want >= np.finfo(dtype).tiny)
    np.testing.assert_array_max_ulp(got[normal], want[normal], maxulp=maxulp)
    subnormal = (want < np.finfo(dtype).tiny) & ~np.isnan(want)  # 0 included: within a subnormal ulp
    assert np.all(np.abs(got[subnormal] - want[subnormal]) <= np.finfo(dtype).smallest_subnormal)
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert np.array_equal(np.isnan(got), np.isnan(x))
    assert got.dtype == dtype and list(got[-5:-1]) == [1, 1, np.inf, 0]


def test_exp64_takes_a_float32_or_an_integer_as_a_double():
    assert exp64(np.float32(1.5)) == pytest.approx(np.exp(1.5), rel=4e-16)
    assert exp64(np.int64(3)) == pytest.approx(np.exp(3.0), rel=4e-16)
    assert exp64(np.float32(100.0)) == pytest.approx(np.exp(100.0), rel=4e-16)  # past float32's exp


def test_exp_and_sigmoid_are_duckdbs_within_3_ulp(db):
    """The join functions on ``exp64`` against DuckDB's own, on a DOUBLE's range."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-745, 709, 3000), rng.standard_normal(3000) * 3, [0.0, -0.0, np.inf, -np.inf]])
    tensor = db.from_numpy("v", x, tile=(1024,))
    for join, duckdb_sql in (("exp(x0)", "exp(v)"), ("sigmoid(x0)", "1.0 / (1.0 + exp(-v))")):
        rows = db.engine.con.execute(f"SELECT {duckdb_sql} FROM (SELECT unnest(?::DOUBLE[]) AS v, "
                                     "generate_subscripts(?, 1) AS i) ORDER BY i", [x.tolist(), x.tolist()]).fetchall()
        want = np.array([r[0] for r in rows])
        got = db.einsum("i->i", tensor, join=join).numpy()
        normal = np.isfinite(want) & (want >= np.finfo(np.float64).tiny)
        np.testing.assert_array_max_ulp(got[normal], want[normal], maxulp=3)
        np.testing.assert_allclose(got[~normal], want[~normal], rtol=0, atol=np.finfo(np.float64).smallest_subnormal)
