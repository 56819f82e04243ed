"""Argument checking for the structural ops: indexing, reshape, transpose, concat."""

from __future__ import annotations

from math import prod

from tra_sql.errors import ShapeError


def check_axis(axis: int, rank: int, name: str) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"axis {axis} is out of range for '{name}' of rank {rank}")
    return axis % rank


def index_bounds(index, shape: tuple[int, ...], name: str):
    """(starts, stops, dimensions dropped by integer indices) for basic indexing."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise ShapeError(f"too many indices for '{name}' of shape {shape}")
    starts, stops, dropped = [], [], []
    for d, n in enumerate(shape):
        item = items[d] if d < len(items) else slice(None)
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step != 1:
                raise ShapeError(f"slice {item} of '{name}': only step 1 is supported")
            if stop <= start:
                raise ShapeError(f"slice {item} of '{name}' along axis {d} (size {n}) is empty")
        elif isinstance(item, int):
            if not -n <= item < n:
                raise ShapeError(f"index {item} is out of range for axis {d} of '{name}' (size {n})")
            start, stop = item % n, item % n + 1
            dropped.append(d)
        else:
            raise ShapeError(f"index {item!r} of '{name}': use integers and slices")
        starts.append(start)
        stops.append(stop)
    return tuple(starts), tuple(stops), dropped


def new_shape(shape, old: tuple[int, ...]) -> tuple[int, ...]:
    """Resolve a reshape target (a tuple or separate ints, one ``-1`` allowed)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    shape = tuple(int(n) for n in shape)
    size = prod(old)
    if shape.count(-1) > 1 or any(n < -1 or n == 0 for n in shape):
        raise ShapeError(f"cannot reshape {old} to {shape}")
    if -1 in shape:
        rest = prod(n for n in shape if n != -1)
        if size % rest:
            raise ShapeError(f"cannot reshape {old} (size {size}) to {shape}")
        shape = tuple(size // rest if n == -1 else n for n in shape)
    if prod(shape) != size:
        raise ShapeError(f"cannot reshape {old} (size {size}) to {shape} (size {prod(shape)})")
    return shape


def permutation(axes, rank: int) -> tuple[int, ...]:
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    perm = tuple(axes) if axes else tuple(reversed(range(rank)))
    if sorted(a % rank if rank else a for a in perm) != list(range(rank)):
        raise ShapeError(f"axes {perm} are not a permutation of {rank} axes")
    return tuple(a % rank for a in perm)
