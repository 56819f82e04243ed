"""Property tests: random einsum specs, shapes and tilings (ragged included) against numpy."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql

LETTERS = "abcdE"


@st.composite
def einsum_cases(draw):
    sizes = {c: draw(st.integers(1, 6)) for c in LETTERS}
    n_operands = draw(st.integers(1, 3))
    subs = []
    for _ in range(n_operands):
        rank = draw(st.integers(0, 3))
        subs.append("".join(draw(st.sampled_from(LETTERS)) for _ in range(rank)))
    used = sorted(set("".join(subs)))
    explicit = draw(st.booleans())
    if explicit:
        output = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
        spec = ",".join(subs) + "->" + output
    else:
        spec = ",".join(subs)
    arrays, tiles = [], []
    for sub in subs:
        shape = tuple(sizes[c] for c in sub)
        arrays.append(draw(st.integers(0, 2**31)).__index__())
        tiles.append(tuple(draw(st.integers(1, n)) for n in shape))
    dtype = draw(st.sampled_from(["float64", "float32", "int64"]))
    return spec, subs, sizes, arrays, tiles, dtype


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_cases())
def test_einsum_matches_numpy(case):
    spec, subs, sizes, seeds, tiles, dtype = case
    arrays = []
    for sub, seed in zip(subs, seeds):
        rng = np.random.default_rng(seed)
        shape = tuple(sizes[c] for c in sub)
        arrays.append((rng.integers(-3, 4, shape) if dtype == "int64" else rng.standard_normal(shape)).astype(dtype))
    expected = np.einsum(spec, *arrays)
    with tra_sql.connect() as db:
        operands = [db.from_numpy(f"t{m}", a, tile=t) for m, (a, t) in enumerate(zip(arrays, tiles))]
        result = db.einsum(spec, *operands)
        got = result.numpy()
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype
    tol = 1e-4 if dtype == "float32" else 1e-9
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
