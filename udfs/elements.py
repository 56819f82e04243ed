"""Element-level tile functions for SQL users: decode tiles to lists, draw random tiles,
pack element rows into tiles.

- ``tra_tile_values(tile, dtype) -> DOUBLE[]`` and ``tra_tile_ints(tile, dtype) -> BIGINT[]``:
  a tile's elements in C order;
- ``tra_random_tile(meta, key) -> BLOB``: a random tile seeded with (seed, *key);
- ``tra_pack_tile(meta, key, list(index), list(value)) -> BLOB``: a tile from its elements
  (``meta``: a ``protocol.TileGeometry``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tra_sql.errors import CorruptTileError, DTypeError, ShapeError, SpecError, SQLError
from tra_sql.udfs.arrowio import binary_array, binary_views, first_string, key_matrix, list_views
from tra_sql.udfs.protocol import TileGeometry
from tra_sql.udfs.python_kernels import implements
from tra_sql.udfs.tiles import tile_shapes

DTYPES = ("float32", "float64", "int32", "int64")


def _dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise DTypeError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return np.dtype(name)


def _decode(tiles, dtypes, out: type) -> pa.Array:
    """The elements of every tile as one list per row, converted to ``out``."""
    data, offsets, valid = binary_views(tiles)
    names = dtypes.combine_chunks() if isinstance(dtypes, pa.ChunkedArray) else dtypes
    import pyarrow.compute as pc  # 60 ms to import: only when needed
    distinct = pc.unique(names)
    if valid.all() and len(distinct) == 1 and distinct[0].is_valid:
        dtype = _dtype(distinct[0].as_py())
        lengths = np.diff(offsets)
        if (lengths % dtype.itemsize).any():
            raise CorruptTileError(f"a tile's byte size is not a multiple of {dtype} ({dtype.itemsize})")
        values = data[offsets[0] : offsets[-1]].view(dtype).astype(out)
        return pa.LargeListArray.from_arrays(pa.array((offsets - offsets[0]) // dtype.itemsize), values)
    rows: list[np.ndarray | None] = []
    for row, name in enumerate(names.to_pylist()):
        if not valid[row] or name is None:
            rows.append(None)
            continue
        dtype = _dtype(name)
        raw = data[offsets[row] : offsets[row + 1]]
        if raw.size % dtype.itemsize:
            raise CorruptTileError(f"a tile of {raw.size} bytes is not a whole number of {dtype} elements")
        rows.append(raw.view(dtype).astype(out))
    return pa.array(rows, type=pa.large_list(pa.from_numpy_dtype(np.dtype(out))))


@implements("tile_values")
def tile_values(tiles, dtypes) -> pa.Array:
    """``tra_tile_values(tile BLOB, dtype VARCHAR) -> DOUBLE[]``: a tile's elements, C order."""
    return _decode(tiles, dtypes, np.float64)


@implements("tile_ints")
def tile_ints(tiles, dtypes) -> pa.Array:
    """``tra_tile_ints(tile BLOB, dtype VARCHAR) -> BIGINT[]``: exact for integer tensors."""
    return _decode(tiles, dtypes, np.int64)


def _read_meta(column, function: str, *extra: str) -> TileGeometry:
    """The meta argument of ``function`` (it must hold the geometry and the ``extra`` fields)."""
    text = first_string(column)
    try:
        meta = TileGeometry.decode(text)
    except (TypeError, ValueError, AttributeError):
        meta = None
    if meta is None or any(getattr(meta, k) is None for k in extra) or meta.dtype not in DTYPES:
        keys = ("name", "dtype", "shape", "tile", *extra)
        raise SpecError(f"{function}(): meta {text!r} is not what the tensor SQL rewrite writes "
                        f"(JSON with {', '.join(keys)})")
    return meta


def _geometry(meta: TileGeometry) -> tuple[str, np.dtype, np.ndarray, np.ndarray]:
    """(name, dtype, full sizes, tile sizes) of the tiles to write."""
    return meta.name, np.dtype(meta.dtype), np.array(meta.shape, dtype=np.int64), np.array(meta.tile, dtype=np.int64)


def _shapes(name: str, keys: np.ndarray, sizes: np.ndarray, tiles: np.ndarray) -> np.ndarray:
    """Per-row tile shapes; a key outside the tile grid is a ``ShapeError``."""
    shapes = tile_shapes(keys, sizes, tiles)
    outside = ((keys < 0) | (shapes <= 0)).any(axis=1)
    if outside.any():
        key = tuple(int(k) for k in keys[int(np.argmax(outside))])
        raise ShapeError(f"{name}(): tile key {key} is outside the tile grid of shape {tuple(sizes.tolist())}")
    return shapes


def _values(name: str, column, dtype: np.dtype) -> np.ndarray:
    """Element values as ``dtype``; an integer tensor takes whole numbers in its range only."""
    values = column.to_numpy(zero_copy_only=False)
    if dtype.kind == "i":
        limit = 2.0 ** (8 * dtype.itemsize - 1)
        bad = ~np.isfinite(values) | (values != np.round(values)) | (values < -limit) | (values >= limit)
        if bad.any():
            raise DTypeError(f"{name}(): value {float(values[int(np.argmax(bad))])} is not a whole number "
                             f"that {dtype} holds")
    return values.astype(dtype)


def _tile_buffer(shapes: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A zeroed element buffer for one tile per row of ``shapes``, and element offsets."""
    offsets = np.zeros(len(shapes) + 1, dtype=np.int64)
    np.cumsum(np.prod(shapes, axis=1, dtype=np.int64), out=offsets[1:])
    return np.zeros(int(offsets[-1]), dtype=dtype), offsets


def _check_unique(name: str, position: np.ndarray, index: np.ndarray) -> None:
    """A ``SQLError`` naming the first element whose (flat) ``position`` is given twice."""
    order = np.argsort(position, kind="stable")
    repeated = np.flatnonzero(np.diff(position[order]) == 0)
    if repeated.size:
        first = order[repeated[0]]
        times = int((position == position[first]).sum())
        where = tuple(int(i) for i in index[first])
        raise SQLError(f"{name}(): element {where} is given {times} times "
                       f"(pass duplicates => 'sum' to add repeated elements up)")


@implements("random_tile")
def random_tiles(meta_col, keys_col) -> pa.Array:
    """``tra_random_tile(meta, key)``: the tile at ``key``, drawn from a generator seeded
    with (seed, *key), so a tile's values depend on the seed, the key and the tiling only."""
    meta = _read_meta(meta_col, "tra_random_tile", "seed", "dist")
    name, dtype, sizes, tiles = _geometry(meta)
    keys = key_matrix(keys_col, len(sizes))
    shapes = _shapes(name, keys, sizes, tiles)
    buf, offsets = _tile_buffer(shapes, dtype)
    for row, key in enumerate(keys):
        rng = np.random.default_rng([meta.seed, *key.tolist()])
        shape = tuple(shapes[row])
        draw = rng.standard_normal(shape) if meta.dist == "normal" else rng.random(shape)
        buf[offsets[row] : offsets[row + 1]] = draw.ravel()
    return binary_array(buf.view(np.uint8), offsets * dtype.itemsize)


@implements("pack_tile")
def pack_tiles(meta_col, keys_col, index_col, values_col) -> pa.Array:
    """``tra_pack_tile(meta, key, list(index), list(value))``: one tile per group from its
    elements; absent elements are zero, repeated indices add up (an error if ``meta.unique``)
    and a NULL value is an error."""
    meta = _read_meta(meta_col, "tra_pack_tile")
    name, dtype, sizes, tiles = _geometry(meta)
    rank = len(sizes)
    keys = key_matrix(keys_col, rank)
    starts, flat_index = list_views(index_col)
    _, flat_values = list_views(values_col)
    import pyarrow.compute as pc  # 60 ms to import: only when needed
    if flat_index.null_count or pc.list_flatten(flat_index).null_count:
        raise ShapeError(f"{name}(): an element index is NULL")
    index = key_matrix(flat_index, rank)
    row = np.repeat(np.arange(len(keys)), np.diff(starts))
    shapes = tile_shapes(keys, sizes, tiles)
    local = index - keys[row] * tiles
    bad = ((local < 0) | (local >= shapes[row])).any(axis=1)
    if bad.any():
        where = tuple(int(i) for i in index[int(np.argmax(bad))])
        raise ShapeError(f"{name}(): element {where} is outside the shape {tuple(sizes.tolist())}")
    strides = np.ones_like(shapes)
    for d in range(rank - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * shapes[:, d + 1]
    if flat_values.null_count:
        where = tuple(int(i) for i in index[int(np.argmax(flat_values.is_null().to_numpy(zero_copy_only=False)))])
        raise SQLError(f"{name}(): element {where} has a NULL value (pass nulls => 'skip' to leave such rows out)")
    buf, offsets = _tile_buffer(shapes, dtype)
    position = offsets[row] + (local * strides[row]).sum(axis=1)
    if meta.unique:
        _check_unique(name, position, index)
    np.add.at(buf, position, _values(name, flat_values, dtype))
    return binary_array(buf.view(np.uint8), offsets * dtype.itemsize)
