"""Each aggregation's definition (``tra_sql.aggregates``) agrees with itself: the generated
loop's fold, the tile fold (``ufunc``), the staged plans' ``combine`` and the ``identity``
compute the same thing, so a new entry is checked by this file before any program runs."""

import math

import numpy as np
import pytest

from tra_sql.aggregates import AGGREGATES
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
    combined = np.array([eval(join_code(agg.combine, 2), {"np": np, "math": math}, {"x0": a, "x1": b})
                         for a, b in zip(x0, x1)])
    np.testing.assert_allclose(combined, agg.ufunc(x0, x1))
