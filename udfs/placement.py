"""The placement kernels: ``tra_place`` (one output tile of a re-tiling, slice,
concatenation or reshape, assembled from the source pieces that overlap it) and ``tra_fill``
(one tile of a constant tensor)."""

from __future__ import annotations

import numpy as np

from tra_sql.errors import CorruptTileError
from tra_sql.udfs.arrowio import binary_array, binary_views, first_string, key_matrix, list_views
from tra_sql.udfs.protocol import FillStep, PlaceStep
from tra_sql.udfs.python_kernels import implements
from tra_sql.udfs.tiles import Operand, allocate_tiles, out_view


def _check_pieces(names, dtypes, parts, origins, extents, offsets, valid) -> None:
    """Every piece's bytes must match its shape and its source's dtype."""
    itemsize = np.array([d.itemsize for d in dtypes], dtype=np.int64)[parts]
    expected = np.prod(extents, axis=1, dtype=np.int64) * itemsize
    held = np.diff(offsets)
    bad = ~valid | (held != expected)
    if bad.any():
        i = int(np.argmax(bad))
        what = "is NULL" if not valid[i] else f"holds {held[i]} bytes"
        raise CorruptTileError(
            f"the tile of tensor '{names[parts[i]]}' at element {tuple(int(o) for o in origins[i])} {what}; "
            f"its shape {tuple(int(n) for n in extents[i])} and dtype {dtypes[parts[i]]} need {expected[i]}")


@implements("place")
def place(meta_col, out_keys_col, pieces_col):
    """``tra_place(meta, out_keys, list({origin, shape, part, tile}))``: assemble each output
    tile from the source pieces that overlap it (origins in output element coordinates;
    row-major flat ones for a reshape)."""
    m = PlaceStep.decode(first_string(meta_col))
    shape, tile = np.array(m.shape, dtype=np.int64), np.array(m.tile, dtype=np.int64)
    target = Operand("result", np.dtype(m.dtype), shape, tile)
    out_keys = key_matrix(out_keys_col, len(shape))
    buf, offsets, shapes = allocate_tiles(target, out_keys)
    starts, flat = list_views(pieces_col)
    origin_col, shape_col, part_col, tile_col = flat.flatten()
    rank = 1 if m.flat else len(shape)
    origins, extents = key_matrix(origin_col, rank), key_matrix(shape_col, rank)
    parts = part_col.to_numpy(zero_copy_only=False)
    data, data_offsets, valid = binary_views(tile_col)
    dtypes = [np.dtype(d) for d in m.dtypes]
    _check_pieces(m.names, dtypes, parts, origins, extents, data_offsets, valid)
    flat_tile = int(tile[0] * np.prod(shape[1:])) if len(shape) else 1
    for row in range(len(out_keys)):
        out = out_view(buf, offsets, row, shapes[row], target.dtype)
        out[...] = 0
        if m.flat:
            out, origin = out.reshape(-1), out_keys[row][:1] * flat_tile
        else:
            origin = out_keys[row] * tile
        for e in range(starts[row], starts[row + 1]):
            piece = data[data_offsets[e] : data_offsets[e + 1]].view(dtypes[parts[e]]).reshape(extents[e])
            lo = np.maximum(origin, origins[e])
            hi = np.minimum(origin + out.shape, origins[e] + extents[e])
            if np.any(hi <= lo):
                continue
            region = tuple(slice(a, b) for a, b in zip(lo - origin, hi - origin))
            cut = piece[tuple(slice(a, b) for a, b in zip(lo - origins[e], hi - origins[e]))]
            if m.add:
                out[region] += cut
            else:
                out[region] = cut
    return binary_array(buf, offsets)


@implements("fill")
def fill(meta_col, out_keys_col):
    """``tra_fill(meta, out_keys)``: one constant tile per row of output keys."""
    m = FillStep.decode(first_string(meta_col))
    target = Operand("result", np.dtype(m.dtype), np.array(m.shape, np.int64), np.array(m.tile, np.int64))
    out_keys = key_matrix(out_keys_col, len(target.sizes))
    buf, offsets, shapes = allocate_tiles(target, out_keys)
    for row in range(len(out_keys)):
        out_view(buf, offsets, row, shapes[row], target.dtype)[...] = m.value
    return binary_array(buf, offsets)
