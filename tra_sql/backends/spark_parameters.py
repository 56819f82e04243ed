"""A training step's per-step scalars as parameters of its Spark query.

An optimizer's step-dependent numbers (Adam's step size and bias correction) are scalar
tensors: one tile, joined ``ON TRUE`` by each parameter's update. Stored as tables they are
rewritten before every step and each join reads its Parquet file again (a file listing when
the step is planned, a scan and a cartesian product in the update's task). ``scalar_parameters``
drops such a join and passes the tile to the kernel as a named parameter, ``:tra_<name>``,
whose bytes the step binds when Spark analyzes it (``spark.sql(text, args)``)."""

from __future__ import annotations

from sqlglot import exp


def marker(name: str) -> str:
    """The parameter that carries scalar relation ``name``'s tile."""
    return f"tra_{name.lower()}"


def scalar_parameters(query: exp.Expression, scalars: set[str]) -> set[str]:
    """Rewrite ``query`` in place: each inner join ``ON TRUE`` of a relation named in ``scalars``
    (one-tile relations, lower-case names) whose select reads only its ``tile`` is dropped, the
    tile read as the parameter ``marker(name)``; returns the scalars it rewrote. A scalar
    relation read any other way (say in ``FROM``) is left as it is."""
    rewritten = set()
    for select in list(query.find_all(exp.Select)):
        joins = select.args.get("joins") or []
        kept = []
        for join in joins:
            table = join.this
            reads = _reads(select, table.alias_or_name) if _cross(join) and isinstance(table, exp.Table) \
                and not table.db and table.name.lower() in scalars else None
            if reads is None or any(column.name != "tile" for column in reads):
                kept.append(join)
                continue
            for column in reads:
                column.replace(exp.Placeholder(this=marker(table.name)))
            rewritten.add(table.name.lower())
        if len(kept) < len(joins):
            select.set("joins", kept or None)
    return rewritten


def _cross(join: exp.Join) -> bool:
    """Whether ``join`` is an inner join ``ON TRUE`` (or without a condition)."""
    on = join.args.get("on")
    return not join.side and join.kind in ("", "INNER", "CROSS") and not join.args.get("using") \
        and (on is None or on == exp.true())


def _reads(select: exp.Select, alias: str) -> list[exp.Column]:
    """The columns of ``alias`` that ``select`` reads outside its joins' tables (its own scope:
    not in a nested select)."""
    return [column for column in select.find_all(exp.Column)
            if column.table == alias and column.find_ancestor(exp.Select) is select]
