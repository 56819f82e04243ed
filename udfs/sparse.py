"""Compressed sparse row (CSR) tiles: the tiles of a sparse matrix kept as its nonzeros.

A tensor with layout ``csr`` is a 2-D tensor relation whose tile bytes are, back to back:
``indptr`` (int64, rows + 1 entries), ``indices`` (int32 column numbers, nnz entries, padded to a
multiple of 8 bytes) and ``data`` (the tensor's dtype, nnz entries); the tile's shape comes from
the catalog's geometry like any tile's.

Elements that are not entries take no part in an einsum, as absent rows of a relation do
not (``numpy()`` shows them as zeros): a sum-of-products einsum of a CSR tile with one dense
tile that keeps one of its indices and contracts the other (``vu,uf->vf`` or ``vu,vf->uf``,
the sparse-dense products of message passing and their gradients) runs as a dedicated Numba
kernel over the entries; any other einsum as a loop kernel over the entries
(``codegen.kernel_source`` with ``sparse``). An einsum whose output is subscripted like its
CSR operands (``ui,uk,ik->ui``: a sampled product; element-wise maps) has a CSR result with
their entries; CSR operands of one einsum must share their entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pyarrow as pa

from tra_sql.errors import CorruptTileError, ShapeError
from tra_sql.udfs.arrowio import binary_array, first_string, key_matrix, list_views
from tra_sql.udfs.codegen import canonical, loop_kernel
from tra_sql.udfs.cores import all_cores
from tra_sql.udfs.protocol import TileGeometry
from tra_sql.udfs.python_kernels import implements

PARALLEL_ENTRIES = 1 << 16  # CSR outputs with this many entries are computed on several threads


def _padded(nnz: int) -> int:
    return (4 * nnz + 7) // 8 * 8


def nbytes(rows: int, nnz: int, itemsize: int) -> int:
    """The size of a CSR tile with ``rows`` rows and ``nnz`` nonzeros."""
    return 8 * (rows + 1) + _padded(nnz) + itemsize * nnz


@dataclass(frozen=True)
class CSRTile:
    """One CSR tile: its (rows, cols) shape and the three CSR arrays (views of the bytes)."""

    shape: tuple[int, int]
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray

    @staticmethod
    def decode(buf: np.ndarray, shape, dtype: np.dtype) -> CSRTile | None:
        """The tile in the bytes ``buf`` (uint8), or None if they are not a CSR tile of
        ``shape`` and ``dtype``."""
        rows, cols = (int(n) for n in shape)
        head = 8 * (rows + 1)
        if len(buf) < head:
            return None
        indptr = buf[:head].view(np.int64)
        nnz = int(indptr[-1])
        if indptr[0] != 0 or nnz < 0 or len(buf) != nbytes(rows, nnz, dtype.itemsize):
            return None
        indices = buf[head : head + 4 * nnz].view(np.int32)
        data = buf[head + _padded(nnz) :].view(dtype)
        if (np.diff(indptr) < 0).any() or (nnz and (indices.min() < 0 or indices.max() >= cols)):
            return None
        return CSRTile((rows, cols), indptr, indices, data)


def like(tile: CSRTile, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of a new CSR tile with ``tile``'s entries and ``dtype`` values, and a view of
    its (uninitialized) data array."""
    rows, nnz = tile.shape[0], len(tile.indices)
    buf = np.empty(nbytes(rows, nnz, dtype.itemsize), np.uint8)
    head = 8 * (rows + 1)
    buf[:head].view(np.int64)[:] = tile.indptr
    buf[head : head + 4 * nnz].view(np.int32)[:] = tile.indices
    buf[head + 4 * nnz : head + _padded(nnz)] = 0
    return buf, buf[head + _padded(nnz) :].view(dtype)


def concat(tiles: list[np.ndarray]) -> pa.Array:
    """A BLOB array of the tile byte buffers ``tiles``."""
    offsets = np.zeros(len(tiles) + 1, np.int64)
    np.cumsum([len(t) for t in tiles], out=offsets[1:])
    return binary_array(np.concatenate(tiles) if tiles else np.empty(0, np.uint8), offsets)


def encode(rows: np.ndarray, cols: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The bytes of the CSR tile of ``shape`` holding ``values`` at (``rows``, ``cols``), in
    (row, column) order, so the same positions always make the same entries (repeated
    positions stay separate entries)."""
    order = np.lexsort((cols, rows))
    nnz = len(order)
    buf = np.zeros(nbytes(shape[0], nnz, values.dtype.itemsize), np.uint8)
    head = 8 * (shape[0] + 1)
    indptr = buf[:head].view(np.int64)
    np.cumsum(np.bincount(rows, minlength=shape[0]), out=indptr[1:])
    buf[head : head + 4 * nnz].view(np.int32)[:] = cols[order]
    buf[head + _padded(nnz) :].view(values.dtype)[:] = values[order]
    return buf


@implements("pack_csr")
def pack_csr(meta_col, keys_col, rows_col, cols_col, values_col) -> pa.Array:
    """``tra_pack_csr(meta, [k0, k1], list(row), list(col), list(value))``: one CSR tile per
    group, from the global row and column numbers of its entries."""
    meta = TileGeometry.decode(first_string(meta_col))
    dtype, shape, tile = np.dtype(meta.dtype), np.array(meta.shape), np.array(meta.tile)
    keys = key_matrix(keys_col, 2)
    starts, rows = list_views(rows_col)
    _, cols = list_views(cols_col)
    _, values = list_views(values_col)
    rows = rows.to_numpy(zero_copy_only=False).astype(np.int64)
    cols = cols.to_numpy(zero_copy_only=False).astype(np.int64)
    values = values.to_numpy(zero_copy_only=False).astype(dtype)
    shapes = np.minimum(tile, shape - keys * tile)
    tiles = []
    for g, (key, tile_shape) in enumerate(zip(keys, shapes)):
        part = slice(starts[g], starts[g + 1])
        r, c = rows[part] - key[0] * tile[0], cols[part] - key[1] * tile[1]
        if len(r) and (r.min() < 0 or c.min() < 0 or r.max() >= tile_shape[0] or c.max() >= tile_shape[1]):
            raise ShapeError(f"{meta.name}: an entry of tile {tuple(key.tolist())} lies outside it")
        tiles.append(encode(r, c, values[part], tuple(int(n) for n in tile_shape)))
    return concat(tiles)


def check(name: str, key, buf: np.ndarray, shape, dtype: np.dtype) -> CSRTile:
    """Decode the tile at ``key`` of tensor ``name`` or raise ``CorruptTileError``."""
    tile = CSRTile.decode(buf, shape, dtype)
    if tile is None:
        raise CorruptTileError(f"tile {tuple(int(k) for k in key)} of tensor '{name}' is not a CSR tile of "
                               f"shape {tuple(int(n) for n in shape)} and dtype {dtype} ({len(buf)} bytes)")
    return tile


@cache
def _kernels():
    """The Numba kernels (compiled on first use, cached on disk)."""
    from tra_sql.udfs import sparse_kernels

    return sparse_kernels


def _product_layout(inputs: tuple[str, ...], output: str, position: int):
    """(kept, contracted, rest) if the CSR operand at ``position`` meets the dense one in a
    sparse-dense product: one of its indices is kept in the output, the other contracted
    with the dense operand, and every other index is the dense operand's."""
    sparse, dense = inputs[position], inputs[1 - position]
    if len(sparse) != 2 or sparse[0] == sparse[1] or len(set(dense)) != len(dense) or len(set(output)) != len(output):
        return None
    for kept, contracted in (sparse, sparse[::-1]):
        rest = [c for c in dense if c != contracted]
        if contracted in dense and contracted not in output and kept not in dense \
                and sorted(output) == sorted([kept, *rest]):
            return kept, contracted, rest
    return None


def native_product(step) -> tuple[int, bool] | None:
    """(the CSR operand's position, whether its column index is the one kept) of a
    ``protocol.EinsumStep`` that the native kernel's CSR bodies compute (``native.sparse``): a
    sum of products of one CSR tile and one dense tile (``_product_layout``) whose dense operand
    is subscripted (contracted, rest...) and whose dense result (kept, rest...), so that the
    kernel reads and writes them as stored; else None (the Arrow UDF computes it)."""
    if step.join is not None or step.agg != "sum" or len(step.inputs) != 2 or step.prologue \
            or step.out_layout != "dense" or tuple(sorted(step.layouts)) != ("csr", "dense"):
        return None
    position = step.layouts.index("csr")
    layout = _product_layout(step.inputs, step.output, position)
    if layout is None:
        return None
    kept, contracted, rest = layout
    if step.inputs[1 - position] != contracted + "".join(rest) or step.output != kept + "".join(rest):
        return None
    return position, step.inputs[position][1] == kept


def same_entries(a: CSRTile, b: CSRTile) -> bool:
    return a.shape == b.shape and np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)


def accumulate(inputs: tuple[str, ...], output: str, join_code: str | None, agg: str, out: np.ndarray,
               tiles: list) -> None:
    """Aggregate an einsum over tiles, some CSR, into ``out`` (the data array of a CSR tile
    with the entries of the CSR operands when ``output`` is subscripted like them). Their
    absent elements take no part (as absent rows of a relation do): a sparse-dense product
    runs as a dedicated kernel, anything else as a loop kernel over the entries."""
    sparse = [m for m, t in enumerate(tiles) if isinstance(t, CSRTile)]
    layout = _product_layout(inputs, output, sparse[0]) \
        if join_code is None and agg == "sum" and len(tiles) == 2 and len(sparse) == 1 else None
    if layout is not None:
        _product(inputs, output, out, tiles, sparse[0], layout)
        return
    pattern, first = inputs[sparse[0]], tiles[sparse[0]]
    if pattern[0] == pattern[1] or any(inputs[m] != pattern for m in sparse):
        raise ShapeError(f"einsum {','.join(inputs)}->{output}: CSR operands must all be subscripted alike, "
                         f"by two different indices")
    if not all(same_entries(first, tiles[m]) for m in sparse[1:]):
        raise ShapeError(f"einsum {','.join(inputs)}->{output}: CSR operands with different nonzero patterns")
    code = join_code or " * ".join(f"x{m}" for m in range(len(inputs)))
    canonical_inputs, canonical_output = canonical(inputs, output)
    parallel = output == pattern and len(first.data) >= PARALLEL_ENTRIES
    kernel = loop_kernel(canonical_inputs, canonical_output, code, agg, parallel, tuple(sparse))
    rows = np.repeat(np.arange(first.shape[0], dtype=np.int64), np.diff(first.indptr))
    with all_cores(parallel):
        kernel(out, rows, first.indices, *[t.data if isinstance(t, CSRTile) else t for t in tiles])


def _product(inputs: tuple[str, ...], output: str, out: np.ndarray, tiles: list, position: int, layout) -> None:
    """A sparse-dense product (see ``_product_layout``) added into the dense ``out``."""
    csr, dense = tiles[position], tiles[1 - position]
    kept, contracted, rest = layout
    sub = inputs[1 - position]
    operand = dense.transpose([sub.index(c) for c in [contracted, *rest]])
    operand = np.ascontiguousarray(operand.reshape(operand.shape[0], -1))
    natural = [kept, *rest]
    n_kept = csr.shape[inputs[position].index(kept)]
    direct = natural == list(output) and out.flags.c_contiguous
    target = out.reshape(n_kept, -1) if direct else np.zeros((n_kept, operand.shape[1]), out.dtype)
    kernel = _kernels().csr_t_dense if inputs[position][1] == kept else _kernels().csr_dense
    with all_cores():
        kernel(csr.indptr, csr.indices, csr.data, operand, target)
    if not direct:
        sizes = [n_kept] + [dense.shape[sub.index(c)] for c in rest]
        out += target.reshape(sizes).transpose([natural.index(c) for c in output])
