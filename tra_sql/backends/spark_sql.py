"""A program's SQL for Spark: the shared sqlglot query in Spark's dialect, as steps, and one
rewrite for memory.

Spark inlines a CTE wherever it is read, so a training step's ~40 CTEs, shared between the
forward pass, the gradients and the optimizer, expanded into a plan ~30 times the program
(one GCN step: 1437 Python UDF evaluations for 49 calls in the text). ``SparkDialect.steps`` makes
every CTE read more than once a temporary view instead, which the session makes a local
checkpoint, so each step runs once per query; a CTE read once is a subquery of its reader.

A fused join + aggregate step, ``tra_einsum_agg_<n>(meta, keys, ARRAY_AGG(STRUCT(...)))``,
and an aggregate of per-row partial results, ``tra_reduce(meta, keys, ARRAY_AGG(tile))``,
hold each group's list of tiles in one row; Spark copies such rows whole (aggregation
buffers, the projection around a Python UDF) and runs out of heap once a group holds
MB-sized tiles. Where a group's tiles exceed the dialect's ``limit``, the step becomes a grouped
aggregate UDF instead, ``tra_einsum_group_<n>(meta, keys, keys0, tile0, ...)`` or
``tra_reduce_group(meta, tile)``, which Spark feeds a group's rows in bounded batches after
sorting by the group keys (see ``spark_udfs``). Small tiles keep the list, which batches
many groups into one kernel call. Of the two, a split aggregation lists its joined input tiles
where they hold no more bytes than a partial result (``SparkDialect.fuse``): a partial result
goes through Arrow twice and a shuffle, the inputs through a shuffle.

Small relations (at most the dialect's ``replicate`` bytes: a few tiles, such as a layer's
weights, a bias, an optimizer's moments) are not shuffled: a join's right side that small (or
its ``FROM`` side, if the right side is not) is read whole by every task of the join (the hint
``SHUFFLE_REPLICATE_NL``: a cartesian product filtered by the join keys, no exchange on either
side), and a step whose result is that small is computed into one partition (``COALESCE(1)``:
its consumers' tasks, each a Python UDF's start, are not multiplied by the shuffle's
partitions). Such a step is computed by the tasks of its inputs and then exchanged into one
partition (``REPARTITION(1)``) when it reads a relation that is not small other than through an
aggregation of tiles computed before it (the features, in a layer's product with its weights; the
adjacency, in its product listed per group): one partition coalesced from big inputs was computed
by one task, and by each executor that read it (every executor's task of a join computed the
replicated side).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from math import ceil, prod

import numpy as np
from sqlglot import exp

from tra_sql.backends.spark_parameters import scalar_parameters
from tra_sql.backends.spark_siblings import merge_siblings
from tra_sql.budget import nbytes
from tra_sql.compile.blocks import call, grouped, key, list_of_structs, struct_field
from tra_sql.compile.dialect import Dialect, selected_tile, with_ctes_of
from tra_sql.compile.program import Program
from tra_sql.graph import Node
from tra_sql.udfs.protocol import FILL, REDUCE_GROUP, EinsumStep, Kernel

#: Groups whose tiles exceed this many bytes go through the grouped aggregate UDF.
GROUP_BYTES = 32 << 20
#: A constant whose tiles are all alike and at most this many bytes is a literal (``_literal_fills``).
FILL_LITERAL_BYTES = 1 << 10
#: marks of a step's ``Select`` (``exp.Expression.meta``): a small step's, one exchanged into one partition
SMALL_STEP, EXCHANGED = "spark_small_step", "spark_exchanged"


def _groups(step: EinsumStep) -> int:
    """Joined rows in one group of a split aggregation (interior tiles)."""
    return prod(ceil(step.sizes[c] / step.tiles[c]) for c in step.aggregated)


def group_bytes(step: EinsumStep) -> int:
    """Bytes of input tiles in one group of a fused step (interior tiles)."""
    per_row = sum(prod(step.tiles[c] for c in sub) * np.dtype(dtype).itemsize
                  for sub, dtype in zip(step.inputs, step.dtypes))
    return per_row * _groups(step)


def lists_inputs(step: EinsumStep) -> bool:
    """Whether a split aggregation ``step`` costs less on Spark as one aggregate of each group's
    joined input tiles (``tra_einsum_agg_<n>``) than as per-row partial results aggregated
    (``tra_reduce``): a partial result leaves a Python worker, is shuffled and enters one again,
    where a joined row's input tiles are shuffled once (and enter a Python worker either way),
    so listing them costs less whenever they hold no more bytes than the partial result,
    whatever a shuffled byte costs against one through Arrow. A CSR tile counts as nothing here
    (its nonzeros are not known; a relation is stored CSR because they are few): a sparse
    adjacency's product with dense features lists its inputs. CSR results, and steps with a
    prologue, keep their partials."""
    if step.out_layout != "dense" or step.prologue:
        return False
    layouts = step.layouts or ("dense",) * len(step.inputs)
    inputs = sum(prod(step.tiles[c] for c in sub) * np.dtype(dtype).itemsize
                 for sub, dtype, layout in zip(step.inputs, step.dtypes, layouts) if layout == "dense")
    return inputs <= prod(step.tiles[c] for c in step.output) * np.dtype(step.out_dtype).itemsize


def largest(program: Program) -> int:
    """Bytes of the largest dense relation ``program`` reads or makes (a CSR one's nonzeros
    are not known here; sparse relations are the small ones)."""
    nodes = [node for _, _, step in program.ctes for node in (step, *step.inputs) if node.layout == "dense"]
    return max((nbytes(node.shape, node.dtype) for node in nodes), default=0)


def relation_bytes(program: Program) -> dict[str, int]:
    """Bytes of every dense relation ``program`` reads or makes, by its name in the SQL (a
    step's CTE, a stored table); CSR relations are left out (their nonzeros are not known)."""
    sizes = {}
    for name, _, step in program.ctes:
        for ref, node in [(name, step), *((program.refs[id(n)], n) for n in step.inputs)]:
            if node.layout == "dense":
                sizes[ref] = nbytes(node.shape, node.dtype)
    return sizes


def partial_bytes(step: EinsumStep) -> int:
    """Bytes of partial results in one group of a ``tra_reduce`` step (interior tiles)."""
    return prod(step.tiles[c] for c in step.output) * np.dtype(step.out_dtype).itemsize * _groups(step)


@dataclass
class Steps:
    """A query as Spark runs it: temporary ``views`` in order (name, SQL, how many later
    steps read it, a view replicated into a join counting once more), then the ``final`` SQL
    over them; the kernels they call; and the bytes of the largest dense relation they read or
    make (0 if not known); the ``big`` views."""

    views: list[tuple[str, str, int]]
    final: str
    kernels: set[Kernel]
    nbytes: int = 0
    #: views bigger than a task's tile budget (the dialect's ``replicate``), or of no known size
    #: (a staged plan's band queries): a checkpoint of one is kept on the executors' disks, not
    #: in their heaps
    big: frozenset[str] = frozenset()
    #: the scalar relations read as query parameters (``spark_parameters``): bind their tiles
    parameters: frozenset[str] = frozenset()
    #: stored tables read through a temporary view of their own, by lower-case name: the session
    #: defines each view over the table, or over another relation of its rows (``SparkEngine.prepare``)
    inputs: dict[str, str] = field(default_factory=dict)
    prefix: str = ""  # how the names of the views begin

    def text(self) -> str:
        """All of it as one script, for reading (the input views over their tables)."""
        inputs = [(view, f"SELECT * FROM {table}") for table, view in self.inputs.items()]
        return "".join(f"CREATE TEMPORARY VIEW {name} AS {sql};\n"
                       for name, sql in inputs + [(name, sql) for name, sql, _ in self.views]) + self.final

    def renamed(self) -> Steps:
        """The same steps with views of other names (a new ``prefix``): two runs of them can be
        planned at once."""
        prefix = _prefix()

        def new(text: str) -> str:
            return text.replace(self.prefix, prefix)

        return replace(self, views=[(new(name), new(sql), reads) for name, sql, reads in self.views],
                       final=new(self.final), big=frozenset(map(new, self.big)),
                       inputs={table: new(view) for table, view in self.inputs.items()}, prefix=prefix)


class SparkDialect(Dialect):
    """Spark SQL: plain CTEs, each run as a temporary view (``steps``), and split
    aggregations over big groups as grouped aggregate UDFs (``call``)."""

    name = "spark"
    materialized = False

    def __init__(self, limit: int = GROUP_BYTES, replicate: float = 0, slots: int = 0):
        self.limit = limit  # the most bytes of tiles a group may hold in one row
        self.replicate = replicate  # relations of at most this many bytes are not shuffled
        self.slots = slots  # tasks the executors run at once (0: not known)

    def fuse(self, select: exp.Select) -> exp.Select:
        """``select`` as one aggregate of its joined input tiles, ``SELECT k.., tra_einsum_agg_<n>(
        step, keys, ARRAY_AGG({keys0, tile0, ...}), ANY_VALUE(e0), ...) FROM <join> GROUP BY k..``,
        if it aggregates per-row partial results, ``SELECT k.., tra_reduce(step, keys,
        ARRAY_AGG(tile), ANY_VALUE(e0), ...) FROM (SELECT k.., tra_einsum_<n>(...) AS tile, e0, ...
        FROM <join>) GROUP BY k..`` (``einsum.partials_first``), that cost more here
        (``lists_inputs``). The two SELECTs' hints go to the one."""
        tile = selected_tile(select)
        source = select.args.get("from_")
        if not isinstance(tile, exp.Anonymous) or "kernel" not in tile.meta or tile.meta["kernel"].kind != "reduce" \
                or not lists_inputs(tile.meta["step"]) or select.args.get("joins") or select.args.get("where") \
                or source is None or not isinstance(source.this, exp.Subquery) \
                or not isinstance(source.this.this, exp.Select) or source.this.this.args.get("group"):
            return select
        inner = source.this.this
        partial = selected_tile(inner)
        if not isinstance(partial, exp.Anonymous) or partial.meta.get("kernel") is None \
                or partial.meta["kernel"].kind not in ("einsum", "contract"):
            return select
        kernel, step = tile.meta["kernel"], tile.meta["step"]
        columns = {e.alias: e.this for e in inner.expressions if isinstance(e, exp.Alias)}
        extras = [exp.AnyValue(this=columns[arg.this.name].copy()) for arg in tile.expressions[3:]]
        operands = partial.expressions[2:]
        fields = [struct_field(f"{kind}{m}", operands[2 * m + i].copy())
                  for m in range(len(operands) // 2) for i, kind in enumerate(("keys", "tile"))]
        agg = call(Kernel("einsum_agg", partial.meta["kernel"].arity, kernel.epilogue), step,
                   [partial.expressions[1].copy(), list_of_structs(fields), *extras])
        names = {key(d) for d in range(len(step.output))}
        keys = [e for e in inner.expressions if isinstance(e, exp.Alias) and e.alias in names]
        fused = grouped(inner.copy().select(*[k.copy() for k in keys], exp.alias_(agg, "tile"), append=False),
                        [k.this for k in keys])
        if select.args.get("hint"):  # (the inner SELECT's are the copy's)
            _add_hint(fused, [hint.copy() for hint in select.args["hint"].expressions])
        return with_ctes_of(select, fused)

    def call(self, node: exp.Anonymous) -> exp.Expression:
        """``node`` as a grouped aggregate UDF call if its groups exceed ``limit`` bytes."""
        kernel, step = node.meta["kernel"], node.meta["step"]
        args = node.expressions
        if len(args) < 3 or not isinstance(args[2], exp.ArrayAgg):
            return node
        if kernel.kind == "reduce":
            if kernel.epilogue or step.out_layout != "dense" or partial_bytes(step) <= self.limit:
                return node  # CSR partials stay a list
            grouped, rest = REDUCE_GROUP, [args[2].this.copy()]
        elif kernel.kind == "einsum_agg":
            if group_bytes(step) <= self.limit:
                return node
            grouped, rest = Kernel("einsum_group", kernel.arity, kernel.epilogue), \
                [args[1].copy(), *(f.expression.copy() for f in args[2].this.expressions),
                 *(extra.this.copy() for extra in args[3:])]  # an epilogue operand: each row of a group has it
        else:
            return node
        ungrouped = exp.Anonymous(this=grouped.name, expressions=[args[0].copy(), *rest])
        ungrouped.meta.update(kernel=grouped, step=step)
        return ungrouped

    def steps(self, program: Program) -> Steps:
        """``program`` as steps (see ``Steps``) whose final query returns ``k0.. (INT), tile``."""
        keys = _keys(len(program.root.shape))
        steps = self._steps(program.query(materialized=False),
                            lambda body: exp.select(*keys, "tile").from_(body.subquery("r")), relation_bytes(program))
        steps.nbytes = largest(program)
        return steps

    def query_steps(self, query: exp.Select, rank: int) -> Steps:
        """A query of a rank-``rank`` tile relation (plain CTEs) as steps whose final query
        returns ``k0.. (INT), tile``."""
        keys = _keys(rank)
        return self._steps(query, lambda body: exp.select(*keys, "tile").from_(body.subquery("r")))

    def union_steps(self, program: Program, results: dict, complete: Callable[[Node], bool] | None = None,
                    scalars: frozenset[str] = frozenset(), inputs: frozenset[str] = frozenset()) -> Steps:
        """``Program.union_query(results)`` as steps: the final query returns the rows
        ``target, k0, ..., tile`` (INT keys) of several results. With ``complete`` (which nodes
        have every tile: ``absent.Completeness``), row-wise results that share relations are
        computed in one step (``spark_siblings``) whose rows hold at most ``replicate`` bytes of
        tiles (a task's tile budget). The one-tile relations named in ``scalars`` (lower-case)
        are read as query parameters where they can be (``spark_parameters``); the stored tables
        named in ``inputs`` (lower-case) through views of their own (``Steps.inputs``). If the
        results fit a task's tile budget and the union reads no relation over it other than
        through an exchange (``_big_reads``), the results are computed in as many tasks
        as the executors run at once (``slots``), not in a task each (a training step's union of
        a result per target ran in waves): a task then computes several results one after the
        other, and Spark frees some of the memory each took (the rows queued for a Python UDF)
        only when the task ends."""
        rank = max((len(node.shape) for node in results.values()), default=0)
        keys = _keys(rank)
        query, sizes = program.union_query(results), relation_bytes(program)
        if complete is not None:
            query = merge_siblings(query, program, results, complete, sizes, self.replicate)
        parameters = scalar_parameters(query, scalars)

        def finish(body: exp.Expression) -> exp.Select:
            return exp.select("target", *keys, "tile").from_(body.subquery("u"))

        fit = all(node.layout == "dense" and nbytes(node.shape, node.dtype) <= self.replicate
                  for node in results.values())
        steps = self._steps(query, finish, sizes, inputs, spread=fit)
        steps.nbytes, steps.parameters = largest(program), frozenset(parameters)
        return steps

    def _steps(self, query: exp.Expression, finish, sizes: dict[str, int] | None = None,
               inputs: frozenset[str] = frozenset(), spread: bool = False) -> Steps:
        """``query``'s CTEs read more than once as views named uniquely (the same program may
        run twice at once), the others subqueries of their readers (``_inline``; as are steps
        that call no kernel, wherever they are read), the relations that ``sizes`` (bytes by
        name) says are small not shuffled (``hint``). A view replicated into a join counts as
        read twice: the session keeps it (a local checkpoint), else each task of the join would
        compute it again, and its inputs. A small step that reads a big relation other than
        through an aggregation is exchanged into its one partition (``_exchange_small_steps``).
        The stored tables named in ``inputs`` are read through views named uniquely too
        (``Steps.inputs``). With ``spread`` the final query runs in ``slots`` tasks if it reads
        nothing big other than through an exchange."""
        key = "with_" if "with_" in query.arg_types else "with"  # sqlglot renamed the argument
        ctes = [(cte.alias, cte.this) for cte in query.args[key].expressions] if query.args.get(key) else []
        body = query.copy()
        body.set(key, None)
        prefix = _prefix()
        names = {name: f"{prefix}{name}" for name, _ in ctes}
        views = {table: f"{prefix}in_{table}" for table in inputs}
        replicated: set[str] = set()

        def renamed(select: exp.Expression, name: str | None = None) -> exp.Expression:
            select = self.hint(_literal_fills(self.fused(select.copy())), sizes or {}, name, replicated)
            for table in select.find_all(exp.Table):
                if table.db:
                    continue
                if table.name in names:
                    table.set("this", exp.to_identifier(names[table.name], quoted=True))
                elif table.name.lower() in views:
                    table.set("this", exp.to_identifier(views[table.name.lower()], quoted=True))
            return select

        parts = [renamed(select, name) for name, select in ctes] + [renamed(finish(body))]
        reads = Counter(table.name for part in parts for table in part.find_all(exp.Table))
        reads.update({names[name]: 1 for name in replicated & names.keys()})
        inlined = {names[name] for name, part in zip(names, parts) if reads[names[name]] == 1 or not _calls(part)}
        _inline(parts, names, inlined)
        kept = [(name, part) for (name, _), part in zip(ctes, parts) if names[name] not in inlined]
        small = {names.get(ref, views.get(ref.lower(), ref)) for ref, size in (sizes or {}).items()
                 if size <= self.replicate}
        written = [part for _, part in kept] + parts[-1:]
        for part in written:
            _exchange_small_steps(part, small)
        if spread and self.slots and not _big_reads(parts[-1], small):
            _add_hint(parts[-1], [exp.Anonymous(this="COALESCE", expressions=[exp.Literal.number(self.slots)])])
        rendered = [self.render(part) for part in written]
        steps = [(names[name], sql, reads[names[name]]) for (name, _), (sql, _) in zip(kept, rendered)]
        big = frozenset(names[name] for name, _ in kept if (sizes or {}).get(name, self.replicate + 1) > self.replicate)
        return Steps(steps, rendered[-1][0], set().union(*(kernels for _, kernels in rendered)), big=big,
                     inputs=views, prefix=prefix)

    def hint(self, query: exp.Expression, sizes: dict[str, int], name: str | None,
             replicated: set[str]) -> exp.Expression:
        """``query`` (the step ``name``, if one) with Spark hints for its small relations: each
        inner join's right side of at most ``replicate`` bytes ``SHUFFLE_REPLICATE_NL`` (read
        whole by each task, no exchange; its name added to ``replicated``), the relation in
        ``FROM`` too if it is that small and the first join's right side is not (a gradient
        joined with the features it is contracted with: the features are not shuffled), and
        ``COALESCE(1)`` if the step's result is that small."""
        def small(ref: str) -> bool:
            return ref in sizes and sizes[ref] <= self.replicate

        def inner(join: exp.Join) -> bool:
            return not join.side and join.kind in ("", "INNER", "CROSS")

        for select in list(query.find_all(exp.Select)):
            joins = select.args.get("joins") or []
            small_sides = [join.this for join in joins
                           if isinstance(join.this, exp.Table) and inner(join) and small(join.this.name)]
            source = select.args.get("from_")
            if joins and inner(joins[0]) and joins[0].this not in small_sides and source is not None \
                    and isinstance(source.this, exp.Table) and small(source.this.name):
                small_sides.insert(0, source.this)
            replicated.update(table.name for table in small_sides)
            _add_hint(select, [exp.Anonymous(this="SHUFFLE_REPLICATE_NL",
                                             expressions=[exp.to_identifier(table.alias_or_name)])
                               for table in small_sides])
            for table in small_sides:  # one partition: each of the other side's is computed once
                alias = table.alias_or_name
                table.replace(_coalesced(exp.select("*").from_(exp.Table(this=table.this.copy())))
                              .subquery(alias))
        if name is not None and small(name) and isinstance(query, exp.Select):
            _coalesced(query).meta[SMALL_STEP] = True
        return query


def _exchange_small_steps(part: exp.Expression, small: set[str]) -> None:
    """Each small step in ``part`` (the innermost first) that reads a relation not named in
    ``small`` other than through an exchange (``_big_reads``) computed in its inputs' partitions
    and then exchanged into one (``REPARTITION(1)`` for its ``COALESCE(1)``)."""
    for select in reversed(list(part.find_all(exp.Select))):
        if select.meta.get(SMALL_STEP) and _big_reads(select, small):
            for hint in select.args["hint"].expressions:
                if isinstance(hint, exp.Anonymous) and hint.name.upper() == "COALESCE":
                    hint.set("this", "REPARTITION")
            select.meta[EXCHANGED] = True


def _big_reads(select: exp.Expression, small: set[str]) -> bool:
    """Whether ``select`` reads a table not named in ``small`` other than through an exchange:
    a step exchanged into one partition (``_exchange_small_steps``), or an aggregation (Spark
    exchanges its input by its keys: a tile relation's scan, and a join with a side read whole,
    have no partitioning of their own) of tiles computed before it. An aggregation whose kernel
    takes each group's joined input tiles (``tra_einsum_agg_<n>``, ``tra_attention_<n>``)
    computes its products after that exchange, in its own tasks: what it reads counts."""
    def reads(node: exp.Expression) -> bool:
        if isinstance(node, exp.Table):  # a relation, or a table function (``RANGE``)
            return isinstance(node.this, exp.Identifier) and node.name not in small
        if isinstance(node, exp.Select) and (node is not select and node.meta.get(EXCHANGED)
                                             or _aggregates(node) and not _lists_tiles(node)):
            return False
        return any(reads(child) for child in node.iter_expressions())
    return reads(select)


def _lists_tiles(select: exp.Select) -> bool:
    """Whether ``select`` calls a kernel on each group's list of joined input tiles."""
    return any(node.meta["kernel"].kind in ("einsum_agg", "attention") for column in select.expressions
               for node in column.find_all(exp.Anonymous) if "kernel" in node.meta)


def _aggregates(select: exp.Select) -> bool:
    """Whether ``select`` groups or aggregates its rows."""
    return bool(select.args.get("group")) or any(
        isinstance(node, exp.AggFunc) for column in select.expressions for node in column.walk())


def _prefix() -> str:
    """A unique beginning of views' names (the same program may run twice at once)."""
    return f"_tra_{uuid.uuid4().hex[:12]}"


def _inline(parts: list[exp.Expression], names: dict[str, str], inlined: set[str]) -> None:
    """Put every step of ``parts`` (the steps in order, the final query last) named in
    ``inlined`` into its readers, as a subquery: Spark analyzes it there only, not as a view
    of its own first (and has no checkpoint to make of it)."""
    bodies = {names[name]: part for name, part in zip(names, parts) if names[name] in inlined}
    for part in parts:  # a step reads only steps before it, which are complete by then
        for table in [t for t in part.find_all(exp.Table) if t.name in bodies and not t.db]:
            alias = table.args.get("alias") or exp.TableAlias(this=table.this.copy())
            table.replace(exp.Subquery(this=bodies[table.name].copy(), alias=alias))


def _calls(query: exp.Expression) -> bool:
    """Whether ``query`` calls a tile kernel."""
    return any("kernel" in node.meta for node in query.find_all(exp.Anonymous))


def _literal_fills(query: exp.Expression) -> exp.Expression:
    """``query`` with each ``tra_fill`` call whose tiles are all alike and at most
    ``FILL_LITERAL_BYTES`` as that tile's bytes, a binary literal: a step of such a constant
    (the seed of a loss's gradient) calls no kernel, so each reader computes it (``_steps``)."""
    def literal(node: exp.Expression) -> exp.Expression:
        if not isinstance(node, exp.Anonymous) or node.meta.get("kernel") != FILL:
            return node
        step = node.meta["step"]
        if prod(step.tile) * np.dtype(step.dtype).itemsize > FILL_LITERAL_BYTES \
                or any(size % t for size, t in zip(step.shape, step.tile)):
            return node  # big, or ragged boundary tiles
        return exp.HexString(this=np.full(step.tile, step.value, dtype=step.dtype).tobytes().hex().upper())
    return query.transform(literal, copy=False)


def _keys(rank: int) -> list[exp.Expression]:
    return [exp.alias_(exp.cast(exp.column(f"k{d}"), "INT"), f"k{d}") for d in range(rank)]


def _coalesced(select: exp.Select) -> exp.Select:
    """``select`` computed into one partition (``COALESCE(1)``, no shuffle)."""
    _add_hint(select, [exp.Anonymous(this="COALESCE", expressions=[exp.Literal.number(1)])])
    return select


def _add_hint(select: exp.Select, hints: list[exp.Expression]) -> None:
    if hints:
        before = select.args.get("hint")
        select.set("hint", exp.Hint(expressions=[*(before.expressions if before else []), *hints]))
