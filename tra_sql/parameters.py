"""Trainable parameters: stored tensors drawn once by an initializer (``parameter``), so a
resumed script picks the stored ones up."""

from __future__ import annotations

import zlib
from math import prod, sqrt
from typing import TYPE_CHECKING

import numpy as np

from tra_sql.errors import ShapeError, SpecError

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) for a weight used as ``x @ W`` (inputs on the leading axes)."""
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    return prod(shape[:-1]), shape[-1]


def initial_value(shape: tuple[int, ...], init, rng: np.random.Generator, scale: float | None = None) -> np.ndarray:
    """An initial array: ``zeros``, ``ones``, ``normal`` (std ``scale``, default 1),
    ``uniform`` (±``scale``, default 1), ``glorot_uniform``/``xavier_uniform``,
    ``glorot_normal``, ``he_normal``, ``fan_in_uniform`` (±1/sqrt(fan_in), PyTorch's Linear
    default); an array; or a function ``(rng, shape) -> array``."""
    fan_in, fan_out = _fans(shape)
    if callable(init):
        return np.asarray(init(rng, shape))
    if not isinstance(init, str):
        array = np.asarray(init)
        if array.shape != tuple(shape):
            raise ShapeError(f"initial value has shape {array.shape}, expected {tuple(shape)}")
        return array
    s = scale
    table = {
        "zeros": lambda: np.zeros(shape),
        "ones": lambda: np.ones(shape),
        "normal": lambda: rng.standard_normal(shape) * (1.0 if s is None else s),
        "uniform": lambda: rng.uniform(-(s or 1.0), s or 1.0, shape),
        "glorot_uniform": lambda: rng.uniform(-1, 1, shape) * sqrt(6 / (fan_in + fan_out)),
        "xavier_uniform": lambda: rng.uniform(-1, 1, shape) * sqrt(6 / (fan_in + fan_out)),
        "glorot_normal": lambda: rng.standard_normal(shape) * sqrt(2 / (fan_in + fan_out)),
        "he_normal": lambda: rng.standard_normal(shape) * sqrt(2 / fan_in),
        "fan_in_uniform": lambda: rng.uniform(-1, 1, shape) / sqrt(fan_in),
    }
    if init not in table:
        raise SpecError(f"initializer {init!r} is not one of {', '.join(table)}")
    return table[init]()


def parameter(db: Session, name: str, shape=None, init="glorot_uniform", *, seed: int = 0, dtype="float64",
              tile=None, scale: float | None = None, replace: bool = False) -> Tensor:
    """The parameter tensor ``name``: the stored one if it exists (a resumed run), else a new
    one drawn by ``init`` from a generator seeded with (``seed``, the name); a stored one of
    another shape than ``shape`` (or ``init``'s, an array's) raises ``ShapeError``. With
    ``replace`` it is drawn anew, replacing a stored one only once the draw succeeded."""
    if shape is None and not isinstance(init, str) and not callable(init):
        shape = np.shape(init)
    if not replace and name.lower() in (t.lower() for t in db.tensors()):
        stored = db.tensor(name)
        if shape is not None and tuple(int(n) for n in shape) != stored.shape:
            raise ShapeError(f"parameter '{name}' is stored with shape {stored.shape}, not {tuple(shape)}: "
                             f"drop it or use another name")
        return stored
    if shape is None:
        shape = np.shape(init)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    value = initial_value(tuple(int(n) for n in shape), init, rng, scale).astype(dtype)
    return db.from_numpy(name, value, tile=tile, replace=replace)
