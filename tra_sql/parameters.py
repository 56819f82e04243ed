"""Trainable parameters: stored tensors drawn once by an initializer (``parameter``), so a
resumed script picks the stored ones up."""

from __future__ import annotations

import zlib
from math import prod, sqrt
from typing import TYPE_CHECKING

import numpy as np

from tra_sql import catalog
from tra_sql.errors import DTypeError, ShapeError, SpecError

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) for a weight used as ``x @ W`` (inputs on the leading axes)."""
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    return prod(shape[:-1]), shape[-1]


#: The named initializers: (generator, shape, scale, fan_in, fan_out) -> array.
INITIALIZERS = {
    "zeros": lambda rng, shape, s, fi, fo: np.zeros(shape),
    "ones": lambda rng, shape, s, fi, fo: np.ones(shape),
    "normal": lambda rng, shape, s, fi, fo: rng.standard_normal(shape) * (1.0 if s is None else s),
    "uniform": lambda rng, shape, s, fi, fo: rng.uniform(-(s or 1.0), s or 1.0, shape),
    "glorot_uniform": lambda rng, shape, s, fi, fo: rng.uniform(-1, 1, shape) * sqrt(6 / (fi + fo)),
    "xavier_uniform": lambda rng, shape, s, fi, fo: rng.uniform(-1, 1, shape) * sqrt(6 / (fi + fo)),
    "glorot_normal": lambda rng, shape, s, fi, fo: rng.standard_normal(shape) * sqrt(2 / (fi + fo)),
    "he_normal": lambda rng, shape, s, fi, fo: rng.standard_normal(shape) * sqrt(2 / fi),
    "fan_in_uniform": lambda rng, shape, s, fi, fo: rng.uniform(-1, 1, shape) / sqrt(fi),
}


def initial_value(shape: tuple[int, ...], init, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """An initial array: ``zeros``, ``ones``, ``normal`` (std ``scale``, default 1),
    ``uniform`` (±``scale``, default 1), ``glorot_uniform``/``xavier_uniform``,
    ``glorot_normal``, ``he_normal``, ``fan_in_uniform`` (±1/sqrt(fan_in), PyTorch's Linear
    default); an array; or a function ``(rng, shape) -> array``."""
    if callable(init):
        return np.asarray(init(rng, shape))
    if not isinstance(init, str):
        array = np.asarray(init)
        if array.shape != tuple(shape):
            raise ShapeError(f"initial value has shape {array.shape}, expected {tuple(shape)}")
        return array
    return INITIALIZERS[check_initializer(init)](rng, shape, scale, *_fans(shape))


def check_initializer(init: str) -> str:
    """``init``, if it names an initializer."""
    if init not in INITIALIZERS:
        raise SpecError(f"initializer {init!r} is not one of {', '.join(INITIALIZERS)}")
    return init


def parameter(db: Session, name: str, shape=None, init="glorot_uniform", *, seed: int = 0, dtype=None,
              tile=None, scale: float | None = None, replace: bool = False) -> Tensor:
    """The parameter tensor ``name``: the stored one if it exists (a resumed run), else a new
    one drawn by ``init`` from a generator seeded with (``seed``, the name), of ``dtype``
    (float64 if not given). A stored one of another shape than ``shape`` (or ``init``'s, an
    array's) or another tiling than ``tile`` raises ``ShapeError``, of another ``dtype``
    ``DTypeError``; the arguments are checked either way. With ``replace`` it is drawn anew,
    replacing a stored one only once the draw succeeded."""
    if dtype is not None:
        dtype = catalog.check_dtype(dtype)
    if isinstance(init, str):
        check_initializer(init)
    if shape is None and not isinstance(init, str) and not callable(init):
        shape = np.shape(init)
    if not replace and name.lower() in (t.lower() for t in db.tensors()):
        stored = db.tensor(name)
        if shape is not None and tuple(int(n) for n in shape) != stored.shape:
            raise ShapeError(f"parameter '{name}' is stored with shape {stored.shape}, not {tuple(shape)}: "
                             f"drop it or use another name")
        if dtype is not None and dtype != stored.dtype:
            raise DTypeError(f"parameter '{name}' is stored as {stored.dtype}, not {dtype}: "
                             f"drop it or use another name")
        if tile is not None and catalog.check_tile(stored.shape, tile, name) != stored.tile:
            raise ShapeError(f"parameter '{name}' is stored in tiles of {stored.tile}, not {tuple(tile)}: "
                             f"drop it or use another name")
        return stored
    if shape is None:
        shape = np.shape(init)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    value = initial_value(tuple(int(n) for n in shape), init, rng, scale).astype(dtype or np.float64)
    return db.from_numpy(name, value, tile=tile, replace=replace)
