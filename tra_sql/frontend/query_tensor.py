"""``CREATE TENSOR name [WITH (shape := [..], tile := [..], dtype := '..', layout := '..')] AS
<query>`` for any query whose rows are tiles (columns ``k0..``, ``tile``): joins with ordinary
tables, CTEs, unions, filters. The geometry is the options' or, for what they leave out, the
tensors the query reads (which must agree); the rows are computed into a temporary table and
checked (key columns integer, keys in the grid and unique, tiles present and of their
position's byte length) before the tensor's table and catalog row are written together."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from sqlglot import exp

from tra_sql import catalog
from tra_sql.catalog import TensorInfo
from tra_sql.compile.dialect import DUCKDB
from tra_sql.engines import duckdb_catalog
from tra_sql.errors import ShapeError, SQLError
from tra_sql.frontend.syntax import aliased, dtype_named, ints_literal, string_literal

if TYPE_CHECKING:
    from tra_sql.frontend.rewrite import Rewriter
    from tra_sql.tensor import Tensor

SHAPE_PROBLEMS = ("key outside grid", "tile size", "csr tile")


def lineage(rewriter: Rewriter, tree: exp.Expression) -> list[Tensor]:
    """The tensors ``tree`` reads: its tensor functions in FROM (once ``rewriter`` has rewritten
    it) and the stored tensors it names as tables (CTE names aside)."""
    ctes = {cte.alias.lower() for cte in tree.find_all(exp.CTE)}
    names = [t.name for t in tree.find_all(exp.Table) if isinstance(t.this, exp.Identifier)
             and not t.args.get("db") and t.name.lower() not in ctes and rewriter.is_tensor(t.name)]
    return [*rewriter.read, *(rewriter.stored(n) for n in names)]


def _agreed(name: str, what: str, values: list, option: str) -> object:
    """The one value the tensors read agree on for ``what`` (an SQLError asking for the option)."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return distinct[0]
    found = f"the tensors it reads have {what}s {', '.join(map(str, distinct))}" if distinct \
        else "it reads no tensor"
    raise SQLError(f"CREATE TENSOR {name}: {found}; give WITH ({option})")


def geometry(name: str, options: dict[str, exp.Expression], read: list[Tensor]) -> TensorInfo:
    """The tensor's geometry: each option given, else the read tensors' (shape is needed when
    they disagree or there are none; tile defaults as for any tensor, dtype to float64, layout
    to dense)."""
    shape = ints_literal(options["shape"], "shape") if "shape" in options else \
        _agreed(name, "shape", [t.shape for t in read], "shape := [...]")
    if "tile" in options:
        tile = ints_literal(options["tile"], "tile")
    else:
        tiles = list(dict.fromkeys(t.tile for t in read if t.shape == shape))
        tile = _agreed(name, "tile", tiles, "tile := [...]") if tiles else None
    dtype = dtype_named(string_literal(options["dtype"], "dtype")) if "dtype" in options else \
        _agreed(name, "dtype", [t.dtype for t in read], "dtype := '...'") if read else np.dtype("float64")
    layout = string_literal(options["layout"], "layout") if "layout" in options else \
        _agreed(name, "layout", [t.node.layout for t in read], "layout := '...'") if read else "dense"
    if layout not in catalog.LAYOUTS:
        raise SQLError(f"CREATE TENSOR {name}: layout {layout!r} is not one of {', '.join(catalog.LAYOUTS)}")
    return TensorInfo(name, dtype, shape, catalog.check_tile(shape, tile, name), layout)


def tiles_query(session, info: TensorInfo, query: exp.Expression) -> exp.Select:
    """``SELECT k0.., tile FROM (query)``, after checking the query's columns are exactly the
    keys (integers) and ``tile`` (a BLOB)."""
    probe = exp.select("*").from_(aliased(query.copy(), "_q")).limit(0)
    schema = session.engine.arrow(probe.sql(dialect="duckdb")).schema
    keys = [f"k{d}" for d in range(len(info.shape))]
    got = [n.lower() for n in schema.names]
    if sorted(got) != sorted([*keys, "tile"]):
        raise SQLError(f"CREATE TENSOR {info.name}: the query must give the columns {', '.join(keys + ['tile'])} "
                       f"(a tile relation), got {', '.join(schema.names) or 'none'}")
    types = {n.lower(): schema.field(n).type for n in schema.names}
    for key in keys:
        if not pa.types.is_integer(types[key]):
            raise SQLError(f"CREATE TENSOR {info.name}: key column {key} is {types[key]}, not an integer")
    if not (pa.types.is_binary(types["tile"]) or pa.types.is_large_binary(types["tile"])):
        raise SQLError(f"CREATE TENSOR {info.name}: column tile is {types['tile']}, not a BLOB")
    return exp.select(*[exp.alias_(exp.cast(exp.column(k, "_q"), "BIGINT"), k) for k in keys],
                      exp.column("tile", "_q")).from_(aliased(query, "_q"))


def store_checked(session, info: TensorInfo, select: exp.Select, replace: bool) -> None:
    """Compute ``select`` into a temporary table, check its rows against ``info`` and store them
    as tensor ``info.name`` (table and catalog row at once); nothing is left on an error."""
    temp = f"_tra_new_{info.name}"
    engine = session.engine
    engine.rows(f'CREATE OR REPLACE TEMP TABLE "{temp}" AS {DUCKDB.render(select)[0]}')
    try:
        findings = duckdb_catalog.tile_findings(engine.con, TensorInfo(temp, info.dtype, info.shape, info.tile,
                                                                       info.layout))
        if findings:
            first = findings[0]
            error = ShapeError if first.problem in SHAPE_PROBLEMS else SQLError
            raise error(f"CREATE TENSOR {info.name}: the query's rows are not the tiles of a {info.shape} "
                        f"{info.dtype} tensor tiled {info.tile}: {first.detail}")
        keys = "".join(f"k{d}::INTEGER AS k{d}, " for d in range(len(info.shape)))
        engine.create_table(info, f'SELECT {keys}tile FROM temp.main."{temp}"', replace)
    finally:
        engine.rows(f'DROP TABLE IF EXISTS temp.main."{temp}"')
