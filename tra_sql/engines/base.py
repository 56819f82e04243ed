"""``Engine``: what the session, the planner, the front end and training need from the
database that stores tensor relations and runs their programs (DuckDB, Spark)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from math import prod
from typing import TYPE_CHECKING, Any, ClassVar

from tra_sql import absent

if TYPE_CHECKING:
    from collections.abc import Iterable

    import pyarrow as pa
    from sqlglot import exp

    from tra_sql.catalog import Finding, TensorInfo
    from tra_sql.compile.program import Program
    from tra_sql.decompose.cost import Constants
    from tra_sql.decompose.plan import Plan
    from tra_sql.errors import TraError
    from tra_sql.graph import Node

class Engine(ABC):
    """One database holding tensor relations (a catalog of ``TensorInfo`` rows and their tile
    tables) that runs compiled programs. ``name``: ``duckdb`` or ``spark``; ``dialect``: the
    sqlglot dialect its SQL is rendered in; ``staged``: whether it runs staged plans (one
    table per step, ops in bands; ``tra_sql.engines.staged``); ``Error``: the base class of
    the errors it raises untranslated (``translate`` makes them ``TraError``s), ``OutOfMemory``
    the one among them a statement raises when it runs out of memory; ``in_process``:
    whether programs run in this process's memory (then ``tra_sql.budget`` refuses steps it
    cannot hold); ``spills``: whether a statement streams its scans and spills its joins and
    aggregations to disk, so that a plan needs only each worker's piece of an op in memory
    (``cost.Budget``)."""

    name: ClassVar[str]
    dialect: ClassVar[str]
    staged: ClassVar[bool] = False
    spills: ClassVar[bool] = False
    in_process: ClassVar[bool] = False
    Error: ClassVar[type[BaseException]] = Exception
    OutOfMemory: ClassVar[type[BaseException]] = MemoryError

    def __init__(self) -> None:
        self._kernels: set = set()

    def ensure_kernels(self, kernels: Iterable) -> None:
        """Register the tile kernels ``kernels`` (those a program calls) once each; a kernel
        is recorded as it registers, so a failure part-way leaves the others known."""
        for kernel in sorted(set(kernels) - self._kernels, key=str):
            self.register_kernels([kernel])
            self._kernels.add(kernel)

    @abstractmethod
    def register_kernels(self, kernels: list) -> None:
        """Register ``kernels`` (none registered before) with the engine."""

    # -- programs and statements --------------------------------------------------------
    @abstractmethod
    def run(self, program: Program) -> pa.Table:
        """Execute ``program``; its tile relation as an Arrow table."""

    @abstractmethod
    def store(self, info: TensorInfo, program: Program, replace: bool = False) -> None:
        """Store ``program``'s tile relation as tensor ``info.name``, all or nothing."""

    @abstractmethod
    def store_query(self, info: TensorInfo, query: exp.Select, replace: bool = False) -> None:
        """Store the tile relation ``query`` (a sqlglot SELECT of ``k0..``, ``tile``, rendered
        in ``dialect``) as tensor ``info.name``, all or nothing."""

    @abstractmethod
    def import_tiles(self, info: TensorInfo, tiles: pa.Table, replace: bool = False) -> None:
        """Store the Arrow tile table ``tiles`` (checked) as tensor ``info.name``, all or nothing."""

    @abstractmethod
    def create_relation(self, info: TensorInfo, select: exp.Select, replace: bool = False) -> None:
        """Make the relation ``select`` over a plain table tensor ``info.name`` (``tra_sql.relations``)."""

    @abstractmethod
    def query(self, sql: str, params=None) -> Any:
        """Run a plain statement; the engine's result (a DuckDB relation, a Spark DataFrame).
        Errors are the engine's own (``Error``)."""

    @abstractmethod
    def rows(self, sql: str, params=None) -> list[tuple]:
        """Run a plain statement; its rows. Errors are the engine's own (``Error``)."""

    @abstractmethod
    def arrow(self, sql: str) -> pa.Table:
        """Run a plain query; its rows as an Arrow table. Errors are the engine's own (``Error``)."""

    @abstractmethod
    def execute(self, sql: str, params=None) -> Any:
        """Run a plain statement; a cursor over its result (``fetchall()``, ``df()``, ...)."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[None]:
        """A context manager: the statements run inside it commit together, or not at all."""

    @abstractmethod
    def run_staged(self, root: Node, plan: Plan) -> AbstractContextManager[str]:
        """A context manager: the table holding ``root`` computed step by step under the
        staged ``plan``, while it runs (then dropped, unless it is a stored tensor's)."""

    @abstractmethod
    def translate(self, err: BaseException, what: str) -> TraError:
        """A ``TraError`` for an engine error raised while doing ``what``; errors raised in tile
        kernels keep their class."""

    # -- the catalog --------------------------------------------------------------------
    @abstractmethod
    def lookup(self, name: str) -> TensorInfo:
        """The catalog row of tensor ``name`` (checked against its table)."""

    @abstractmethod
    def catalog_row(self, name: str) -> TensorInfo | None:
        """The catalog row of tensor ``name`` as stored (its table not read), if it has one."""

    @abstractmethod
    def tensors(self) -> list[str]:
        """Names of all stored tensors."""

    @abstractmethod
    def drop(self, name: str) -> None:
        """Drop tensor ``name``'s table and its catalog row."""

    @abstractmethod
    def check(self, repair: bool = False) -> list[Finding]:
        """Every disagreement between the catalog and the tensor tables (``Session.check``)."""

    @abstractmethod
    def tile_count(self, table: str) -> int:
        """Rows (tiles) of table ``table``."""

    def has_every_tile(self, source: Node) -> bool:
        """Whether stored relation ``source`` (a ``graph.Source``) has a row at every key of
        its grid (counted now)."""
        return self.tile_count(source.table) >= prod(source.grid)

    def completeness(self) -> absent.Completeness:
        """Which nodes have a tile at every key, stored relations counted now."""
        return absent.Completeness(self.has_every_tile)

    # -- memory and the planner ---------------------------------------------------------
    @abstractmethod
    def memory_limit(self) -> int | None:
        """The engine's own memory limit in bytes, if it has one (``tra_sql.budget``)."""

    @abstractmethod
    def budget(self, workers: int | None = None, memory=None) -> tuple[int, float]:
        """(workers, bytes per worker) for the planner: the engine's unless given."""

    @abstractmethod
    def constants(self) -> Constants | None:
        """The planner's cost constants measured by the last ``calibrate``, if any."""

    @abstractmethod
    def calibrate(self, session) -> Constants:
        """Measure the planner's cost constants on this engine with probe programs built
        through ``session`` (the facade over this engine), keep them and return them."""

    def fuse_bytes(self) -> float:
        """Up to how many bytes of intermediates a training step runs as one query (0: never)."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Release the engine (connection, Spark application, temporary warehouse)."""
