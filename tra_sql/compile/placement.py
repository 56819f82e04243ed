"""The lowering of the nodes without a contraction: a ``Source`` is its stored table; a
``Fill`` generates constant tiles from ``range()`` tables; a ``Place`` (re-tile, slice,
concat, reshape) joins each source tile to the output tiles it overlaps (a range join on
computed element offsets) and assembles each output tile from its pieces."""

from __future__ import annotations

import numpy as np
from sqlglot import exp

from tra_sql.compile import blocks
from tra_sql.compile.blocks import array, call, grid_table, key, number, plus, select_keys, struct_field
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.graph import Fill, Place, Source
from tra_sql.udfs.protocol import FILL, PLACE, FillStep, PlaceStep

PIECE = ("origin", "shape", "part", "tile")  # the fields of a piece, as tra_place's list of structs has them


@LOWERING.register(Source)
def lower_source(node: Source, relations: Relations) -> str:
    return node.table


def _piece_geometry(node: Place, m: int) -> list[tuple[exp.Expression, exp.Expression]]:
    """(origin, length) per placement dimension of source ``m``'s tile ``s``, in output
    element coordinates (flat: one dimension, row-major order)."""
    src, offsets = node.sources[m], node.offsets[m]
    keys = [exp.column(key(d), "s") for d in range(len(src.shape))]
    lengths = [exp.Anonymous(this="least", expressions=[
        number(t), exp.Sub(this=number(n), expression=exp.Mul(this=k.copy(), expression=number(t)))])
        for k, n, t in zip(keys, src.shape, src.tile)]
    if not node.flat:
        return [(plus(exp.Mul(this=k, expression=number(t)), off), length)
                for k, t, off, length in zip(keys, src.tile, offsets, lengths)]
    if not src.shape:
        return [(number(0), number(1))]
    row = int(np.prod(src.shape[1:], dtype=np.int64))
    return [(exp.Mul(this=keys[0], expression=number(src.tile[0] * row)),
             exp.Mul(this=lengths[0], expression=number(row)))]


def _pieces_select(node: Place, m: int, ref: str) -> exp.Select:
    """One row per (source tile, output tile it overlaps): the output keys ``o<d>`` and the
    piece's origin, shape, source number and bytes (``piece_<field>``, ``PIECE``)."""
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
        low = exp.IntDiv(this=exp.paren(origin.copy()), expression=number(tile))
        high = exp.IntDiv(this=exp.paren(exp.Sub(this=end.copy(), expression=number(1))), expression=number(tile))
        target = exp.column("o", f"r{g}")
        joins.append((grid_table(g, grid), exp.Between(this=target, low=low, high=high)))
        where += [exp.LT(this=origin.copy(), expression=number(size)), exp.GT(this=end, expression=number(0))]
        out_keys.append(target)
    if node.flat and node.shape:
        out_keys = out_keys[:1] + [number(0)] * (len(node.shape) - 1)
    piece = [array([o for o, _ in geometry]), array([n for _, n in geometry]), number(m), exp.column("tile", "s")]
    select = exp.select(*[exp.alias_(k, f"o{d}") for d, k in enumerate(out_keys)],
                        *(exp.alias_(e, f"piece_{name}") for name, e in zip(PIECE, piece)))
    select = select.from_(blocks.table(ref, "s"))
    for table, on in joins:
        select = select.join(table, on=on)
    return select.where(exp.and_(*where)) if where else select


@LOWERING.register(Place)
def lower_place(node: Place, relations: Relations) -> exp.Select:
    """The SELECT assembling ``node``'s tiles from the pieces of its sources."""
    refs, names = relations(node.inputs)
    parts = [_pieces_select(node, m, ref) for m, ref in enumerate(refs)]
    pieces = parts[0]
    for part in parts[1:]:
        pieces = exp.union(pieces, part, distinct=False)
    step = PlaceStep(tuple(names), tuple(src.dtype.name for src in node.sources), node.dtype.name,
                     tuple(node.shape), tuple(node.tile), node.flat, node.add)
    out_keys = [exp.column(f"o{d}", "p") for d in range(len(node.shape))]
    piece = exp.Struct(expressions=[struct_field(name, exp.column(f"piece_{name}", "p")) for name in PIECE])
    tile = call(PLACE, step, [array([k.copy() for k in out_keys]), exp.ArrayAgg(this=piece)])
    select = exp.select(*select_keys(out_keys, tile)).from_(exp.Subquery(
        this=pieces, alias=exp.TableAlias(this=exp.to_identifier("p"))))
    return blocks.grouped(select, out_keys)


@LOWERING.register(Fill)
def lower_fill(node: Fill, relations: Relations) -> exp.Select:
    """The SELECT generating every tile of a constant tensor."""
    keys = [exp.column("o", f"r{d}") for d in range(len(node.shape))]
    step = FillStep(node.dtype.name, tuple(node.shape), tuple(node.tile), node.value)
    select = exp.select(*select_keys(keys, call(FILL, step, [array([k.copy() for k in keys])])))
    for d, grid in enumerate(node.grid):
        table = grid_table(d, grid)
        select = select.from_(table) if d == 0 else select.join(table, join_type="CROSS")
    return select
