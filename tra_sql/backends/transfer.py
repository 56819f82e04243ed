"""Copying tables between engines: prototype on DuckDB, scale out on Spark, and back.

``copy(src, dst, name)`` copies a tensor relation (its tile table and its catalog row) or a
plain table (edges, ratings, ...) from one session to another. The data goes through Parquet
files, streamed by the engines themselves: DuckDB writes the files into the Spark warehouse
(``COPY ... TO``), and reads a Spark table's files back (``read_parquet``), so nothing passes
through Python. A Spark table outside the warehouse layout comes back through Arrow instead.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import duckdb

from tra_sql import catalog
from tra_sql.backends.warehouse import ROW_GROUP_BYTES, literal, quote
from tra_sql.catalog import TensorInfo
from tra_sql.errors import ExecutionError, TensorExistsError, TraError, UnknownTensorError


def copy(src, dst, name: str, *, to: str | None = None, replace: bool = False) -> str:
    """Copy table ``name`` of session ``src`` to session ``dst`` as ``to`` (default: the same
    name); a tensor relation keeps its catalog row. Returns the new table's name."""
    to = to or name
    catalog.check_name(to)
    route = (src.engine.name, dst.engine.name)
    if route == ("duckdb", "spark"):
        _duckdb_to_spark(src, dst, name, to, replace)
    elif route == ("spark", "duckdb"):
        _spark_to_duckdb(src, dst, name, to, replace)
    else:
        raise TraError(f"copy from {route[0]} to {route[1]}: use store() or SQL within one engine")
    return to


def _duckdb_info(session, name: str) -> TensorInfo | None:
    try:
        return session.engine.lookup(name)
    except UnknownTensorError:
        return None


def _spark_info(session, name: str) -> TensorInfo | None:
    try:
        return session.engine.warehouse.lookup(name)
    except UnknownTensorError:
        return None


def _select(info: TensorInfo | None, source: str, cast_keys: str) -> str:
    if info is None:
        return f"SELECT * FROM {source}"
    keys = [f"CAST(k{d} AS {cast_keys}) AS k{d}" for d in range(len(info.shape))]
    return f"SELECT {', '.join(keys + ['tile'])} FROM {source}"


def _duckdb_to_spark(src, dst, name: str, to: str, replace: bool) -> None:
    info = _duckdb_info(src, name)
    if info is None and src.engine.object_kind(name) != "TABLE":
        raise UnknownTensorError(f"no table named '{name}' in the DuckDB database")
    rows = ""
    if info is not None:
        tile_bytes = prod(info.tile) * info.dtype.itemsize
        rows = f", ROW_GROUP_SIZE {max(1, ROW_GROUP_BYTES // tile_bytes)}"
        info = TensorInfo(to, info.dtype, info.shape, info.tile, info.layout)

    def write(directory: Path) -> None:
        directory.mkdir(parents=True)
        target = literal(str(directory / "part-00000.parquet"))
        try:
            src.engine.rows(f"COPY ({_select(info, _duckdb_name(name), 'INTEGER')}) TO {target} "
                            f"(FORMAT parquet{rows})")
        except duckdb.Error as err:
            raise ExecutionError(f"copying '{name}' out of DuckDB failed: {err}") from None

    dst.engine.warehouse.create(to, write, info, replace)


def _duckdb_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _spark_to_duckdb(src, dst, name: str, to: str, replace: bool) -> None:
    info = _spark_info(src, name)
    spark = src.engine
    files = sorted(spark.warehouse.path(name).glob("*.parquet"))
    if not files and not spark.spark.catalog.tableExists(name):
        raise UnknownTensorError(f"no table named '{name}' in the Spark warehouse")
    if files:
        source = f"read_parquet([{', '.join(literal(str(f)) for f in files)}])"
        _duckdb_create(dst, to, info, _select(info, source, "INTEGER"), replace)
        return
    with dst.engine.registered("_tra_copy", spark.spark.table(quote(name)).toArrow()):
        _duckdb_create(dst, to, info, _select(info, "_tra_copy", "INTEGER"), replace)


def _duckdb_create(dst, to: str, info: TensorInfo | None, select: str, replace: bool) -> None:
    try:
        if info is not None:
            dst.engine.create_table(TensorInfo(to, info.dtype, info.shape, info.tile, info.layout), select, replace)
            return
        if dst.engine.object_kind(to) == "TABLE":
            if not replace:
                raise TensorExistsError(f"a table named '{to}' exists already; pass replace=True to overwrite it")
            if _duckdb_info(dst, to) is not None:
                dst.engine.drop(to)
        dst.engine.rows(f"CREATE OR REPLACE TABLE {_duckdb_name(to)} AS {select}")
    except duckdb.Error as err:
        raise ExecutionError(f"copying into DuckDB table '{to}' failed: {err}") from None
