"""Structural ops (re-tile, slice, index, reshape, transpose, concat, fill) run in SQL."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, max_rank=3):
    shape = tuple(draw(st.integers(1, 7)) for _ in range(draw(st.integers(1, max_rank))))
    tile = tuple(draw(st.integers(1, n)) for n in shape)
    return shape, tile, draw(st.integers(0, 2**31))


def stored(db, name, shape, tile, seed):
    array = np.random.default_rng(seed).standard_normal(shape)
    return db.from_numpy(name, array, tile=tile), array


@SETTINGS
@given(tensors(), st.data())
def test_slices_match_numpy(case, data):
    shape, tile, seed = case
    index = []
    for n in shape:
        if data.draw(st.booleans()):
            index.append(data.draw(st.integers(-n, n - 1)))
        else:
            start = data.draw(st.integers(0, n - 1))
            index.append(slice(start, data.draw(st.integers(start + 1, n))))
    with tra_sql.connect() as db:
        t, array = stored(db, "A", shape, tile, seed)
        got = t[tuple(index)]
        np.testing.assert_array_equal(got.numpy(), array[tuple(index)])


@SETTINGS
@given(tensors(), st.data())
def test_reshape_matches_numpy(case, data):
    shape, tile, seed = case
    size = int(np.prod(shape))
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    target = (data.draw(st.sampled_from(divisors)),)
    target = target + (size // target[0],) if data.draw(st.booleans()) else (size,) if target[0] == size else \
        target + (-1,)
    with tra_sql.connect() as db:
        t, array = stored(db, "A", shape, tile, seed)
        np.testing.assert_array_equal(t.reshape(target).numpy(), array.reshape(target))


@SETTINGS
@given(tensors(), st.data())
def test_retile_and_transpose_match_numpy(case, data):
    shape, tile, seed = case
    new_tile = tuple(data.draw(st.integers(1, n)) for n in shape)
    perm = data.draw(st.permutations(range(len(shape))))
    with tra_sql.connect() as db:
        t, array = stored(db, "A", shape, tile, seed)
        np.testing.assert_array_equal(t.retile(new_tile).numpy(), array)
        np.testing.assert_array_equal(t.transpose(*perm).numpy(), array.transpose(perm))


@SETTINGS
@given(tensors(), st.data())
def test_concat_matches_numpy(case, data):
    shape, tile, seed = case
    axis = data.draw(st.integers(0, len(shape) - 1))
    other = tuple(data.draw(st.integers(1, 5)) if d == axis else n for d, n in enumerate(shape))
    other_tile = tuple(data.draw(st.integers(1, n)) for n in other)
    with tra_sql.connect() as db:
        a, x = stored(db, "A", shape, tile, seed)
        b, y = stored(db, "B", other, other_tile, seed + 1)
        got = db.concat([a, b, a], axis=axis)
        np.testing.assert_array_equal(got.numpy(), np.concatenate([x, y, x], axis=axis))


def test_fill_is_generated_in_sql(db):
    t = db.full((5, 3), 2.5, tile=(2, 2))
    assert "TRA_FILL(" in t.program().sql(pretty=False) and "RANGE(0, 3)" in t.program().sql(pretty=False)
    np.testing.assert_array_equal(t.numpy(), np.full((5, 3), 2.5))
    np.testing.assert_array_equal(db.zeros((4,), dtype="int32").numpy(), np.zeros(4, np.int32))
    np.testing.assert_array_equal(db.ones(()).numpy(), np.ones(()))
    x = db.from_numpy("x", np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(db.einsum("ij,ij->ij", x, db.ones((2, 3)), join="x0 + x1").numpy(),
                                  np.arange(6.0).reshape(2, 3) + 1)


def test_scalar_reshapes(db):
    s = db.from_numpy("s", np.float64(3.0))
    np.testing.assert_array_equal(s.reshape(1, 1).numpy(), np.full((1, 1), 3.0))
    np.testing.assert_array_equal(db.from_numpy("v", np.ones(1)).reshape(()).numpy(), np.ones(()))


def test_structural_errors(db):
    a = db.from_numpy("A", np.ones((4, 5)), tile=(2, 2))
    with pytest.raises(tra_sql.ShapeError, match="step 1"):
        a[::2]
    with pytest.raises(tra_sql.ShapeError, match="out of range"):
        a[4]
    with pytest.raises(tra_sql.ShapeError, match="empty"):
        a[3:1]
    with pytest.raises(tra_sql.ShapeError, match="too many indices"):
        a[1, 2, 3]
    with pytest.raises(tra_sql.ShapeError, match="cannot reshape"):
        a.reshape(3, -1)
    with pytest.raises(tra_sql.ShapeError, match="permutation"):
        a.transpose(0, 0)
    with pytest.raises(tra_sql.ShapeError, match="concat along axis 0"):
        db.concat([a, db.from_numpy("B", np.ones((4, 4)))], axis=0)
    with pytest.raises(tra_sql.ShapeError, match="axis 2"):
        db.concat([a, a], axis=2)


def test_add_is_a_keyed_sum(db, rng):
    x, y = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    a = db.from_numpy("A", x, tile=(2, 2))
    b = db.from_numpy("B", y, tile=(3, 3))
    db.engine.con.execute('DELETE FROM "A" WHERE k0 = 0 AND k1 = 0').fetchall()
    x[:2, :2] = 0
    total = db.add(a, b, a)
    assert "TRA_PLACE_ADD_FLOAT64(" in total.program().sql(pretty=False)
    np.testing.assert_allclose(total.numpy(), 2 * x + y)
    with pytest.raises(tra_sql.ShapeError, match="add"):
        db.add(a, db.from_numpy("C", np.ones(3)))
