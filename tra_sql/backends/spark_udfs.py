"""The tile UDFs of ``tra_sql.udfs`` registered on Spark as scalar Arrow UDFs.

The Python functions are the ones DuckDB calls: a batch of rows comes in as one
``pyarrow.Array`` per argument (binary tiles, key lists, lists of structs, the constant JSON
``meta``), the kernels work on zero-copy NumPy views, and one ``pyarrow.Array`` of result
tiles goes back. Spark ships them to the executors' Python workers by reference, so
``tra_sql`` must be importable there (it is, when executors run this interpreter).
"""

from __future__ import annotations

import gc
import re

import numpy as np
import pyarrow as pa

from tra_sql import errors
from tra_sql.errors import ExecutionError, TraError

#: DuckDB result types of the tile UDFs, as Spark types.
RESULT_TYPES = {"BLOB": ("binary", pa.large_binary()), "DOUBLE[]": ("array<double>", pa.large_list(pa.float64())),
                "BIGINT[]": ("array<bigint>", pa.large_list(pa.int64()))}
ERROR_LINE = re.compile(r"^(?:tra_sql\.errors\.)?(\w+Error): (.*)$", re.M)


def _settle() -> None:
    """Move every object this Python worker holds into the garbage collector's permanent
    generation (``gc.freeze``, which costs nothing), so that collections skip them. A reused
    PySpark worker runs a full ``gc.collect()`` before each UDF evaluation (a task's UDF
    operator): with the kernel modules and their compiled Numba kernels in its heap (~170k
    objects) each took 150-200 ms, ~20 of them per worker in a step of ``bench_spark``'s GCN,
    a third of the step. Frozen objects are still freed when their last reference goes; a
    reference cycle frozen is kept (each task has the collection before it: few are garbage
    then). Called first by every tile UDF here, which run only in the Python workers."""
    gc.freeze()


def _batch_udf(function, empty: pa.DataType):
    """``function`` over a batch; a batch of no rows gives no tiles (the kernels read the
    constant ``meta`` from the first row)."""
    def udf(*columns):
        _settle()
        if len(columns[0]) == 0:
            return pa.array([], empty)
        return function(*columns)
    udf.__name__ = function.__name__
    return udf


def _fold(name: str, batches) -> np.ndarray:
    """One output tile (its elements, flat) from ``(meta column, tile column)`` batches of
    partial results, each reduced with the step's aggregate, then reduced in turn. Memory: one
    batch at a time."""
    from tra_sql.aggregates import AGGREGATES
    from tra_sql.udfs.arrowio import binary_views, first_string
    from tra_sql.udfs.protocol import EinsumStep

    out = None
    for meta_col, tiles in batches:
        if not len(meta_col):
            continue
        step = EinsumStep.decode(first_string(meta_col))
        combine = AGGREGATES[step.agg].ufunc
        data, offsets, _ = binary_views(tiles)
        rows = data[offsets[0]:offsets[-1]].view(step.out_dtype).reshape(len(meta_col), -1)
        part = combine.reduce(rows, axis=0)
        out = part if out is None else combine(out, part, out=out)
    if out is None:
        raise ValueError(f"{name}: an empty group")
    return out


def einsum_group(batches) -> bytes:
    """``tra_einsum_group_<n>[_<k>](meta, out_keys, keys_0, tile_0, ..., keys_<n-1>, tile_<n-1>,
    then the keys and tile of each of k epilogue operands)``, a grouped aggregate: the joined
    rows of one output tile come in batches; each batch is one kernel call per row
    (``tra_einsum_<n>``'s, without the step's epilogue) whose products are reduced with the
    step's aggregate; then the epilogue, if any, over the epilogue operands of the group's first
    row (every row of a group has the same: they are joined on the output keys)."""
    import dataclasses

    from tra_sql.udfs.arrowio import binary_array, first_string
    from tra_sql.udfs.einsum_kernels import einsum_rows, reduce_partials
    from tra_sql.udfs.protocol import EinsumStep

    _settle()
    first = {}  # of the group's first row: meta, output keys, epilogue operands; the step without epilogue

    def products():
        for meta_col, keys_col, *columns in batches:
            if not len(meta_col):
                continue
            if not first:
                step = EinsumStep.decode(first_string(meta_col))
                own = 2 * len(step.present)
                first.update(meta=meta_col.slice(0, 1), keys=keys_col.slice(0, 1), own=own,
                             epilogue=[c.slice(0, 1) for c in columns[own:]],
                             plain=pa.array([dataclasses.replace(step, epilogue=None).encode()]))
            yield meta_col, einsum_rows(first["plain"], keys_col, *columns[:first["own"]])

    tile = _fold("tra_einsum_group", products())
    if not first["epilogue"]:
        return tile.tobytes()
    partial = pa.LargeListArray.from_arrays(pa.array([0, 1], pa.int64()),
                                            binary_array(tile.view(np.uint8), np.array([0, tile.nbytes])))
    return reduce_partials(first["meta"], first["keys"], partial, *first["epilogue"])[0].as_py()


def reduce_group(batches) -> bytes:
    """``tra_reduce_group(meta, partial)``, a grouped aggregate: the partial results of one
    output tile (all of its shape) come in batches, reduced with the step's aggregate."""
    _settle()
    return _fold("tra_reduce_group", batches).tobytes()


GROUPED = {"einsum_group": einsum_group, "reduce_group": reduce_group}  # by kernel kind


def register(spark, kernels) -> None:
    """Register ``kernels`` (``protocol.Kernel``s: those of ``tra_sql.udfs.register``, and
    the grouped aggregates ``einsum_group`` and ``reduce_group``) on ``spark``."""
    import warnings

    from pyspark.sql.functions import ArrowUDFType, arrow_udf

    from tra_sql.udfs.register import implementation

    for kernel in kernels:
        grouped = GROUPED.get(kernel.kind)
        if grouped is not None:
            with warnings.catch_warnings():  # type hints cannot say "any number of arguments"
                warnings.simplefilter("ignore", UserWarning)
                udf = arrow_udf(grouped, "binary", ArrowUDFType.GROUPED_AGG_ITER)
            spark.udf.register(kernel.name, udf)
            continue
        spark_type, arrow_type = RESULT_TYPES[kernel.result]
        spark.udf.register(kernel.name, arrow_udf(_batch_udf(implementation(kernel), arrow_type), spark_type))


def translate(err: Exception, what: str) -> TraError:
    """A ``TraError`` for a Spark error; errors raised in tile UDFs keep their class."""
    text = str(err)
    for name, message in reversed(ERROR_LINE.findall(text)):
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, TraError):
            return cls(message.strip())
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ExecutionError(f"{what} failed on Spark: {first}")
