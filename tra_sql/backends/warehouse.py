"""Tensor relations on Spark: Parquet tables in a warehouse directory.

Layout (every name lower-cased, since SQL names are case-insensitive)::

    <root>/tra_tensors/<name>.parquet   the catalog: one row (name, dtype, shape, tile_shape, layout)
    <root>/<name>/*.parquet             a tile relation (k0.. INT, tile BINARY) or a plain table
    <root>/_staging/<uuid>/             writes in flight; published by a directory rename
    <root>/_staging/<uuid>.<name>.old   a replaced table until its successor is in place

Every table directory is registered with Spark (``USING parquet LOCATION``) when a session
opens, so a warehouse written by one Spark application opens in the next, as a DuckDB file
does. Opening also puts back a table whose replacement a crash interrupted between its two
renames; catalog rows are replaced by an atomic file rename, never removed first. The driver
reads and writes the directory itself, so it must be a path that the driver and every
executor see alike: local disk for ``local[N]`` and a cluster on one machine, a shared
filesystem for a cluster of several.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tra_sql import catalog
from tra_sql.catalog import CATALOG_TABLE, TensorInfo
from tra_sql.errors import TensorExistsError, UnknownTensorError

CATALOG_SCHEMA = pa.schema([("name", pa.string()), ("dtype", pa.string()),
                            ("shape", pa.list_(pa.int64())), ("tile_shape", pa.list_(pa.int64())),
                            ("layout", pa.string())])  # absent (dense) in warehouses written before it
#: Parquet row groups of about this size (Spark's unit of parallel reads; the writers' too:
#: ``parquet.block.size``): Spark's reader holds a row group's column chunk and the batch it
#: decodes from it (grown by doubling) in a task's heap at once, so they are kept small.
ROW_GROUP_BYTES = 8 << 20


def quote(name: str) -> str:
    """A Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def literal(text: str) -> str:
    """A Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def columns(schema: pa.Schema) -> str:
    """``schema`` as a Spark SQL column list, ``(name TYPE, ...)``."""
    from pyspark.sql.pandas.types import from_arrow_type

    return "(" + ", ".join(f"{quote(f.name)} {from_arrow_type(f.type).simpleString()}" for f in schema) + ")"


def tile_schema(rank: int) -> pa.Schema:
    """The columns of a tile relation of a rank-``rank`` tensor: ``k0..`` (INT), ``tile``."""
    return pa.schema([(f"k{d}", pa.int32()) for d in range(rank)] + [("tile", pa.large_binary())])


def write_parquet(table: pa.Table, directory: Path) -> None:
    """``table`` as one Parquet file in ``directory`` (created), in row groups of about
    ``ROW_GROUP_BYTES``, without dictionary encoding: pyarrow puts a tile column's first tiles
    in a dictionary page, which Spark's reader copies whole into a task's heap (twice) before
    it reads a row (a 512m executor ran out of heap on 32 MiB tiles)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = max(1, int(ROW_GROUP_BYTES * table.num_rows // max(1, table.nbytes))) if table.num_rows else None
    pq.write_table(table, directory / "part-00000.parquet", row_group_size=rows, use_dictionary=False)


class Warehouse:
    """The warehouse directory ``root`` and the Spark tables registered over it."""

    def __init__(self, root: Path, spark):
        self.root = root
        self.spark = spark
        self.catalog_dir = root / CATALOG_TABLE
        self.catalog_dir.mkdir(parents=True, exist_ok=True)
        #: the plain tables this session defined with a column list, by name (``_publish``)
        self.columns: dict[str, str] = {}
        self._session_catalog = None  # Spark's SessionCatalog and TableIdentifier class (``registered``)
        #: how many times a table's files were replaced or dropped through this warehouse (a plan
        #: made when it read n reads the files of then: ``spark_pipeline``)
        self.generation = 0
        self.recover()
        self.attach_all()

    def path(self, name: str) -> Path:
        return self.root / name.lower()

    def recover(self) -> None:
        """Put back every replaced table whose successor never arrived (see ``_publish``);
        drop the other leftovers of replacements."""
        for old in sorted((self.root / "_staging").glob("*.*.old")):
            name = old.name.split(".", 1)[1][: -len(".old")]
            if self.path(name).exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.rename(self.path(name))

    # -- Spark's view of the directory ----------------------------------------------------
    def attach(self, name: str, schema: str = "") -> None:
        """Register directory ``name`` as a Parquet table (``schema``: a column list, else
        inferred from the files)."""
        self.spark.sql(f"CREATE TABLE IF NOT EXISTS {quote(name)} {schema} USING parquet "
                       f"LOCATION {literal(str(self.path(name)))}")

    def attach_all(self) -> None:
        self.attach(CATALOG_TABLE, "(name STRING, dtype STRING, shape ARRAY<BIGINT>, tile_shape ARRAY<BIGINT>, "
                                   "layout STRING)")
        for entry in sorted(self.root.iterdir()):
            if entry.is_dir() and entry.name[0] not in "_." and any(entry.glob("*.parquet")):
                self.attach(entry.name)

    def registered(self, name: str) -> bool:
        """Whether Spark's session catalog holds table ``name`` (asked directly:
        ``spark.catalog.tableExists`` analyzes a query plan to answer)."""
        if self._session_catalog is None:  # found once: each step through the JVM's packages is a call
            self._session_catalog = (self.spark._jsparkSession.sessionState().catalog(),
                                     self.spark._jvm.org.apache.spark.sql.catalyst.TableIdentifier)
        catalog, ident = self._session_catalog
        return catalog.tableExists(ident(name))

    def exists(self, name: str) -> bool:
        """Whether table ``name`` exists: its directory (no call to Spark), else a table Spark knows."""
        return self.path(name).exists() or self.spark.catalog.tableExists(name)

    # -- the catalog ----------------------------------------------------------------------
    def rows(self) -> list[dict]:
        files = sorted(self.catalog_dir.glob("*.parquet"))
        return pa.concat_tables([pq.read_table(f, schema=CATALOG_SCHEMA) for f in files]).to_pylist() if files else []

    def lookup(self, name: str) -> TensorInfo:
        entry = self.entry(name)
        if entry is None:
            raise UnknownTensorError(f"no tensor named '{name}' in the catalog")
        return entry

    def entry(self, name: str) -> TensorInfo | None:
        """Tensor ``name``'s catalog row, if it has one."""
        path = self._catalog_file(name)
        if not path.exists():
            return None
        row = pq.read_table(path, schema=CATALOG_SCHEMA).to_pylist()[0]
        return TensorInfo(row["name"], np.dtype(row["dtype"]), tuple(row["shape"]), tuple(row["tile_shape"]),
                          row["layout"] or "dense")

    def tensors(self) -> list[str]:
        return sorted(row["name"] for row in self.rows())

    def _catalog_file(self, name: str) -> Path:
        return self.catalog_dir / f"{name.lower()}.parquet"

    # -- writing tables -------------------------------------------------------------------
    def create(self, name: str, write: Callable[[Path], None], info: TensorInfo | None = None,
               replace: bool = False, schema: str = "") -> None:
        """Create table ``name`` from the Parquet files that ``write(directory)`` leaves in a
        staging directory, then publish it (and ``info``'s catalog row, for a tensor; a plain
        table's ``schema``, a column list, saves Spark the job that infers it). A failing
        ``write`` leaves the warehouse as it was."""
        catalog.check_name(name)
        if not replace and self.exists(name):
            raise TensorExistsError(f"a table named '{name}' exists already (names are case-insensitive, "
                                    f"as in SQL); pass replace=True to overwrite it")
        staging = self.root / "_staging" / uuid.uuid4().hex
        try:
            write(staging)
            self._publish(name, staging, info, schema)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _publish(self, name: str, staging: Path, info: TensorInfo | None, schema: str = "") -> None:
        """Directory ``staging`` becomes table ``name`` (two renames: the old table aside,
        the new one in; ``recover`` undoes the first if a crash comes between them), with
        ``info``'s catalog row (else none). A table that keeps its definition (a tensor its
        catalog row, a plain table the column list this session defined it with) keeps its
        Spark table, whose listing of files is refreshed."""
        if self._keeps(name, info, schema):
            self._replace(name, staging)
            return
        self.spark.sql(f"DROP TABLE IF EXISTS {quote(name)}")
        self.columns.pop(name.lower(), None)
        self._swap(name, staging)
        if info is not None:
            keys = ", ".join(f"k{d} INT" for d in range(len(info.shape)))
            self.attach(name, f"({keys}{', ' if keys else ''}tile BINARY)")
            row = {"name": [info.name], "dtype": [info.dtype.name], "shape": [list(info.shape)],
                   "tile_shape": [list(info.tile)], "layout": [info.layout]}
            written = self.catalog_dir / f".{uuid.uuid4().hex}.tmp"
            pq.write_table(pa.table(row, schema=CATALOG_SCHEMA), written)
            os.replace(written, self._catalog_file(name))
        else:
            removed = self._catalog_file(name).exists()
            self._catalog_file(name).unlink(missing_ok=True)
            self.attach(name, schema)
            if schema:
                self.columns[name.lower()] = schema
            if not removed:
                return
        self.spark.catalog.refreshTable(CATALOG_TABLE)

    def _keeps(self, name: str, info: TensorInfo | None, schema: str) -> bool:
        """Whether table ``name``, published anew with catalog row ``info`` (or as a plain
        table of columns ``schema``), keeps its definition and its Spark table."""
        if info is not None:
            same = info == self.entry(name)
        else:
            same = bool(schema) and self.columns.get(name.lower()) == schema and not self._catalog_file(name).exists()
        return same and self.registered(name)

    def _replace(self, name: str, staging: Path) -> None:
        """Directory ``staging`` becomes the files of Spark table ``name``, which Spark lists anew."""
        self._swap(name, staging)
        self.spark.catalog.refreshTable(quote(name))

    def _swap(self, name: str, staging: Path) -> None:
        """Directory ``staging`` becomes directory ``name`` by two renames, the old one set
        aside first (see ``recover``)."""
        old = self.root / "_staging" / f"{uuid.uuid4().hex}.{name.lower()}.old"
        self.generation += 1
        if self.path(name).exists():
            self.path(name).rename(old)
        staging.rename(self.path(name))
        shutil.rmtree(old, ignore_errors=True)

    def publish(self, directory: Path, name: str) -> None:
        """The Parquet files in ``directory`` (moved) become table ``name``'s, which keeps its
        catalog row (if it has one)."""
        info = self.entry(name)
        if info is not None and self.registered(name):
            self._replace(name, directory)
        else:
            self._publish(name, directory, info)

    def empty_tiles(self, name: str, directory: Path) -> None:
        """An empty tile relation shaped like tensor ``name``'s, written to ``directory``."""
        write_parquet(tile_schema(len(self.lookup(name).shape)).empty_table(), directory)

    def drop(self, name: str) -> None:
        """Drop table ``name``: its Spark table, its directory and its catalog row, if any."""
        self.generation += 1
        self.spark.sql(f"DROP TABLE IF EXISTS {quote(name)}")
        self.columns.pop(name.lower(), None)
        self._catalog_file(name).unlink(missing_ok=True)
        shutil.rmtree(self.path(name), ignore_errors=True)
        self.spark.catalog.refreshTable(CATALOG_TABLE)
