"""``connect()`` and ``Session``: a DuckDB connection with the tra_sql catalog and UDFs."""

from __future__ import annotations

from math import prod

import duckdb
import numpy as np
import pyarrow as pa
from sqlglot import exp

from tra_sql import absent, allocator, budget, catalog, errors, graph, structure
from tra_sql.catalog import TensorInfo
from tra_sql.compile.program import Program
from tra_sql.duckdb_errors import translate
from tra_sql.errors import ExecutionError, TraError, UnknownTensorError
from tra_sql.tensor import Tensor
from tra_sql.udfs import protocol, register_kernels


def connect(database: str = ":memory:", *, threads: int | None = None,
            memory_limit: str | None = None, read_only: bool = False, engine: str = "duckdb",
            **engine_options) -> Session:
    """Open (or create) a tra_sql database; ``:memory:`` by default.

    ``engine="spark"`` runs on Spark SQL instead: ``database`` is then the warehouse
    directory, and ``engine_options`` go to ``tra_sql.backends.spark.connect`` (``master=``,
    ``executor_memory=``, ``config=``, ...). On glibc the process's ``malloc`` keeps freed
    memory for the next tiles (``tra_sql.allocator``; ``TRA_SQL_MALLOC=system`` to opt out)."""
    if engine != "duckdb":
        if engine != "spark":
            raise TraError(f"engine={engine!r}: use 'duckdb' or 'spark'")
        from tra_sql.backends import spark
        return spark.connect(database, **engine_options)
    if engine_options:
        raise TraError(f"options {sorted(engine_options)} are for engine='spark'")
    config = {}
    if threads is not None:
        config["threads"] = threads
    if memory_limit is not None:
        config["memory_limit"] = memory_limit
    allocator.retain_freed_memory()
    if not read_only:
        catalog.remove_unwritten_database(database)
    try:
        con = duckdb.connect(database, read_only=read_only, config=config)
    except duckdb.Error as err:
        raise ExecutionError(f"cannot open database {database!r}: {err}") from None
    return Session(con, read_only=read_only)


class Session:
    """A DuckDB connection holding tensor relations. Use ``connect()`` to make one."""

    def __init__(self, con: duckdb.DuckDBPyConnection, read_only: bool = False):
        self.con = con
        self._udfs: set[str] = set()
        if not read_only:
            catalog.ensure_catalog(con)
        # relation views call them
        self.ensure_udfs((protocol.PACK, protocol.PACK_F32, protocol.PACK_TILE, protocol.PACK_CSR))

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tensors in and out -------------------------------------------------------------
    def from_numpy(self, name: str, array, tile=None, *, replace: bool = False) -> Tensor:
        """Store ``array`` as tensor relation ``name`` cut into tiles of shape ``tile``."""
        catalog.check_name(name)
        array = np.asarray(array)
        dtype = catalog.check_dtype(array.dtype)
        tile = catalog.check_tile(array.shape, tile, name)
        return self._import(TensorInfo(name, dtype, array.shape, tile), catalog.tile_table(array, tile), replace)

    def from_arrow(self, name: str, tiles: pa.Table, shape, tile, dtype, *, replace: bool = False) -> Tensor:
        """Store an Arrow tile relation (columns ``k0..``, ``tile``) as tensor ``name``;
        every tile is checked against ``shape``, ``tile`` and ``dtype`` first."""
        return self._import(catalog.check_tile_table(name, tiles, shape, tile, dtype), tiles, replace)

    def _import(self, info: TensorInfo, tiles: pa.Table, replace: bool) -> Tensor:
        """Store the Arrow tile table ``tiles`` as tensor ``info.name``, all or nothing."""
        self.con.register("_tra_import", tiles)
        try:
            keys = ", ".join(f"k{d}::INTEGER AS k{d}" for d in range(len(info.shape)))
            select = f"SELECT {keys}{', ' if keys else ''}tile::BLOB AS tile FROM _tra_import"
            catalog.create_tensor_table(self.con, info, select, replace)
        except duckdb.Error as err:
            raise translate(err, f"storing '{info.name}'") from None
        finally:
            self.con.unregister("_tra_import")
        return self.tensor(info.name)

    def store_query(self, info: TensorInfo, query: exp.Select, replace: bool = False) -> Tensor:
        """Store the tile relation ``query`` (columns ``k0..``, ``tile``; a sqlglot SELECT, any
        engine renders it) as tensor ``info.name``, all or nothing."""
        try:
            catalog.create_tensor_table(self.con, info, query.sql(dialect="duckdb"), replace)
        except duckdb.Error as err:
            raise translate(err, f"storing '{info.name}'") from None
        return self.tensor(info.name)

    def tensor(self, name: str) -> Tensor:
        """The stored tensor relation ``name``."""
        info = catalog.lookup(self.con, name)
        return Tensor(self, graph.Source(info.shape, info.dtype, info.tile, info.name, info.layout))

    def tensors(self) -> list[str]:
        """Names of all stored tensors."""
        return catalog.list_tensors(self.con)

    def drop(self, name: str) -> None:
        """Drop tensor relation ``name`` and its catalog row."""
        catalog.drop_tensor(self.con, name)

    def check(self, repair: bool = False) -> list[catalog.Finding]:
        """Every disagreement between the catalog and the tensor tables (a full scan of every
        tile), as ``Finding(tensor, problem, detail, repaired)``; ``repair`` deletes the
        catalog rows whose table is gone (tables without a row are only reported)."""
        try:
            return catalog.check(self.con, repair)
        except duckdb.Error as err:
            raise translate(err, "checking the catalog") from None

    def completeness(self) -> absent.Completeness:
        """Which nodes have a tile at every key, stored relations counted now."""
        return absent.Completeness(lambda source: self.tile_count(source.table) >= prod(source.grid))

    def tile_count(self, table: str) -> int:
        """Rows (tiles) of table ``table``."""
        return self.con.execute(f'SELECT count(*) FROM "{table}"').fetchall()[0][0]

    # -- building programs --------------------------------------------------------------
    def _node(self, operand) -> tuple[graph.Node, str]:
        if isinstance(operand, Tensor):
            if operand.session is not self:
                raise TraError("operand belongs to another session")
            return operand.node, operand.name or operand.node.label
        if isinstance(operand, str):
            tensor = self.tensor(operand)
            return tensor.node, operand
        raise UnknownTensorError(f"operand {operand!r} is neither a Tensor nor a tensor name")

    def einsum(self, spec: str, *operands, join: str | None = None, agg: str = "sum") -> Tensor:
        """Lazy extended einsum: ``out[o] = agg over the rest of join(x0, ..., xn)``.

        ``operands`` are Tensors or names of stored tensors. ``join`` is a SQL scalar
        expression over ``x0..xn`` (default: their product); ``agg`` is sum, max, min or prod.
        An absent tile of a dense operand is a tile of zeros under every join and ``agg``
        (``tra_sql.absent``).
        """
        nodes, names = zip(*(self._node(op) for op in operands)) if operands else ((), ())
        return Tensor(self, self.einsum_node(spec, list(nodes), list(names), join, agg))

    def einsum_node(self, spec: str, nodes: list[graph.Node], names: list[str], join: str | None = None,
                    agg: str = "sum", completeness: absent.Completeness | None = None) -> graph.Node:
        """``einsum``'s node: checked, its operands completed with zeros where their absent tiles
        matter (``completeness``: which nodes have every tile; by default counted now)."""
        if join is not None:
            from tra_sql.udfs.expr import join_code
            join_code(join, len(nodes))
        node = graph.einsum(spec, nodes, names, join, agg)
        return absent.complete_operands(node, completeness or self.completeness())

    def retile(self, tensor, tile) -> Tensor:
        """``tensor`` cut into tiles of shape ``tile`` (in SQL)."""
        node, name = self._node(tensor)
        return Tensor(self, graph.retile(node, catalog.check_tile(node.shape, tile, name)))

    def concat(self, tensors, axis: int = 0) -> Tensor:
        """``tensors`` joined along ``axis`` (tiled like the first)."""
        nodes, names = zip(*(self._node(t) for t in tensors)) if tensors else ((), ())
        if not nodes:
            raise errors.ShapeError("concat needs at least one tensor")
        rank = len(nodes[0].shape)
        axis = structure.check_axis(axis, rank, names[0])
        for node, name in zip(nodes, names):
            if len(node.shape) != rank or any(n != m for d, (n, m) in enumerate(zip(node.shape, nodes[0].shape))
                                              if d != axis):
                raise errors.ShapeError(f"concat along axis {axis}: '{name}' has shape {node.shape}, "
                                        f"'{names[0]}' has {nodes[0].shape}")
        return Tensor(self, graph.concat(list(nodes), axis))

    def add(self, *tensors) -> Tensor:
        """Element-wise sum of same-shaped tensors as a keyed sum (absent tiles are zeros)."""
        nodes, names = zip(*(self._node(t) for t in tensors)) if tensors else ((), ())
        if not nodes:
            raise errors.ShapeError("add needs at least one tensor")
        for node, name in zip(nodes, names):
            if node.shape != nodes[0].shape:
                raise errors.ShapeError(f"add: '{name}' has shape {node.shape}, '{names[0]}' has {nodes[0].shape}")
        return Tensor(self, graph.add(list(nodes)))

    def full(self, shape, value: float, dtype="float64", tile=None) -> Tensor:
        """A constant tensor (lazy: its tiles are generated in SQL); one this session cannot
        hold raises ``MemoryBudgetError`` (``tra_sql.budget``)."""
        shape = tuple(int(n) for n in shape)
        dtype = catalog.check_dtype(dtype)
        tile = catalog.check_tile(shape, tile, "full")
        budget.check_generated(self, f"full({shape})", shape, tile, dtype)
        return Tensor(self, graph.Fill(shape, dtype, tile, float(value) if dtype.kind == "f" else int(value)))

    def zeros(self, shape, dtype="float64", tile=None) -> Tensor:
        return self.full(shape, 0, dtype, tile)

    def ones(self, shape, dtype="float64", tile=None) -> Tensor:
        return self.full(shape, 1, dtype, tile)

    # -- running ------------------------------------------------------------------------
    def ensure_udfs(self, names) -> None:
        """Register the named tile UDFs on this connection, once each."""
        missing = set(names) - self._udfs
        register_kernels(self.con, sorted(missing))
        self._udfs |= missing

    def _prepare(self, program: Program) -> None:
        self.ensure_udfs(program.kernels)

    def run(self, program: Program) -> pa.Table:
        """Execute a program; its tile relation as an Arrow table."""
        budget.check_program(self, program.root)
        self._prepare(program)
        try:
            return self.con.sql(program.sql(pretty=False)).to_arrow_table()
        except duckdb.Error as err:
            raise translate(err, f"computing {program.root.label}") from None

    def fetch_numpy(self, tensor: Tensor) -> np.ndarray:
        info = TensorInfo(tensor.name or tensor.node.label, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
        return catalog.assemble(info, self.run(tensor.program()))

    def store(self, tensor: Tensor, name: str, replace: bool = False) -> Tensor:
        program = tensor.program()
        budget.check_program(self, program.root)
        self._prepare(program)
        info = TensorInfo(name, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
        try:
            catalog.create_tensor_table(self.con, info, program.sql(pretty=False), replace)
        except duckdb.Error as err:
            raise translate(err, f"storing '{name}'") from None
        return self.tensor(name)

    # -- planning (see tra_sql.decompose) -----------------------------------------------
    def plan(self, tensor: Tensor, workers: int | None = None, memory=None):
        """EinDecomp: the tiling of every index of ``tensor``'s program for ``workers`` workers
        (default: DuckDB's threads) with ``memory`` each (``"2GB"``; default: memory_limit /
        workers). Run it with ``tensor.numpy(plan=...)`` or ``store(..., plan=...)``."""
        from tra_sql.decompose import execute
        return execute.plan(self, tensor, workers, memory)

    def calibrate(self):
        """Measure the planner's cost constants on this engine and machine (a few seconds);
        they are kept in table ``tra_calibration`` and used by later plans."""
        from tra_sql.decompose import calibrate
        return calibrate.calibrate(self)

    # -- SQL with tensor syntax (see tra_sql.frontend) ----------------------------------
    def sql(self, text: str, params=None):
        """Run ``text``: DuckDB SQL plus ``einsum(...)`` and the other tensor table functions,
        ``CREATE TENSOR`` and ``DROP TENSOR`` (see ``tra_sql.frontend``). Statements run in
        order; the last one's result is returned as DuckDB's ``con.sql()`` gives it (a
        relation), or ``None`` for CREATE/DROP TENSOR. ``params`` bind to the last statement."""
        from tra_sql import frontend
        return frontend.run(self, text, params)

    def execute(self, text: str, params=None):
        """Like ``sql()``, but the last statement runs through ``con.execute()``: the
        connection is returned, ready for ``fetchall()``, ``df()``, ``arrow()``."""
        from tra_sql import frontend
        return frontend.run(self, text, params, cursor=True)

    def explain_sql(self, text: str) -> str:
        """The SQL that ``sql(text)`` hands DuckDB, statement by statement."""
        from tra_sql import frontend
        return frontend.explain(self, text)

    # -- autodiff, relations and training (see tra_sql.autodiff, .relations, .train) -----
    def grad(self, loss, wrt, seed=None):
        """Gradients of the scalar ``loss`` with respect to ``wrt`` (a tensor or a list), as
        lazy tensors: relational programs like any other (``.sql()`` shows them)."""
        from tra_sql import autodiff
        return autodiff.grad(self, loss, wrt, seed)

    def relation(self, table: str, keys, value: str | None = None, shape=None, **options) -> Tensor:
        """View table ``table`` as a sparse tensor relation (a VIEW, no copy): one dimension per
        key column, values from column ``value`` (1.0 per row if None)."""
        from tra_sql import relations
        return relations.relation(self, table, keys, value, shape, **options)

    def parameter(self, name: str, shape=None, init="glorot_uniform", **options) -> Tensor:
        """A trainable tensor: the stored ``name`` if it exists, else initialized by ``init``."""
        from tra_sql import train
        return train.parameter(self, name, shape, init, **options)

    def train(self, loss, params, optimizer, epochs: int, **options):
        """Minimize ``loss`` over ``params`` with ``optimizer``, resumably (see ``tra_sql.train``)."""
        from tra_sql import train
        return train.train(self, loss, params, optimizer, epochs, **options)
