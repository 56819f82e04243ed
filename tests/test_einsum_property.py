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


@st.composite
def ellipsis_cases(draw):
    batch = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2)))]
    sizes = {c: draw(st.integers(1, 4)) for c in "ijk"}
    subs, shapes = [], []
    for _ in range(draw(st.integers(1, 3))):
        sub = "".join(draw(st.sampled_from("ijk")) for _ in range(draw(st.integers(0, 2))))
        width = draw(st.integers(0, len(batch)))
        dims = [1 if draw(st.booleans()) else n for n in batch[len(batch) - width :]]
        subs.append("..." + sub)
        shapes.append(tuple(dims) + tuple(sizes[c] for c in sub))
    used = sorted(set("".join(subs).replace(".", "")))
    if draw(st.booleans()):
        spec = ",".join(subs)
    else:
        spec = ",".join(subs) + "->..." + "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
    tiles = [tuple(draw(st.integers(1, n)) for n in shape) for shape in shapes]
    return spec, shapes, tiles, draw(st.integers(0, 2**31))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ellipsis_cases())
def test_ellipsis_and_broadcasting_match_numpy(case):
    spec, shapes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in shapes]
    expected = np.einsum(spec, *arrays)
    with tra_sql.connect() as db:
        operands = [db.from_numpy(f"t{m}", a, tile=t) for m, (a, t) in enumerate(zip(arrays, tiles))]
        got = db.einsum(spec, *operands).numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)
