"""Choosing the plan a tensor runs under: ``db.plan()``'s (EinDecomp for the engine's workers
and memory, with its measured constants) and the one ``numpy()`` follows by default. The
engine (``tra_sql.engines``) runs it; it is reached through its interface, never imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tra_sql.decompose.cost import Constants
from tra_sql.decompose.plan import Plan, make_plan
from tra_sql.errors import TraError
from tra_sql.graph import Einsum, Source, topological

if TYPE_CHECKING:
    from tra_sql.engines.base import Engine
    from tra_sql.tensor import Tensor

#: Auto-planning leaves programs alone whose inputs are smaller than this (bytes).
AUTO_MIN_BYTES = 256 * 2**20


def plan(engine: Engine, tensor: Tensor, workers=None, memory=None, **kw) -> Plan:
    """EinDecomp's plan of ``tensor`` for ``engine``'s budget (``workers`` of ``memory`` each
    unless given; whether its statements spill) and its measured constants (else the defaults)."""
    workers, per_worker = engine.budget(workers, memory)
    return make_plan(tensor.node, workers, per_worker, engine.constants() or Constants(), spills=engine.spills, **kw)


def _sparse(engine: Engine, node: Source) -> bool:
    """Whether the stored relation keeps nonzeros only (CSR tiles) or lacks some of its tiles."""
    if node.layout != "dense":
        return True
    return not engine.has_every_tile(node)


def auto(tensor: Tensor) -> Plan | None:
    """The plan ``numpy()`` follows by default: none for small programs (inputs under
    ``AUTO_MIN_BYTES``); otherwise the DP's plan when the tiling as written does not fit in
    memory, or when the plan is predicted at least 30% and 0.5 s faster."""
    engine = tensor.session.engine
    if not engine.staged:
        return None  # the planner's constants and staging are DuckDB's
    leaves = [n for n in topological(tensor.node) if isinstance(n, Source)]
    if not any(isinstance(n, Einsum) for n in topological(tensor.node)):
        return None
    if sum(n.dtype.itemsize * int(np.prod(n.shape)) for n in leaves) < AUTO_MIN_BYTES:
        return None
    if any(_sparse(engine, n) for n in leaves):
        return None  # the cost model prices dense relations; sparse ones run as written
    p = plan(engine, tensor, yardsticks=False)
    written = p.written_cost
    if not np.isfinite(written) or (p.cost < 0.7 * written and written - p.cost > 0.5):
        return p
    return None


def resolve(tensor: Tensor, plan_: Plan | bool | None) -> Plan | None:
    """The plan ``tensor`` runs under: ``plan_`` (checked), the automatic one if None, none if False."""
    if plan_ is None:
        return auto(tensor)
    if plan_ is False:
        return None
    if not isinstance(plan_, Plan):
        raise TraError(f"plan must be a Plan from db.plan(), got {type(plan_).__name__}")
    if plan_.root is not tensor.node:
        raise TraError("this plan was made for another tensor: call db.plan() on this one")
    return plan_
