"""From the DAG to SQL: every node becomes a SELECT over its inputs' tile relations.

- an ``Einsum`` joins its operands on the keys of shared indices (an index repeated inside
  one operand filters that operand's keys), calls a tile UDF per joined row, and, when an
  aggregated index is split over several tiles, groups by the output keys and hands the
  kernel each group's joined rows as one list of structs (a fused join + aggregate; one
  list keeps the operands' tiles aligned without sorting);
- a ``Retile`` joins each source tile to the target tiles it overlaps and assembles them;
- a program is a ``WITH ... AS MATERIALIZED`` chain, one CTE per node, shared nodes once.

Everything is built as sqlglot expressions; ``Program.sql()`` renders a dialect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlglot import exp

from tra_sql.graph import Einsum, Node, Retile, Source, topological

KEY_TYPE = "BIGINT[]"


def key(d: int) -> str:
    return f"k{d}"


def _array(items: list[exp.Expression]) -> exp.Expression:
    return exp.Array(expressions=items) if items else exp.cast(exp.Array(expressions=[]), KEY_TYPE)


def _field(name: str, value: exp.Expression) -> exp.PropertyEQ:
    return exp.PropertyEQ(this=exp.to_identifier(name), expression=value)


def _list_of_structs(fields: list[exp.PropertyEQ]) -> exp.Expression:
    return exp.ArrayAgg(this=exp.Struct(expressions=fields))


def _table(name: str, alias: str) -> exp.Table:
    return exp.Table(this=exp.to_identifier(name, quoted=True), alias=exp.TableAlias(this=exp.to_identifier(alias)))


def _meta(payload: dict) -> exp.Literal:
    return exp.Literal.string(json.dumps(payload, separators=(",", ":")))


def _select_keys(keys: list[exp.Expression], tile: exp.Expression) -> list[exp.Expression]:
    return [exp.alias_(k.copy(), key(d)) for d, k in enumerate(keys)] + [exp.alias_(tile, "tile")]


def einsum_select(node: Einsum, refs: list[str], names: list[str]) -> tuple[exp.Select, str]:
    """The SELECT computing ``node`` from the relations ``refs``, and the UDF it calls."""
    spec = node.spec
    aliases = [f"x{m}" for m in range(len(refs))]
    first: dict[str, exp.Column] = {}
    joins: list[tuple[exp.Table, list[exp.Expression]]] = []
    where: list[exp.Expression] = []
    for m, (sub, alias) in enumerate(zip(spec.inputs, aliases)):
        on = []
        seen_here: dict[str, exp.Column] = {}
        for d, c in enumerate(sub):
            col = exp.column(key(d), alias)
            if c in seen_here:
                where.append(exp.EQ(this=col, expression=seen_here[c].copy()))
            elif c in first:
                on.append(exp.EQ(this=col, expression=first[c].copy()))
            seen_here.setdefault(c, col)
            first.setdefault(c, col)
        if m:
            joins.append((_table(refs[m], alias), on))
    out_keys = [first[c] for c in spec.output]
    split = [first[c] for c in spec.aggregated if node.tiles[c] < node.sizes[c]]
    meta = _meta({
        "inputs": list(spec.inputs), "output": spec.output, "sizes": node.sizes,
        "tiles": node.tiles, "dtypes": [op.dtype.name for op in node.operands],
        "out_dtype": node.dtype.name, "names": names, "join": node.join, "agg": node.agg,
    })
    args: list[exp.Expression] = [meta, _array([k.copy() for k in out_keys])]
    fields: list[exp.Expression] = []
    for m, (sub, alias) in enumerate(zip(spec.inputs, aliases)):
        keys = _array([exp.column(key(d), alias) for d in range(len(sub))])
        fields += [_field(f"keys{m}", keys), _field(f"tile{m}", exp.column("tile", alias))]
    if split:
        args.append(_list_of_structs(fields))
    else:
        args += [f.expression for f in fields]
    udf = f"tra_einsum_{'agg_' if split else ''}{len(refs)}"
    select = exp.select(*_select_keys(out_keys, exp.Anonymous(this=udf, expressions=args)))
    select = select.from_(_table(refs[0], aliases[0]))
    for table, on in joins:
        select = select.join(table, on=exp.and_(*on) if on else exp.true())
    if where:
        select = select.where(exp.and_(*where))
    if split:
        select = select.group_by(*[k.copy() for k in out_keys]) if out_keys else select
    return select, udf


def retile_select(node: Retile, ref: str, name: str) -> exp.Select:
    """The SELECT cutting ``ref`` (tiled ``node.source.tile``) into tiles of ``node.tile``."""
    source = node.source
    out_keys: list[exp.Expression] = []
    joins = []
    for d, (n, old, new) in enumerate(zip(node.shape, source.tile, node.tile)):
        k = exp.column(key(d), "s")
        if old == new:
            out_keys.append(k)
            continue
        target = exp.column("o", f"r{d}")
        first = exp.IntDiv(this=exp.Mul(this=k.copy(), expression=exp.Literal.number(old)),
                           expression=exp.Literal.number(new))
        end = exp.Least(this=exp.Mul(this=exp.paren(exp.Add(this=k.copy(), expression=exp.Literal.number(1))),
                                     expression=exp.Literal.number(old)),
                        expressions=[exp.Literal.number(n)])
        last = exp.IntDiv(this=exp.paren(exp.Sub(this=end, expression=exp.Literal.number(1))),
                          expression=exp.Literal.number(new))
        grid = exp.Table(
            this=exp.Anonymous(this="range", expressions=[exp.Literal.number(0), exp.Literal.number(node.grid[d])]),
            alias=exp.TableAlias(this=exp.to_identifier(f"r{d}"), columns=[exp.to_identifier("o")]),
        )
        joins.append((grid, exp.Between(this=target, low=first, high=last)))
        out_keys.append(target)
    rank = len(node.shape)
    meta = _meta({"name": name, "dtype": node.dtype.name, "shape": list(node.shape),
                  "from": list(source.tile), "to": list(node.tile)})
    src_keys = [exp.column(key(d), "s") for d in range(rank)]
    pieces = _list_of_structs([_field("keys", _array(src_keys)), _field("tile", exp.column("tile", "s"))])
    call = exp.Anonymous(this="tra_retile", expressions=[meta, _array([k.copy() for k in out_keys]), pieces])
    select = exp.select(*_select_keys(out_keys, call)).from_(_table(ref, "s"))
    for table, on in joins:
        select = select.join(table, on=on)
    return select.group_by(*[k.copy() for k in out_keys])


@dataclass
class Program:
    """The SQL of a DAG: one materialized CTE per computed node, and the UDFs it calls."""

    root: Node
    ctes: list[tuple[str, exp.Select, Node]] = field(default_factory=list)
    udfs: set[str] = field(default_factory=set)
    refs: dict[int, str] = field(default_factory=dict)

    @classmethod
    def compile(cls, root: Node) -> Program:
        program = cls(root)
        for node in topological(root):
            program._add(node)
        return program

    def _add(self, node: Node) -> None:
        if isinstance(node, Source):
            self.refs[id(node)] = node.table
            return
        name = f"_t{len(self.ctes) + 1}"
        refs = [self.refs[id(child)] for child in node.inputs]
        labels = [child.table if isinstance(child, Source) else r for child, r in zip(node.inputs, refs)]
        if isinstance(node, Einsum):
            select, udf = einsum_select(node, refs, labels)
        elif isinstance(node, Retile):
            select, udf = retile_select(node, refs[0], labels[0]), "tra_retile"
        else:
            raise TypeError(f"cannot compile {type(node).__name__}")
        self.udfs.add(udf)
        self.ctes.append((name, select, node))
        self.refs[id(node)] = name

    def query(self) -> exp.Select:
        """``WITH ... SELECT k0, ..., tile FROM <root>``."""
        columns = [exp.column(key(d)) for d in range(len(self.root.shape))] + [exp.column("tile")]
        select = exp.select(*columns).from_(exp.to_table(self.refs[id(self.root)], quoted=True))
        for name, cte, _ in self.ctes:
            select = select.with_(name, as_=cte, materialized=True)
        return select

    def sql(self, dialect: str = "duckdb", pretty: bool = True) -> str:
        return self.query().sql(dialect=dialect, pretty=pretty)
