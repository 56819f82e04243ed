"""Plain value columns viewed as 1x1 tiles (tensor relations over ordinary tables).

``tra_pack(value DOUBLE) -> BLOB`` gives each value as the 8 bytes of a float64 tile and
``tra_pack_f32(value DOUBLE) -> BLOB`` as the 4 bytes of a float32 tile; a NULL value gives a
NULL tile. Both are vectorized: the tile bytes are the value column's buffer, reinterpreted.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tra_sql.udfs.arrowio import binary_array
from tra_sql.udfs.python_kernels import implements


def _pack(values, dtype: np.dtype) -> pa.Array:
    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    data = np.ascontiguousarray(arr.to_numpy(zero_copy_only=False), dtype=dtype)
    offsets = np.arange(len(arr) + 1, dtype=np.int64) * dtype.itemsize
    out = binary_array(data.view(np.uint8), offsets)
    import pyarrow.compute as pc  # 60 ms to import: only when needed
    return pc.if_else(arr.is_valid(), out, pa.scalar(None, out.type)) if arr.null_count else out


@implements("pack")
def pack(values) -> pa.Array:
    """``tra_pack``: float64 1x1 tiles."""
    return _pack(values, np.dtype(np.float64))


@implements("pack_f32")
def pack_f32(values) -> pa.Array:
    """``tra_pack_f32``: float32 1x1 tiles."""
    return _pack(values, np.dtype(np.float32))
