"""A planning problem priced: the states of every op, their costs, and the edge costs
between ops, ready for the search (``search.py``) and for evaluating any assignment."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from tra_sql.decompose.cost import Budget, Constants, OpCost, Repartition, leaf_repartition, op_cost, repartition
from tra_sql.decompose.problem import Problem, States, candidates, code1, states


@dataclass
class Model:
    problem: Problem
    consts: Constants
    budget: Budget
    cands: list[list[list[int]]]       # per op, per index
    states: list[States]
    costs: list[OpCost]
    unary: list[np.ndarray]            # op cost + reads of fixed inputs + fixed consumers
    out_tiles: list[np.ndarray]        # per op, per state
    in_tiles: list[list[np.ndarray]]   # per op, per operand, per state
    reps: list[Repartition]            # per edge
    match: list[np.ndarray]            # per edge, per consumer state: the producer's matching block or -1

    def block(self, v: int, s):
        """The output-tiling block of state(s) ``s`` of op ``v``."""
        return s // self.states[v].inner

    def __repr__(self) -> str:
        return f"<Model: {len(self.states)} ops, {sum(len(u) for u in self.unary)} states>"

    # -- one assignment (a state index per op) ----------------------------------------
    def edge_cost(self, e: int, su: int, sv: int) -> float:
        edge = self.problem.edges[e]
        same = self.match[e][sv] == self.block(edge.src, su)
        return float(self.reps[e](same, self.out_tiles[edge.src][su], self.in_tiles[edge.dst][edge.m][sv]))

    def total(self, assign: list[int]) -> float:
        cost = sum(float(self.unary[v][s]) for v, s in enumerate(assign))
        return cost + sum(self.edge_cost(e, assign[x.src], assign[x.dst]) for e, x in enumerate(self.problem.edges))

    def state_of(self, v: int, parts: tuple[int, ...]) -> int:
        """The state index of op ``v`` with these tiles per index (which must be candidates)."""
        op = self.problem.ops[v]
        order = list(op.out) + [i for i in range(len(op.indices)) if i not in op.out]
        index = 0
        for i in order:
            index = index * len(self.cands[v][i]) + self.cands[v][i].index(parts[i])
        return index

    def _blocks(self, v: int) -> np.ndarray:
        cache = self.__dict__.setdefault("_block_cache", {})
        if v not in cache:
            st = self.states[v]
            cache[v] = np.repeat(np.arange(st.n_out), st.inner)
        return cache[v]

    # -- vectors used by the search -----------------------------------------------------
    def consumer_side(self, e: int, su: int) -> np.ndarray:
        """Edge ``e``'s cost over the consumer's states, the producer's state fixed."""
        edge = self.problem.edges[e]
        same = self.match[e] == self.block(edge.src, su)
        return self.reps[e](same, self.out_tiles[edge.src][su], self.in_tiles[edge.dst][edge.m])

    def producer_side(self, e: int, sv: int) -> np.ndarray:
        """Edge ``e``'s cost over the producer's states, the consumer's state fixed."""
        edge = self.problem.edges[e]
        same = self._blocks(edge.src) == self.match[e][sv]
        return self.reps[e](same, self.out_tiles[edge.src], self.in_tiles[edge.dst][edge.m][sv])


def axis_candidates(problem: Problem, extra: dict[int, set[int]] | None = None,
                    base: tuple[int, ...] | None = None) -> dict[int, list[int]]:
    """Candidate tile counts per axis class: the base set, the as-written tilings and ``extra``."""
    extra = extra or {}
    wanted: dict[int, set[int]] = {a: set(extra.get(a, ())) for a in problem.axis_size}
    for op in problem.ops:
        for a, p in zip(op.axes, op.written):
            wanted[a].add(p)
        for x in op.inputs:
            if x.fixed is not None:
                for i, p in zip(x.pos, x.fixed):
                    wanted[op.axes[i]].add(p)
        for f in op.fixed_consumers:
            for i, p in zip(op.out, f):
                wanted[op.axes[i]].add(p)
    kw = {} if base is None else {"base": base}
    return {a: candidates(n, wanted[a], **kw) for a, n in problem.axis_size.items()}


def build(problem: Problem, consts: Constants, budget: Budget, axis_cands: dict[int, list[int]]) -> Model:
    """Price every state of every op (ops with the same signature share the work)."""
    cache: dict[tuple, tuple[States, OpCost, np.ndarray, np.ndarray, list[np.ndarray]]] = {}
    cands, all_states, costs, unary, out_tiles, in_tiles = [], [], [], [], [], []
    for op in problem.ops:
        c = [axis_cands[a] for a in op.axes]
        key = (str(op.node.spec), op.sizes, op.node.join, op.node.agg, op.node.dtype.name,
               tuple((x.nbytes, x.fixed, x.node.tile if x.fixed else None, x.op is None) for x in op.inputs),
               tuple(op.fixed_consumers), tuple(map(tuple, c)), op.pinned and op.written)
        if key not in cache:
            st = states(op, c)
            oc = op_cost(op, st.Q, consts, budget)
            u = oc.total.copy()
            tiles_in = [np.prod(st.Q[:, list(x.pos)], axis=1) if x.pos else np.ones(len(st.Q)) for x in op.inputs]
            tiles_out = np.prod(st.Q[:, list(op.out)], axis=1) if op.out else np.ones(len(st.Q))
            for x in op.inputs:
                if x.fixed is not None:
                    u = u + leaf_repartition(x.node.shape, x.node.dtype.itemsize, x.node.tile, st.Q[:, list(x.pos)],
                                             consts, budget)
            for f in op.fixed_consumers:
                rep = repartition(op.out_bytes, consts, budget)
                u = u + rep(st.out_code == code1(f), tiles_out, prod(f))
            if op.pinned:
                u = np.where(np.all(st.Q == np.array(op.written), axis=1), u, np.inf)
            cache[key] = (st, oc, u, tiles_out, tiles_in)
        st, oc, u, tiles_out, tiles_in = cache[key]
        cands.append(c)
        all_states.append(st)
        costs.append(oc)
        unary.append(u)
        out_tiles.append(tiles_out)
        in_tiles.append(tiles_in)
    reps = [repartition(e.nbytes, consts, budget) for e in problem.edges]
    match = [_match(all_states[e.src], all_states[e.dst].in_codes[e.m]) for e in problem.edges]
    return Model(problem, consts, budget, cands, all_states, costs, unary, out_tiles, in_tiles, reps, match)


def _match(src: States, want: np.ndarray) -> np.ndarray:
    """For each wanted tiling code, the producer's output block with that tiling, or -1."""
    codes = src.out_code[:: src.inner]
    sorter = np.argsort(codes, kind="stable")
    at = np.clip(np.searchsorted(codes[sorter], want), 0, len(codes) - 1)
    block = sorter[at]
    return np.where(codes[block] == want, block, -1)
