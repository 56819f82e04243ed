"""The dtype conversion kernel: ``tra_cast`` converts each tile to another dtype by NumPy's
rules (float to int truncates toward zero). A float that has no value in the target integer
type (NaN, infinity, out of range) raises ``DTypeError`` naming the tensor and the tile,
instead of NumPy's unspecified result."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tra_sql.errors import DTypeError
from tra_sql.udfs.arrowio import binary_array, binary_views, first_string, key_matrix
from tra_sql.udfs.protocol import KEYS, META, TILE, Kernel, Literal, Signature, declare
from tra_sql.udfs.python_kernels import implements
from tra_sql.udfs.tiles import Operand, allocate_tiles, out_view


@dataclass(frozen=True)
class CastStep(Literal):
    """The tiles of tensor ``name`` (for errors), a ``shape`` tensor tiled ``tile``,
    converted from dtype ``source`` to ``dtype``."""

    name: str
    source: str
    dtype: str
    shape: tuple[int, ...]
    tile: tuple[int, ...]


declare("cast", Signature(lambda n, k: (META, KEYS, TILE)))
CAST = Kernel("cast")


def _check_integral(name: str, key: np.ndarray, tile: np.ndarray, target: np.dtype) -> None:
    """Every element of float ``tile`` truncates to a value of integer dtype ``target``."""
    if not tile.size:
        return
    lo = tile.dtype.type(np.iinfo(target).min)  # -2**(bits-1): exact in either float type
    low, high = np.trunc(tile.min()), np.trunc(tile.max())  # NaN propagates and fails both tests
    if not (low >= lo and high < -lo):
        raise DTypeError(f"tile {tuple(int(k) for k in key)} of tensor '{name}' holds NaN, an infinity or a "
                         f"value outside {target}'s range ({low} to {high}): it cannot be cast to {target}")


@implements("cast")
def cast(meta_col, keys_col, tile_col):
    """``tra_cast(meta, keys, tile)``: each row's tile in the step's target dtype."""
    m = CastStep.decode(first_string(meta_col))
    shape, tile = np.array(m.shape, dtype=np.int64), np.array(m.tile, dtype=np.int64)
    source = Operand(m.name, np.dtype(m.source), shape, tile)
    target = Operand(m.name, np.dtype(m.dtype), shape, tile)
    keys = key_matrix(keys_col, len(shape))
    tiles = source.views(*binary_views(tile_col), np.arange(len(keys)), keys)  # every length checked first
    integral = np.issubdtype(source.dtype, np.floating) and np.issubdtype(target.dtype, np.integer)
    buf, offsets, shapes = allocate_tiles(target, keys)
    for row, values in enumerate(tiles):
        if integral:
            _check_integral(m.name, keys[row], values, target.dtype)
        np.copyto(out_view(buf, offsets, row, shapes[row], target.dtype), values, casting="unsafe")
    return binary_array(buf, offsets)
