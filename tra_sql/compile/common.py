"""Common subexpressions: nodes that compute the same thing on the same inputs become one.

A DAG written as a tree (the SQL front end's nested ``einsum(...)`` calls, a gradient spelled
out by hand, a model that builds the same step twice) holds structurally identical nodes.
Compiled apart, each copy is fused with its own consumer, so the copies may run in different
kernels (a BLAS product here, a generated loop there) and round differently; a program that
compares them, as the gradient of ``max`` compares its recomputed join with the maximum,
then breaks. Merged before the fusion passes, identical nodes are one step with all their
consumers: computed once, with the same bits everywhere."""

from __future__ import annotations

from dataclasses import fields

from tra_sql.graph import Node, topological, with_inputs


def merge_common(roots: tuple[Node, ...]) -> tuple[list[Node], dict[int, Node]]:
    """The steps under ``roots`` (inputs before consumers) with identical nodes merged, and
    every original node's id mapped to the step that computes it."""
    canonical: dict[int, Node] = {}
    by_key: dict[tuple, Node] = {}
    for node in {id(n): n for root in roots for n in topological(root)}.values():
        inputs = tuple(canonical[id(child)] for child in node.inputs)
        rebuilt = with_inputs(node, inputs) if inputs else node
        key = _key(rebuilt)
        canonical[id(node)] = by_key.setdefault(key, rebuilt) if key is not None else rebuilt
    steps = list({id(n): n for n in canonical.values()}.values())
    return steps, canonical


def _key(node: Node) -> tuple | None:
    """What makes ``node`` the computation it is: its kind, its fields, its inputs (by
    identity, already merged); None when a field cannot be compared."""
    values = []
    for f in fields(node):
        value = getattr(node, f.name)
        if f.name == node.INPUTS:
            value = tuple(id(child) for child in value)
        elif isinstance(value, float):
            value = ("float", value.hex())  # -0.0 and NaN are values of their own
        values.append(value)
    key = (type(node), tuple(values))
    try:
        hash(key)
    except TypeError:
        return None
    return key
