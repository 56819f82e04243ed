"""The tensor table functions: what each of ``einsum``, ``grad``, ``tra_random``,
``tra_from_elements``, ``tra_elements`` and ``tra_check`` means as a tensor or a relation."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import pyarrow as pa
from sqlglot import exp

from tra_sql import absent, autodiff, budget, catalog, relations
from tra_sql.catalog import TensorInfo
from tra_sql.errors import DTypeError, SpecError, SQLError
from tra_sql.frontend.syntax import (
    SQL_TYPES,
    aliased,
    arguments,
    array,
    bool_literal,
    choice,
    dtype_named,
    int_literal,
    ints_literal,
    json_literal,
    shown,
    sql_call,
    string_literal,
    strings_literal,
    tile_position,
)
from tra_sql.graph import Source
from tra_sql.tensor import Tensor
from tra_sql.udfs import protocol

if TYPE_CHECKING:
    from tra_sql.session import Session


class TensorFunctions:
    """The table functions of a statement's rewrite (``frontend.rewrite.Rewriter`` adds the
    walk: ``tensor`` for an operand, ``query`` for a tensor's tiles, ``rewrite`` for a query)."""

    def __init__(self, session: Session, run: bool = False):
        self.session = session
        self.run = run  # the statement runs now (else it is only shown): memory budgets apply, tra_check may repair
        self.literals: dict[str, exp.Select] = {}
        self.complete: dict[str, bool] = {}  # literal -> whether it has every tile
        self.counter = itertools.count(1)

    def _einsum(self, call: exp.Anonymous) -> Tensor:
        args, options = arguments(call)
        if not args:
            raise SpecError("einsum() needs a spec string and operands: einsum('ij,jk->ik', A, B)")
        spec = string_literal(args[0], "the einsum spec")
        join = string_literal(options["join"], "join") if "join" in options else None
        agg = string_literal(options["agg"], "agg") if "agg" in options else "sum"
        operands = [self.tensor(a) for a in args[1:]]
        names = [t.name or t.node.label for t in operands]
        node = self.session.einsum_node(spec, [t.node for t in operands], names, join, agg, self.completeness())
        return Tensor(self.session, node)

    def completeness(self) -> absent.Completeness:
        """``Session.completeness``, told about the statement's literals, which are no tables:
        ``tra_random`` has every tile, ``tra_from_elements`` may lack some."""
        stored = self.session.completeness().source_complete
        return absent.Completeness(lambda source: self.complete[source.table] if source.table in self.complete
                                   else stored(source))

    def _grad(self, call: exp.Anonymous) -> Tensor:
        """``grad(loss, W)``: the gradient of the scalar tensor ``loss`` with respect to ``W``
        (both stored tensors or nested tensor functions), a relational program itself."""
        args, _ = arguments(call)
        if len(args) != 2:
            raise SpecError("grad() takes two tensors: grad(loss, W)")
        loss, wrt = (self.tensor(a) for a in args)
        return Tensor(self.session, autodiff.gradients(loss.node, [wrt.node], self.gradient_context())[0])

    def gradient_context(self) -> autodiff.Context:
        """``Session.gradient_context``, told about the statement's literals (as ``completeness``)."""
        stored = self.session.gradient_context()
        return autodiff.Context(lambda source: self.complete[source.table] if source.table in self.complete
                                else stored.source_dense(source), stored.eye)

    def _geometry(self, fname: str, args, options, dtype: str) -> TensorInfo:
        if "shape" in options and args:
            raise SpecError(f"{fname}(): shape is given twice")
        if "shape" not in options and not args:
            raise SpecError(f"{fname}() needs shape => [...]")
        shape = ints_literal(options["shape"] if "shape" in options else args[0], "shape")
        name = f"_{fname}_{next(self.counter)}"
        tile = ints_literal(options["tile"], "tile") if "tile" in options else None
        dt = dtype_named(string_literal(options["dtype"], "dtype") if "dtype" in options else dtype)
        return TensorInfo(name, dt, shape, catalog.check_tile(shape, tile, fname))

    def _literal(self, info: TensorInfo, select: exp.Select, complete: bool) -> Tensor:
        self.literals[info.name] = select
        self.complete[info.name] = complete
        return Tensor(self.session, Source(info.shape, info.dtype, info.tile, info.name, info.layout))

    def _tra_random(self, call: exp.Anonymous) -> Tensor:
        args, options = arguments(call)
        if len(args) > 1:
            raise SpecError("tra_random() takes one positional argument, the shape")
        info = self._geometry("tra_random", args, options, "float64")
        seed = int_literal(options["seed"], "seed") if "seed" in options else 0
        dist = string_literal(options["dist"], "dist") if "dist" in options else "uniform"
        if dist not in ("uniform", "normal"):
            raise SpecError(f"tra_random(): dist must be 'uniform' or 'normal', got {dist!r}")
        if info.dtype.kind != "f":
            raise DTypeError(f"tra_random() draws floats; dtype {info.dtype} is not float32 or float64")
        if seed < 0:
            raise SpecError(f"tra_random(): seed must be non-negative, got {seed}")
        if self.run:
            budget.check_generated(self.session, "tra_random()", info.shape, info.tile, info.dtype)
        keys = [exp.column("k", f"r{d}") for d in range(len(info.shape))]
        meta = json_literal(name="tra_random", dtype=info.dtype.name, shape=info.shape, tile=info.tile, seed=seed,
                            dist=dist)
        select = exp.select(*[exp.alias_(exp.cast(k.copy(), "INTEGER"), f"k{d}") for d, k in enumerate(keys)],
                            exp.alias_(sql_call(protocol.RANDOM_TILE.name, meta, array(keys)), "tile"))
        for d, grid in enumerate(info.grid):
            table = aliased(exp.Table(this=sql_call("range", exp.Literal.number(grid))), f"r{d}", ["k"])
            select = select.from_(table) if d == 0 else select.join(table, join_type="cross")
        return self._literal(info, select, complete=True)

    def _tra_from_elements(self, call: exp.Anonymous) -> Tensor:
        """``tra_from_elements(rows, shape => [..])``: a tensor from rows (i0, .., value); a
        NULL value or a repeated index is an error unless ``nulls => 'skip'`` (leave those
        rows out) or ``duplicates => 'sum'`` (add them up); the dtype defaults to float32 for
        a FLOAT value column, float64 for any other."""
        args, options = arguments(call)
        if not args or len(args) > 2:
            raise SpecError("tra_from_elements() takes a table or (query) of elements, then shape => [...]")
        source, args = args[0], args[1:]
        nulls = choice(options, "nulls", ("error", "skip"))
        duplicates = choice(options, "duplicates", ("error", "sum"))
        if isinstance(source, exp.Subquery):
            relation: exp.Expression = self.rewrite(source.this)
        elif isinstance(source, exp.Column):
            relation = exp.to_table(source.sql(dialect="duckdb"), dialect="duckdb")
        else:
            raise SQLError(f"tra_from_elements(): {shown(source)} is not a table name or a (query)")
        schema = self._schema(relation)
        value_type = schema.field(len(schema) - 1).type if len(schema) else None
        default = "float32" if value_type == pa.float32() else "float64"
        info = self._geometry("tra_from_elements", args, options, default)
        rank = len(info.shape)
        if len(schema) != rank + 1:
            raise SQLError(f"tra_from_elements(): the elements of a rank-{rank} tensor are rows of "
                           f"{rank + 1} columns (indices, then the value), got {len(schema)}: "
                           f"{', '.join(schema.names)}")
        if self.run:
            budget.check_tile(budget.Budget.of(self.session), "tra_from_elements()", info.tile, info.dtype)
        columns = [f"i{d}" for d in range(rank)] + ["value"]
        keys = [exp.column(f"k{d}") for d in range(rank)]
        inner = exp.select(
            *[exp.alias_(exp.cast(exp.IntDiv(this=exp.cast(exp.column(c, "e"), "BIGINT"),
                                             expression=exp.Literal.number(t)), "INTEGER"), f"k{d}")
              for d, (c, t) in enumerate(zip(columns, info.tile))],
            *[exp.alias_(exp.cast(exp.column(c, "e"), "BIGINT"), c) for c in columns[:-1]],
            exp.alias_(exp.cast(exp.column("value", "e"), "DOUBLE"), "value"),
        ).from_(aliased(relation, "e", columns))
        if nulls == "skip":
            inner = inner.where(exp.column("value", "e").is_(exp.null()).not_())
        pack = sql_call(protocol.PACK_TILE.name, json_literal(name="tra_from_elements", dtype=info.dtype.name,
                                                              shape=info.shape, tile=info.tile,
                                                              unique=duplicates == "error"),
                        array([k.copy() for k in keys]),
                        exp.ArrayAgg(this=array([exp.column(c) for c in columns[:-1]])),
                        exp.ArrayAgg(this=exp.column("value")))
        select = exp.select(*keys, exp.alias_(pack, "tile")).from_(aliased(inner, "e"))
        return self._literal(info, select.group_by(*[k.copy() for k in keys]) if keys else select, complete=False)

    def _schema(self, relation: exp.Expression) -> pa.Schema:
        """The columns of ``relation`` (a table or a query), read with LIMIT 0."""
        query = exp.select("*").from_(aliased(relation.copy(), "_s")).limit(0)
        return self.session.engine.arrow(query.sql(dialect=self.session.engine.dialect)).schema

    def _tra_relation(self, call: exp.Anonymous) -> Tensor:
        """``tra_relation(table, keys => [..] [, value => 'col'] [, shape, tile, dtype, layout,
        sum_duplicates])``: the rows of ``table`` as the nonzeros of a tensor (``db.relation``'s
        view, read where the statement uses it: nothing is copied or stored)."""
        args, options = arguments(call)
        if len(args) != 1 or "keys" not in options:
            raise SpecError("tra_relation() takes a table, then keys => ['col', ...]: "
                            "tra_relation(edges, keys => ['src', 'dst'], value => 'w')")
        table = args[0]
        if isinstance(table, exp.Literal) and table.is_string:
            name = table.this
        elif isinstance(table, exp.Column) and not table.table:
            name = table.name
        else:
            raise SQLError(f"tra_relation(): {shown(table)} is not a table name")
        value = options.get("value")
        given = {key: parse(options[key], key) for key, parse in (
            ("shape", ints_literal), ("tile", ints_literal), ("dtype", string_literal), ("layout", string_literal),
            ("sum_duplicates", bool_literal)) if key in options}
        info, select = relations.relation_query(
            self.session, name, strings_literal(options["keys"], "keys"),
            None if value is None or isinstance(value, exp.Null) else string_literal(value, "value"),
            name=f"_tra_relation_{next(self.counter)}", **given)
        relations.ensure_udfs(self.session)
        return self._literal(info, select, complete=False)

    def elements(self, call: exp.Anonymous) -> exp.Select:
        """``tra_elements(t)``: one row per element of the tiles present, (i0, ..., value)."""
        args, _ = arguments(call)
        if len(args) != 1:
            raise SQLError("tra_elements() takes one tensor: tra_elements(A)")
        tensor = self.tensor(args[0])
        if tensor.node.layout != "dense":
            raise SQLError(f"tra_elements() needs dense tiles; {tensor.node.label} is {tensor.node.layout} "
                           f"(its entries are the rows of the table it was made from)")
        rank, dtype = tensor.ndim, tensor.dtype
        keys = [exp.column(f"k{d}") for d in range(rank)]
        extents = [exp.column(f"_e{d}") for d in range(rank)]
        decode = (protocol.TILE_INTS if dtype.kind == "i" else protocol.TILE_VALUES).name
        tiles = exp.select(
            *keys,
            *[exp.alias_(sql_call("least", exp.Literal.number(t), exp.Sub(
                this=exp.Literal.number(n), expression=exp.Mul(this=k.copy(), expression=exp.Literal.number(t)))),
                f"_e{d}") for d, (k, n, t) in enumerate(zip(keys, tensor.shape, tensor.tile))],
            exp.alias_(sql_call(decode, exp.column("tile"), exp.Literal.string(dtype.name)), "_v"),
        ).from_(aliased(self.query(tensor), "_q"))
        flat = exp.select(
            *keys, *extents, exp.alias_(sql_call("unnest", exp.column("_v")), "value"),
            exp.alias_(sql_call("unnest", sql_call("range", sql_call("len", exp.column("_v")))), "_p"),
        ).from_(aliased(tiles, "_w"))
        indices = [exp.alias_(exp.Add(this=exp.Mul(this=k.copy(), expression=exp.Literal.number(t)),
                                      expression=tile_position(d, extents)), f"i{d}")
                   for d, (k, t) in enumerate(zip(keys, tensor.tile))]
        value = exp.alias_(exp.cast(exp.column("value"), SQL_TYPES[dtype.name]), "value")
        return exp.select(*indices, value).from_(aliased(flat, "_u"))

    def plan(self, call: exp.Anonymous) -> exp.Select:
        """``tra_plan(t [, workers => 4] [, memory => '1GB'] [, format => 'text'])``: the
        planner's plan for computing ``t`` (``Session.plan(...).explain(format)``), a row per line."""
        args, options = arguments(call)
        if len(args) != 1:
            raise SQLError("tra_plan() takes one tensor: tra_plan(einsum(...) [, workers => 4])")
        tensor = self.tensor(args[0])
        workers = int_literal(options["workers"], "workers") if "workers" in options else None
        memory = string_literal(options["memory"], "memory") if "memory" in options else None
        fmt = string_literal(options["format"], "format") if "format" in options else "text"
        text = self.session.plan(tensor, workers, memory).explain(fmt)
        lines = sql_call("string_split", exp.Literal.string(text), exp.Literal.string("\n"))
        return exp.select(exp.alias_(sql_call("unnest", lines), "plan"))

    def check(self, call: exp.Anonymous) -> exp.Select:
        """``tra_check([repair => true])``: ``Session.check``'s findings as rows (tensor,
        problem, detail, repaired); it repairs only when the statement runs (not in EXPLAIN)."""
        args, options = arguments(call)
        repair = options.get("repair", exp.false())
        if args or not isinstance(repair, exp.Boolean):
            raise SQLError("write tra_check() or tra_check(repair => true)")
        return catalog.findings_query(self.session.check(repair=repair.this and self.run))

