"""Tile geometry and zero-copy views: how the kernels read operand tiles from Arrow columns
and allocate their output tiles."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tra_sql.errors import CorruptTileError
from tra_sql.udfs import sparse
from tra_sql.udfs.arrowio import binary_views, key_matrix
from tra_sql.udfs.sparse import CSRTile


def tile_shapes(keys: np.ndarray, sizes: np.ndarray, tiles: np.ndarray) -> np.ndarray:
    """Per-row tile shapes (ragged at the boundary) for an (n, rank) key matrix."""
    return np.minimum(tiles, sizes - keys * tiles)


@dataclass(frozen=True)
class Operand:
    """How to read one operand's tiles: its name, dtype, full sizes, tile sizes and layout
    (``dense`` or ``csr``, see ``tra_sql.udfs.sparse``)."""

    name: str
    dtype: np.dtype
    sizes: np.ndarray
    tiles: np.ndarray
    layout: str = "dense"

    @staticmethod
    def of(name: str, dtype: str, sub: str, sizes: dict[str, int], tiles: dict[str, int],
           layout: str = "dense") -> Operand:
        """The operand subscripted ``sub`` of a step with ``sizes`` and ``tiles`` per index."""
        return Operand(name, np.dtype(dtype), np.array([sizes[c] for c in sub], dtype=np.int64),
                       np.array([tiles[c] for c in sub], dtype=np.int64), layout)

    def check(self, offsets, valid, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The shapes of the tiles at ``rows``; a tile whose bytes disagree with the catalog's
        geometry raises ``CorruptTileError``."""
        shapes = tile_shapes(keys, self.sizes, self.tiles)
        expected = np.prod(shapes, axis=1, dtype=np.int64) * self.dtype.itemsize
        held = offsets[rows + 1] - offsets[rows]
        bad = ~valid[rows] | (held != expected)
        if bad.any():
            i = int(np.argmax(bad))
            what = "is NULL" if not valid[rows[i]] else f"holds {held[i]} bytes"
            raise CorruptTileError(
                f"tile {tuple(int(k) for k in keys[i])} of tensor '{self.name}' {what}; its shape "
                f"{tuple(int(n) for n in shapes[i])} and dtype {self.dtype} need {expected[i]}"
            )
        return shapes

    def views(self, data, offsets, valid, rows: np.ndarray, keys: np.ndarray) -> list[np.ndarray | CSRTile]:
        """Zero-copy NumPy views of the tiles at ``rows`` (CSR tiles over views of their bytes)."""
        if self.layout == "csr":
            return [self.csr(data, offsets, valid, r, key) for r, key in zip(rows, keys)]
        shapes = self.check(offsets, valid, rows, keys)
        return [data[offsets[r] : offsets[r + 1]].view(self.dtype).reshape(shape) for r, shape in zip(rows, shapes)]

    def stacked(self, data, offsets, valid, rows: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
        """The tiles at ``rows`` as one ``(len(rows), *shape)`` array when they all have one
        shape (a view when they lie back to back in the Arrow buffer), else ``None``."""
        if self.layout == "csr":
            return None
        shapes = self.check(offsets, valid, rows, keys)
        if not len(rows) or (shapes != shapes[0]).any():
            return None
        nbytes = int(np.prod(shapes[0])) * self.dtype.itemsize
        starts = offsets[rows]
        if (np.diff(starts) == nbytes).all():
            flat = data[starts[0] : starts[0] + nbytes * len(rows)]
        else:
            flat = np.concatenate([data[start : start + nbytes] for start in starts])
        return flat.view(self.dtype).reshape(len(rows), *shapes[0])

    def csr(self, data, offsets, valid, row: int, key: np.ndarray) -> CSRTile:
        """The CSR tile at ``row``."""
        shape = tile_shapes(key, self.sizes, self.tiles)
        if not valid[row]:
            raise CorruptTileError(f"tile {tuple(int(k) for k in key)} of tensor '{self.name}' is NULL")
        return sparse.check(self.name, key, data[offsets[row] : offsets[row + 1]], shape, self.dtype)


def allocate_tiles(result: Operand, out_keys: np.ndarray):
    """A byte buffer for one output tile per row, with offsets and per-row shapes."""
    shapes = tile_shapes(out_keys, result.sizes, result.tiles)
    nbytes = np.prod(shapes, axis=1, dtype=np.int64) * result.dtype.itemsize
    offsets = np.zeros(len(out_keys) + 1, dtype=np.int64)
    np.cumsum(nbytes, out=offsets[1:])
    return np.empty(int(offsets[-1]), dtype=np.uint8), offsets, shapes


def out_view(buf, offsets, row, shape, dtype) -> np.ndarray:
    """Row ``row``'s tile in an output buffer of ``allocate_tiles``, as an array."""
    return buf[offsets[row] : offsets[row + 1]].view(dtype).reshape(shape)


def operand_tiles(operands: list[Operand], columns, elements: np.ndarray, stack: bool):
    """Tiles at ``elements`` of ``operands``, read from their (keys, tile) column pairs:
    stacked into one array per operand when ``stack`` and each operand's tiles share a shape,
    else lists of views. Returns (tiles, stacked?)."""
    sources = [(binary_views(columns[2 * i + 1]), key_matrix(columns[2 * i], len(op.sizes)))
               for i, op in enumerate(operands)]
    if stack:
        stacked = [op.stacked(*views, elements, keys) for op, (views, keys) in zip(operands, sources)]
        if all(t is not None for t in stacked):
            return stacked, True
    return [op.views(*views, elements, keys) for op, (views, keys) in zip(operands, sources)], False


def uniform(shapes: np.ndarray) -> bool:
    """Whether there are tiles and they all have one shape."""
    return len(shapes) > 0 and bool((shapes == shapes[0]).all())
