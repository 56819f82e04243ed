"""The tensor catalog stored in a DuckDB database: table ``tra_tensors`` and the tile tables
it describes, created and dropped atomically, and checked for drift and corruption."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from math import prod

import duckdb
import numpy as np

from tra_sql.catalog import CATALOG_TABLE, Finding, TensorInfo, check_name, row_problem
from tra_sql.errors import CatalogDriftError, CorruptTileError, TensorExistsError, UnknownTensorError
from tra_sql.udfs import sparse
from tra_sql.udfs.arrowio import binary_views

KEY_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT")
HEADER_BYTES = 3 * 4096  # a DuckDB file's main header and its two database headers
STAGE_PREFIX = "_tra_stage_"  # the tables of a staged plan's steps (tra_sql.engines.staged)


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """The statements run on ``con`` inside the ``with`` block commit together or not at all."""
    con.execute("BEGIN TRANSACTION").fetchall()
    try:
        yield
        con.execute("COMMIT").fetchall()
    except BaseException:
        con.execute("ROLLBACK").fetchall()
        raise


def remove_unwritten_database(path: str) -> None:
    """Remove database file ``path`` if DuckDB's creation of it was interrupted before its
    headers were written: a process killed while connecting leaves an empty file or a lone main
    header, which DuckDB refuses to open and which holds nothing. Any other file, one with a
    WAL and one that a process holds open (DuckDB locks it) are left alone."""
    if not os.path.isfile(path) or os.path.getsize(path) >= HEADER_BYTES or os.path.exists(path + ".wal"):
        return
    with open(path, "rb+") as file:
        try:
            fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return
        head = file.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES and (not head or head[8:12] == b"DUCK"):
            os.remove(path)


def catalog_ddl() -> str:
    return resources.files("tra_sql.sql").joinpath("catalog.sql").read_text()


def ensure_catalog(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(catalog_ddl()).fetchall()


def _row(con: duckdb.DuckDBPyConnection, name: str) -> tuple:
    """The catalog row (name, dtype, shape, tile_shape, layout) of ``name``, as stored."""
    try:
        rows = con.execute(f"SELECT name, dtype, shape, tile_shape, layout FROM {CATALOG_TABLE} "
                           f"WHERE lower(name) = lower(?)", [name]).fetchall()
    except duckdb.Error as err:
        raise CatalogDriftError(f"{_unreadable_catalog(err)}; db.check() says more") from None
    if not rows:
        orphan = " (a table of that name exists without a catalog row: see db.check())" \
            if object_kind(con, name) else ""
        raise UnknownTensorError(f"no tensor named '{name}' in the catalog{orphan}")
    return rows[0]


def catalog_row(con: duckdb.DuckDBPyConnection, name: str) -> TensorInfo | None:
    """Tensor ``name``'s catalog row as stored (unchecked; its table not read), if it has one
    and it is readable."""
    try:
        stored, dtype, shape, tile, layout = _row(con, name)
    except (UnknownTensorError, CatalogDriftError):
        return None
    if row_problem(dtype, shape, tile, layout):
        return None
    return TensorInfo(stored, np.dtype(dtype), tuple(shape), tuple(tile), layout)


def _unreadable_catalog(err: duckdb.Error) -> str:
    return f"the catalog table {CATALOG_TABLE} cannot be read ({str(err).splitlines()[0]})"


def lookup(con: duckdb.DuckDBPyConnection, name: str) -> TensorInfo:
    """The catalog row of tensor ``name``, after checking it against its table: the row's
    geometry, the table's columns and, for a table (not a view), its keys (``verify``)."""
    stored, dtype, shape, tile, layout = _row(con, name)
    problem = row_problem(dtype, shape, tile, layout)
    if problem:
        raise CatalogDriftError(f"tensor '{stored}': its catalog row is invalid: {problem}")
    info = TensorInfo(stored, np.dtype(dtype), tuple(shape), tuple(tile), layout)
    verify(con, info)
    return info


def list_tensors(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(f"SELECT name FROM {CATALOG_TABLE} ORDER BY name").fetchall()]


def table_exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return object_kind(con, name) == "TABLE"


def object_kind(con: duckdb.DuckDBPyConnection, name: str) -> str | None:
    """``"VIEW"``, ``"TABLE"`` or None for an object ``name`` in the current schema."""
    rows = con.execute(
        "SELECT 'VIEW' FROM duckdb_views() WHERE lower(view_name) = lower(?) AND NOT internal "
        "AND database_name = current_database() AND schema_name = current_schema() UNION ALL "
        "SELECT 'TABLE' FROM duckdb_tables() WHERE lower(table_name) = lower(?) "
        "AND database_name = current_database() AND schema_name = current_schema()", [name, name]).fetchall()
    return rows[0][0] if rows else None


def _view_problem(con: duckdb.DuckDBPyConnection, name: str) -> str | None:
    """Why view ``name`` does not bind (a table it reads is gone, ...), or None."""
    try:
        con.execute(f'DESCRIBE SELECT * FROM "{name}"').fetchall()
    except duckdb.Error as err:
        return f"its view no longer binds: {str(err).splitlines()[0]}"
    return None


def _columns_problem(con: duckdb.DuckDBPyConnection, info: TensorInfo, kind: str) -> str | None:
    """What is wrong with the columns of ``info``'s table or view, or None: they must be the
    integer keys ``k0..`` and the BLOB ``tile``, in that order."""
    columns = con.execute(
        "SELECT column_name, data_type FROM duckdb_columns() WHERE lower(table_name) = lower(?) "
        "AND database_name = current_database() AND schema_name = current_schema() ORDER BY column_index",
        [info.name]).fetchall()
    expected = [f"k{d}" for d in range(len(info.shape))] + ["tile"]
    if [c.lower() for c, _ in columns] != expected:
        return f"its {kind.lower()} has columns {[c for c, _ in columns]}, not {expected}"
    for column, sql_type in columns[:-1]:
        if sql_type not in KEY_TYPES:
            return f"its key column {column} has type {sql_type}, not an integer type"
    if columns[-1][1] != "BLOB":
        return f"its tile column has type {columns[-1][1]}, not BLOB"
    return None


def structure_finding(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> tuple[Finding | None, str | None]:
    """(the first problem with the table of ``info``'s catalog row: gone, a view that does not
    bind, other columns; or None) and the object's kind (``TABLE``, ``VIEW`` or None)."""
    kind = object_kind(con, info.name)
    if kind is None:
        return Finding(info.name, "no table", "its table is gone (dropped or renamed outside tra_sql)"), None
    problem = _view_problem(con, info.name) if kind == "VIEW" else None
    if problem:
        return Finding(info.name, "view", problem), kind
    problem = _columns_problem(con, info, kind)
    return (Finding(info.name, "columns", problem) if problem else None), kind


def _key_list(rank: int) -> str:
    return f"[{', '.join(f'k{d}' for d in range(rank))}]" if rank else "CAST([] AS BIGINT[])"


def _row_problems_sql(info: TensorInfo, tiles: bool) -> str:
    """A query of (problem, rows, first key, its tile's bytes) over the rows of ``info``'s
    table whose keys (and, with ``tiles``, whose tiles) disagree with the catalog."""
    rank, keys = len(info.shape), [f"k{d}" for d in range(len(info.shape))]
    cases = []
    if rank:
        cases.append(f"WHEN {' OR '.join(f'{k} IS NULL' for k in keys)} THEN 'null key'")
        inside = " AND ".join(f"{k} BETWEEN 0 AND {g - 1}" for k, g in zip(keys, info.grid))
        cases.append(f"WHEN NOT ({inside}) THEN 'key outside grid'")
    cases.append("WHEN tile IS NULL THEN 'null tile'")
    if tiles and info.layout == "dense":
        extents = [f"least({t}, {n} - {k}::BIGINT * {t})" for k, n, t in zip(keys, info.shape, info.tile)]
        cases.append(f"WHEN octet_length(tile) <> {' * '.join([*extents, str(info.dtype.itemsize)])} THEN 'tile size'")
    size = "octet_length(tile)" if tiles else "NULL"
    return (f"SELECT problem, count(*), min(struct_pack(key := key, size := size)) FROM ("
            f"SELECT CASE {' '.join(cases)} END AS problem, {_key_list(rank)} AS key, {size} AS size "
            f'FROM "{info.name}") WHERE problem IS NOT NULL GROUP BY problem ORDER BY problem')


def _detail(info: TensorInfo, problem: str, count: int, key: tuple, size: int | None) -> str:
    others = f" (and {count - 1} more)" if count > 1 else ""
    if problem == "null key":
        return f"{count} tile(s) have a NULL key, such as {key}"
    if problem == "key outside grid":
        return f"tile {key} is outside the grid {info.grid}{others}"
    if problem == "null tile":
        return f"tile {key} is NULL{others}"
    shape = info.tile_shape(key)
    return (f"tile {key} holds {size} bytes; shape {shape} and dtype {info.dtype} need "
            f"{prod(shape) * info.dtype.itemsize}{others}")


def _duplicates(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> list[Finding]:
    """A finding for keys (not NULL) held by more than one row."""
    keys = [f"k{d}" for d in range(len(info.shape))]
    where = f"WHERE {' AND '.join(f'{k} IS NOT NULL' for k in keys)} GROUP BY {', '.join(keys)}" if keys else ""
    count, first = con.execute(f'SELECT count(*), min(struct_pack(key := key, n := n)) FROM (SELECT '
                               f'{_key_list(len(keys))} AS key, count(*) AS n FROM "{info.name}" {where} '
                               f'HAVING count(*) > 1)').fetchall()[0]
    if not count:
        return []
    others = f" (and {count - 1} more keys)" if count > 1 else ""
    return [Finding(info.name, "duplicate key", f"tile {tuple(first['key'])} is stored {first['n']} times{others}")]


def _csr_findings(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> list[Finding]:
    """A finding for the first tile of the CSR table ``info`` that does not decode."""
    inside = " AND ".join(f"k{d} BETWEEN 0 AND {g - 1}" for d, g in enumerate(info.grid))
    reader = con.sql(f'SELECT k0, k1, tile FROM "{info.name}" WHERE tile IS NOT NULL AND {inside}').to_arrow_reader()
    for batch in reader:
        keys = np.stack([batch.column(0).to_numpy(), batch.column(1).to_numpy()], axis=1).astype(np.int64)
        data, offsets, _ = binary_views(batch.column(2))
        for i, key in enumerate(keys):
            try:
                sparse.check(info.name, key, data[offsets[i] : offsets[i + 1]], info.tile_shape(key), info.dtype)
            except CorruptTileError as err:
                return [Finding(info.name, "csr tile", str(err).replace(f" of tensor '{info.name}'", ""))]
    return []


def tile_findings(con: duckdb.DuckDBPyConnection, info: TensorInfo, tiles: bool = True) -> list[Finding]:
    """The problems with the rows of ``info``'s table: NULL keys, keys outside the grid,
    duplicate keys, NULL tiles and, with ``tiles`` (which reads every tile), tiles whose size
    disagrees with the catalog (CSR tiles that do not decode)."""
    found = [Finding(info.name, problem, _detail(info, problem, count, tuple(first["key"]), first["size"]))
             for problem, count, first in con.execute(_row_problems_sql(info, tiles)).fetchall()]
    found += _duplicates(con, info)
    if tiles and info.layout == "csr" and not found:
        found += _csr_findings(con, info)
    return found


def _rows_suspect(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> bool:
    """Whether the rows of ``info``'s table may have NULL, repeated or out-of-grid keys or NULL
    tiles (one scan of the key columns; tiles are not read)."""
    keys = [f"k{d}" for d in range(len(info.shape))]
    stats = "".join(f", count({k}), min({k}), max({k})" for k in keys)
    distinct = f"count(DISTINCT ({', '.join(keys)}))" if keys else "least(count(*), 1)"
    rows, distinct, tiles, *per_key = con.execute(
        f'SELECT count(*), {distinct}, count(tile){stats} FROM "{info.name}"').fetchall()[0]
    if not rows:
        return False
    bounds = [per_key[3 * d : 3 * d + 3] for d in range(len(keys))]
    return distinct < rows or tiles < rows or any(n < rows or low < 0 or high >= g
                                                  for (n, low, high), g in zip(bounds, info.grid))


def verify(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> None:
    """Raise ``CatalogDriftError`` if ``info``'s table is gone or its columns changed, and
    ``CorruptTileError`` if a key is NULL, repeated or outside the grid or a tile is NULL.
    Tile sizes are checked where tiles are read (kernels, ``assemble``); ``check`` reads all."""
    finding, kind = structure_finding(con, info)
    if finding:
        raise CatalogDriftError(finding.message)
    if kind == "TABLE" and _rows_suspect(con, info):
        raise CorruptTileError(tile_findings(con, info, tiles=False)[0].message)


def _orphans(con: duckdb.DuckDBPyConnection, known: set[str]) -> list[Finding]:
    """Tables (and views) shaped like tensor relations (keys ``k0..``, then ``tile``) without a
    catalog row: a planned store's staging tables (``_tra_stage_...``) that outlived their
    process, and any other."""
    tables = con.execute(
        "SELECT table_name, list(column_name ORDER BY column_index) FROM duckdb_columns() "
        "WHERE database_name = current_database() AND schema_name = current_schema() GROUP BY table_name "
        "ORDER BY table_name").fetchall()
    return [Finding(table, "stage table", f"'{table}' is a staging table of a planned store whose process died")
            if table.lower().startswith(STAGE_PREFIX) else
            Finding(table, "no catalog row", f"'{table}' looks like a tensor relation but has no row in "
                                             f"{CATALOG_TABLE} (left as it is)")
            for table, columns in tables
            if table.lower() not in known and table.lower() != CATALOG_TABLE
            and [c.lower() for c in columns] == [f"k{d}" for d in range(len(columns) - 1)] + ["tile"]]


def tensor_findings(con: duckdb.DuckDBPyConnection, row: tuple) -> list[Finding]:
    """The problems of one catalog row (name, dtype, shape, tile_shape, layout) and its table."""
    name, dtype, shape, tile, layout = row
    problem = row_problem(dtype, shape, tile, layout)
    if problem:
        return [Finding(name, "bad catalog row", problem)]
    info = TensorInfo(name, np.dtype(dtype), tuple(shape), tuple(tile), layout)
    finding, kind = structure_finding(con, info)
    if finding:
        return [finding]
    return tile_findings(con, info) if kind == "TABLE" else []


def check(con: duckdb.DuckDBPyConnection, repair: bool = False) -> list[Finding]:
    """Every disagreement between the catalog and the tables (reads every tile of every
    table; views are checked for their columns only). ``repair`` deletes the catalog rows whose
    table is gone and drops leftover staging tables, in one transaction (and recreates a
    dropped catalog table); other tables without a row are reported, never dropped. Do not
    repair while a planned store runs on the database (its staging tables would go)."""
    try:
        rows = con.execute(f"SELECT name, dtype, shape, tile_shape, layout FROM {CATALOG_TABLE} "
                           f"ORDER BY name").fetchall()
    except duckdb.CatalogException as err:  # dropped: every tensor table is now without a row
        if repair:
            ensure_catalog(con)
        lost = [Finding(CATALOG_TABLE, "no catalog table", _unreadable_catalog(err), repair)]
        rows = []
    else:
        lost = []
    findings = [f for row in rows for f in tensor_findings(con, row)] + _orphans(con, {r[0].lower() for r in rows})
    return lost + (_repair(con, findings) if repair else findings)


def _repair(con: duckdb.DuckDBPyConnection, findings: list[Finding]) -> list[Finding]:
    """``findings``, those repaired marked so: catalog rows without a table deleted and
    staging tables dropped, in one transaction."""
    fixed = [f for f in findings if f.problem in ("no table", "stage table")]
    if not fixed:
        return findings
    with transaction(con):
        for f in fixed:
            if f.problem == "no table":
                con.execute(f"DELETE FROM {CATALOG_TABLE} WHERE name = ?", [f.tensor]).fetchall()
            else:
                con.execute(f'DROP TABLE "{f.tensor}"').fetchall()
    return [Finding(f.tensor, f.problem, f.detail, True) if f in fixed else f for f in findings]

def insert_row(con: duckdb.DuckDBPyConnection, info: TensorInfo) -> None:
    """Add ``info``'s catalog row."""
    con.execute(f"INSERT INTO {CATALOG_TABLE} (name, dtype, shape, tile_shape, layout) VALUES (?, ?, ?, ?, ?)",
                [info.name, info.dtype.name, list(info.shape), list(info.tile), info.layout]).fetchall()


def create_tensor_table(
    con: duckdb.DuckDBPyConnection, info: TensorInfo, select_sql: str, replace: bool = False
) -> None:
    """Create table ``info.name`` from ``select_sql`` and its catalog row, atomically. Tiles
    are stored uncompressed: a checkpoint would otherwise compress them (ZSTD), and reading one
    tile would decompress much of its segment."""
    check_name(info.name)
    with transaction(con):
        kind = object_kind(con, info.name)
        if kind:
            if not replace:
                raise TensorExistsError(f"a {kind.lower()} named '{info.name}' exists already (names are "
                                        f"case-insensitive, as in SQL); pass replace=True to overwrite it")
            con.execute(f'DROP {kind} "{info.name}"').fetchall()
        con.execute(f"DELETE FROM {CATALOG_TABLE} WHERE lower(name) = lower(?)", [info.name]).fetchall()
        keys = "".join(f"k{d} INTEGER, " for d in range(len(info.shape)))
        con.execute(f'CREATE TABLE "{info.name}" ({keys}tile BLOB USING COMPRESSION uncompressed)').fetchall()
        con.execute(f'INSERT INTO "{info.name}" {select_sql}').fetchall()
        insert_row(con, info)


def create_view(con: duckdb.DuckDBPyConnection, info: TensorInfo, select_sql: str, replace: bool = False) -> None:
    """Create view ``info.name`` over ``select_sql`` (a relation) and its catalog row, atomically."""
    with transaction(con):
        kind = object_kind(con, info.name)
        if kind and not replace:
            raise TensorExistsError(f"a table or view named '{info.name}' exists already; pass replace=True")
        if kind:
            con.execute(f'DROP {kind} "{info.name}"').fetchall()
        con.execute(f"DELETE FROM {CATALOG_TABLE} WHERE lower(name) = lower(?)", [info.name]).fetchall()
        con.execute(f'CREATE VIEW "{info.name}" AS {select_sql}').fetchall()
        insert_row(con, info)


def drop_tensor(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Drop tensor ``name``'s table or view (if it is still there) and its catalog row."""
    name = _row(con, name)[0]
    with transaction(con):
        kind = con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = ? "
                           "AND table_schema = current_schema()", [name]).fetchall()
        con.execute(f'DROP {"VIEW" if kind and kind[0][0] == "VIEW" else "TABLE"} IF EXISTS "{name}"').fetchall()
        con.execute(f"DELETE FROM {CATALOG_TABLE} WHERE name = ?", [name]).fetchall()
