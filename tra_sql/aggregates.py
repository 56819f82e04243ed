"""The aggregations of an extended einsum (``agg=``), one definition each.

Everything a layer needs to know about an aggregation is in its ``Aggregate``: the graph
checks names against ``AGGREGATES``; the kernels start from ``identity``, fold joined values
with ``loop_update`` (generated loops) and fold tiles with ``ufunc`` (NumPy, also on Spark);
staged plans combine partial results with the join ``combine``; the absent-tile rule asks
``absorbs_zeros``. Adding an aggregation is adding an entry here (and its test).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Aggregate:
    """One aggregation over joined values.

    ``loop_update``: statements (``; ``-separated) that fold the scalar ``v`` into the
    accumulator ``acc`` in a generated Numba loop; with ``compensated``, ``err`` carries the
    rounding error of each step (``acc + err`` is the result). ``combine``: a SQL join
    expression over two partial results ``x0, x1`` (tiles of the same keys)."""

    name: str
    ufunc: np.ufunc
    loop_update: str
    combine: str
    compensated: bool = False
    absorbs_zeros: bool = False  # an absent (zero) tile under a product changes nothing

    def identity(self, dtype: np.dtype):
        """The value this aggregation starts from for elements of ``dtype``."""
        return self.ufunc.reduce(np.empty(0, dtype=dtype)) if self.ufunc.identity is not None \
            else _extreme(self.name, np.dtype(dtype))


def _extreme(name: str, dtype: np.dtype):
    """max/min start from the other end of the dtype's range."""
    if np.issubdtype(dtype, np.floating):
        return -np.inf if name == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if name == "max" else info.max


AGGREGATES: dict[str, Aggregate] = {agg.name: agg for agg in (
    # a compensated sum (Neumaier's, branch-free): ``err`` keeps what each addition rounded
    # off, so a long sum keeps ~1e-16 relative error whatever the tiling (exact on integers)
    Aggregate("sum", np.add, "t = acc + v; w = t - acc; err = err + ((acc - (t - w)) + (v - w)); acc = t",
              "x0 + x1", compensated=True, absorbs_zeros=True),
    # NaN wins, as in NumPy's max and min (``acc != acc`` only for NaN)
    Aggregate("max", np.maximum, "acc = acc if acc != acc or acc >= v else v", "greatest(x0, x1)"),
    Aggregate("min", np.minimum, "acc = acc if acc != acc or acc <= v else v", "least(x0, x1)"),
    Aggregate("prod", np.multiply, "acc = acc * v", "x0 * x1"),
)}
