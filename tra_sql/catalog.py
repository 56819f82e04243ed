"""Tensor relations, engine-neutral: catalog rows (``TensorInfo``) and their checks, the
findings of a catalog check, and moving tiles between NumPy and Arrow."""

from __future__ import annotations

import ctypes
import itertools
import re
from dataclasses import dataclass
from math import ceil, prod

import numpy as np
import pyarrow as pa
from sqlglot import exp

from tra_sql.errors import CorruptTileError, DTypeError, ShapeError, SpecError
from tra_sql.graph import default_tile
from tra_sql.udfs import sparse
from tra_sql.udfs.arrowio import binary_views

CATALOG_TABLE = "tra_tensors"
DTYPES = ("float32", "float64", "int32", "int64")
LAYOUTS = ("dense", "csr")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_dtype(dtype) -> np.dtype:
    """The numpy dtype, if tra_sql can store it."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):  # not a dtype at all ('ij,jk->ik' reads as a record format)
        raise DTypeError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}") from None
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



@dataclass(frozen=True)
class Finding:
    """One problem ``check`` found: the tensor (or table), what is wrong (``no table``, ``no
    catalog row``, ``stage table``, ``no catalog table``, ``bad catalog row``, ``columns``,
    ``view``, ``null key``, ``key outside grid``, ``duplicate key``, ``null tile``, ``tile
    size``, ``csr tile``), the details, and whether ``repair`` fixed it."""

    tensor: str
    problem: str
    detail: str
    repaired: bool = False

    @property
    def message(self) -> str:
        hint = "db.check(repair=True) removes its catalog row" if self.problem == "no table" else \
            "db.check() lists every problem"
        return f"tensor '{self.tensor}': {self.detail} ({hint})"


def row_problem(dtype, shape, tile, layout) -> str | None:
    """What is wrong with a catalog row's dtype, layout, shape and tile shape, or None."""
    if dtype not in DTYPES:
        return f"dtype {dtype!r} is not one of {', '.join(DTYPES)}"
    if layout not in LAYOUTS:
        return f"layout {layout!r} is not one of {', '.join(LAYOUTS)}"
    if shape is None or tile is None or len(shape) != len(tile):
        return f"shape {shape} and tile shape {tile} differ in rank"
    if any(n is None or n < 1 for n in shape):
        return f"shape {tuple(shape)} has a dimension that is not positive"
    if any(t is None or not 1 <= t <= n for t, n in zip(tile, shape)):
        return f"tile shape {tuple(tile)} does not fit shape {tuple(shape)}"
    if layout == "csr" and len(shape) != 2:
        return f"layout csr needs two dimensions, not shape {tuple(shape)}"
    return None

def findings_query(findings: list[Finding]) -> exp.Select:
    """The rows (tensor, problem, detail, repaired) of ``findings`` as a query."""
    columns = ("tensor", "problem", "detail", "repaired")
    if not findings:
        return exp.select(*[exp.alias_(exp.cast(exp.null(), "BOOLEAN" if c == "repaired" else "VARCHAR"), c)
                            for c in columns]).where(exp.false())
    rows = [exp.tuple_(exp.Literal.string(f.tensor), exp.Literal.string(f.problem), exp.Literal.string(f.detail),
                       exp.Boolean(this=f.repaired)) for f in findings]
    return exp.select(*columns).from_(exp.values(rows, alias="findings", columns=list(columns)))


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


def _in_place(info: TensorInfo, keys: np.ndarray, data: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """The array as the tiles' bytes where they lie in ``data`` (no copy, writable, keeping
    ``data`` and its Arrow buffer alive) when those are already its bytes in order: every
    tile present, in key order, the tiling cutting the first dimension only (a one-tile
    tensor always); else None."""
    if not info.shape or any(g != 1 for g in info.grid[1:]) or len(keys) != info.grid[0]:
        return None
    at = data.ctypes.data + int(offsets[0])
    if (keys[:, 0] != np.arange(len(keys))).any() or at % info.dtype.itemsize:
        return None
    memory = (ctypes.c_uint8 * int(offsets[-1] - offsets[0])).from_address(at)
    memory.data = data  # the Arrow buffer stays while the array does
    return np.frombuffer(memory, dtype=info.dtype).reshape(info.shape)


def assemble(info: TensorInfo, tiles: pa.Table) -> np.ndarray:
    """Lay the tiles of a tile relation into one array; absent tiles are zeros. Tiles are
    checked against the catalog's geometry; tiles that already lie in the array's order are
    its memory (``_in_place``), full-size tiles are placed in one vectorized step, ragged
    boundary tiles one by one."""
    out = np.zeros(info.shape, dtype=info.dtype)
    if tiles.num_rows == 0:
        return out
    rank = len(info.shape)
    if any(tiles.column(f"k{d}").null_count for d in range(rank)):
        raise CorruptTileError(f"tensor '{info.name}' has a tile with a NULL key")
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
    in_place = _in_place(info, keys, data, offsets)
    if in_place is not None:
        return in_place
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
