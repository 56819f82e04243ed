"""The lowering of an ``Einsum``: its operands joined on the keys of shared indices (an index
repeated inside one operand filters that operand's keys), one tile kernel call per joined
row. When an aggregated index is split over several tiles it groups by the output keys:
each joined row's partial result is aggregated (``tra_reduce`` over ``list(partial)``), or,
where a row's input tiles hold fewer bytes than its result, the kernel gets each group's
joined rows as one list of structs (a fused join + aggregate; one list keeps the operands'
tiles aligned without sorting), see ``partials_first``. The epilogue and prologue fusions
lower through ``einsum_select`` too."""

from __future__ import annotations

from math import prod

from sqlglot import exp

from tra_sql.compile import blocks, passes
from tra_sql.compile.blocks import array, call, select_keys
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.graph import Einsum
from tra_sql.udfs.contract import gemm_form
from tra_sql.udfs.protocol import EinsumStep, Kernel


def per_row(step: EinsumStep, arity: int) -> Kernel:
    """The kernel computing ``step`` once per joined row: ``tra_contract_2`` for a plain BLAS
    product (which engines may run natively), else ``tra_einsum_<arity>``."""
    return Kernel("contract" if gemm_form(step) is not None else "einsum", arity)


def partials_first(node: Einsum) -> bool:
    """Whether a split aggregation should compute one partial result per joined row and
    aggregate those (``tra_reduce``), rather than aggregate the joined input tiles and compute
    per group (``tra_einsum_agg``): DuckDB's ``list()`` copies every byte it collects, so the
    side with fewer bytes per joined row goes through it (unless ``fusions`` switched one off).
    DuckDB's dialect writes a split sum of BLAS products either way as the fused contraction
    aggregate, which lists neither (``dialect.Dialect.fuse``); Spark keeps this choice."""
    if node.layout != "dense" or "agg_inputs" not in passes.enabled:
        return True
    if "partials" not in passes.enabled:
        return False
    size = node.tiles
    out = prod(size[c] for c in node.spec.output) * node.dtype.itemsize
    inputs = sum(prod(size[c] for c in sub) * op.dtype.itemsize for sub, op in zip(node.spec.inputs, node.operands))
    return out <= inputs


def einsum_select(node: Einsum, refs: list[str], names: list[str], epilogue=None,
                  prologue: tuple[int, ...] = ()) -> exp.Select:
    """The SELECT computing ``node`` (then ``epilogue``, if any: ``(einsum, position, refs,
    names)`` of an element-wise einsum reading ``node``'s result at ``position``) from the
    relations ``refs``. The operands at ``prologue`` (their refs are ignored) are not joined:
    the kernel computes them from the others, in that order."""
    spec = node.spec
    present = [m for m in range(len(spec.inputs)) if m not in prologue]
    inputs = [spec.inputs[m] for m in present]
    joins, where, first = blocks.joins(inputs, [refs[m] for m in present])
    refs = [refs[m] for m in present]
    out_keys = [first[c] for c in spec.output]
    split = [first[c] for c in spec.aggregated if node.tiles[c] < node.sizes[c]]
    steps = tuple(node.operands[p].step([names[node.operands.index(src)] for src in node.operands[p].operands],
                              position=p, sources=tuple(node.operands.index(src) for src in node.operands[p].operands))
                  for p in prologue)
    extras: list[exp.Expression] = []  # (keys, tile) of each epilogue operand, joined on the output keys
    after = None
    if epilogue:
        outer, position, outer_refs, outer_names = epilogue
        after = outer.step(outer_names, position=position)
        position_of = {c: i for i, c in enumerate(outer.spec.output)}
        for j, (sub, ref) in enumerate(zip(outer.spec.inputs, outer_refs)):
            if j == position:
                continue
            alias = f"y{j}"
            cols = [exp.column(blocks.key(d), alias) for d in range(len(sub))]
            joins.append((blocks.table(ref, alias), [exp.EQ(this=col, expression=out_keys[position_of[c]].copy())
                                                     for col, c in zip(cols, sub)]))
            extras += [array([c.copy() for c in cols]), exp.column("tile", alias)]
    k = len(extras) // 2
    step = node.step(names, epilogue=after, prologue=steps)
    fields = blocks.operand_fields(inputs)
    select = blocks.joined(refs[0], joins, where)
    row_args = [array([key.copy() for key in out_keys])] + [f.expression for f in fields]
    if not split:
        return select.select(*select_keys(out_keys, call(per_row(step, len(refs) + k), step, row_args + extras)))
    if partials_first(node):
        # each joined row's partial result first, then only those go through list() (smaller than the inputs)
        partial_step = node.step(names)
        partial = call(per_row(partial_step, len(refs)), partial_step, row_args)
        extra_cols = [exp.alias_(e, f"e{i}") for i, e in enumerate(extras)]
        inner = select.select(*select_keys(out_keys, partial), *extra_cols)
        keys = [exp.column(blocks.key(d)) for d in range(len(out_keys))]
        args = [array([key.copy() for key in keys]), exp.ArrayAgg(this=exp.column("tile"))] + \
            [exp.AnyValue(this=exp.column(f"e{i}")) for i in range(len(extras))]
        outer_select = exp.select(*select_keys(keys, call(Kernel("reduce", 0, k), step, args)))
        return blocks.grouped(outer_select.from_(inner.subquery("p")), keys)
    args = [array([key.copy() for key in out_keys]), blocks.list_of_structs(fields)] + \
        [exp.AnyValue(this=e) for e in extras]
    select = select.select(*select_keys(out_keys, call(Kernel("einsum_agg", len(refs), k), step, args)))
    return blocks.grouped(select, out_keys)


@LOWERING.register(Einsum)
def lower_einsum(node: Einsum, relations: Relations) -> exp.Select:
    return einsum_select(node, *relations(node.inputs))
