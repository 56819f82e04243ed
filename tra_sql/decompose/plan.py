"""``Plan``: the partition of every einsum op, its predicted cost broken down, the yardsticks
beside it, ``explain()`` as text and DOT, and ``apply()``, which rebuilds the DAG so that
every op reads its operands in the planned tiling (repartitions become Tile/Concat in SQL).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field, replace
from math import ceil, prod

import numpy as np

from tra_sql import graph
from tra_sql.decompose import search
from tra_sql.decompose.cost import (
    BAND_FILL,
    BYTES_ONLY,
    COMPONENTS,
    VECTOR,
    Budget,
    Constants,
    leaf_repartition,
    scan_memory,
)
from tra_sql.decompose.model import Model, axis_candidates, build
from tra_sql.decompose.problem import CONSTANT, OP, RETILE, extract, pinned, producer, role
from tra_sql.errors import ShapeError, SpecError, TraError
from tra_sql.graph import Einsum, Node, topological

#: Graphs of more ops than this search fewer tile counts per index (still not only powers of two).
LARGE = 200
LARGE_BASE = (1, 2, 3, 4, 8, 16, 32)


@dataclass
class OpPlan:
    """One op of a plan: tiles per index, predicted seconds by component, memory."""

    label: str
    parts: dict[str, int]
    tile: dict[str, int]
    seconds: float
    components: dict[str, float]
    working_set: float
    piece: float
    bands: int


@dataclass
class Plan:
    """The plan of the DAG under ``root`` for ``workers`` workers of ``memory`` bytes each."""

    root: Node
    workers: int
    memory: float
    consts: Constants
    model: Model
    assign: list[int]
    cost: float
    yardsticks: list[search.Yardstick] = field(default_factory=list)
    seconds: float = 0.0
    stats: search.SearchStats = field(default_factory=search.SearchStats)
    written_cost: float = float("nan")

    def __repr__(self) -> str:
        return f"<Plan {self.root.label!r}: {len(self.assign)} ops, predicted {self.cost:.4g} s>"

    # -- what was chosen --------------------------------------------------------------
    @property
    def parts(self) -> dict[int, tuple[int, ...]]:
        """Tiles per index (in ``spec.indices`` order) of every einsum node, by ``id(node)``."""
        return {id(op.node): tuple(int(q) for q in st.Q[s])
                for op, st, s in zip(self.model.problem.ops, self.model.states, self.assign)}

    @property
    def ops(self) -> list[OpPlan]:
        out = []
        for v, (op, s) in enumerate(zip(self.model.problem.ops, self.assign)):
            oc = self.model.costs[v]
            q = self.model.states[v].Q[s]
            comps = {k: float(a[s]) for k, a in oc.parts.items()}
            out.append(OpPlan(op.node.label, dict(zip(op.indices, map(int, q))),
                              {c: ceil(n / int(p)) for c, n, p in zip(op.indices, op.sizes, q)},
                              float(oc.total[s]), comps, float(oc.working_set[s]), float(oc.piece[s]),
                              int(oc.bands[s])))
        return out

    def breakdown(self) -> dict[str, float]:
        """Predicted seconds by component, repartitions included."""
        total = dict.fromkeys(COMPONENTS, 0.0)
        for v, s in enumerate(self.assign):
            for k, a in self.model.costs[v].parts.items():
                total[k] += float(a[s])
            total["repartition"] += float(self.model.unary[v][s] - self.model.costs[v].total[s])
        for e, edge in enumerate(self.model.problem.edges):
            total["repartition"] += self.model.edge_cost(e, self.assign[edge.src], self.assign[edge.dst])
        return total

    @property
    def staged(self) -> bool:
        """Whether the plan must run as several statements: an op in bands, or the
        intermediates of one statement over the memory budget."""
        if any(op.bands > 1 for op in self.ops):
            return True
        held = sum(op.out_bytes for op in self.model.problem.ops)
        return held > self.model.budget.statement

    def apply(self) -> Node:
        """The DAG rebuilt under this plan."""
        return rebuild(self.root, self.parts)

    # -- showing it -------------------------------------------------------------------
    def explain(self, fmt: str = "text") -> str:
        """The plan as ``text``, a Graphviz DOT graph (``dot``), that graph drawn as SVG
        (``svg``: needs Graphviz's ``dot`` program) or ``json`` (the ops and their costs)."""
        if fmt == "text":
            return self._text()
        if fmt == "dot":
            return self.dot()
        if fmt == "svg":
            return _svg(self.dot())
        if fmt == "json":
            return json.dumps({"root": self.root.label, "workers": self.workers, "memory": self.memory,
                               "cost": self.cost, "staged": self.staged,
                               "ops": [dataclasses.asdict(op) for op in self.ops]})
        raise SpecError(f"explain format {fmt!r} is not one of text, dot, svg, json")

    def _text(self) -> str:
        b = self.breakdown()
        kind = "tree: exact" if self.stats.tree else f"DAG: {self.stats.passes} forest passes"
        lines = [f"Plan for {self.root.label} {self.root.shape}: {self.workers} workers x "
                 f"{_size(self.memory)}; predicted {self.cost:.4g} s; planned in {self.seconds * 1e3:.0f} ms "
                 f"({len(self.assign)} ops, {kind})",
                 "  " + ", ".join(f"{k} {v:.3g}" for k, v in b.items() if v)]
        lines.append(f"  {'op':<44} {'tiles per index':<28} {'s':>9} {'memory':>9} {'bands':>5}")
        for op in self.ops:
            parts = " ".join(f"{c}={p}" for c, p in op.parts.items())
            lines.append(f"  {op.label[:44]:<44} {parts[:28]:<28} {op.seconds:>9.4g} "
                         f"{_size(op.working_set):>9} {op.bands:>5}")
        moves = self.repartitions()
        if moves:
            lines.append("  repartitions:")
            lines += [f"    {a} -> {b}: tiles {t0} -> {t1} ({s:.3g} s)" for a, b, t0, t1, s in moves]
        if self.yardsticks:
            lines.append("  yardsticks (predicted s, ratio to this plan):")
            for y in self.yardsticks:
                ratio = y.cost / self.cost if self.cost > 0 else np.inf
                scale = f" x{y.scale}" if y.scale > 1 else ""
                lines.append(f"    {y.name + scale:<44} {y.cost:>10.4g} {ratio:>8.2f}")
        return "\n".join(lines)

    def repartitions(self) -> list[tuple[str, str, tuple, tuple, float]]:
        """(producer, consumer, tile before, tile after, seconds) of every re-tiling an op reads."""
        out = []
        parts, model = self.parts, self.model
        edge_of = {(e.dst, e.m): i for i, e in enumerate(model.problem.edges)}
        for v, op in enumerate(model.problem.ops):
            q = model.states[v].Q[self.assign[v]]
            for m, x in enumerate(op.inputs):
                if role(x.node) == CONSTANT:
                    continue
                want = tuple(ceil(op.sizes[i] / q[i]) for i in x.pos)
                have = tuple(ceil(n / p) for n, p in zip(x.node.shape, _grid(parts, x.node)))
                if have == want:
                    continue
                if (v, m) in edge_of:
                    e = edge_of[(v, m)]
                    cost = model.edge_cost(e, self.assign[model.problem.edges[e].src], self.assign[v])
                else:
                    dst = np.array([[int(q[i]) for i in x.pos]], dtype=np.int64)
                    cost = float(leaf_repartition(x.node.shape, x.node.dtype.itemsize, x.node.tile, dst,
                                                  model.consts, model.budget)[0])
                out.append((x.node.label[:30], op.node.label[:30], have, want, cost))
        return out

    def dot(self) -> str:
        """Graphviz DOT of the DAG as the plan runs it: einsums with their tiles per index,
        the repartitions (Tile/Concat in SQL) in red."""
        root = self.apply()
        names = {id(n): f"n{i}" for i, n in enumerate(topological(root))}
        lines = ["digraph plan {", "  rankdir=BT; node [shape=box, fontsize=10];"]
        for node in topological(root):
            label = node.label.replace('"', "'")
            op = role(node) == OP
            if op:
                label += "\\n" + " ".join(f"{c}:{node.sizes[c]}/{node.tiles[c]}" for c in node.spec.indices)
            label += f"\\nshape {node.shape} tile {node.tile}"
            style = (', style=filled, fillcolor="#e8f0ff"' if op
                     else ', color=red, fontcolor=red' if node.inputs else "")
            lines.append(f'  {names[id(node)]} [label="{label}"{style}];')
        for node in topological(root):
            for child in node.inputs:
                lines.append(f"  {names[id(child)]} -> {names[id(node)]};")
        lines.append("}")
        return "\n".join(lines)


def _grid(parts: dict[int, tuple[int, ...]], node: Node) -> tuple[int, ...]:
    """Tiles per dimension of ``node``'s output under the plan (its own tiling if not planned)."""
    if id(node) in parts:
        q = dict(zip(node.spec.indices, parts[id(node)]))
        return tuple(q[c] for c in node.spec.output)
    return node.grid


def _svg(dot: str) -> str:
    """``dot`` drawn by Graphviz as SVG."""
    program = shutil.which("dot")
    if program is None:
        raise TraError("explain('svg') needs Graphviz's dot program: install Graphviz "
                       "(apt-get install graphviz, brew install graphviz or conda install graphviz), "
                       "or use explain('dot')")
    done = subprocess.run([program, "-Tsvg"], input=dot, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise TraError(f"Graphviz could not draw the plan: {done.stderr.strip()}")
    return done.stdout


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}B"


def rebuild(root: Node, parts: dict[int, tuple[int, ...]]) -> Node:
    """Rebuild the DAG: each planned einsum reads its operands re-tiled to
    ``ceil(size / parts)`` per index; other nodes keep the tilings they had."""
    memo: dict[int, Node] = {}
    kept = pinned(root)

    def visit(node: Node) -> Node:
        if id(node) in memo:
            return memo[id(node)]
        kind = role(node)
        if kind == OP and id(node) in parts and id(node) not in kept:
            new = _planned(node, parts[id(node)], visit)
        elif kind == RETILE:
            new = graph.retile(visit(producer(node)), node.tile)
        else:
            new = graph.with_inputs(node, [graph.retile(visit(producer(s)), s.tile) for s in node.inputs])
        memo[id(node)] = new
        return new

    return visit(root)


def _planned(node: Einsum, parts: tuple[int, ...], visit) -> Node:
    """``node`` in the tiling ``parts`` (tiles per index), its operands re-tiled to it (a
    constant generated in it)."""
    q = dict(zip(node.spec.indices, parts))
    tiles = {c: ceil(n / q[c]) for c, n in node.sizes.items()}
    operands = []
    for sub, operand in zip(node.spec.inputs, node.operands):
        src = producer(operand)
        want = tuple(tiles[c] for c in sub)
        if role(src) == CONSTANT:
            operands.append(replace(src, tile=tuple(min(t, n) for t, n in zip(want, src.shape))))
        else:
            operands.append(graph.retile(visit(src), want))
    return replace(node, tile=tuple(tiles[c] for c in node.spec.output), operands=tuple(operands))


def make_plan(root: Node, workers: int, memory: float, consts: Constants, *, yardsticks: bool = True,
              base: tuple[int, ...] | None = None, exhaustive_limit: float = 2e6, spills: bool = False) -> Plan:
    """Plan the DAG under ``root``: the DP, and (``yardsticks``) the presets, the published
    algorithm and, when the graph is small enough, exhaustive search beside it. ``spills``:
    for an engine whose statements spill (see ``cost.Budget``)."""
    start = time.perf_counter()
    workers = max(1, int(workers))
    budget = Budget(workers, float(memory), spills)
    problem = extract(root)
    check_sources(problem, consts, budget)
    if base is None and len(problem.ops) > LARGE:
        base = LARGE_BASE
    cands = axis_candidates(problem, search.preset_extra(problem, workers), base)
    model = build(problem, consts, budget, cands)
    marks = search.presets(model)
    starts = [y.assign for y in marks if y.assign is not None and np.isfinite(y.cost)]
    assign, stats = search.dp(model, starts)
    cost = model.total(assign)
    seconds = time.perf_counter() - start
    if yardsticks:
        marks.append(published(problem, model))
        best = search.exhaustive(model, exhaustive_limit)
        marks.append(search.Yardstick("exhaustive", best, model.total(best) if best else np.nan))
    written = next(y.cost for y in marks if y.name == "as written")
    return Plan(root, workers, float(memory), consts, model, assign, cost, marks if yardsticks else [], seconds, stats,
                written)


def check_sources(problem, consts: Constants, budget: Budget) -> None:
    """Every stored input must be readable under the memory budget (see ``cost.scan_memory``):
    a scan loads whole vectors of tiles, a read by the key of an aggregated index (bands over
    it) only the tiles with one key value."""
    for op in problem.ops:
        for x in op.inputs:
            if x.fixed is None:
                continue
            tile_bytes = x.node.dtype.itemsize * prod(x.node.tile)
            need = float(scan_memory(tile_bytes, prod(x.fixed)))
            if any(i in op.agg for i in x.pos):
                need = min(need, tile_bytes * prod(f for i, f in zip(x.pos, x.fixed) if i not in op.agg))
            if need > budget.statement * BAND_FILL:
                raise ShapeError(
                    f"'{x.node.label}' is stored in tiles of {tile_bytes} bytes: reading any loads {need:.3g} "
                    f"bytes (a scan loads a whole vector of up to {VECTOR} tiles, a read by key the tiles with "
                    f"that key), over half the memory budget of {budget.statement:.3g} bytes; store it in "
                    f"smaller tiles")


def published(problem, model: Model) -> search.Yardstick:
    """The published EinDecomp: every op cut into exactly p pieces, communicated bytes
    minimized by a DP on a forest with the DAG's other edges ignored; priced by our model."""
    p = model.budget.workers
    bytes_model = build(problem, BYTES_ONLY, Budget(p, np.inf), {a: c for a, c in _axis_cands(model).items()})
    for v, st in enumerate(bytes_model.states):
        pieces = np.prod(st.Q, axis=1)
        target = pieces[np.argmin(np.abs(pieces - p))]
        bytes_model.unary[v] = np.where(pieces == target, bytes_model.unary[v], np.inf)
    assign = search.solve_forest(bytes_model, search.kept_edges(bytes_model), None)
    return search.Yardstick("published EinDecomp (p pieces, bytes)", assign, model.total(assign))


def _axis_cands(model: Model) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for op, cands in zip(model.problem.ops, model.cands):
        for a, c in zip(op.axes, cands):
            out[a] = c
    return out
