"""``DuckDBEngine``: tensor relations in an embedded DuckDB database (the default engine)."""

from __future__ import annotations

import re
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import duckdb
import pyarrow as pa
from sqlglot import exp

from tra_sql import allocator, errors
from tra_sql.catalog import Finding, TensorInfo
from tra_sql.decompose import calibrate
from tra_sql.decompose.cost import Constants, parse_bytes
from tra_sql.engines import duckdb_catalog, staged
from tra_sql.engines.base import Engine
from tra_sql.errors import ExecutionError, SpecError, TraError
from tra_sql.udfs import protocol, register_kernels
from tra_sql.udfs.native.capi import ERROR_PREFIX
from tra_sql.udfs.native.kernels import NativeKernels, requested

if TYPE_CHECKING:
    from tra_sql.compile.program import Program
    from tra_sql.decompose.plan import Plan
    from tra_sql.graph import Node

# a kernel's error: an Arrow UDF's Python exception, or a native kernel's message
UDF_ERROR = re.compile(r"(?:Python exception occurred while executing the UDF:|" + re.escape(ERROR_PREFIX.strip())
                       + r") (\w+): (.*)", re.S)
CALIBRATION = "tra_calibration"  # the planner's constants measured on this database
#: kernels whose split sums the dialect may write as a fused contraction aggregate: those come
#: with them (their Arrow macros call ``tra_contract_2``)
FUSED_FROM = frozenset({protocol.CONTRACT, protocol.Kernel("einsum_agg", 2)})


def no_tile_copies(con: duckdb.DuckDBPyConnection) -> None:
    """Switch off DuckDB's caching operators on ``con``: a hash join (or filter) whose output
    chunk has under 64 rows appends it to a cache chunk, copying every BLOB in it, and tile
    relations have a few fat rows, so each tile passing a join was copied once more (64 MB of
    tiles through a join: 12 ms with, 1 ms without). Plain SQL on the connection runs as
    before but for that batching of small chunks (``SET enable_caching_operators = true``
    brings it back). A DuckDB without the setting is left as it is."""
    try:
        con.execute("SET enable_caching_operators = false")
    except duckdb.Error:
        pass


def translate(err: duckdb.Error, what: str) -> TraError:
    """A ``TraError`` for a DuckDB error; errors raised in tile kernels keep their class."""
    match = UDF_ERROR.search(str(err))
    if match and isinstance(getattr(errors, match.group(1), None), type):
        cls = getattr(errors, match.group(1))
        if issubclass(cls, TraError):
            return cls(match.group(2).strip())
    return ExecutionError(f"{what} failed: {err}")


class DuckDBEngine(Engine):
    """A DuckDB connection holding the catalog, the tile tables and the registered kernels;
    ``con`` is the connection (for DuckDB-only code: the staged executor, tests). ``kernels``
    says which tile kernels run: ``native`` (the kinds with a native implementation through
    DuckDB's C API, the others as Arrow UDFs) or ``arrow`` (all as Arrow UDFs: asked for with
    ``TRA_SQL_KERNELS=arrow``, or the extension unbuilt, or a connection opened without
    ``allow_unsigned_extensions``); see docs/kernels.md."""

    name: ClassVar[str] = "duckdb"
    dialect: ClassVar[str] = "duckdb"
    staged: ClassVar[bool] = True
    in_process: ClassVar[bool] = True
    Error: ClassVar[type[BaseException]] = duckdb.Error
    OutOfMemory: ClassVar[type[BaseException]] = duckdb.OutOfMemoryException

    def __init__(self, con: duckdb.DuckDBPyConnection, read_only: bool = False):
        super().__init__()
        self.con = con
        no_tile_copies(con)
        self.native = NativeKernels.attach(con)
        self.kernels = "native" if self.native else "arrow"
        if self.native and self.native.keep_heap:  # DuckDB's own malloc_trim calls would undo the allocator's tuning
            allocator.keep_duckdb_heap(self.native.keep_heap)
        if not read_only:
            duckdb_catalog.ensure_catalog(con)
        self.ensure_kernels(protocol.PACKING)  # relation views call them
        # the dialect writes split sums as whole-tile reductions (macros over it on Arrow)
        self.ensure_kernels((*protocol.REDUCTIONS, protocol.Kernel("reduce")))

    @classmethod
    def open(cls, database: str = ":memory:", *, threads: int | None = None, memory_limit: str | None = None,
             read_only: bool = False) -> DuckDBEngine:
        """Open (or create) database ``database``. On glibc the process's ``malloc`` keeps freed
        memory for the next tiles (``tra_sql.allocator``)."""
        config = {"allow_unsigned_extensions": "true"} if requested() else {}  # tra_sql's own extension
        if threads is not None:
            config["threads"] = threads
        if memory_limit is not None:
            config["memory_limit"] = memory_limit
        allocator.retain_freed_memory()
        if not read_only:
            duckdb_catalog.remove_unwritten_database(database)
        try:
            con = duckdb.connect(database, read_only=read_only, config=config)
        except duckdb.Error as err:
            raise ExecutionError(f"cannot open database {database!r}: {err}") from None
        return cls(con, read_only=read_only)

    def __repr__(self) -> str:
        try:
            path = self.con.execute("SELECT path FROM duckdb_databases() "
                                    "WHERE database_name = current_database()").fetchone()[0] or ":memory:"
        except duckdb.Error:  # a connection that cannot answer now (closed, an aborted transaction)
            path = "(unknown)"
        return f"<tra_sql DuckDB database {path}>"

    def close(self) -> None:
        if self.native:
            self.native.close()
        self.con.close()

    def ensure_kernels(self, kernels) -> None:
        """``Engine.ensure_kernels``, with the fused contraction aggregates (and the product
        their Arrow macros call) for a program whose split sums of BLAS products the dialect
        may fuse (``FUSED_FROM``), and ``tra_loop_<n>`` and ``tra_loop_chain_<n>`` with
        ``tra_einsum_<n>``, ``tra_loop_chain_<n>`` with ``tra_chain_<n>``, the placement aggregates
        with ``tra_place`` (``protocol.NATIVE_FORMS``: the dialect writes the steps native kernels
        compute so, ``Dialect.call``; the aggregates' Arrow macros call ``tra_place``)."""
        kernels = set(kernels)
        if kernels & FUSED_FROM:
            kernels |= {*protocol.CONTRACTIONS, protocol.CONTRACT}
        if kernels & set(protocol.PLACEMENTS):  # their Arrow macros call tra_place
            kernels.add(protocol.PLACE)
        kernels |= {protocol.Kernel(kind, k.arity) for k in kernels for kind in protocol.NATIVE_FORMS.get(k.kind, ())}
        super().ensure_kernels(kernels)

    def register_kernels(self, kernels: list) -> None:
        native = [k for k in kernels if self.native and self.native.implements(k)]
        for kernel in native:
            self.native.register(kernel)
        register_kernels(self.con, [k for k in kernels if k not in native])

    def translate(self, err: BaseException, what: str) -> TraError:
        return translate(err, what)

    # -- programs and statements --------------------------------------------------------
    def run(self, program: Program) -> pa.Table:
        self.ensure_kernels(program.kernels)
        try:
            return self.con.sql(program.sql(pretty=False)).to_arrow_table()
        except duckdb.Error as err:
            raise translate(err, f"computing {program.root.label}") from None

    def store(self, info: TensorInfo, program: Program, replace: bool = False) -> None:
        self.ensure_kernels(program.kernels)
        self._create(info, program.sql(pretty=False), replace)

    def store_query(self, info: TensorInfo, query: exp.Select, replace: bool = False) -> None:
        self._create(info, query.sql(dialect=self.dialect), replace)

    def import_tiles(self, info: TensorInfo, tiles: pa.Table, replace: bool = False) -> None:
        with self.registered("_tra_import", tiles):
            keys = ", ".join(f"k{d}::INTEGER AS k{d}" for d in range(len(info.shape)))
            self._create(info, f"SELECT {keys}{', ' if keys else ''}tile::BLOB AS tile FROM _tra_import", replace)

    def _create(self, info: TensorInfo, select_sql: str, replace: bool) -> None:
        try:
            self.create_table(info, select_sql, replace)
        except duckdb.Error as err:
            raise translate(err, f"storing '{info.name}'") from None

    def create_table(self, info: TensorInfo, select_sql: str, replace: bool = False) -> None:
        """Store the tile relation of DuckDB query ``select_sql`` as tensor ``info.name``, all
        or nothing (DuckDB's errors untranslated)."""
        duckdb_catalog.create_tensor_table(self.con, info, select_sql, replace)

    def create_relation(self, info: TensorInfo, select: exp.Select, replace: bool = False) -> None:
        duckdb_catalog.create_view(self.con, info, select.sql(dialect=self.dialect), replace)

    @contextmanager
    def registered(self, name: str, table: pa.Table) -> Iterator[None]:
        """Arrow table ``table`` readable as view ``name`` inside the ``with`` block."""
        self.con.register(name, table)
        try:
            yield
        finally:
            self.con.unregister(name)

    def query(self, sql: str, params=None) -> duckdb.DuckDBPyRelation:
        return self.con.sql(sql, params=params)

    def arrow(self, sql: str) -> pa.Table:
        return self.con.sql(sql).to_arrow_table()

    def execute(self, sql: str, params=None) -> duckdb.DuckDBPyConnection:
        return self.con.execute(sql, params)

    def rows(self, sql: str, params=None) -> list[tuple]:
        return self.con.execute(sql, params).fetchall()

    def transaction(self):
        return duckdb_catalog.transaction(self.con)

    def run_staged(self, root: Node, plan: Plan):
        return staged.computed(staged.DuckDBStages(self), root, plan)

    def setting(self, name: str):
        """The current value of DuckDB setting ``name``."""
        return self.con.execute(f"SELECT current_setting('{name}')").fetchall()[0][0]

    @contextmanager
    def settings(self, **values) -> Iterator[None]:
        """DuckDB settings changed inside the ``with`` block only (one the database refuses,
        such as the progress bar without ipywidgets in Jupyter, is left as it is)."""
        before = {name: self.setting(name) for name in values}
        changed = []
        try:
            for name, value in values.items():
                if value != before[name]:
                    try:
                        self.con.execute(f"SET {name} = {_literal(value)}").fetchall()
                    except duckdb.Error:
                        continue
                    changed.append(name)
            yield
        finally:
            for name in changed:
                self.con.execute(f"SET {name} = {_literal(before[name])}").fetchall()

    # -- the catalog --------------------------------------------------------------------
    def lookup(self, name: str) -> TensorInfo:
        return duckdb_catalog.lookup(self.con, name)

    def catalog_row(self, name: str) -> TensorInfo | None:
        return duckdb_catalog.catalog_row(self.con, name)

    def tensors(self) -> list[str]:
        return duckdb_catalog.list_tensors(self.con)

    def drop(self, name: str) -> None:
        duckdb_catalog.drop_tensor(self.con, name)

    def check(self, repair: bool = False) -> list[Finding]:
        try:
            return duckdb_catalog.check(self.con, repair)
        except duckdb.Error as err:
            raise translate(err, "checking the catalog") from None

    def tile_count(self, table: str) -> int:
        return self.con.execute(f'SELECT count(*) FROM "{table}"').fetchall()[0][0]

    def object_kind(self, name: str) -> str | None:
        """``"VIEW"``, ``"TABLE"`` or None for an object ``name`` in the current schema."""
        return duckdb_catalog.object_kind(self.con, name)

    def views(self) -> frozenset[str]:
        """Lower-case names of the views (relations read their tables when read)."""
        rows = self.con.execute("SELECT lower(view_name) FROM duckdb_views() WHERE NOT internal").fetchall()
        return frozenset(v[0] for v in rows)

    # -- memory and the planner ---------------------------------------------------------
    def memory_limit(self) -> int | None:
        try:
            return int(parse_bytes(str(self.setting("memory_limit")).replace(" ", "")))
        except ValueError:
            return None  # unlimited

    def budget(self, workers: int | None = None, memory=None) -> tuple[int, float]:
        """(workers, bytes per worker): DuckDB's threads and memory_limit unless given."""
        rows = self.con.execute("SELECT current_setting('threads'), current_setting('memory_limit')").fetchall()
        threads, limit = rows[0]
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise SpecError(f"workers={workers!r}: give a positive number of workers")
        workers = int(workers or threads)
        per_worker = parse_bytes(memory) if memory is not None else parse_bytes(str(limit).replace(" ", "")) / workers
        return workers, per_worker

    def fuse_bytes(self) -> float:
        """Half of DuckDB's memory_limit: materialized CTEs stay in memory; staging tables spill."""
        return parse_bytes(str(self.setting("memory_limit")).replace(" ", "")) / 2

    def constants(self) -> Constants:
        """The constants ``calibrate`` kept in this database, else the defaults; ``fused`` as
        this session's kernels have it (native: split BLAS sums in the fused aggregate's state)."""
        found = self.con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND database_name = "
                                 "current_database()", [CALIBRATION]).fetchall()[0][0]
        rows = self.con.execute(f"SELECT name, value FROM {CALIBRATION}").fetchall() if found else []
        return replace(Constants.from_dict(dict(rows)) if rows else Constants(), fused=int(self.kernels == "native"))

    def save_constants(self, consts: Constants) -> None:
        """Keep ``consts`` in table ``tra_calibration``."""
        self.con.execute(f"CREATE OR REPLACE TABLE {CALIBRATION} (name VARCHAR, value DOUBLE, "
                         f"measured_at TIMESTAMP)").fetchall()
        self.con.executemany(f"INSERT INTO {CALIBRATION} VALUES (?, ?, current_timestamp)",
                             [[k, float(v)] for k, v in consts.as_dict().items()])

    def calibrate(self, session) -> Constants:
        """The probes of ``tra_sql.decompose.calibrate`` on a fresh database file (tables in the
        buffer manager, as out-of-core runs have them) with this one's threads."""
        threads = int(self.setting("threads"))
        with tempfile.TemporaryDirectory() as tmp, \
                type(session)(DuckDBEngine.open(f"{tmp}/calibrate.duckdb", threads=threads)) as probe:
            consts = replace(calibrate.measure(probe, threads), fused=int(self.kernels == "native"))
        try:
            self.save_constants(consts)
        except duckdb.Error:
            pass  # a read-only database: use the constants without keeping them
        return consts

    def peak_memory(self) -> PeakMemory:
        """A context manager measuring the most memory DuckDB holds while it is open."""
        return PeakMemory(self.con)


def _literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "'" + str(value).replace("'", "''") + "'"


class PeakMemory:
    """Polls ``duckdb_memory()`` from a second cursor while a query runs: ``base`` and ``peak``."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.cursor = con.cursor()
        self.base = self._now()
        self.peak = self.base
        self._stop = False
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _now(self) -> int:
        return int(self.cursor.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchall()[0][0])

    def _poll(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, self._now())
            time.sleep(0.002)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()
        self.cursor.close()
