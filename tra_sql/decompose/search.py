"""Search over partitions: a DP exact on trees; on DAGs, the DAG cut into a spanning forest,
each tree solved exactly with its cut neighbours fixed, re-solved with the kept edges rotated,
then polished by single-op moves; exhaustive search for small graphs; the presets.

Every search result is an assignment: one state index per op (see ``model.Model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from tra_sql.decompose.model import Model
from tra_sql.decompose.problem import Problem, normalize

EPS = 1e-12


def _components(n: int, kept: list[tuple[int, int]]) -> list[int]:
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in kept:
        parent[find(u)] = find(v)
    return [find(x) for x in range(n)]


def kept_edges(model: Model, rotation: int = 0) -> list[bool]:
    """A spanning forest: each op keeps one of its out-edges (the ``rotation``-th), so every
    component is a tree rooted where no out-edge is kept."""
    out: dict[int, list[int]] = {}
    for e, edge in enumerate(model.problem.edges):
        out.setdefault(edge.src, []).append(e)
    keep = [False] * len(model.problem.edges)
    for es in out.values():
        keep[es[rotation % len(es)]] = True
    return keep


def solve_forest(model: Model, keep: list[bool], current: list[int] | None) -> list[int]:
    """Exact DP on the trees of kept edges. A cut edge is priced with the state of its other
    end in ``current`` (on both sides when it joins two trees, on the consumer's side when it
    lies inside one tree), or ignored when ``current`` is None."""
    ops, edges = model.problem.ops, model.problem.edges
    n = len(ops)
    comp = _components(n, [(e.src, e.dst) for e, k in zip(edges, keep) if k])
    local = [u.copy() for u in model.unary]
    if current is not None:
        for e, (edge, k) in enumerate(zip(edges, keep)):
            if k:
                continue
            local[edge.dst] += model.consumer_side(e, current[edge.src])
            if comp[edge.src] != comp[edge.dst]:
                local[edge.src] += model.producer_side(e, current[edge.dst])
    F: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    choice: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    into: dict[int, list[int]] = {}
    for e, (edge, k) in enumerate(zip(edges, keep)):
        if k:
            into.setdefault(edge.dst, []).append(e)
    for v in range(n):  # ops are in topological order
        f = local[v]
        for e in into.get(v, []):
            h, chosen, best = _edge_message(model, e, F[edges[e].src])
            choice[e] = (chosen, best)
            f = f + h
        F[v] = f
    assign = [-1] * n
    feeds = {edges[e].src: e for e, k in enumerate(keep) if k}
    for v in reversed(range(n)):
        if v not in feeds:
            assign[v] = int(np.argmin(F[v]))
        for e in into.get(v, []):
            chosen, best = choice[e]
            block = int(chosen[assign[v]])
            assign[edges[e].src] = block * model.states[edges[e].src].inner + int(best[block])
    return assign


def _edge_message(model: Model, e: int, f_src: np.ndarray):
    """min over the producer's states of (its subtree cost + the edge cost), for every state
    of the consumer; and, per consumer state, the producer's output tiling chosen."""
    edge = model.problem.edges[e]
    st_u = model.states[edge.src]
    blocks = f_src.reshape(st_u.n_out, st_u.inner)
    best = blocks.argmin(axis=1)
    G = blocks[np.arange(st_u.n_out), best]
    tiles = model.out_tiles[edge.src][:: st_u.inner]
    rep = model.reps[e]
    alt_block = int(np.argmin(G + rep.per_tile * tiles))
    alt = G[alt_block] + rep.per_tile * tiles[alt_block] + rep.fixed + rep.per_tile * model.in_tiles[edge.dst][edge.m]
    block = model.match[e]
    direct = np.where(block >= 0, G[block], np.inf)
    use_direct = direct <= alt
    return np.where(use_direct, direct, alt), np.where(use_direct, block, alt_block), best


def polish(model: Model, assign: list[int], sweeps: int = 6) -> list[int]:
    """Single-op moves: each op takes its best state with every neighbour fixed, until none
    moves (ops are revisited only when a neighbour moved)."""
    edges = model.problem.edges
    into: dict[int, list[int]] = {}
    outof: dict[int, list[int]] = {}
    for e, edge in enumerate(edges):
        into.setdefault(edge.dst, []).append(e)
        outof.setdefault(edge.src, []).append(e)
    assign = list(assign)
    todo = set(range(len(assign)))
    for _ in range(sweeps):
        if not todo:
            break
        moved: set[int] = set()
        for v in sorted(todo):
            f = model.unary[v].copy()
            for e in into.get(v, []):
                if edges[e].src != v:
                    f += model.consumer_side(e, assign[edges[e].src])
            for e in outof.get(v, []):
                if edges[e].dst != v:
                    f += model.producer_side(e, assign[edges[e].dst])
            s = int(np.argmin(f))
            if np.isfinite(f[s]) and f[s] < f[assign[v]] - EPS * max(1.0, abs(float(f[s]))):  # none fits: stay
                assign[v] = s
                moved |= {edges[e].src for e in into.get(v, [])} | {edges[e].dst for e in outof.get(v, [])}
        todo = moved
    return assign


def is_tree(model: Model) -> bool:
    """Whether every op's output feeds at most one op (then one forest solve is exact)."""
    srcs = [e.src for e in model.problem.edges]
    return len(srcs) == len(set(srcs))


@dataclass
class SearchStats:
    passes: int = 0
    tree: bool = True


def dp(model: Model, starts: list[list[int]] = (), max_passes: int = 8) -> tuple[list[int], SearchStats]:
    """The planner's search. On a tree: one exact DP. On a DAG: from the best of the forest
    DP (cut edges ignored) and ``starts`` (the presets), re-solve the forest with cut edges
    priced at the current neighbours and the kept edges rotated, polish with single-op moves,
    and keep a result only if the true total improved: never worse than any start."""
    stats = SearchStats(tree=is_tree(model))
    first = solve_forest(model, kept_edges(model), None)
    if stats.tree:
        stats.passes = 1
        return first, stats
    rotations = max((sum(1 for e in model.problem.edges if e.src == u) for u in range(len(model.problem.ops))),
                    default=1)
    best, best_cost = None, np.inf
    ranked = sorted([first, *starts], key=model.total)[:1]  # refine the best start only
    for start in ranked:
        cur = polish(model, start)
        cur_cost = model.total(cur)
        stall = 0
        for r in range(max_passes):
            stats.passes += 1
            cand = polish(model, solve_forest(model, kept_edges(model, r), cur))
            cost = model.total(cand)
            if cost < cur_cost - EPS * max(1.0, abs(cur_cost)):
                cur, cur_cost, stall = cand, cost, 0
            else:
                stall += 1
                if stall >= rotations:
                    break
        if best is None or cur_cost < best_cost:  # a DAG where nothing fits still gets a plan, as a tree does
            best, best_cost = cur, cur_cost
    return best, stats


def exhaustive(model: Model, limit: float = 2e7) -> list[int] | None:
    """The optimum over every combination of states, or None when there are over ``limit``."""
    sizes = [len(u) for u in model.unary]
    if not sizes or prod(sizes) > limit:
        return None
    n = len(sizes)
    total = np.zeros(sizes)
    for v, u in enumerate(model.unary):
        total = total + u.reshape([-1 if d == v else 1 for d in range(n)])
    for e, edge in enumerate(model.problem.edges):
        u, v = edge.src, edge.dst
        mat = np.stack([model.consumer_side(e, su) for su in range(sizes[u])])
        shape = [1] * n
        shape[u], shape[v] = sizes[u], sizes[v]
        total = total + mat.reshape(shape)
    return [int(i) for i in np.unravel_index(int(np.argmin(total)), sizes)]


# -- presets ---------------------------------------------------------------------------

SCALES = (1, 2, 4, 8, 16)


@dataclass
class Roles:
    """Axis classes by role: the batch (data), the sequence, the model-parallel axes."""

    data: set[int]
    sequence: set[int]
    model: set[int]


def roles(problem: Problem) -> Roles:
    """Guess roles from the graph: the root's first axis is the data axis, its second-to-last
    the sequence (the same axis for a (tokens, features) root); in each weight (a stored
    input without those), the first axis that is not an axis of the root is split
    Megatron-style (columns, then rows)."""
    root = problem.root_op if problem.root_op is not None else len(problem.ops) - 1
    if root < 0:
        return Roles(set(), set(), set())
    op = problem.ops[root]
    root_axes = [op.axes[i] for i in op.out]
    data = set(root_axes[:1])
    sequence = {root_axes[-2]} if len(root_axes) >= 2 else set()
    model_axes: set[int] = set()
    for o in problem.ops:
        for x in o.inputs:
            if x.op is not None:
                continue
            axes = [o.axes[i] for i in x.pos]
            if any(a in data or a in sequence for a in axes):
                continue
            first = next((a for a in axes if a not in root_axes and problem.axis_size[a] > 1), None)
            if first is not None:
                model_axes.add(first)
    return Roles(data, sequence, model_axes)


def preset_axes(r: Roles) -> dict[str, set[int]]:
    return {"data parallel": r.data, "sequence parallel": r.sequence, "Megatron (column/row)": r.model}


def preset_extra(problem: Problem, workers: int) -> dict[int, set[int]]:
    """Tile counts the presets need (the worker count times a scale), per axis class, so
    that every preset lies in the search space."""
    values = {workers * s for s in SCALES}
    return {a: {normalize(n, v) for v in values} for a, n in problem.axis_size.items()}


def preset(model: Model, name: str, axes: set[int] | None, scale: int) -> list[int] | None:
    """A preset's assignment at ``scale`` times the worker count, or None if it splits nothing."""
    p = model.budget.workers * scale
    assign, splits = [], False
    for v, op in enumerate(model.problem.ops):
        if name == "no split":
            parts = tuple(1 for _ in op.sizes)
        elif name == "as written":
            parts = op.written
        elif name == "split every index":
            parts = tuple(normalize(n, p) for n in op.sizes)
        else:
            parts = tuple(normalize(n, p) if a in axes else 1 for n, a in zip(op.sizes, op.axes))
        parts = tuple(q if q in model.cands[v][i] else _nearest(model.cands[v][i], q) for i, q in enumerate(parts))
        splits |= any(q > 1 for q in parts)
        assign.append(model.state_of(v, parts))
    if name not in ("no split", "as written") and not splits:
        return None
    return assign


def _nearest(values: list[int], q: int) -> int:
    return min(values, key=lambda x: (abs(x - q), x))


@dataclass
class Yardstick:
    name: str
    assign: list[int] | None
    cost: float
    scale: int = 1


def presets(model: Model) -> list[Yardstick]:
    """Every preset at the smallest scale (×1, ×2, ×4, ...) at which it fits in memory."""
    r = roles(model.problem)
    named = [("no split", None), ("as written", None)] + list(preset_axes(r).items()) + \
        [("split every index", None)]
    out, seen = [], {}
    for name, axes in named:
        if axes is not None and not axes:
            out.append(Yardstick(name, None, np.inf))
            continue
        result = Yardstick(name, None, np.inf)
        for scale in SCALES if name not in ("no split", "as written") else (1,):
            assign = preset(model, name, axes, scale)
            if assign is None:
                break
            cost = model.total(assign)
            if np.isfinite(cost):
                result = Yardstick(name, assign, cost, scale)
                break
        key = tuple(result.assign) if result.assign else None
        if key is not None and key in seen and name != "as written":
            result = Yardstick(f"{name} (= {seen[key]})", result.assign, result.cost, result.scale)
        elif key is not None:
            seen.setdefault(key, name)
        out.append(result)
    return out
