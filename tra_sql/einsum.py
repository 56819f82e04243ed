"""Einsum specs: parsing numpy-style subscripts and checking them against operands."""

from __future__ import annotations

import string
from dataclasses import dataclass

from tra_sql.errors import ShapeError, SpecError

LETTERS = set(string.ascii_letters)


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


def parse_spec(spec: str, n_operands: int, ranks: list[int] | None = None) -> EinsumSpec:
    """Parse ``spec`` as numpy.einsum does: explicit or implicit output, and ``...`` standing
    for the leading (broadcast) dimensions, which needs the operands' ``ranks``."""
    if not isinstance(spec, str):
        raise SpecError(f"einsum spec must be a string, got {type(spec).__name__}")
    text = spec.replace(" ", "")
    if text.count("->") != spec.count("->") or text.count("...") != spec.count("..."):
        raise SpecError(f"einsum spec {spec!r}: a space inside '->' or '...'")
    lhs, arrow, rhs = text.partition("->")
    if "->" in rhs or "-" in lhs or ">" in lhs:
        raise SpecError(f"einsum spec {spec!r} is malformed: use 'ij,jk->ik'")
    inputs = lhs.split(",")
    bad = sorted(set(lhs.replace(",", "").replace("...", "") + rhs.replace("...", "")) - LETTERS)
    if bad:
        raise SpecError(f"einsum spec {spec!r}: {''.join(bad)!r} are not index letters (a-z, A-Z)")
    if any(sub.count("...") > 1 for sub in inputs + [rhs]):
        raise SpecError(f"einsum spec {spec!r}: '...' may appear once per operand")
    if len(inputs) != n_operands:
        raise ShapeError(f"einsum spec {spec!r} names {len(inputs)} operand(s), got {n_operands}")
    ellipsis = ""
    if "..." in text:
        inputs, ellipsis = _expand_ellipsis(spec, inputs, ranks)
    if arrow:
        if "..." in rhs and not ellipsis and "..." not in lhs:
            raise SpecError(f"einsum spec {spec!r}: output '...' but no input has one")
        if ellipsis and "..." not in rhs:  # numpy.einsum's rule: '...' is not summed away
            raise SpecError(f"einsum spec {spec!r}: the output needs '...' for the {len(ellipsis)} "
                            f"dimension(s) the inputs' '...' stand for")
        output = rhs.replace("...", ellipsis)
        if len(set(output)) != len(output):
            raise SpecError(f"einsum spec {spec!r}: an output index appears twice")
        missing = [c for c in output if c not in "".join(inputs)]
        if missing:
            raise SpecError(f"einsum spec {spec!r}: output index {missing[0]!r} is in no input")
    else:
        joined = "".join(inputs)
        output = ellipsis + "".join(sorted(c for c in set(joined) - set(ellipsis) if joined.count(c) == 1))
    return EinsumSpec(tuple(inputs), output)


def _expand_ellipsis(spec: str, inputs: list[str], ranks: list[int] | None) -> tuple[list[str], str]:
    """Replace ``...`` by fresh letters, right-aligned across operands as in broadcasting."""
    if ranks is None:
        raise SpecError(f"einsum spec {spec!r}: '...' needs the operands' ranks")
    widths = []
    for m, (sub, rank) in enumerate(zip(inputs, ranks)):
        named = len(sub.replace("...", ""))
        if "..." in sub and rank < named:
            raise ShapeError(f"einsum spec {spec!r}: operand {m} has rank {rank}, fewer than the "
                             f"{named} named indices of {sub!r}")
        widths.append(rank - named if "..." in sub else 0)
    free = [c for c in string.ascii_letters if c not in spec]
    if max(widths) > len(free):
        raise ShapeError(f"einsum spec {spec!r}: '...' stands for {max(widths)} dimensions, more than the "
                         f"{len(free)} index letters the spec leaves free")
    ellipsis = "".join(free[: max(widths)])
    expanded = [sub.replace("...", ellipsis[len(ellipsis) - w :] if w else "") for sub, w in zip(inputs, widths)]
    return expanded, ellipsis


def broadcast(spec: EinsumSpec, shapes: list[tuple[int, ...]], names: list[str]) -> tuple[EinsumSpec, dict[str, int]]:
    """Check ranks and index sizes; a size-1 dimension facing a larger size of the same
    index broadcasts (numpy's rule): it gets a fresh index of its own, aggregated away.
    Returns the (possibly rewritten) spec and the size of every index."""
    sizes: dict[str, int] = {}
    where: dict[str, str] = {}
    for sub, shape, name in zip(spec.inputs, shapes, names):
        if len(sub) != len(shape):
            raise ShapeError(f"einsum {spec}: operand '{name}' has rank {len(shape)} "
                             f"but its subscript {sub!r} has {len(sub)} indices")
        for ch, n in zip(sub, shape):
            inside = {m for c, m in zip(sub, shape) if c == ch}
            if len(inside) > 1:  # a diagonal: numpy.einsum does not broadcast inside one operand
                raise ShapeError(f"einsum {spec}: operand '{name}' repeats index {ch!r} over sizes "
                                 f"{sorted(inside)}")
            known = sizes.get(ch, 1)
            if known == 1:
                sizes[ch], where[ch] = n, name
            elif n not in (1, known):
                raise ShapeError(f"einsum {spec}: index {ch!r} has size {known} in "
                                 f"'{where[ch]}' but {n} in '{name}'")
    free = [c for c in string.ascii_letters if c not in sizes]
    broadcasting = sum(n == 1 and sizes[ch] > 1 for sub, shape in zip(spec.inputs, shapes) for ch, n in zip(sub, shape))
    if broadcasting > len(free):
        raise ShapeError(f"einsum {spec}: broadcasting {broadcasting} size-1 dimensions needs as many index "
                         f"letters besides the spec's, and only {len(free)} are left")
    free = iter(free)
    inputs = []
    for sub, shape in zip(spec.inputs, shapes):
        renamed = {ch: next(free) for ch, n in zip(sub, shape) if n == 1 and sizes[ch] > 1}
        inputs.append("".join(renamed.get(ch, ch) for ch in sub))
        sizes.update({new: 1 for new in renamed.values()})
    return EinsumSpec(tuple(inputs), spec.output), sizes
