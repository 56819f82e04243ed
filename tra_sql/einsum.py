"""Einsum specs: parsing numpy-style subscripts and checking them against operands."""

from __future__ import annotations

import string
from dataclasses import dataclass

from tra_sql.errors import ShapeError, SpecError

LETTERS = set(string.ascii_letters)
AGGREGATES = ("sum", "max", "min", "prod")


@dataclass(frozen=True)
class EinsumSpec:
    """Index strings of the inputs and of the output, e.g. ``('ij', 'jk') -> 'ik'``."""

    inputs: tuple[str, ...]
    output: str

    def __str__(self) -> str:
        return ",".join(self.inputs) + "->" + self.output

    @property
    def indices(self) -> list[str]:
        """Every index once, in order of first appearance."""
        return list(dict.fromkeys("".join(self.inputs) + self.output))

    @property
    def aggregated(self) -> list[str]:
        """Indices that are aggregated away (in an input, not in the output)."""
        return [c for c in self.indices if c not in self.output]


def parse_spec(spec: str, n_operands: int) -> EinsumSpec:
    """Parse ``spec`` as numpy.einsum does (explicit or implicit output; no ``...``)."""
    if not isinstance(spec, str):
        raise SpecError(f"einsum spec must be a string, got {type(spec).__name__}")
    text = spec.replace(" ", "")
    if "..." in text:
        raise SpecError(f"einsum spec {spec!r}: ellipsis '...' is not supported")
    lhs, arrow, rhs = text.partition("->")
    if "->" in rhs or "-" in lhs or ">" in lhs:
        raise SpecError(f"einsum spec {spec!r} is malformed: use 'ij,jk->ik'")
    inputs = tuple(lhs.split(","))
    bad = sorted(set(lhs.replace(",", "") + rhs) - LETTERS)
    if bad:
        raise SpecError(f"einsum spec {spec!r}: {''.join(bad)!r} are not index letters (a-z, A-Z)")
    if len(inputs) != n_operands:
        raise ShapeError(f"einsum spec {spec!r} names {len(inputs)} operand(s), got {n_operands}")
    if arrow:
        output = rhs
        if len(set(output)) != len(output):
            raise SpecError(f"einsum spec {spec!r}: an output index appears twice")
        missing = [c for c in output if c not in lhs]
        if missing:
            raise SpecError(f"einsum spec {spec!r}: output index {missing[0]!r} is in no input")
    else:
        counts = {c: lhs.count(c) for c in set(lhs) - {","}}
        output = "".join(sorted(c for c, n in counts.items() if n == 1))
    return EinsumSpec(inputs, output)


def index_sizes(spec: EinsumSpec, shapes: list[tuple[int, ...]], names: list[str]) -> dict[str, int]:
    """The size of every index, checking ranks and that every use of an index agrees."""
    sizes: dict[str, int] = {}
    where: dict[str, str] = {}
    for sub, shape, name in zip(spec.inputs, shapes, names):
        if len(sub) != len(shape):
            raise ShapeError(f"einsum {spec}: operand '{name}' has rank {len(shape)} "
                             f"but its subscript {sub!r} has {len(sub)} indices")
        for ch, n in zip(sub, shape):
            if sizes.setdefault(ch, n) != n:
                raise ShapeError(f"einsum {spec}: index {ch!r} has size {sizes[ch]} in "
                                 f"'{where[ch]}' but {n} in '{name}'")
            where.setdefault(ch, name)
    return sizes
