"""The absent-tile rule (``tra_sql.absent``): an absent tile of a dense tensor is a tile of
zeros under every join and aggregation, on every path, as NumPy computes on the dense array."""

import numpy as np
import pytest

import tra_sql
from tra_sql.absent import absorbs

CASES = [  # spec, join, agg, NumPy on the dense arrays (x: 6x5 with absent tiles, y: 5)
    ("ij->i", None, "max", lambda x, y: x.max(1)),
    ("ij->i", None, "min", lambda x, y: x.min(1)),
    ("ij->j", None, "prod", lambda x, y: x.prod(0)),
    ("ij,j->i", "x0 + x1", "sum", lambda x, y: (x + y).sum(1)),
    ("ij,j->ij", "greatest(x0 + x1, 0)", "sum", lambda x, y: np.maximum(x + y, 0)),
    ("ij,j->i", "x0 * x1", "max", lambda x, y: (x * y).max(1)),
    ("ij->ij", "exp(x0)", "sum", lambda x, y: np.exp(x)),
    ("ij,j->i", "x1 * x0", "sum", lambda x, y: x @ y),
]


@pytest.fixture
def holes(db):
    """A 6x5 tensor of negative numbers in 2x2 tiles with two tiles deleted (a ragged one
    among them), its dense array with zeros there, and a vector."""
    rng = np.random.default_rng(7)
    x = -1 - rng.random((6, 5))
    db.from_numpy("X", x, tile=(2, 2))
    db.engine.con.execute('DELETE FROM "X" WHERE (k0 = 0 AND k1 = 1) OR (k0 = 2 AND k1 = 2)').fetchall()
    x[0:2, 2:4] = 0
    x[4:6, 4:5] = 0
    y = rng.standard_normal(5)
    db.from_numpy("y", y, tile=(2,))
    return x, y


@pytest.mark.parametrize("spec, join, agg, reference", CASES)
def test_absent_tiles_are_zeros_under_every_join_and_agg(db, holes, spec, join, agg, reference):
    x, y = holes
    operands = ["X", "y"] if "," in spec else ["X"]
    t = db.einsum(spec, *operands, join=join, agg=agg)
    expected = reference(x, y)
    np.testing.assert_allclose(t.numpy(plan=False), expected, rtol=1e-12, atol=1e-12)
    for workers, memory in ((2, "1GB"), (3, "2KB")):
        np.testing.assert_allclose(t.numpy(plan=db.plan(t, workers=workers, memory=memory)), expected,
                                   rtol=1e-12, atol=1e-12)
    retiled = db.einsum(spec, db.retile("X", (3, 5)), *operands[1:], join=join, agg=agg)
    np.testing.assert_allclose(retiled.numpy(plan=False), expected, rtol=1e-12, atol=1e-12)


def test_products_over_absent_tiles_join_only_the_present_ones(db, holes):
    """Where absent tiles contribute nothing the program is unchanged: no zero tiles made."""
    x, y = holes
    t = db.einsum("ij,j->i", "X", "y")
    assert "TRA_FILL" not in t.sql().upper() and "TRA_PLACE" not in t.sql().upper()
    np.testing.assert_allclose(t.numpy(), x @ y, rtol=1e-12)
    assert "TRA_PLACE" in db.einsum("ij->i", "X", agg="max").sql().upper()


def test_complete_operands_are_not_padded(db):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5))
    db.from_numpy("X", x, tile=(2, 2))
    t = db.einsum("ij->i", "X", agg="max")
    assert "TRA_PLACE" not in t.sql().upper()
    np.testing.assert_allclose(t.numpy(), x.max(1))


def test_which_joins_absorb_an_absent_operand():
    assert absorbs(None, "sum", 1) and absorbs("x0 * exp(x1)", "sum", 0) and absorbs("-(x1 * 2) * x0", "sum", 1)
    assert not absorbs("x0 * exp(x1)", "sum", 1) and not absorbs("x0 + x1", "sum", 0)
    assert not absorbs(None, "max", 0) and not absorbs("x0", "prod", 0)


def test_a_sum_over_no_tiles_is_an_absent_tile_and_its_gradient_zeros():
    """A 0-d aggregation that joins no rows has no tile (grouping by keys gives no group
    either), not a NULL one: fused with an epilogue (a gradient's seed) it read the NULL
    (found by the long differential run)."""
    db = tra_sql.connect()
    A = db.from_numpy("A", np.ones((2, 3, 4)), tile=(1, 2, 2))
    db.engine.execute('DELETE FROM "A"')
    total = db.einsum("->", db.einsum("abc->", A))
    assert total.arrow(plan=False).num_rows == 0 and total.numpy() == 0
    (grad,) = db.grad(total, [A])
    np.testing.assert_array_equal(grad.numpy(plan=False), np.zeros((2, 3, 4)))


@pytest.mark.parametrize("workers, memory", [(1, "1MB"), (4, "64KB")])
def test_a_plan_keeps_the_keys_a_gradient_is_kept_at(db, workers, memory):
    """A gradient is kept at its relation's keys through a keys-only join of an op computed
    from that relation; a plan that re-tiled the op (2 tiles a row instead of the stored 3
    columns) made a tile of zeros present where one was deleted, and the gradient 1 there
    (found by the differential harness's planned path)."""
    a = np.random.default_rng(743).uniform(-2, 2, (2, 4))
    A = db.from_numpy("A", a, tile=(1, 3))
    db.engine.con.execute('DELETE FROM "A" WHERE k0 = 0 AND k1 = 0').fetchall()
    (grad,) = db.grad(db.einsum("ab->", A.transpose(0, 1)), [A])
    expected = np.ones((2, 4))
    expected[0, :3] = 0
    np.testing.assert_array_equal(grad.numpy(plan=False), expected)
    np.testing.assert_array_equal(grad.numpy(plan=db.plan(grad, workers=workers, memory=memory)), expected)
