"""``connect()`` and ``Session``: the user's facade over an engine (``tra_sql.engines``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from sqlglot import exp

from tra_sql import absent, autodiff, budget, catalog, errors, graph, structure
from tra_sql.catalog import TensorInfo
from tra_sql.compile.program import Program
from tra_sql.decompose import choose
from tra_sql.decompose.cost import Constants
from tra_sql.decompose.plan import Plan
from tra_sql.engines.base import Engine
from tra_sql.engines.duckdb import DuckDBEngine
from tra_sql.errors import TraError, UnknownTensorError
from tra_sql.tensor import Tensor


def connect(database: str = ":memory:", *, threads: int | None = None,
            memory_limit: str | None = None, read_only: bool = False, engine: str = "duckdb",
            **engine_options) -> Session:
    """Open (or create) a tra_sql database; ``:memory:`` by default.

    ``engine="spark"`` runs on Spark SQL instead: ``database`` is then the warehouse
    directory, and ``engine_options`` go to ``tra_sql.backends.spark.SparkEngine.open``
    (``master=``, ``executor_memory=``, ``config=``, ...). On glibc the process's ``malloc``
    keeps freed memory for the next tiles (``tra_sql.allocator``; ``TRA_SQL_MALLOC=system``
    to opt out)."""
    if engine != "duckdb":
        if engine != "spark":
            raise TraError(f"engine={engine!r}: use 'duckdb' or 'spark'")
        from tra_sql.backends.spark import SparkEngine
        return Session(SparkEngine.open(database, **engine_options))
    if engine_options:
        raise TraError(f"options {sorted(engine_options)} are for engine='spark'")
    return Session(DuckDBEngine.open(database, threads=threads, memory_limit=memory_limit, read_only=read_only))


class ClosedEngine:
    """What a closed session holds in place of its engine: every use is an error."""

    def __init__(self, description: str):
        self.description = description

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{self.description} (closed)"

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocols probed by copy, pickle, hasattr: not a use
            raise AttributeError(name)
        raise errors.SessionClosedError(f"the session on {self.description} is closed")


class Session:
    """Tensor relations in an engine (``tra_sql.engines``): building lazy programs over them,
    running and storing them. Use ``connect()`` to make one."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def close(self) -> None:
        """Release the engine; using the session or its tensors afterwards raises
        ``SessionClosedError`` (closing again does nothing)."""
        if isinstance(self.engine, ClosedEngine):
            return
        engine, self.engine = self.engine, ClosedEngine(repr(self.engine))
        engine.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<tra_sql session on {self.engine!r}>"

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
        self.engine.import_tiles(info, tiles, replace)
        return self.tensor(info.name)

    def store_query(self, info: TensorInfo, query: exp.Select, replace: bool = False) -> Tensor:
        """Store the tile relation ``query`` (columns ``k0..``, ``tile``; a sqlglot SELECT, any
        engine renders it) as tensor ``info.name``, all or nothing."""
        self.engine.store_query(info, query, replace)
        return self.tensor(info.name)

    def tensor(self, name: str) -> Tensor:
        """The stored tensor relation ``name``."""
        info = self.engine.lookup(name)
        return Tensor(self, graph.Source(info.shape, info.dtype, info.tile, info.name, info.layout))

    def tensors(self) -> list[str]:
        """Names of all stored tensors."""
        return self.engine.tensors()

    def drop(self, name: str) -> None:
        """Drop tensor relation ``name`` and its catalog row."""
        self.engine.drop(name)

    def check(self, repair: bool = False) -> list[catalog.Finding]:
        """Every disagreement between the catalog and the tensor tables (a full scan of every
        tile), as ``Finding(tensor, problem, detail, repaired)``; ``repair`` deletes the
        catalog rows whose table is gone (tables without a row are only reported)."""
        return self.engine.check(repair)

    def completeness(self) -> absent.Completeness:
        """Which nodes have a tile at every key, stored relations counted now."""
        return self.engine.completeness()

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
    def run(self, program: Program) -> pa.Table:
        """Execute a program; its tile relation as an Arrow table."""
        if self.engine.in_process:
            budget.check_program(self, program.root)
        return self.engine.run(program)

    def check_current(self, tensor: Tensor) -> None:
        """Every stored tensor ``tensor`` reads still has the shape, tiles, dtype and layout it
        was read with (``StaleTensorError``): a handle made before its tensor was replaced
        under the same name would read the new tiles as the old ones. Tables outside the
        catalog are not checked."""
        rows: dict[str, TensorInfo | None] = {}  # by table: a stale and a new handle may both be read
        for node in graph.topological(tensor.node):
            if not isinstance(node, graph.Source):
                continue
            if node.table.lower() not in rows:
                rows[node.table.lower()] = self.engine.catalog_row(node.table)
            info = rows[node.table.lower()]
            if info is None:
                continue  # an internal or plain table; a dropped tensor fails where it is read
            if (info.shape, info.tile, info.dtype, info.layout) != (node.shape, node.tile, node.dtype, node.layout):
                raise errors.StaleTensorError(
                    f"tensor '{info.name}' was replaced after this handle to it was made: it is now {info.dtype} "
                    f"{info.shape} in tiles of {info.tile} ({info.layout}), the handle's {node.dtype} {node.shape} "
                    f"in tiles of {node.tile} ({node.layout}); use db.tensor('{info.name}')")

    def fetch_arrow(self, tensor: Tensor, plan: Plan | None = None) -> pa.Table:
        """``tensor``'s tile relation, computed under ``plan`` (as written if None), in the
        tensor's tiling (a plan may compute it in another)."""
        self.check_current(tensor)
        if plan is None:
            return self.run(tensor.program())
        root = plan.apply()
        if not plan.staged:
            return self.run(Program.compile(graph.retile(root, tensor.tile)))
        with self.engine.run_staged(root, plan) as table:
            stored = graph.Source(root.shape, root.dtype, root.tile, table, root.layout)
            return self.run(Program.compile(graph.retile(stored, tensor.tile)))

    def fetch_numpy(self, tensor: Tensor, plan: Plan | None = None) -> np.ndarray:
        """``tensor``'s tiles (computed under ``plan``) assembled into an array."""
        info = TensorInfo(tensor.name or tensor.node.label, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout)
        return catalog.assemble(info, self.fetch_arrow(tensor, plan))

    def store(self, tensor: Tensor, name: str, replace: bool = False, plan: Plan | None = None) -> Tensor:
        """Store ``tensor`` (computed under ``plan``, staged if it is) as tensor ``name``."""
        self.check_current(tensor)
        if plan is not None:
            root = plan.apply()
            if plan.staged:
                info = TensorInfo(name, root.dtype, root.shape, root.tile, root.layout)
                with self.engine.run_staged(root, plan) as table:
                    self.engine.store_query(info, exp.select("*").from_(exp.to_table(table, quoted=True)), replace)
                return self.tensor(name)
            tensor = Tensor(self, root)
        program = tensor.program()
        if self.engine.in_process:
            budget.check_program(self, program.root)
        self.engine.store(TensorInfo(name, tensor.dtype, tensor.shape, tensor.tile, tensor.node.layout),
                          program, replace)
        return self.tensor(name)

    # -- planning (see tra_sql.decompose) -----------------------------------------------
    def plan(self, tensor: Tensor, workers: int | None = None, memory=None) -> Plan:
        """EinDecomp: the tiling of every index of ``tensor``'s program for ``workers`` workers
        with ``memory`` each (``"2GB"``), by default the engine's (DuckDB: its threads and
        memory_limit / workers; Spark: ``SparkEngine.budget``), with the constants of
        ``calibrate()`` if it ran. Run it with ``tensor.numpy(plan=...)`` or ``store(..., plan=...)``."""
        return choose.plan(self.engine, tensor, workers, memory)

    def calibrate(self) -> Constants:
        """Measure the planner's cost constants on this engine and machine (DuckDB: a few
        seconds, kept in table ``tra_calibration``); later plans use them."""
        return self.engine.calibrate(self)

    # -- SQL with tensor syntax (see tra_sql.frontend) ----------------------------------
    def sql(self, text: str, params=None):
        """Run ``text``: SQL plus ``einsum(...)`` and the other tensor table functions,
        ``CREATE TENSOR`` and ``DROP TENSOR`` (see ``tra_sql.frontend``). Statements run in
        order; the last one's result is returned as the engine gives it (DuckDB: a relation,
        as ``con.sql()``; Spark: a DataFrame), or ``None`` for CREATE/DROP TENSOR. ``params``
        bind to the last statement."""
        if self.engine.name == "spark":
            from tra_sql.backends import spark_frontend
            return spark_frontend.run(self, text, params)
        from tra_sql import frontend
        return frontend.run(self, text, params)

    def execute(self, text: str, params=None):
        """Like ``sql()``, but the last statement runs through DuckDB's ``con.execute()``: the
        connection is returned, ready for ``fetchall()``, ``df()``, ``arrow()``."""
        from tra_sql import frontend
        return frontend.run(self, text, params, cursor=True)

    def explain_sql(self, text: str) -> str:
        """The SQL that ``sql(text)`` hands the engine, statement by statement."""
        if self.engine.name == "spark":
            from tra_sql.backends import spark_frontend
            return spark_frontend.explain(self, text)
        from tra_sql import frontend
        return frontend.explain(self, text)

    # -- autodiff, relations and training (see tra_sql.autodiff, .relations, .train) -----
    def grad(self, loss, wrt, seed=None):
        """Gradients of the scalar ``loss`` with respect to ``wrt`` (a tensor, a name, or a list
        of them), as lazy tensors: relational programs like any other (``.sql()`` shows them)."""
        single = not isinstance(wrt, (list, tuple))
        nodes = [self._node(w)[0] for w in ([wrt] if single else wrt)]
        seed_node = self._node(seed)[0] if seed is not None else None
        result = [Tensor(self, n) for n in autodiff.gradients(self._node(loss)[0], nodes, self.gradient_context(),
                                                              seed_node)]
        return result[0] if single else result

    def detach(self, tensor) -> Tensor:
        """``tensor`` as a constant for differentiation (``autodiff.stop_gradient``), like
        ``torch.Tensor.detach``."""
        return Tensor(self, autodiff.stop_gradient(self._node(tensor)[0]))

    def gradient_context(self) -> autodiff.Context:
        """The ``autodiff.Context`` of this session: which stored relations are dense (their rows
        counted), and identity matrices stored as ``tra_eye_<n>_<dtype>``."""
        def eye(n: int, dtype: np.dtype) -> graph.Node:
            name = f"tra_eye_{n}_{np.dtype(dtype).name}"
            if name not in self.tensors():
                self.from_numpy(name, np.eye(n, dtype=dtype))
            return self.tensor(name).node

        return autodiff.Context(self.engine.has_every_tile, eye)

    def relation(self, table: str, keys, value: str | None = None, shape=None, **options) -> Tensor:
        """View table ``table`` as a sparse tensor relation (a VIEW, no copy): one dimension per
        key column, values from column ``value`` (1.0 per row if None)."""
        from tra_sql import relations
        return relations.relation(self, table, keys, value, shape, **options)

    def parameter(self, name: str, shape=None, init="glorot_uniform", **options) -> Tensor:
        """A trainable tensor: the stored ``name`` if it exists, else initialized by ``init``."""
        from tra_sql import parameters
        return parameters.parameter(self, name, shape, init, **options)

    def train(self, loss, params, optimizer, epochs: int, **options):
        """Minimize ``loss`` over ``params`` with ``optimizer``, resumably (see ``tra_sql.train``;
        on Spark ``tra_sql.backends.spark_train``)."""
        if self.engine.name == "spark":
            from tra_sql.backends import spark_train
            return spark_train.train(self, loss, params, optimizer, epochs, **options)
        from tra_sql import train
        return train.train(self, loss, params, optimizer, epochs, **options)
