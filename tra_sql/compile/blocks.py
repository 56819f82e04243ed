"""sqlglot building blocks of the lowering: tile keys, arrays and structs, operand joins,
range tables, and kernel calls that carry their typed ``protocol`` step and kernel."""

from __future__ import annotations

from sqlglot import exp

from tra_sql.udfs.protocol import Kernel, Literal

KEY_TYPE = "BIGINT[]"


def key(d: int) -> str:
    return f"k{d}"


def array(items: list[exp.Expression]) -> exp.Expression:
    return exp.Array(expressions=items) if items else exp.cast(exp.Array(expressions=[]), KEY_TYPE)


def struct_field(name: str, value: exp.Expression) -> exp.PropertyEQ:
    return exp.PropertyEQ(this=exp.to_identifier(name), expression=value)


def list_of_structs(fields: list[exp.PropertyEQ]) -> exp.Expression:
    return exp.ArrayAgg(this=exp.Struct(expressions=fields))


def table(name: str, alias: str) -> exp.Table:
    return exp.Table(this=exp.to_identifier(name, quoted=True), alias=exp.TableAlias(this=exp.to_identifier(alias)))


def number(value: int) -> exp.Literal:
    return exp.Literal.number(value)


def plus(value: exp.Expression, offset: int) -> exp.Expression:
    if offset == 0:
        return value
    return exp.Add(this=value, expression=number(offset)) if offset > 0 else \
        exp.Sub(this=value, expression=number(-offset))


def select_keys(keys: list[exp.Expression], tile: exp.Expression) -> list[exp.Expression]:
    """``k0, ..., tile`` columns."""
    return [exp.alias_(k.copy(), key(d)) for d, k in enumerate(keys)] + [exp.alias_(tile, "tile")]


def call(kernel: Kernel, step: Literal, args: list[exp.Expression]) -> exp.Anonymous:
    """``kernel(step, *args)``: the step as a string literal; the typed kernel and step ride
    along in the expression's ``meta`` (``kernel``, ``step``) for a dialect to read."""
    node = exp.Anonymous(this=kernel.name, expressions=[exp.Literal.string(step.encode()), *args])
    node.meta.update(kernel=kernel, step=step)
    return node


def kernels_called(select: exp.Expression) -> set[Kernel]:
    """The kernels a query calls (read from the calls' ``meta``, see ``call``)."""
    return {node.meta["kernel"] for node in select.find_all(exp.Anonymous) if "kernel" in node.meta}


def joins(inputs, refs: list[str]) -> tuple[list, list[exp.Expression], dict[str, exp.Column]]:
    """How operands ``x0, x1, ...`` (subscripts ``inputs``, relations ``refs``) join: each
    later one on the keys of the indices it shares with earlier ones, an index repeated inside
    one operand as a filter. Returns (joins, filters, the first key column of every index)."""
    first: dict[str, exp.Column] = {}
    joined: list[tuple[exp.Table, list[exp.Expression]]] = []
    where: list[exp.Expression] = []
    for m, sub in enumerate(inputs):
        on = []
        seen_here: dict[str, exp.Column] = {}
        for d, c in enumerate(sub):
            col = exp.column(key(d), f"x{m}")
            if c in seen_here:
                where.append(exp.EQ(this=col, expression=seen_here[c].copy()))
            elif c in first:
                on.append(exp.EQ(this=col, expression=first[c].copy()))
            seen_here.setdefault(c, col)
            first.setdefault(c, col)
        if m:
            joined.append((table(refs[m], f"x{m}"), on))
    return joined, where, first


def joined(ref: str, joins: list, where: list[exp.Expression]) -> exp.Select:
    """``FROM ref AS x0 JOIN ... WHERE ...``, nothing selected yet."""
    select = exp.select().from_(table(ref, "x0"))
    for other, on in joins:
        select = select.join(other, on=exp.and_(*on) if on else exp.true())
    return select.where(exp.and_(*where)) if where else select


def operand_fields(inputs) -> list[exp.PropertyEQ]:
    """``keys<m>``, ``tile<m>`` struct fields of every operand ``x<m>``."""
    fields = []
    for m, sub in enumerate(inputs):
        keys = array([exp.column(key(d), f"x{m}") for d in range(len(sub))])
        fields += [struct_field(f"keys{m}", keys), struct_field(f"tile{m}", exp.column("tile", f"x{m}"))]
    return fields


def extents(inputs, operands) -> tuple[dict[str, int], dict[str, int]]:
    """The full size and the tile size of every index of ``operands`` (subscripts ``inputs``)."""
    sizes = {c: n for sub, op in zip(inputs, operands) for c, n in zip(sub, op.shape)}
    return sizes, {c: t for sub, op in zip(inputs, operands) for c, t in zip(sub, op.tile)}


def grid_table(g: int, size: int) -> exp.Table:
    """``range(0, size) AS r<g>(o)``: the output tile keys along one dimension."""
    return exp.Table(this=exp.Anonymous(this="range", expressions=[number(0), number(size)]),
                     alias=exp.TableAlias(this=exp.to_identifier(f"r{g}"), columns=[exp.to_identifier("o")]))


def grouped(select: exp.Select, keys: list[exp.Expression]) -> exp.Select:
    """``select`` grouped by ``keys``; with none, one group if any row was joined (as grouping
    by keys gives no group without rows: the result's tile is then absent, not NULL)."""
    if keys:
        return select.group_by(*[k.copy() for k in keys])
    return select.having(exp.GT(this=exp.Count(this=exp.Star()), expression=exp.Literal.number(0)))
