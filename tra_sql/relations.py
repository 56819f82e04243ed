"""Ordinary tables viewed as sparse tensor relations, without copying.

``relation(db, "edges", keys=("dst", "src"), value="w", shape=(N, N))`` creates a VIEW with
the tensor-relation columns ``k0, k1, tile`` over table ``edges`` and a catalog row, so the
table's rows are the nonzeros of an (N, N) tensor and joins against it are ordinary einsums:

- with ``tile=None`` every row is one 1x1 tile: ``tra_pack(value)`` reinterprets the value
  column's bytes, and absent keys are zeros (under a join other than the product the view is
  completed with zero tiles, see ``tra_sql.absent``: use ``layout="csr"`` for a large one);
- with a ``tile`` shape, rows are grouped into dense blocks (``tra_pack_tile``); absent
  blocks are zeros, and elements inside a block that no row names are zeros too;
- with ``layout="csr"`` (matrices), rows are grouped into blocks (default: one block) kept
  as their nonzeros (``tra_pack_csr``, see ``tra_sql.udfs.sparse``): sparse-dense products
  such as ``vu,uf->vf`` then run over the nonzeros, in one kernel call per block. Rows with
  the same keys stay separate entries (they add up in products and in ``numpy()``). Store the
  view (``tensor.store(name)``) to pack the blocks once instead of at every use.

Keys must be integers in ``[0, n)``; rows outside ``shape`` are not part of the tensor.
Rows with the same keys add up when ``sum_duplicates`` (or when blocked); otherwise each row
is a tile of its own, which sum-of-products also adds up but which other joins see twice.
``value=None`` means 1.0 per row (an adjacency or incidence relation). The engine makes the
relation (``Engine.create_relation``): DuckDB a VIEW; Spark a tensor table (a copy: later
changes to the table do not show).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
from sqlglot import exp

from tra_sql import catalog
from tra_sql.errors import ShapeError, SpecError, UnknownTensorError
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor

PACK = {"float64": protocol.PACK, "float32": protocol.PACK_F32}


def ensure_udfs(db: Session) -> None:
    """Register the kernels relation views call (needed once per engine)."""
    db.engine.ensure_kernels(protocol.PACKING)


def _column(name: str) -> exp.Expression:
    if not isinstance(name, str) or not name:
        raise SpecError(f"relation column {name!r} must be a column name")
    return exp.column(name, quoted=True)


def check_columns(db: Session, table: str, columns: tuple[str, ...]) -> None:
    """``table`` exists and has ``columns`` (case-insensitive, as in SQL)."""
    probe = exp.select("*").from_(exp.to_table(table)).limit(0)
    try:
        found = db.engine.query(probe.sql(dialect=db.engine.dialect)).columns
    except db.engine.Error:
        raise UnknownTensorError(f"relation: no table or view named {table!r}") from None
    have = {c.lower() for c in found}
    for column in columns:
        _column(column)  # a name at all
        if column.lower() not in have:
            raise SpecError(f"relation over {table!r}: no column {column!r} (it has {', '.join(found)})")


def key_shape(db: Session, table: str, keys: tuple[str, ...]) -> tuple[int, ...]:
    """``max(key) + 1`` per key column."""
    select = exp.select(*[exp.Max(this=_column(k)) for k in keys]).from_(exp.to_table(table))
    row = db.engine.rows(select.sql(dialect=db.engine.dialect))[0]
    if any(v is None for v in row):
        raise ShapeError(f"relation over {table!r} is empty: give its shape")
    return tuple(int(v) + 1 for v in row)


def view_select(table: str, keys: tuple[str, ...], value: str | None, shape: tuple[int, ...],
                dtype: np.dtype, tile: tuple[int, ...], sum_duplicates: bool, layout: str = "dense") -> exp.Select:
    """The SELECT producing ``k0.., tile`` from ``table``."""
    cols = [exp.cast(_column(k), "BIGINT") for k in keys]
    val = exp.cast(_column(value), "DOUBLE") if value is not None else exp.Literal.number("1.0")
    inside = [exp.Between(this=c.copy(), low=exp.Literal.number(0), high=exp.Literal.number(n - 1))
              for c, n in zip(cols, shape)]
    where = exp.and_(*inside, *([exp.Not(this=exp.Is(this=val.copy(), expression=exp.Null()))]
                                if value is not None else []))
    source = exp.to_table(table)
    if layout == "dense" and all(t == 1 for t in tile):
        if sum_duplicates:
            val = exp.Sum(this=val)
        packed = exp.Anonymous(this=PACK[dtype.name].name, expressions=[val])
        select = exp.select(*[exp.alias_(exp.cast(c, "INTEGER"), f"k{d}") for d, c in enumerate(cols)],
                            exp.alias_(packed, "tile")).from_(source).where(where)
        return select.group_by(*[c.copy() for c in cols]) if sum_duplicates else select
    blocks = [exp.IntDiv(this=c.copy(), expression=exp.Literal.number(t)) for c, t in zip(cols, tile)]
    meta = json.dumps({"name": "relation", "dtype": dtype.name, "shape": list(shape), "tile": list(tile)})
    entries = [exp.ArrayAgg(this=c.copy()) for c in cols] if layout == "csr" else \
        [exp.ArrayAgg(this=exp.Array(expressions=[c.copy() for c in cols]))]
    packed = exp.Anonymous(this=(protocol.PACK_CSR if layout == "csr" else protocol.PACK_TILE).name, expressions=[
        exp.Literal.string(meta), exp.Array(expressions=[b.copy() for b in blocks]), *entries, exp.ArrayAgg(this=val)])
    select = exp.select(*[exp.alias_(exp.cast(b, "INTEGER"), f"k{d}") for d, b in enumerate(blocks)],
                        exp.alias_(packed, "tile")).from_(source).where(where)
    return select.group_by(*[b.copy() for b in blocks])


def relation_tile(name: str, shape: tuple[int, ...], layout: str, tile) -> tuple[int, ...]:
    """The tile shape of relation ``name`` in ``layout`` (checked): ``tile``, by default one
    element per tile (``dense``) or the whole matrix (``csr``, which needs two dimensions)."""
    if layout not in catalog.LAYOUTS:
        raise SpecError(f"relation {name!r}: layout {layout!r} is not one of {', '.join(catalog.LAYOUTS)}")
    if layout == "csr" and len(shape) != 2:
        raise ShapeError(f"relation {name!r}: a csr layout needs two key columns (a matrix), not {len(shape)}")
    default = shape if layout == "csr" else (1,) * len(shape)
    return catalog.check_tile(shape, default if tile is None else tile, name)


def relation(db: Session, table: str, keys, value: str | None = None, shape=None, *, name: str | None = None,
             dtype="float64", tile=None, sum_duplicates: bool = False, replace: bool = False,
             layout: str = "dense") -> Tensor:
    """View ``table`` as a tensor relation named ``name`` (default ``<table>_<keys...>``):
    one dimension per column in ``keys``, the nonzeros from column ``value`` (1.0 if None).
    ``shape`` defaults to ``max(key) + 1`` per column; ``layout`` is ``dense`` or ``csr``."""
    info, select = relation_query(db, table, keys, value, shape, name=name, dtype=dtype, tile=tile,
                                  sum_duplicates=sum_duplicates, layout=layout)
    ensure_udfs(db)
    db.engine.create_relation(info, select, replace)
    return db.tensor(info.name)


def relation_query(db: Session, table: str, keys, value: str | None = None, shape=None, *, name: str | None = None,
                   dtype="float64", tile=None, sum_duplicates: bool = False,
                   layout: str = "dense") -> tuple[catalog.TensorInfo, exp.Select]:
    """The geometry of ``relation``'s tensor and the SELECT of its tiles (checked, nothing made)."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    if not keys:
        raise SpecError("a relation needs at least one key column")
    dtype = catalog.check_dtype(dtype)
    if dtype.name not in PACK:
        raise SpecError(f"relation values are floating point (float32 or float64), not {dtype}")
    name = catalog.check_name(name or f"{table}_{'_'.join(keys)}")
    if name.lower() == table.lower():
        raise SpecError(f"relation {name!r} would replace the table it views (names are case-insensitive)")
    check_columns(db, table, keys + (() if value is None else (value,)))
    shape = key_shape(db, table, keys) if shape is None else tuple(int(n) for n in shape)
    if len(shape) != len(keys):
        raise ShapeError(f"relation {name!r}: {len(keys)} key columns but shape {shape}")
    tile = relation_tile(name, shape, layout, tile)
    select = view_select(table, keys, value, shape, dtype, tile, sum_duplicates, layout)
    return catalog.TensorInfo(name, dtype, shape, tile, layout), select


def drop_relation(db: Session, name: str) -> None:
    """Drop a relation view and its catalog row (the underlying table stays)."""
    if db.engine.object_kind(name) != "VIEW":
        raise UnknownTensorError(f"no relation view named '{name}'")
    db.engine.drop(name)
