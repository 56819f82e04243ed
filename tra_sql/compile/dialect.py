"""How a program's SQL is written for one engine: a ``Dialect`` renders the compiled query,
giving each kernel call a chance to take the engine's form (``call``) and, first, each split
aggregation the form that costs least on the engine (``fuse``: DuckDB's writes a split sum of
BLAS products as one fused aggregate). DuckDB's is the base; an engine with quirks subclasses
it (Spark: ``tra_sql.backends.spark_sql.SparkDialect``)."""

from __future__ import annotations

from sqlglot import exp

from tra_sql.compile import passes
from tra_sql.compile.blocks import call, grouped, kernels_called
from tra_sql.udfs.attention import native_attention
from tra_sql.udfs.contract import gemm_form, native_chain, native_loop, prologue_chain
from tra_sql.udfs.protocol import CONTRACT, NATIVE_FORMS, Kernel, fused_contraction, placement_aggregate, tile_reduction


def _fusible(node: exp.Expression, kind: str) -> bool:
    """Whether ``node`` is a kernel call of ``kind`` without epilogue, summing dense tiles."""
    if not isinstance(node, exp.Anonymous) or "kernel" not in node.meta:
        return False
    kernel, step = node.meta["kernel"], node.meta["step"]
    return (kernel.kind == kind and not kernel.epilogue and step.epilogue is None and step.agg == "sum"
            and step.out_layout == "dense")


def selected_tile(select: exp.Select) -> exp.Expression | None:
    """The expression ``select`` selects as ``tile``."""
    return next((e.this for e in select.expressions if isinstance(e, exp.Alias) and e.alias == "tile"), None)


class Dialect:
    """DuckDB: every step a ``MATERIALIZED`` CTE; a split sum of BLAS products as the fused
    contraction aggregate (``fuse``); other split aggregations' partial results aggregated by
    a whole-tile reduction where there is one (``call``)."""

    name = "duckdb"
    materialized = True  # whether CTEs are written ``AS MATERIALIZED``

    def fuse(self, select: exp.Select) -> exp.Select:
        """``select`` as one grouped call of the fused contraction aggregate
        (``protocol.CONTRACTIONS``: each joined row's product added into the group's state) if
        it computes a split sum of BLAS products without epilogue: either ``SELECT k.., tra_reduce(
        step, keys, ARRAY_AGG(tile)) FROM (SELECT k.., tra_contract_2(step, keys, ...) AS tile FROM
        <join>) GROUP BY k..`` (``einsum.partials_first``) or ``SELECT k.., tra_einsum_agg_2(step,
        keys, ARRAY_AGG({keys0, tile0, keys1, tile1})) FROM <join> GROUP BY k..`` of a step in
        gemm form (``contract.gemm_form``), which becomes ``SELECT k.., tra_contract_agg_<dtype>(
        step, keys, keys0, tile0, keys1, tile1) FROM <join> GROUP BY k..``."""
        tile = selected_tile(select)
        if _fusible(tile, "einsum_agg") and tile.meta["kernel"].arity == 2 \
                and _product(tile.meta["step"]) and isinstance(tile.expressions[2], exp.ArrayAgg):
            fields = tile.expressions[2].this.expressions
            tile.replace(_fused(tile.meta["step"], [tile.expressions[1], *(f.expression for f in fields)]))
            return select
        source = select.args.get("from_")
        if not _fusible(tile, "reduce") or not isinstance(tile.expressions[2], exp.ArrayAgg) \
                or select.args.get("joins") or select.args.get("where") or source is None \
                or not isinstance(source.this, exp.Subquery) or not isinstance(source.this.this, exp.Select):
            return select
        inner = source.this.this
        partial = selected_tile(inner)
        if partial is None or partial.meta.get("kernel") != CONTRACT or inner.args.get("group") \
                or not _product(partial.meta["step"]):
            return select
        partial.replace(_fused(partial.meta["step"], partial.expressions[1:]))
        fused = grouped(inner, [e.this for e in inner.expressions if isinstance(e, exp.Alias) and e.alias != "tile"])
        return with_ctes_of(select, fused)

    def call(self, node: exp.Anonymous) -> exp.Expression:
        """The engine's form of a kernel call (``blocks.call``): ``tra_einsum_<n>`` of a step
        ``contract.native_loop`` accepts becomes ``tra_loop_<n>``, and ``tra_chain_<n>`` of a
        chain ``contract.native_chain`` accepts ``tra_loop_chain_<n>`` (as does a step with a
        prologue, as the chain ``contract.prologue_chain`` of it), unless ``passes.fusions``
        switched ``loops`` off (native on DuckDB: the loop kernel or BLAS product and the
        epilogue without Arrow; DuckDB binds one function per name, so the native kernels get
        their steps by name); ``tra_reduce(meta, keys,
        ARRAY_AGG(tile))`` without epilogue, over dense tiles, becomes the aggregate
        ``tra_reduce_<agg>_<dtype>(meta, keys, tile)`` (``protocol.TILE_REDUCTIONS``; native
        on DuckDB: one tile of state per group, no list); ``tra_attention_<n>(meta, keys,
        ARRAY_AGG({keys0, tile0, ...}))`` of one float dtype becomes the aggregate
        ``tra_attention_agg_<dtype>_<n>(meta, keys, keys0, tile0, ...)`` (``protocol.ATTENTIONS``;
        native on DuckDB: each joined row folded into the group's online softmax, no list), and
        ``tra_place(meta, keys, ARRAY_AGG({origin, shape, part, tile}))`` the aggregate
        ``protocol.placement_aggregate`` gives (native on DuckDB: each piece copied into the
        group's tile, no list), unless ``loops`` is switched off."""
        kernel, step = node.meta["kernel"], node.meta["step"]
        args = node.expressions
        if "loops" in passes.enabled and kernel.kind == "place" and (placed := placement_aggregate(step)) \
                and isinstance(args[2], exp.ArrayAgg) and isinstance(args[2].this, exp.Struct):
            return call(placed, step, [args[1].copy(), *(f.expression.copy() for f in args[2].this.expressions)])
        if "loops" in passes.enabled and kernel.kind == "attention" and native_attention(step) \
                and isinstance(args[2], exp.ArrayAgg) and isinstance(args[2].this, exp.Struct):
            fields = [f.expression.copy() for f in args[2].this.expressions]
            return call(Kernel(f"attention_agg_{step.out_dtype}", kernel.arity), step, [args[1].copy(), *fields])
        if "loops" in passes.enabled and kernel.kind == "einsum" and step.prologue \
                and (chain := prologue_chain(step)) is not None:
            return call(Kernel("loop_chain", kernel.arity), chain, [a.copy() for a in args[1:]])
        if "loops" in passes.enabled and (kernel.kind == "einsum" and native_loop(step)
                                          or kernel.kind == "chain" and native_chain(step)):
            return call(Kernel(NATIVE_FORMS[kernel.kind][0], kernel.arity), step, [a.copy() for a in args[1:]])
        if kernel.kind != "reduce" or kernel.epilogue or step.epilogue is not None or len(args) != 3 \
                or not isinstance(args[2], exp.ArrayAgg) or step.out_layout != "dense":
            return node
        reduction = tile_reduction(step.agg, step.out_dtype)
        return node if reduction is None else call(reduction, step, [args[1].copy(), args[2].this.copy()])

    def fused(self, query: exp.Expression) -> exp.Expression:
        """``query`` with its split aggregations in the engine's form (``fuse``, the innermost
        first), unless ``passes.fusions`` switched ``contractions`` off (rewritten in place)."""
        if "contractions" not in passes.enabled:
            return query
        for select in reversed(list(query.find_all(exp.Select))):
            fused = self.fuse(select)
            if select is query:
                query = fused
            elif fused is not select:
                select.replace(fused)
        return query

    def render(self, query: exp.Expression, pretty: bool = False) -> tuple[str, set[Kernel]]:
        """``query``'s text in this dialect, with its split aggregations in the engine's form
        (``fused``) and its kernel calls too (``call``), and the kernels it calls (``query`` is
        rewritten in place: pass a copy of your own)."""
        query = self.fused(query).transform(lambda node: self.call(node) if isinstance(node, exp.Anonymous)
                                            and "kernel" in node.meta else node, copy=False)
        return query.sql(dialect=self.name, pretty=pretty), kernels_called(query)


def with_ctes_of(select: exp.Select, fused: exp.Select) -> exp.Select:
    """``fused`` (what ``fuse`` made of ``select``) with ``select``'s CTEs, if it has them."""
    for key in ("with_", "with"):  # sqlglot renamed the argument
        if key in select.arg_types and select.args.get(key):
            fused.set(key, select.args[key])
    return fused


def _product(step) -> bool:
    """Whether ``step``'s per-row kernel is the BLAS product (``contract.gemm_form``) of tiles
    that a fused contraction aggregate takes."""
    return gemm_form(step) is not None and fused_contraction(step.out_dtype) is not None


def _fused(step, args: list[exp.Expression]) -> exp.Anonymous:
    return call(fused_contraction(step.out_dtype), step, args)


DUCKDB = Dialect()
