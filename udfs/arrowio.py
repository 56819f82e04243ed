"""Zero-copy views between Arrow arrays (as DuckDB hands them to UDFs) and NumPy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _single(chunked: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(chunked, pa.ChunkedArray):
        return chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
    return chunked


def first_string(chunked: pa.ChunkedArray) -> str:
    """The value of a constant VARCHAR argument."""
    return _single(chunked)[0].as_py()


def binary_views(chunked) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, start offsets, valid mask) of a BLOB array, without copying the bytes."""
    arr = _single(chunked)
    offset_type = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.empty(0, np.uint8)
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else np.ones(len(arr), dtype=bool)
    return data, offsets.astype(np.int64, copy=False), valid


def list_views(chunked) -> tuple[np.ndarray, pa.Array]:
    """(row offsets into the flattened values, flattened values) of a LIST array."""
    arr = _single(chunked)
    offsets = arr.offsets.to_numpy().astype(np.int64, copy=False)
    return offsets - offsets[0], arr.flatten()


def key_matrix(chunked, rank: int) -> np.ndarray:
    """An ``INTEGER[]`` column whose lists all have ``rank`` elements, as an (n, rank) array."""
    arr = _single(chunked)
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    return flat.astype(np.int64, copy=False).reshape(len(arr), rank)


def binary_array(data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """A LARGE BLOB array over ``data`` (uint8) with ``len(offsets) - 1`` rows, no copy."""
    return pa.Array.from_buffers(
        pa.large_binary(),
        len(offsets) - 1,
        [None, pa.py_buffer(offsets.astype(np.int64, copy=False)), pa.py_buffer(data)],
    )
