"""``Cast``: a tensor converted to another dtype, tile by tile (``Tensor.astype``), with its
rules: the lowering (one ``tra_cast`` call per tile), the gradient (the incoming gradient cast
back), completeness (its input's). The planner keeps its tiling (no ``ROLE`` rule: FIXED)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sqlglot import exp

from tra_sql.absent import COMPLETE, Completeness
from tra_sql.autodiff import GRADIENT, Context
from tra_sql.catalog import check_dtype
from tra_sql.compile import blocks
from tra_sql.compile.blocks import array, call, key, select_keys
from tra_sql.compile.lowering import LOWERING, Relations
from tra_sql.errors import DTypeError, ShapeError
from tra_sql.graph import Node
from tra_sql.udfs.cast import CAST, CastStep


@dataclass(eq=False)
class Cast(Node):
    """``sources[0]`` converted to ``dtype`` (same shape and tiles; dense tiles only)."""

    sources: tuple[Node, ...]

    INPUTS: ClassVar[str] = "sources"

    def __post_init__(self):
        src = self.sources[0]
        if src.layout != "dense":
            raise ShapeError(f"{self.label} needs dense tiles, but {src.label} is stored {src.layout}: "
                             f"store it dense to cast it")

    @property
    def label(self) -> str:
        return f"cast {self.sources[0].dtype} -> {self.dtype}"


def cast(node: Node, dtype, name: str) -> Node:
    """``node`` (tensor ``name``, for errors) converted to ``dtype``, one of the dtypes
    tra_sql stores (``node`` itself if it has that dtype already)."""
    try:
        target = check_dtype(dtype)
    except (DTypeError, TypeError) as err:
        raise DTypeError(f"cannot cast '{name}' to {dtype!r}: {err}") from None
    if target == node.dtype:
        return node
    return Cast(node.shape, target, node.tile, (node,))


@LOWERING.register(Cast)
def _lower_cast(node: Cast, relations: Relations) -> exp.Select:
    """``SELECT k0.., tra_cast(step, [k0..], tile) FROM <input>``."""
    (ref,), (name,) = relations(node.inputs)
    src = node.sources[0]
    keys = [exp.column(key(d), "x") for d in range(len(node.shape))]
    step = CastStep(name, src.dtype.name, node.dtype.name, tuple(node.shape), tuple(node.tile))
    tile = call(CAST, step, [array([k.copy() for k in keys]), exp.column("tile", "x")])
    return exp.select(*select_keys(keys, tile)).from_(blocks.table(ref, "x"))


@GRADIENT.register(Cast)
def _cast_gradient(node: Cast, g: Node, needs: set[int], ctx: Context):
    """The gradient cast back to the input's dtype (none into an integer input: it is not
    in ``needs``, as autodiff only differentiates through floats)."""
    src = node.sources[0]
    if id(src) in needs:
        part = cast(g, src.dtype, "gradient")
        if (id(node), id(g)) in ctx.tight:  # same keys as the gradient
            ctx.tight.add((id(src), id(part)))
        yield src, part


@COMPLETE.register(Cast)
def _cast_complete(node: Cast, complete: Completeness) -> bool:
    return complete(node.sources[0])
