"""Sibling results of one query computed in one projection, for Spark.

An optimizer step writes several results from the same inputs: Adam's new weights, first and
second moments each join the weights, the moments and the gradient tile by tile and call a
kernel. As steps of their own, each is a Python UDF evaluation in the Spark job (a round trip
to a Python worker: ~0.1 s per result on a small cluster, whatever the tiles' size), with its
own scans of the same tables, and the gradient they share becomes a view and a checkpoint.
``merge_siblings`` rewrites results whose steps are such row-wise joins over the same tile
grid into one step that joins the union of their relations once and calls every kernel in one
projection (Spark evaluates the Python UDFs of one projection in one worker), whose rows the
union reads back with ``STACK``.

The rewrite keeps every result's rows: a step joins its relations on keys that all map to the
output's keys, so it has a row at an output key where each relation has a tile there. Merged
steps join more relations, so each relation they join must have a tile at every key of its grid
(``absent.Completeness``), and its grid must be the output's along the keys it maps to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

from sqlglot import exp

from tra_sql.compile.program import Program
from tra_sql.graph import Node

#: the only arguments a row-wise step's SELECT may have
ROW_WISE_ARGS = {"expressions", "from_", "joins"}

#: a relation as a row-wise step reads it: its name, and the output key each of its keys equals
Relation = tuple[str, tuple[int, ...]]


@dataclass
class RowWise:
    """A step computing one result: for each output key, one kernel ``call`` over the tiles
    of ``relations`` (by alias) that lie at that key."""

    name: str  # its CTE
    target: str  # its result's name in the union
    node: Node
    relations: dict[str, Relation]
    call: exp.Expression


def merge_siblings(query: exp.Select, program: Program, results: dict[str, Node],
                   complete: Callable[[Node], bool], sizes: dict[str, int], row_bytes: float) -> exp.Expression:
    """``query`` (``program.union_query(results)``) with every group of row-wise result steps
    that share a relation computed as one step (see the module docstring), if a row of it (the
    tiles it joins and the tiles it makes) holds at most ``row_bytes``; ``sizes`` (bytes by
    relation name) gets the merged steps' sizes."""
    members = _members(query)
    ctes = {cte.alias: cte for cte in query.args["with_"].expressions} if query.args.get("with_") else {}
    if len(members) < 2 or not ctes:
        return query
    reads = _reads(ctes, members)
    nodes = _relation_nodes(program)
    by_name = {name: node for name, _, node in program.ctes}
    steps = []
    for target, name in members:
        if name in ctes and reads.get(name, 0) == 1 and name in by_name:
            step = _row_wise(name, target, by_name[name], ctes[name].this, nodes)
            if step is not None and all(complete(nodes[rel[0]]) for rel in step.relations.values()):
                steps.append(step)
    groups = _groups(steps, nodes, row_bytes)
    if not groups:
        return query
    rank = max((len(node.shape) for node in results.values()), default=0)
    merged_of = {step.name: group for group in groups for step in group}
    done: set[int] = set()
    new_ctes, members_sql = [], []
    order = list(ctes)
    last = {id(group): max(order.index(step.name) for step in group) for group in groups}
    for i, (name, cte) in enumerate(ctes.items()):
        group = merged_of.get(name)
        if group is None:
            new_ctes.append((name, cte.this))
        elif i == last[id(group)]:  # after every input of every member
            new_ctes.append((_merged_name(group), _merged_select(group, ctes)))
            sizes[_merged_name(group)] = sum(sizes.get(step.name, 0) for step in group)
    for (_, name), member in zip(members, _member_selects(query)):
        group = merged_of.get(name)
        if group is None:
            members_sql.append(member)
        elif id(group) not in done:
            done.add(id(group))
            members_sql.append(_stacked(group, rank))
    union = members_sql[0]
    for member in members_sql[1:]:
        union = exp.union(union, member, distinct=False)
    for name, select in new_ctes:
        union = union.with_(name, as_=select, copy=False)
    return union


def _member_selects(query: exp.Expression) -> list[exp.Select]:
    """The SELECTs of a UNION ALL tree, in order (its WITH left out)."""
    if isinstance(query, exp.Union):
        return _member_selects(query.this) + _member_selects(query.expression)
    return [query]


def _members(query: exp.Expression) -> list[tuple[str, str]]:
    """(target, relation) of each member ``SELECT 'target' AS target, k.., tile FROM relation``."""
    members = []
    for select in _member_selects(query):
        source = select.args.get("from_")
        first = select.expressions[0] if select.expressions else None
        if not (isinstance(first, exp.Alias) and isinstance(first.this, exp.Literal) and source is not None
                and isinstance(source.this, exp.Table)):
            return []
        members.append((first.this.this, source.this.name))
    return members


def _reads(ctes: dict[str, exp.CTE], members: list[tuple[str, str]]) -> Counter:
    """How many times each relation is read by the CTEs and by the union's members: a result
    read by another step too is not merged."""
    reads = Counter(table.name for cte in ctes.values() for table in cte.this.find_all(exp.Table))
    reads.update(name for _, name in members)
    return reads


def _relation_nodes(program: Program) -> dict[str, Node]:
    """The node behind each relation name the program's steps read or write."""
    nodes: dict[str, Node] = {}
    for name, _, step in program.ctes:
        nodes[name] = step
        for child in step.inputs:
            ref = program.refs.get(id(child))
            if ref is not None:
                nodes.setdefault(ref, child)
    return nodes


def _row_wise(name: str, target: str, node: Node, select: exp.Expression, nodes: dict[str, Node]) -> RowWise | None:
    """``select`` as a ``RowWise`` step, or None if it is not one: ``SELECT xa.kc AS k0, ..,
    KERNEL(..) AS tile FROM t AS x0 JOIN u AS x1 ON <key equalities or TRUE> ..`` (inner joins
    of stored relations or steps, no filter or grouping), each relation's keys all equal to
    output keys, its grid the output's along them."""
    if not isinstance(select, exp.Select) or {k for k, v in select.args.items() if v} - ROW_WISE_ARGS \
            or select.args.get("from_") is None or not select.expressions:
        return None
    tables = [select.args["from_"].this, *(join.this for join in select.args.get("joins") or [])]
    joins = select.args.get("joins") or []
    if not all(isinstance(t, exp.Table) and t.alias and not t.db and t.name in nodes for t in tables) or \
            any(join.side or join.kind not in ("", "INNER") or join.args.get("using") for join in joins):
        return None
    aliases = {t.alias: t.name for t in tables}
    if len(aliases) != len(tables):
        return None
    *key_columns, tile = select.expressions
    rank = len(node.shape)
    if len(key_columns) != rank or not (isinstance(tile, exp.Alias) and tile.alias == "tile"
                                        and isinstance(tile.this, exp.Anonymous) and "kernel" in tile.this.meta):
        return None
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    def union(a, b):
        parent[find(a)] = find(b)

    for d, column in enumerate(key_columns):
        if not (isinstance(column, exp.Alias) and column.alias == f"k{d}" and _key(column.this, aliases)):
            return None
        union(_key(column.this, aliases), ("", f"k{d}"))
    for join in joins:
        for condition in _conjuncts(join.args.get("on")):
            if isinstance(condition, exp.Boolean) and condition.this:
                continue
            left, right = (_key(condition.this, aliases), _key(condition.expression, aliases)) \
                if isinstance(condition, exp.EQ) else (None, None)
            if not (left and right):
                return None
            union(left, right)
    if any(c.table not in aliases for c in tile.this.find_all(exp.Column)):
        return None
    out_of = {find(("", f"k{d}")): d for d in range(rank)}
    if len(out_of) != rank:
        return None  # two output keys equal
    relations = {}
    for alias, table in aliases.items():
        source = nodes[table]
        dims = tuple(out_of.get(find((alias, f"k{a}")), -1) for a in range(len(source.shape)))
        if -1 in dims or any((node.shape[d], node.tile[d]) != (source.shape[a], source.tile[a])
                             for a, d in enumerate(dims)):
            return None
        relations[alias] = (table, dims)
    return RowWise(name, target, node, relations, tile.this)


def _key(column: exp.Expression, aliases: dict[str, str]) -> tuple[str, str] | None:
    """``(alias, kN)`` for a key column ``alias.kN`` of a relation in ``aliases``."""
    if isinstance(column, exp.Column) and column.table in aliases and column.name[:1] == "k" \
            and column.name[1:].isdigit():
        return column.table, column.name
    return None


def _conjuncts(condition: exp.Expression | None) -> list[exp.Expression]:
    if condition is None:
        return []
    if isinstance(condition, exp.And):
        return _conjuncts(condition.this) + _conjuncts(condition.expression)
    return [condition.unnest()]


def _groups(steps: list[RowWise], nodes: dict[str, Node], row_bytes: float) -> list[list[RowWise]]:
    """Steps of the same grid that share a relation, in groups of two or more (in order) whose
    rows hold at most ``row_bytes`` of tiles."""
    def tile_bytes(node: Node) -> int:
        return prod(node.tile) * node.dtype.itemsize

    def row(group: list[RowWise]) -> int:
        relations = {rel for step in group for rel in step.relations.values()}
        return sum(tile_bytes(nodes[name]) for name, _ in relations) + sum(tile_bytes(s.node) for s in group)

    groups: list[list[RowWise]] = []
    for step in steps:
        mine = set(step.relations.values())
        for group in groups:
            theirs = {rel for other in group for rel in other.relations.values()}
            first = group[0].node
            if (step.node.shape, step.node.tile) == (first.shape, first.tile) and mine & theirs \
                    and row([*group, step]) <= row_bytes:
                group.append(step)
                break
        else:
            groups.append([step])
    return [group for group in groups if len(group) > 1]


def _merged_name(group: list[RowWise]) -> str:
    return "_".join(step.name for step in group)


def _merged_select(group: list[RowWise], ctes: dict[str, exp.CTE]) -> exp.Select:
    """One SELECT joining every relation of ``group`` once (aliases ``x0..``, each relation's
    keys equal to the first relation's that give the same output key) and calling each member's
    kernel (with its aliases renamed) as ``tile0``, ``tile1``, .. Relations that are steps
    (``ctes``) come first: the first is read in FROM (a subquery if nothing else reads it), where
    a join's side would be read whole by each task (``SparkDialect.hint``) and so kept as a view."""
    relations = list(dict.fromkeys(rel for step in group for rel in step.relations.values()))
    relations.sort(key=lambda rel: rel[0] not in ctes)
    alias_of: dict[Relation, str] = {}
    provider: dict[int, exp.Column] = {}  # output key -> the first relation key that gives it
    select = None
    for relation in relations:
        alias = alias_of[relation] = f"x{len(alias_of)}"
        table, dims = relation
        conditions = []
        for a, d in enumerate(dims):
            column = exp.column(f"k{a}", table=alias)
            if d in provider:
                conditions.append(exp.EQ(this=column, expression=provider[d].copy()))
            else:
                provider[d] = column
        source = exp.Table(this=exp.to_identifier(table, quoted=True),
                           alias=exp.TableAlias(this=exp.to_identifier(alias)))
        if select is None:
            select = exp.select().from_(source)
        else:
            on = exp.and_(*conditions) if conditions else exp.true()
            select = select.join(source, on=on, join_type="INNER")
    rank = len(group[0].node.shape)
    columns = [exp.alias_(provider[d].copy(), f"k{d}") for d in range(rank)]
    for i, step in enumerate(group):
        renamed = {alias: alias_of[relation] for alias, relation in step.relations.items()}
        call = step.call.copy()
        for column in call.find_all(exp.Column):
            column.set("table", exp.to_identifier(renamed[column.table]))
        columns.append(exp.alias_(call, f"tile{i}"))
    return select.select(*columns, copy=False)


def _stacked(group: list[RowWise], rank: int) -> exp.Select:
    """The union's member for ``group``: each member's rows ``target, k0.., tile`` from the
    merged step, with ``STACK`` (keys past a result's rank NULL)."""
    values = []
    for i, step in enumerate(group):
        own = len(step.node.shape)
        values += [exp.Literal.string(step.target),
                   *(exp.column(f"k{d}") if d < own else exp.cast(exp.Null(), "INTEGER") for d in range(rank)),
                   exp.column(f"tile{i}")]
    stack = exp.Stack(this=exp.Literal.number(len(group)), expressions=values)
    names = ["target", *(f"k{d}" for d in range(rank)), "tile"]
    return exp.select(exp.Aliases(this=stack, expressions=[exp.to_identifier(n) for n in names])) \
        .from_(exp.Table(this=exp.to_identifier(_merged_name(group), quoted=True)))
