"""Tensor relations: the catalog table, and moving tiles between NumPy, Arrow and DuckDB."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from importlib import resources
from math import ceil, prod

import duckdb
import numpy as np
import pyarrow as pa

from tra_sql.errors import (
    CorruptTileError,
    DTypeError,
    ShapeError,
    SpecError,
    TensorExistsError,
    UnknownTensorError,
)
from tra_sql.udfs import sparse
from tra_sql.udfs.arrowio import binary_views

CATALOG_TABLE = "tra_tensors"
DTYPES = ("float32", "float64", "int32", "int64")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEFAULT_TILE_ELEMENTS = 1 << 20


def catalog_ddl() -> str:
    return resources.files("tra_sql.sql").joinpath("catalog.sql").read_text()


def check_dtype(dtype) -> np.dtype:
    """The numpy dtype, if tra_sql can store it."""
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise DTypeError(f"dtype {dt} is not supported; use one of {', '.join(DTYPES)}")
    return dt


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.lower() == CATALOG_TABLE:
        raise SpecError(f"{name!r} is not a valid tensor name (letters, digits, _; not "
                        f"'{CATALOG_TABLE}')")
    return name


@dataclass(frozen=True)
class TensorInfo:
    """A catalog row: a tensor's name, dtype, full shape, interior tile shape and tile layout
    (``dense`` or ``csr``)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    tile: tuple[int, ...]
    layout: str = "dense"

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of tiles along each dimension."""
        return tuple(ceil(n / t) for n, t in zip(self.shape, self.tile))

    def tile_shape(self, key) -> tuple[int, ...]:
        return tuple(min(t, n - k * t) for k, n, t in zip(key, self.shape, self.tile))


def default_tile(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Halve the largest dimension until a tile holds at most 2^20 elements."""
    tile = list(shape)
    while prod(tile) > DEFAULT_TILE_ELEMENTS:
        d = max(range(len(tile)), key=tile.__getitem__)
        tile[d] = ceil(tile[d] / 2)
    return tuple(tile)


def check_tile(shape: tuple[int, ...], tile, name: str) -> tuple[int, ...]:
    """Validate a tile shape for ``shape`` (``None`` picks ``default_tile``)."""
    if any(n <= 0 for n in shape):
        raise ShapeError(f"tensor '{name}' has an empty dimension: shape {shape}")
    if tile is None:
        return default_tile(shape)
    tile = (tile,) * len(shape) if isinstance(tile, int) else tuple(tile)
    if len(tile) != len(shape) or any(not isinstance(t, (int, np.integer)) or t < 1 for t in tile):
        raise ShapeError(f"tile {tile} does not fit tensor '{name}' of shape {shape}: "
                         f"give {len(shape)} positive integers")
    return tuple(min(int(t), n) for t, n in zip(tile, shape))


def ensure_catalog(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(catalog_ddl()).fetchall()


def lookup(con: duckdb.DuckDBPyConnection, name: str) -> TensorInfo:
    rows = con.execute(
        f"SELECT name, dtype, shape, tile_shape, layout FROM {CATALOG_TABLE} WHERE lower(name) = lower(?)", [name]
    ).fetchall()
    if not rows:
        raise UnknownTensorError(f"no tensor named '{name}' in the catalog")
    stored, dtype, shape, tile, layout = rows[0]
    return TensorInfo(stored, np.dtype(dtype), tuple(shape), tuple(tile), layout)


def list_tensors(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(f"SELECT name FROM {CATALOG_TABLE} ORDER BY name").fetchall()]


def table_exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return object_kind(con, name) == "TABLE"


def object_kind(con: duckdb.DuckDBPyConnection, name: str) -> str | None:
    """``"VIEW"``, ``"TABLE"`` or None for an object ``name`` in the current schema."""
    rows = con.execute(
        "SELECT 'VIEW' FROM duckdb_views() WHERE lower(view_name) = lower(?) AND NOT internal "
        "AND database_name = current_database() AND schema_name = current_schema() UNION ALL "
        "SELECT 'TABLE' FROM duckdb_tables() WHERE lower(table_name) = lower(?) "
        "AND database_name = current_database() AND schema_name = current_schema()", [name, name]).fetchall()
    return rows[0][0] if rows else None


def tile_table(array: np.ndarray, tile: tuple[int, ...]) -> pa.Table:
    """The tile relation of ``array``: int32 keys ``k0..`` and a BLOB ``tile`` per tile. Tiles
    of whole rows (trailing dimensions untiled) of a C-ordered array are views of its bytes."""
    info = TensorInfo("", array.dtype, array.shape, tile)
    keys = list(itertools.product(*(range(g) for g in info.grid)))
    sizes = [prod(info.tile_shape(k)) * array.dtype.itemsize for k in keys]
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if array.flags.c_contiguous and tuple(tile[1:]) == array.shape[1:]:
        data = array.reshape(-1).view(np.uint8)
    else:
        data = np.empty(int(offsets[-1]), dtype=np.uint8)
        for i, key in enumerate(keys):
            region = tuple(slice(k * t, k * t + s) for k, t, s in zip(key, tile, info.tile_shape(key)))
            data[offsets[i] : offsets[i + 1]].view(array.dtype).reshape(info.tile_shape(key))[...] = array[region]
    columns = {f"k{d}": pa.array([k[d] for k in keys], pa.int32()) for d in range(array.ndim)}
    columns["tile"] = pa.Array.from_buffers(
        pa.large_binary(), len(keys), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    return pa.table(columns)


def check_tile_table(name: str, tiles: pa.Table, shape, tile, dtype) -> TensorInfo:
    """The ``TensorInfo`` of an Arrow tile relation (columns ``k0..``, ``tile``) to store as
    tensor ``name``, after checking every tile against ``shape``, ``tile`` and ``dtype``."""
    info = TensorInfo(check_name(name), check_dtype(dtype), tuple(shape), check_tile(tuple(shape), tile, name))
    expected = [f"k{d}" for d in range(len(info.shape))] + ["tile"]
    if tiles.column_names != expected:
        raise ShapeError(f"tile table for '{name}' must have columns {expected}, got {tiles.column_names}")
    assemble(info, tiles)
    return info


def _assemble_csr(info: TensorInfo, out: np.ndarray, keys, shapes, data, offsets, valid) -> np.ndarray:
    """Add the entries of CSR tiles into the dense ``out``."""
    for i, (key, shape) in enumerate(zip(keys, shapes)):
        if not valid[i]:
            raise CorruptTileError(f"tile {tuple(int(k) for k in key)} of tensor '{info.name}' is NULL")
        tile = sparse.check(info.name, key, data[offsets[i] : offsets[i + 1]], shape, info.dtype)
        rows = np.repeat(np.arange(key[0] * info.tile[0], key[0] * info.tile[0] + shape[0]), np.diff(tile.indptr))
        np.add.at(out, (rows, key[1] * info.tile[1] + tile.indices), tile.data)
    return out


def assemble(info: TensorInfo, tiles: pa.Table) -> np.ndarray:
    """Lay the tiles of a tile relation into one array; absent tiles are zeros. Tiles are
    checked against the catalog's geometry; full-size tiles are placed in one vectorized
    step, ragged boundary tiles one by one."""
    out = np.zeros(info.shape, dtype=info.dtype)
    if tiles.num_rows == 0:
        return out
    rank = len(info.shape)
    keys = np.stack([tiles.column(f"k{d}").to_numpy() for d in range(rank)], axis=1).astype(np.int64) if rank \
        else np.zeros((tiles.num_rows, 0), dtype=np.int64)
    outside = ((keys < 0) | (keys >= np.array(info.grid, dtype=np.int64))).any(axis=1)
    if outside.any():
        key = tuple(int(k) for k in keys[int(np.argmax(outside))])
        raise CorruptTileError(f"tensor '{info.name}' has a tile at key {key} outside its grid {info.grid}")
    data, offsets, valid = binary_views(tiles.column("tile"))  # no copy of a one-chunk result
    tile = np.array(info.tile, dtype=np.int64)
    shapes = np.minimum(tile, np.array(info.shape, dtype=np.int64) - keys * tile)
    if info.layout == "csr":
        return _assemble_csr(info, out, keys, shapes, data, offsets, valid)
    expected = np.prod(shapes, axis=1, dtype=np.int64) * info.dtype.itemsize
    bad = ~valid | (np.diff(offsets) != expected)
    if bad.any():
        i = int(np.argmax(bad))
        held = "is NULL" if not valid[i] else f"holds {offsets[i + 1] - offsets[i]} bytes"
        raise CorruptTileError(f"tile {tuple(int(k) for k in keys[i])} of tensor '{info.name}' {held}; shape "
                               f"{tuple(int(n) for n in shapes[i])} and dtype {info.dtype} need {expected[i]}")
    full = (shapes == tile).all(axis=1)
    if rank and full.all() and all(n % t == 0 for n, t in zip(info.shape, info.tile)):
        grid = [n // t for n, t in zip(info.shape, info.tile)]
        blocked = out.reshape([x for g, t in zip(grid, info.tile) for x in (g, t)])
        blocked = blocked.transpose(list(range(0, 2 * rank, 2)) + list(range(1, 2 * rank, 2)))
        stacked = data[offsets[0] : offsets[-1]].view(info.dtype).reshape(len(keys), *info.tile)
        blocked[tuple(keys.T)] = stacked
        return out
    for i, (key, shape) in enumerate(zip(keys, shapes)):
        region = tuple(slice(k * t, k * t + s) for k, t, s in zip(key, info.tile, shape))
        out[region] = data[offsets[i] : offsets[i + 1]].view(info.dtype).reshape(shape)
    return out


def insert_row(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> None:
    """Add ``info``'s catalog row."""
    con.execute(f"INSERT INTO {CATALOG_TABLE} (name, dtype, shape, tile_shape, layout) VALUES (?, ?, ?, ?, ?)",
                [info.name, info.dtype.name, list(info.shape), list(info.tile), info.layout]).fetchall()


def create_tensor_table(
    con: duckdb.DuckDBPyConnection, info: TensorInfo, select_sql: str, replace: bool = False
) -> None:
    """Create table ``info.name`` from ``select_sql`` and its catalog row, atomically. Tiles
    are stored uncompressed: a checkpoint would otherwise compress them (ZSTD), and reading one
    tile would decompress much of its segment."""
    check_name(info.name)
    con.execute("BEGIN TRANSACTION").fetchall()
    try:
        kind = object_kind(con, info.name)
        if kind:
            if not replace:
                raise TensorExistsError(f"a {kind.lower()} named '{info.name}' exists already (names are "
                                        f"case-insensitive, as in SQL); pass replace=True to overwrite it")
            con.execute(f'DROP {kind} "{info.name}"').fetchall()
        con.execute(f"DELETE FROM {CATALOG_TABLE} WHERE lower(name) = lower(?)", [info.name]).fetchall()
        keys = "".join(f"k{d} INTEGER, " for d in range(len(info.shape)))
        con.execute(f'CREATE TABLE "{info.name}" ({keys}tile BLOB USING COMPRESSION uncompressed)').fetchall()
        con.execute(f'INSERT INTO "{info.name}" {select_sql}').fetchall()
        insert_row(con, info)
        con.execute("COMMIT").fetchall()
    except BaseException:
        con.execute("ROLLBACK").fetchall()
        raise


def drop_tensor(con: duckdb.DuckDBPyConnection, name: str) -> None:
    name = lookup(con, name).name
    con.execute("BEGIN TRANSACTION").fetchall()
    try:
        kind = con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = ? "
                           "AND table_schema = current_schema()", [name]).fetchall()
        con.execute(f'DROP {"VIEW" if kind and kind[0][0] == "VIEW" else "TABLE"} IF EXISTS "{name}"').fetchall()
        con.execute(f"DELETE FROM {CATALOG_TABLE} WHERE name = ?", [name]).fetchall()
        con.execute("COMMIT").fetchall()
    except BaseException:
        con.execute("ROLLBACK").fetchall()
        raise
