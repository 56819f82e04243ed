"""Each aggregation's definition (``tra_sql.aggregates``) agrees with itself: the generated
loop's fold, the tile fold (``ufunc``), the staged plans' ``combine`` and the ``identity``
compute the same thing, so a new entry is checked by this file before any program runs."""


import numpy as np
import pytest

from tra_sql.aggregates import AGGREGATES
from tra_sql.udfs.codegen import namespace
from tra_sql.udfs.expr import join_code


def _loop_fold(agg, start, values):
    """The generated loop's fold (``loop_update``) run in Python."""
    scope = {"acc": start, "err": 0}
    for v in values:
        scope["v"] = v
        exec(agg.loop_update.replace("; ", "\n"), {"np": np}, scope)
    return scope["acc"] + scope["err"] if agg.compensated else scope["acc"]


@pytest.mark.parametrize("name", sorted(AGGREGATES))
@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_definition_is_consistent(name, dtype):
    agg = AGGREGATES[name]
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(7) * 3).astype(dtype) if dtype == "float64" else rng.integers(-4, 5, 7)
    if agg.floating:  # its result (and so its accumulator) is floating point
        values = values.astype("float64")
    start = agg.identity(values.dtype)
    assert agg.ufunc.reduce(np.concatenate([[start], values]).astype(values.dtype)) == agg.ufunc.reduce(values)
    assert _loop_fold(agg, start, values) == pytest.approx(agg.ufunc.reduce(values))
    x0, x1 = values[:3], values[3:6]
    combined = np.array([eval(join_code(agg.combine, 2), namespace(), {"x0": a, "x1": b})
                         for a, b in zip(x0, x1)])
    np.testing.assert_allclose(combined, agg.ufunc(x0, x1))


def test_logsumexp_matches_pytorch_values_and_gradients():
    """``agg="logsumexp"`` (the aggregation recipe's example, docs/architecture.md): values over
    ragged tiles, planned, over an operand lacking tiles, over integers, and its gradient."""
    import torch

    import tra_sql

    db = tra_sql.connect()
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((7, 9)) * 4, rng.standard_normal((9, 5))
    X, Y = db.from_numpy("X", x, tile=(3, 4)), db.from_numpy("Y", y, tile=(4, 2))
    L = db.einsum("ij,jk->ik", X, Y, agg="logsumexp")
    xt = torch.tensor(x, requires_grad=True)
    ref = torch.logsumexp(xt[:, :, None] * torch.tensor(y)[None], 1)
    np.testing.assert_allclose(L.numpy(), ref.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(L.numpy(plan=db.plan(L, workers=3, memory="4KB")), ref.detach().numpy(), rtol=1e-12)
    (gx,) = db.grad(db.einsum("ik->", L), [X])
    ref.sum().backward()
    np.testing.assert_allclose(gx.numpy(), xt.grad.numpy(), rtol=1e-10)
    db.engine.execute('DELETE FROM "X" WHERE k0 = 1 AND k1 = 1')  # an absent tile is a tile of zeros
    x[3:6, 4:8] = 0
    np.testing.assert_allclose(db.einsum("ij->i", "X", agg="logsumexp").numpy(), np.logaddexp.reduce(x, axis=1),
                               rtol=1e-12)
    ints = rng.integers(-3, 4, (4, 6))
    R = db.einsum("ij->i", db.from_numpy("I", ints, tile=(3, 4)), agg="logsumexp")
    assert R.dtype == np.float64
    np.testing.assert_allclose(R.numpy(), np.logaddexp.reduce(ints.astype(float), axis=1), rtol=1e-12)
