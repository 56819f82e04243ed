"""From the DAG to SQL: every node becomes a SELECT over its inputs' tile relations.

- an ``Einsum`` joins its operands on the keys of shared indices (an index repeated inside
  one operand filters that operand's keys) and calls a tile UDF per joined row. When an
  aggregated index is split over several tiles it groups by the output keys: each joined
  row's partial result is aggregated (``tra_reduce`` over ``list(partial)``), or, where a
  row's input tiles hold fewer bytes than its result, the kernel gets each group's joined
  rows as one list of structs (a fused join + aggregate; one list keeps the operands'
  tiles aligned without sorting), see ``partials_first``;
- a ``Place`` (re-tile, slice, concat, reshape) joins each source tile to the output tiles it
  overlaps (a range join on computed element offsets) and assembles each output tile from
  its pieces; a ``Fill`` generates constant tiles from ``range()`` tables;
- einsums that each read the previous one's result, which nothing else reads, are one step
  when every index they sum over is a single tile (``Chain``: one kernel call per joined row
  computes them in turn);
- a program is a ``WITH ... AS MATERIALIZED`` chain, one CTE per node, shared nodes once.

Everything is built as sqlglot expressions; ``Program.sql()`` renders a dialect.
"""

from __future__ import annotations

import contextlib
import json
import string
from collections import Counter
from dataclasses import dataclass, field
from math import ceil, prod

import numpy as np
from sqlglot import exp

from tra_sql.graph import Einsum, Fill, Node, Place, Source, topological
from tra_sql.udfs.attention import Roles

KEY_TYPE = "BIGINT[]"
PLAIN_CTE_DIALECTS = {"spark", "spark2", "databricks", "hive"}  # no ``AS MATERIALIZED``
CHAIN_CALL_BYTES = 1 << 30  # the most input bytes a chain's kernel call may receive (else: steps)
BATCH_ROWS = 2048  # the most rows a UDF call receives
#: The fusions ``Program.compile`` may make: ``attention``, ``prologue``, ``epilogue``, ``chain``;
#: and the two ways of a split aggregation, ``partials`` and ``agg_inputs`` (see ``partials_first``).
FUSIONS = frozenset({"attention", "prologue", "epilogue", "chain", "partials", "agg_inputs"})
enabled = FUSIONS


@contextlib.contextmanager
def fusions(off=()):
    """Compile with the fusions named in ``off`` switched off (a testing and debugging aid;
    not thread-safe): ``with sqlgen.fusions(off={"epilogue"}): C.numpy()`` runs C with every
    element-wise step as a step of its own. Off ``partials``, a split aggregation always
    aggregates its input tiles (but for CSR results); off ``agg_inputs``, it always aggregates
    the partial results; not both."""
    global enabled
    off = frozenset(off)
    if off - FUSIONS or {"partials", "agg_inputs"} <= off:
        raise ValueError(f"fusions(off={sorted(off)}): name some of {sorted(FUSIONS)}, not both ways of aggregating")
    before, enabled = enabled, FUSIONS - off
    try:
        yield
    finally:
        enabled = before


def key(d: int) -> str:
    return f"k{d}"


def _array(items: list[exp.Expression]) -> exp.Expression:
    return exp.Array(expressions=items) if items else exp.cast(exp.Array(expressions=[]), KEY_TYPE)


def _field(name: str, value: exp.Expression) -> exp.PropertyEQ:
    return exp.PropertyEQ(this=exp.to_identifier(name), expression=value)


def _list_of_structs(fields: list[exp.PropertyEQ]) -> exp.Expression:
    return exp.ArrayAgg(this=exp.Struct(expressions=fields))


def _table(name: str, alias: str) -> exp.Table:
    return exp.Table(this=exp.to_identifier(name, quoted=True), alias=exp.TableAlias(this=exp.to_identifier(alias)))


def _meta(payload: dict) -> exp.Literal:
    return exp.Literal.string(json.dumps(payload, separators=(",", ":")))


def _select_keys(keys: list[exp.Expression], tile: exp.Expression) -> list[exp.Expression]:
    return [exp.alias_(k.copy(), key(d)) for d, k in enumerate(keys)] + [exp.alias_(tile, "tile")]


@dataclass(frozen=True)
class Epilogue:
    """An element-wise einsum fused into the contraction that produces its operand
    ``position``: the kernel applies its join to each contracted tile before returning it."""

    node: Einsum
    position: int
    refs: list[str]
    names: list[str]

    def meta(self) -> dict:
        return _step_meta(self.node, self.names) | {"position": self.position}


def _layouts(node: Einsum) -> dict:
    """The operands' and the result's tile layouts for the kernel's meta, when any is not dense."""
    layouts = [op.layout for op in node.operands]
    if all(layout == "dense" for layout in layouts):
        return {}
    return {"layouts": layouts} | ({"out_layout": node.layout} if node.layout != "dense" else {})


def _joins(inputs, refs: list[str]) -> tuple[list, list[exp.Expression], dict[str, exp.Column]]:
    """How operands ``x0, x1, ...`` (subscripts ``inputs``, relations ``refs``) join: each
    later one on the keys of the indices it shares with earlier ones, an index repeated inside
    one operand as a filter. Returns (joins, filters, the first key column of every index)."""
    first: dict[str, exp.Column] = {}
    joins: list[tuple[exp.Table, list[exp.Expression]]] = []
    where: list[exp.Expression] = []
    for m, sub in enumerate(inputs):
        on = []
        seen_here: dict[str, exp.Column] = {}
        for d, c in enumerate(sub):
            col = exp.column(key(d), f"x{m}")
            if c in seen_here:
                where.append(exp.EQ(this=col, expression=seen_here[c].copy()))
            elif c in first:
                on.append(exp.EQ(this=col, expression=first[c].copy()))
            seen_here.setdefault(c, col)
            first.setdefault(c, col)
        if m:
            joins.append((_table(refs[m], f"x{m}"), on))
    return joins, where, first


def _joined(ref: str, joins: list, where: list[exp.Expression]) -> exp.Select:
    """``FROM ref AS x0 JOIN ... WHERE ...``, nothing selected yet."""
    select = exp.select().from_(_table(ref, "x0"))
    for table, on in joins:
        select = select.join(table, on=exp.and_(*on) if on else exp.true())
    return select.where(exp.and_(*where)) if where else select


def _operand_fields(inputs) -> list[exp.PropertyEQ]:
    """``keys<m>``, ``tile<m>`` struct fields of every operand ``x<m>``."""
    fields = []
    for m, sub in enumerate(inputs):
        keys = _array([exp.column(key(d), f"x{m}") for d in range(len(sub))])
        fields += [_field(f"keys{m}", keys), _field(f"tile{m}", exp.column("tile", f"x{m}"))]
    return fields


def _extents(inputs, operands) -> tuple[dict[str, int], dict[str, int]]:
    """The full size and the tile size of every index of ``operands`` (subscripts ``inputs``)."""
    sizes = {c: n for sub, op in zip(inputs, operands) for c, n in zip(sub, op.shape)}
    return sizes, {c: t for sub, op in zip(inputs, operands) for c, t in zip(sub, op.tile)}


def _step_meta(node: Einsum, names: list[str]) -> dict:
    """The kernel's description of ``node``: subscripts, sizes and tiles, dtypes, names, join."""
    return {"inputs": list(node.spec.inputs), "output": node.spec.output, "sizes": node.sizes,
            "tiles": node.tiles, "dtypes": [op.dtype.name for op in node.operands],
            "out_dtype": node.dtype.name, "names": names, "join": node.join, "agg": node.agg} | _layouts(node)


def einsum_select(node: Einsum, refs: list[str], names: list[str], epilogue: Epilogue | None = None,
                  prologue: tuple[int, ...] = ()) -> tuple[exp.Select, list[str]]:
    """The SELECT computing ``node`` (then ``epilogue``, if any) from the relations ``refs``,
    and the UDFs it calls. The operands at ``prologue`` (see ``prologue_parts``; their refs
    are ignored) are not joined: the kernel computes them from the others, in that order."""
    spec = node.spec
    present = [m for m in range(len(spec.inputs)) if m not in prologue]
    inputs = [spec.inputs[m] for m in present]
    joins, where, first = _joins(inputs, [refs[m] for m in present])
    refs = [refs[m] for m in present]
    out_keys = [first[c] for c in spec.output]
    split = [first[c] for c in spec.aggregated if node.tiles[c] < node.sizes[c]]
    meta = _step_meta(node, names)
    steps = [_step_meta(node.operands[p], [names[node.operands.index(src)] for src in node.operands[p].operands])
             | {"position": p, "sources": [node.operands.index(src) for src in node.operands[p].operands]}
             for p in prologue]
    full_meta = _meta(meta | ({"epilogue": epilogue.meta()} if epilogue else {})
                      | ({"prologue": steps} if steps else {}))
    fields = _operand_fields(inputs)
    extras: list[exp.Expression] = []  # (keys, tile) of each epilogue operand, joined on the output keys
    if epilogue:
        position_of = {c: i for i, c in enumerate(epilogue.node.spec.output)}
        for j, (sub, ref) in enumerate(zip(epilogue.node.spec.inputs, epilogue.refs)):
            if j == epilogue.position:
                continue
            alias = f"y{j}"
            cols = [exp.column(key(d), alias) for d in range(len(sub))]
            joins.append((_table(ref, alias), [exp.EQ(this=col, expression=out_keys[position_of[c]].copy())
                                               for col, c in zip(cols, sub)]))
            extras += [_array([c.copy() for c in cols]), exp.column("tile", alias)]
    suffix = f"_{len(extras) // 2}" if extras else ""
    select = _joined(refs[0], joins, where)
    per_row = [_array([k.copy() for k in out_keys])] + [f.expression for f in fields]
    if not split:
        udf = f"tra_einsum_{len(refs) + len(extras) // 2}"
        return select.select(*_select_keys(out_keys, exp.Anonymous(this=udf, expressions=[full_meta] + per_row
                                                                    + extras))), [udf]
    if partials_first(node):
        # each joined row's partial result first, then only those go through list() (smaller than the inputs)
        partial = exp.Anonymous(this=f"tra_einsum_{len(refs)}", expressions=[_meta(meta)] + per_row)
        extra_cols = [exp.alias_(e, f"e{i}") for i, e in enumerate(extras)]
        inner = select.select(*_select_keys(out_keys, partial), *extra_cols)
        keys = [exp.column(key(d)) for d in range(len(out_keys))]
        udfs = [partial.name, f"tra_reduce{suffix}"]
        args = [full_meta, _array([k.copy() for k in keys]), exp.ArrayAgg(this=exp.column("tile"))] + \
            [exp.AnyValue(this=exp.column(f"e{i}")) for i in range(len(extras))]
        outer = exp.select(*_select_keys(keys, exp.Anonymous(this=udfs[1], expressions=args)))
        outer = outer.from_(inner.subquery("p"))
        return (outer.group_by(*[k.copy() for k in keys]) if keys else outer), udfs
    udf = f"tra_einsum_agg_{len(refs)}{suffix}"
    args = [full_meta, _array([k.copy() for k in out_keys]), _list_of_structs(fields)] + \
        [exp.AnyValue(this=e) for e in extras]
    select = select.select(*_select_keys(out_keys, exp.Anonymous(this=udf, expressions=args)))
    return (select.group_by(*[k.copy() for k in out_keys]) if out_keys else select), [udf]


def partials_first(node: Einsum) -> bool:
    """Whether a split aggregation should compute one partial result per joined row and
    aggregate those (``tra_reduce``), rather than aggregate the joined input tiles and compute
    per group (``tra_einsum_agg``): DuckDB's ``list()`` copies every byte it collects, so the
    side with fewer bytes per joined row goes through it (unless ``fusions`` switched one off)."""
    if node.layout != "dense" or "agg_inputs" not in enabled:
        return True
    if "partials" not in enabled:
        return False
    size = node.tiles
    out = prod(size[c] for c in node.spec.output) * node.dtype.itemsize
    inputs = sum(prod(size[c] for c in sub) * op.dtype.itemsize for sub, op in zip(node.spec.inputs, node.operands))
    return out <= inputs


def fusable(node: Node, consumers: Counter) -> int | None:
    """The operand of ``node`` that can absorb ``node`` as an epilogue: ``node`` is an
    element-wise einsum (custom join, nothing aggregated) over a plain contraction that only
    it consumes, laid out exactly as ``node``'s output (so tiles correspond one to one)."""
    if not isinstance(node, Einsum) or node.join is None or node.spec.aggregated or node.layout != "dense":
        return None
    for p, (op, sub) in enumerate(zip(node.operands, node.spec.inputs)):
        if (isinstance(op, Einsum) and op.join is None and op.agg == "sum" and consumers[id(op)] == 1
                and sub == node.spec.output and op.tile == node.tile):
            return p
    return None


def _statistic(op: Node, position: dict[int, int]) -> bool:
    """Whether ``op`` is a reduction over whole tiles of dense operands at ``position``."""
    return (isinstance(op, Einsum) and op.layout == "dense" and bool(op.spec.aggregated)
            and all(op.tiles[c] == op.sizes[c] for c in op.spec.aggregated)
            and all(id(src) in position and src.layout == "dense" for src in op.operands))


def _aligned(node: Einsum, stat: Einsum, position: dict[int, int]) -> bool:
    """Whether ``node`` joins ``stat`` on the indices ``stat`` keeps of its sources, so each
    joined row's source tiles are exactly the ones ``stat``'s tile is computed from."""
    letter: dict[str, str] = {}
    for sub, src in zip(stat.spec.inputs, stat.operands):
        for c, outer in zip(sub, node.spec.inputs[position[id(src)]]):
            if letter.setdefault(c, outer) != outer:
                return False
    return all(letter.get(c) == outer for c, outer in zip(stat.spec.output, node.spec.inputs[position[id(stat)]]))


def prologue_parts(node: Node, consumers: Counter) -> tuple[int, ...]:
    """Positions of ``node``'s operands that its kernel computes itself, in the order to
    compute them: row statistics (reductions over whole tiles, such as layer norm's mean and
    variance or softmax's row max and sum) of its other operands that nothing else reads.
    ``node`` must be element-wise (nothing aggregated), dense, its operands distinct."""
    if not isinstance(node, Einsum) or node.spec.aggregated or node.layout != "dense":
        return ()
    operands = node.operands
    position = {id(op): p for p, op in enumerate(operands)}
    if len(position) != len(operands):
        return ()
    chosen = {p for p, op in enumerate(operands) if _statistic(op, position) and _aligned(node, op, position)}
    while True:
        uses = Counter(id(c) for n in (node, *(operands[p] for p in chosen)) for c in n.inputs)
        kept = {p for p in chosen if consumers[id(operands[p])] == uses[id(operands[p])]}
        if kept == chosen:
            break
        chosen = kept
    order: list[int] = []
    while len(order) < len(chosen):  # sources first
        order += [p for p in sorted(chosen) if p not in order and all(
            position[id(src)] in order or position[id(src)] not in chosen for src in operands[p].operands)]
    return tuple(order) if len(order) < len(operands) else ()


@dataclass(frozen=True)
class Attention:
    """``node = softmax(scale * Q·K, mask) · V`` found in the DAG (see ``attention_parts``):
    the steps it absorbs, and the fused step's operands (Q, K, V, the mask if any) with their
    subscripts, the scores' subscript and the output's, all in the scores' index letters."""

    node: Einsum
    absorbed: tuple[Node, ...]
    operands: tuple[Node, ...]
    inputs: tuple[str, ...]
    scores: str
    output: str
    scale: float


def attention_parts(node: Node, consumers: Counter) -> Attention | None:
    """``node`` as a fused attention step, when it contracts V with a ``Softmax``-marked einsum
    (over its last index) of scores ``Q·K`` and nothing else reads the scores, the row max,
    the row sum or the probabilities. The scores' contracted indices must be single tiles
    (the kernel computes whole score tiles), the indices must play the parts of ``Roles``,
    everything dense."""
    if not isinstance(node, Einsum) or node.join is not None or node.agg != "sum" or len(node.operands) != 2:
        return None
    probs, values = node.operands
    if not isinstance(probs, Einsum) or probs.softmax is None or consumers[id(probs)] != 1:
        return None
    scores, row_max, row_sum = probs.operands[0], probs.operands[-2], probs.operands[-1]
    if not (isinstance(scores, Einsum) and scores.join is None and scores.agg == "sum" and len(scores.operands) == 2
            and isinstance(row_max, Einsum) and isinstance(row_sum, Einsum)
            and row_max.operands[0] is scores and row_sum.operands[0] is scores and row_sum.operands[-1] is row_max):
        return None
    if (consumers[id(scores)], consumers[id(row_max)], consumers[id(row_sum)]) != (3, 2, 1):
        return None
    mask = probs.operands[1:2] if probs.softmax.masked else ()
    if any(n.layout != "dense" for n in (*scores.operands, values, *mask)):
        return None
    if any(scores.tiles[c] < scores.sizes[c] for c in scores.spec.aggregated):
        return None
    letters = scores.spec.output
    probs_sub, (over, own) = probs.spec.inputs[0], node.spec.inputs
    if (probs.spec.output != probs_sub or len(set(letters)) != len(letters) or over[-1] in node.spec.output
            or set(node.spec.aggregated) != {over[-1]}):
        return None
    rename = dict(zip(over, letters))
    fresh = (c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in "".join(scores.spec.inputs))
    for c in own:
        rename.setdefault(c, next(fresh))
    inputs = (*scores.spec.inputs, "".join(rename[c] for c in own))
    if mask:
        inputs += ("".join(dict(zip(probs_sub, letters))[c] for c in probs.spec.inputs[1]),)
    output = "".join(rename[c] for c in node.spec.output)
    if Roles.of(inputs, output, letters[-1]) is None:
        return None
    return Attention(node, (scores, row_max, row_sum, probs), (*scores.operands, values, *mask), inputs,
                     letters, output, probs.softmax.scale)


def attention_select(att: Attention, refs: list[str], names: list[str]) -> exp.Select:
    """The fused attention step: Q, K, V (and the mask) joined on their shared indices, one
    ``tra_attention_<n>`` call per output tile over the list of its joined rows (one per key
    tile: the kernel runs the softmax online across them)."""
    joins, where, first = _joins(att.inputs, refs)
    out_keys = [first[c] for c in att.output]
    operands = att.operands
    sizes, tiles = _extents(att.inputs, operands)
    meta = _meta({"inputs": list(att.inputs), "scores": att.scores, "output": att.output, "sizes": sizes,
                  "tiles": tiles, "dtypes": [op.dtype.name for op in operands], "out_dtype": att.node.dtype.name,
                  "probs_dtype": att.absorbed[-1].dtype.name,
                  "names": names, "scale": att.scale})
    call = exp.Anonymous(this=f"tra_attention_{len(refs)}", expressions=[
        meta, _array([k.copy() for k in out_keys]), _list_of_structs(_operand_fields(att.inputs))])
    select = _joined(refs[0], joins, where).select(*_select_keys(out_keys, call))
    return select.group_by(*[k.copy() for k in out_keys]) if out_keys else select


def chainable(node: Node) -> bool:
    """Whether ``node`` can be a link of a ``Chain``: a dense einsum whose aggregated indices
    are single tiles, so one kernel call per joined row computes it."""
    return (isinstance(node, Einsum) and node.layout == "dense" and all(op.layout == "dense" for op in node.operands)
            and all(node.tiles[c] == node.sizes[c] for c in node.spec.aggregated))


def feeds(node: Einsum, position: int) -> bool:
    """Whether ``node`` can compute its operand ``position`` per joined row without doing it
    twice: every index the operand lacks is a single tile (so each of its tiles joins one row)."""
    sub = node.spec.inputs[position]
    letters = set("".join(node.spec.inputs))
    return len(set(sub)) == len(sub) and all(node.tiles[c] == node.sizes[c] for c in letters - set(sub))


@dataclass(frozen=True)
class Chain:
    """Einsums that each read the previous one's result (contractions with their fused
    element-wise epilogues, or element-wise steps), computed one after another in one kernel
    call per joined row, so their intermediate results never become relations (an MLP's layers
    at inference). ``steps``: the einsums in order (the last is the chain's result); ``leaves``:
    the relations joined, ``inputs`` their subscripts in the chain's letters, ``output`` the
    result's; ``sources``: per step, each operand's origin (leaf ``m``, or ``-1 - k`` for step
    ``k``'s result)."""

    steps: tuple[Einsum, ...]
    leaves: tuple[Node, ...]
    inputs: tuple[str, ...]
    output: str
    sources: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(links: list[tuple[Einsum, Einsum | None]]) -> Chain | None:
        """The chain of ``links`` (einsum, its epilogue or None), each link's einsum reading the
        previous link's result; ``None`` if its indices need more than 52 letters."""
        fresh = iter(string.ascii_letters)
        steps: list[Einsum] = []
        leaves: list[Node] = []
        inputs: list[str] = []
        sources: list[tuple[int, ...]] = []
        result = ""
        try:
            for inner, epilogue in links:
                rename: dict[str, str] = {}
                for sub, op in zip(inner.spec.inputs, inner.operands):
                    if steps and op is steps[-1]:
                        rename.update(zip(sub, result))
                for c in "".join(inner.spec.inputs):
                    if c not in rename:
                        rename[c] = next(fresh)
                parts = [(inner, rename)]
                if epilogue is not None:  # its output's letters are those of the einsum it wraps
                    outer = dict(zip(epilogue.spec.output, (rename[c] for c in inner.spec.output)))
                    parts.append((epilogue, outer))
                for node, names in parts:
                    origin = []
                    for sub, op in zip(node.spec.inputs, node.operands):
                        if steps and op is steps[-1]:
                            origin.append(-len(steps))
                        else:
                            origin.append(len(leaves))
                            leaves.append(op)
                            inputs.append("".join(names[c] for c in sub))
                    steps.append(node)
                    sources.append(tuple(origin))
                    result = "".join(names[c] for c in node.spec.output)
        except StopIteration:
            return None
        return Chain(tuple(steps), tuple(leaves), tuple(inputs), result, tuple(sources))

    def call_bytes(self) -> int:
        """The input bytes of the largest kernel call: every joined row (one per output tile)
        carries a tile of every leaf, weights included, so a chain of many large weights over
        many row tiles is better run as steps."""
        grid = {c: ceil(n / t) for sub, op in zip(self.inputs, self.leaves) for c, n, t in zip(sub, op.shape, op.tile)}
        per_row = sum(prod(op.tile) * op.dtype.itemsize for op in self.leaves)
        return min(prod(grid[c] for c in self.output), BATCH_ROWS) * per_row


def chain_select(chain: Chain, refs: list[str], names: list[str]) -> exp.Select:
    """The chain's step: its leaves joined on their shared indices, one ``tra_chain_<n>``
    call per joined row computing every step in turn."""
    joins, where, first = _joins(chain.inputs, refs)
    out_keys = [first[c] for c in chain.output]
    sizes, tiles = _extents(chain.inputs, chain.leaves)
    labels = [*names, *(step.label for step in chain.steps)]
    steps = [_step_meta(step, [labels[s if s >= 0 else len(names) - 1 - s] for s in origin])
             | {"sources": list(origin)} for step, origin in zip(chain.steps, chain.sources)]
    meta = _meta({"leaves": {"inputs": list(chain.inputs), "output": chain.output, "sizes": sizes, "tiles": tiles,
                             "dtypes": [op.dtype.name for op in chain.leaves],
                             "out_dtype": chain.steps[-1].dtype.name, "names": names, "join": None, "agg": "sum"},
                  "steps": steps})
    per_row = [_array([k.copy() for k in out_keys])] + [f.expression for f in _operand_fields(chain.inputs)]
    call = exp.Anonymous(this=f"tra_chain_{len(refs)}", expressions=[meta] + per_row)
    return _joined(refs[0], joins, where).select(*_select_keys(out_keys, call))


def _num(value: int) -> exp.Literal:
    return exp.Literal.number(value)


def _plus(value: exp.Expression, offset: int) -> exp.Expression:
    if offset == 0:
        return value
    return exp.Add(this=value, expression=_num(offset)) if offset > 0 else exp.Sub(this=value, expression=_num(-offset))


def grid_table(g: int, size: int) -> exp.Table:
    """``range(0, size) AS r<g>(o)``: the output tile keys along one dimension."""
    return exp.Table(this=exp.Anonymous(this="range", expressions=[_num(0), _num(size)]),
                     alias=exp.TableAlias(this=exp.to_identifier(f"r{g}"), columns=[exp.to_identifier("o")]))


def _piece_geometry(node: Place, m: int) -> list[tuple[exp.Expression, exp.Expression]]:
    """(origin, length) per placement dimension of source ``m``'s tile ``s``, in output
    element coordinates (flat: one dimension, row-major order)."""
    src, offsets = node.sources[m], node.offsets[m]
    keys = [exp.column(key(d), "s") for d in range(len(src.shape))]
    lengths = [exp.Anonymous(this="least", expressions=[
        _num(t), exp.Sub(this=_num(n), expression=exp.Mul(this=k.copy(), expression=_num(t)))])
        for k, n, t in zip(keys, src.shape, src.tile)]
    if not node.flat:
        return [(_plus(exp.Mul(this=k, expression=_num(t)), off), length)
                for k, t, off, length in zip(keys, src.tile, offsets, lengths)]
    if not src.shape:
        return [(_num(0), _num(1))]
    row = int(np.prod(src.shape[1:], dtype=np.int64))
    return [(exp.Mul(this=keys[0], expression=_num(src.tile[0] * row)), exp.Mul(this=lengths[0], expression=_num(row)))]


def _pieces_select(node: Place, m: int, ref: str) -> exp.Select:
    """One row per (source tile, output tile it overlaps): the output keys ``o<d>`` and a
    struct with the piece's origin, shape, source number and bytes."""
    src = node.sources[m]
    geometry = _piece_geometry(node, m)
    if node.flat:
        extents = [(node.tile[0] * int(np.prod(node.shape[1:], dtype=np.int64)), node.grid[0],
                    int(np.prod(node.shape, dtype=np.int64)))] if node.shape else [(1, 1, 1)]
    else:
        extents = list(zip(node.tile, node.grid, node.shape))
    out_keys: list[exp.Expression] = []
    joins, where = [], []
    for g, ((origin, length), (tile, grid, size)) in enumerate(zip(geometry, extents)):
        direct = not node.flat and src.tile[g] == tile and node.offsets[m][g] == 0 and src.shape[g] == size
        if direct:
            out_keys.append(exp.column(key(g), "s"))
            continue
        end = exp.paren(exp.Add(this=origin.copy(), expression=length.copy()))
        low = exp.IntDiv(this=exp.paren(origin.copy()), expression=_num(tile))
        high = exp.IntDiv(this=exp.paren(exp.Sub(this=end.copy(), expression=_num(1))), expression=_num(tile))
        target = exp.column("o", f"r{g}")
        joins.append((grid_table(g, grid), exp.Between(this=target, low=low, high=high)))
        where += [exp.LT(this=origin.copy(), expression=_num(size)), exp.GT(this=end, expression=_num(0))]
        out_keys.append(target)
    if node.flat and node.shape:
        out_keys = out_keys[:1] + [_num(0)] * (len(node.shape) - 1)
    piece = exp.Struct(expressions=[
        _field("origin", _array([o for o, _ in geometry])), _field("shape", _array([n for _, n in geometry])),
        _field("part", _num(m)), _field("tile", exp.column("tile", "s")),
    ])
    select = exp.select(*[exp.alias_(k, f"o{d}") for d, k in enumerate(out_keys)], exp.alias_(piece, "piece"))
    select = select.from_(_table(ref, "s"))
    for table, on in joins:
        select = select.join(table, on=on)
    return select.where(exp.and_(*where)) if where else select


def place_select(node: Place, refs: list[str], names: list[str]) -> exp.Select:
    """The SELECT assembling ``node``'s tiles from the pieces of its sources."""
    parts = [_pieces_select(node, m, ref) for m, ref in enumerate(refs)]
    pieces = parts[0]
    for part in parts[1:]:
        pieces = exp.union(pieces, part, distinct=False)
    meta = _meta({"names": names, "dtypes": [src.dtype.name for src in node.sources], "dtype": node.dtype.name,
                  "shape": list(node.shape), "tile": list(node.tile), "flat": node.flat, "add": node.add})
    out_keys = [exp.column(f"o{d}", "p") for d in range(len(node.shape))]
    call = exp.Anonymous(this="tra_place", expressions=[
        meta, _array([k.copy() for k in out_keys]), exp.ArrayAgg(this=exp.column("piece", "p"))])
    select = exp.select(*_select_keys(out_keys, call)).from_(exp.Subquery(
        this=pieces, alias=exp.TableAlias(this=exp.to_identifier("p"))))
    return select.group_by(*[k.copy() for k in out_keys]) if out_keys else select


def fill_select(node: Fill) -> exp.Select:
    """The SELECT generating every tile of a constant tensor."""
    keys = [exp.column("o", f"r{d}") for d in range(len(node.shape))]
    meta = _meta({"dtype": node.dtype.name, "shape": list(node.shape), "tile": list(node.tile), "value": node.value})
    call = exp.Anonymous(this="tra_fill", expressions=[meta, _array([k.copy() for k in keys])])
    select = exp.select(*_select_keys(keys, call))
    for d, grid in enumerate(node.grid):
        table = grid_table(d, grid)
        select = select.from_(table) if d == 0 else select.join(table, join_type="CROSS")
    return select


def _chains(order: list[Node], consumers: Counter, fused: dict[int, int], taken: set[int]) -> dict[int, Chain]:
    """The ``Chain`` of two or more links ending at each step that ends one, by the id of its
    last node. A link is a ``chainable`` einsum with its fused epilogue, if any (``fused``:
    epilogue id -> the contraction's position); it joins the chain of the link that produces
    its operand (the longest such chain) when nothing else reads that operand and it ``feeds``
    the link's einsum. Nodes in ``taken`` (absorbed by other fusions) are left alone; a chain
    whose kernel calls would receive over ``CHAIN_CALL_BYTES`` stays steps."""
    links: dict[int, tuple[Einsum, Einsum | None]] = {}
    for node in order:
        if id(node) in taken:
            continue
        if id(node) in fused:
            inner = node.inputs[fused[id(node)]]
            if chainable(inner):
                links[id(node)] = (inner, node)
        elif chainable(node):
            links[id(node)] = (node, None)
    runs: dict[int, list[tuple[Einsum, Einsum | None]]] = {}
    for node in order:
        if id(node) not in links:
            continue
        inner = links[id(node)][0]
        producers = [op for p, op in enumerate(inner.operands)
                     if id(op) in runs and consumers[id(op)] == 1 and feeds(inner, p)]
        longest = max(producers, key=lambda op: len(runs[id(op)]), default=None)
        runs[id(node)] = ([] if longest is None else runs.pop(id(longest))) + [links[id(node)]]
    chains = {key: Chain.of(run) for key, run in runs.items() if len(run) > 1}
    return {key: chain for key, chain in chains.items() if chain is not None and chain.call_bytes() <= CHAIN_CALL_BYTES}


@dataclass
class Program:
    """The SQL of a DAG: one SELECT per computed node (a materialized CTE, but for the root,
    which is the final SELECT), and the UDFs it calls. Nodes whose SQL is identical (the same
    computation on the same inputs) share one CTE."""

    root: Node
    ctes: list[tuple[str, exp.Select, Node]] = field(default_factory=list)
    udfs: set[str] = field(default_factory=set)
    refs: dict[int, str] = field(default_factory=dict)
    by_sql: dict[str, str] = field(default_factory=dict)

    @classmethod
    def compile(cls, root: Node, *others: Node) -> Program:
        """Compile the DAG under ``root`` (and ``others``: more results, see ``union_query``);
        attention (softmax over scores, contracted with values) becomes one step (see
        ``attention_parts``), an element-wise einsum computes the row statistics only it reads
        (see ``prologue_parts``), element-wise einsums over a contraction are fused into it
        (see ``fusable``), and the steps left that each read the previous one's result are
        chained (see ``_chains``); each only where ``fusions`` has not switched it off."""
        program = cls(root)
        order = list({id(node): node for top in (root, *others) for node in topological(top)}.values())
        consumers = Counter(id(child) for node in order for child in node.inputs)
        consumers.update(id(top) for top in (root, *others))  # a result stays a step of its own
        attention = {id(node): att for node in order
                     if "attention" in enabled and (att := attention_parts(node, consumers))}
        absorbed = {id(part) for att in attention.values() for part in att.absorbed}
        prologues = {id(node): parts for node in order if "prologue" in enabled
                     and id(node) not in absorbed and (parts := prologue_parts(node, consumers))}
        absorbed |= {id(node.inputs[p]) for node in order for p in prologues.get(id(node), ())}
        fused = {id(node): p for node in order if "epilogue" in enabled and (p := fusable(node, consumers)) is not None
                 and id(node) not in prologues and id(node.inputs[p]) not in attention
                 and id(node.inputs[p]) not in absorbed}
        absorbed |= {id(node.inputs[p]) for node in order if (p := fused.get(id(node))) is not None}
        chains = _chains(order, consumers, fused, absorbed | set(attention) | set(prologues)) \
            if "chain" in enabled else {}
        absorbed |= {id(step) for chain in chains.values() for step in chain.steps[:-1]}
        for node in order:
            if id(node) not in absorbed:
                program._add(node, fused.get(id(node)), attention.get(id(node)), prologues.get(id(node), ()),
                             chains.get(id(node)))
        return program

    def _labels(self, nodes) -> tuple[list[str], list[str]]:
        refs = [self.refs[id(child)] for child in nodes]
        return refs, [child.table if isinstance(child, Source) else r for child, r in zip(nodes, refs)]

    def _add(self, node: Node, epilogue_of: int | None = None, attention: Attention | None = None,
             prologue: tuple[int, ...] = (), chain: Chain | None = None) -> None:
        if isinstance(node, Source):
            self.refs[id(node)] = node.table
            return
        name = f"_t{len(self.ctes) + 1}"
        within: list[Node] = []  # absorbed nodes, computed by this step too
        if chain is not None:
            refs, labels = self._labels(chain.leaves)
            select, udfs = chain_select(chain, refs, labels), [f"tra_chain_{len(refs)}"]
            within = list(chain.steps[:-1])
        elif attention is not None:
            refs, labels = self._labels(attention.operands)
            select, udfs = attention_select(attention, refs, labels), [f"tra_attention_{len(refs)}"]
            within = list(attention.absorbed)
        elif epilogue_of is not None:
            inner = node.inputs[epilogue_of]
            outer_refs, outer_labels = self._labels(
                [child for i, child in enumerate(node.inputs) if i != epilogue_of])
            outer_refs.insert(epilogue_of, "")  # the contraction's own result
            outer_labels.insert(epilogue_of, "")
            refs, labels = self._labels(inner.inputs)
            select, udfs = einsum_select(inner, refs, labels, Epilogue(node, epilogue_of, outer_refs, outer_labels))
            within = [inner]
        elif prologue:
            within = [node.inputs[p] for p in prologue]
            refs, labels = self._labels([child for child in node.inputs if child not in within])
            for p in sorted(prologue):  # computed in the kernel: no relation
                refs.insert(p, "")
                labels.insert(p, node.inputs[p].label)
            select, udfs = einsum_select(node, refs, labels, prologue=prologue)
        elif isinstance(node, Einsum):
            refs, labels = self._labels(node.inputs)
            select, udfs = einsum_select(node, refs, labels)
        elif isinstance(node, Place):
            refs, labels = self._labels(node.inputs)
            select, udfs = place_select(node, refs, labels), ["tra_place"]
        elif isinstance(node, Fill):
            select, udfs = fill_select(node), ["tra_fill"]
        else:
            raise TypeError(f"cannot compile {type(node).__name__}")
        text = select.sql(dialect="duckdb")
        if text not in self.by_sql:
            self.udfs.update(udfs)
            self.ctes.append((name, select, node))
            self.by_sql[text] = name
        for computed in (node, *within):
            self.refs[id(computed)] = self.by_sql[text]

    def query(self, materialized: bool = True) -> exp.Select:
        """``WITH <steps> AS MATERIALIZED (...) <root's SELECT>``: columns ``k0, ..., tile``
        (plain CTEs without ``materialized``, for engines that lack the keyword)."""
        root = self.refs[id(self.root)]
        steps = [(name, cte) for name, cte, _ in self.ctes if name != root]
        final = next((cte for name, cte, _ in self.ctes if name == root), None)
        if final is None:  # the root is a stored table
            columns = [exp.column(key(d)) for d in range(len(self.root.shape))] + [exp.column("tile")]
            final = exp.select(*columns).from_(exp.to_table(root, quoted=True))
        select = final.copy()
        for name, cte in steps:
            select = select.with_(name, as_=cte, materialized=materialized or None)
        return select

    def sql(self, dialect: str = "duckdb", pretty: bool = True) -> str:
        return self.query(dialect not in PLAIN_CTE_DIALECTS).sql(dialect=dialect, pretty=pretty)

    def union_query(self, results: dict[str, Node]) -> exp.Select:
        """Several results of one compiled DAG in one query: every step a materialized CTE,
        then ``target, k0, ..., tile`` rows of each result (``target`` its key in ``results``;
        keys past a result's rank are NULL)."""
        rank = max((len(node.shape) for node in results.values()), default=0)
        parts = []
        for target, node in results.items():
            keys = [exp.column(key(d)) if d < len(node.shape) else exp.cast(exp.Null(), "INTEGER")
                    for d in range(rank)]
            columns = [exp.alias_(exp.Literal.string(target), "target"), *_select_keys(keys, exp.column("tile"))]
            parts.append(exp.select(*columns).from_(exp.to_table(self.refs[id(node)], quoted=True)))
        select = parts[0]
        for part in parts[1:]:
            select = exp.union(select, part, distinct=False)
        for name, cte, _ in self.ctes:
            select = select.with_(name, as_=cte, materialized=True)
        return select
