"""Optimizers as einsums over weight tables: SGD (with momentum / Nesterov), Adam and AdamW.

An optimizer step maps a parameter ``W``, its gradient ``g`` and its state tensors (momentum
buffer, Adam's moments) to their new values, each one elementwise einsum whose join is the
update rule; ``tra_sql.train`` stores them and swaps them into the tables in one transaction.
Hyperparameters that change from step to step (the learning rate under a schedule, Adam's
bias corrections) are scalar tensors in the join, not constants in its text, so the same SQL
and the same compiled kernels serve every step. Conventions are PyTorch's: ``weight_decay`` is
L2 added to the gradient (SGD, Adam) or decoupled (AdamW); momentum has no dampening.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from tra_sql.errors import SpecError

if TYPE_CHECKING:
    from tra_sql.session import Session
    from tra_sql.tensor import Tensor

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _f(value: float) -> str:
    return repr(float(value))


def _check(value, what: str, below: float = math.inf) -> None:
    """``value`` must be a finite number in [0, ``below``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < below:
        limit = "a finite number >= 0" if below == math.inf else f"in [0, {below:g})"
        raise SpecError(f"{what} must be {limit}, got {value!r}")


@dataclass
class Optimizer:
    """Base class: ``lr`` is a number or a function of the step (1, 2, ...); ``weight_decay``
    a number or a mapping from parameter name to number (absent names: 0)."""

    lr: float | Callable[[int], float] = 1e-3
    weight_decay: float | Mapping[str, float] = 0.0

    #: names of the state tensors kept per parameter (zeros at the start)
    slots: tuple[str, ...] = ()

    def __post_init__(self):
        """PyTorch's checks of the hyperparameters: a rate (not a schedule) and weight decay
        that are finite and not negative."""
        if not callable(self.lr):
            _check(self.lr, "lr")
        for name, wd in (self.weight_decay.items() if isinstance(self.weight_decay, Mapping)
                         else [(None, self.weight_decay)]):
            _check(wd, "weight_decay" if name is None else f"weight_decay of {name!r}")

    def rate(self, step: int) -> float:
        """The learning rate of step ``step``; a schedule's must be finite and not negative."""
        if not callable(self.lr):
            return float(self.lr)
        value = self.lr(step)
        _check(value, f"lr of step {step} (the schedule's value)")
        return float(value)

    def decay(self, name: str) -> float:
        wd = self.weight_decay
        return float(wd.get(name, 0.0) if isinstance(wd, Mapping) else wd)

    def scalars(self, step: int) -> dict[str, float]:
        """Per-step scalars for step ``step`` (1-based), as scalar tensors in the updates."""
        return {"lr": self.rate(step)}

    def update(self, db: Session, name: str, w: Tensor, g: Tensor, state: dict[str, Tensor],
               scalars: dict[str, Tensor]) -> dict[str, Tensor]:
        """New values: ``{"param": W', slot: state', ...}`` (lazy tensors)."""
        raise NotImplementedError

    def describe(self) -> str:
        """A stable description (stored with a run, checked when it resumes)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if callable(value):
                value = getattr(value, "__name__", type(value).__name__)
            elif isinstance(value, Mapping):
                value = dict(sorted(value.items()))
            parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _ew(db: Session, tensors: list[Tensor], n_scalars: int, join: str) -> Tensor:
    """An elementwise einsum over equally shaped ``tensors`` followed by scalar tensors."""
    idx = LETTERS[: tensors[0].ndim]
    spec = ",".join([idx] * (len(tensors) - n_scalars) + [""] * n_scalars) + "->" + idx
    return db.einsum(spec, *tensors, join=join)


def _decayed(grad: str, param: str, wd: float) -> str:
    return f"({grad} + {_f(wd)} * {param})" if wd else grad


@dataclass
class SGD(Optimizer):
    """``W -= lr * d`` with ``d = g + wd W``; with momentum ``b = mu b + d`` and ``d = b``
    (Nesterov: ``d + mu b``)."""

    lr: float | Callable[[int], float] = 1e-2
    momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        super().__post_init__()
        _check(self.momentum, "momentum")
        if self.nesterov and not self.momentum:
            raise SpecError("Nesterov momentum needs momentum > 0")
        self.slots = ("momentum",) if self.momentum else ()

    def update(self, db, name, w, g, state, scalars):
        """With momentum, the new parameter reads the old buffer (the new one is written out
        in its join), as Adam's reads the old moments."""
        wd, mu = self.decay(name), self.momentum
        if not mu:
            return {"param": _ew(db, [w, g, scalars["lr"]], 1, f"x0 - x2 * {_decayed('x1', 'x0', wd)}")}
        buf = _ew(db, [state["momentum"], g, w], 0, f"{_f(mu)} * x0 + {_decayed('x1', 'x2', wd)}")
        d = _decayed("x2", "x0", wd)
        new_buf = f"({_f(mu)} * x1 + {d})"
        step = f"({d} + {_f(mu)} * {new_buf})" if self.nesterov else new_buf
        return {"param": _ew(db, [w, state["momentum"], g, scalars["lr"]], 1, f"x0 - x3 * {step}"),
                "momentum": buf}


@dataclass
class Adam(Optimizer):
    """Adam (Kingma & Ba) as PyTorch computes it: ``m = b1 m + (1-b1) d``,
    ``v = b2 v + (1-b2) d^2``, ``W -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` with
    ``d = g + wd W`` and bias corrections ``bc = 1 - beta^t``."""

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    slots: tuple[str, ...] = ("m", "v")

    decoupled = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise SpecError(f"betas must be two numbers, got {self.betas!r}")
        for k, beta in enumerate(self.betas):
            _check(beta, f"betas[{k}]", below=1.0)
        _check(self.eps, "eps")

    def scalars(self, step):
        b1, b2 = self.betas
        lr = self.rate(step)
        return {"lr": lr, "step_size": lr / (1 - b1 ** step), "inv_bc2": 1 / math.sqrt(1 - b2 ** step)}

    def moments(self, m: str, v: str, d: str) -> tuple[str, str]:
        """The new moments' expressions, given the old ones' and the decayed gradient's."""
        b1, b2 = self.betas
        return f"({_f(b1)} * {m} + {_f(1 - b1)} * {d})", f"({_f(b2)} * {v} + {_f(1 - b2)} * {d} * {d})"

    def update(self, db, name, w, g, state, scalars):
        """The new parameter reads the old moments (the new ones are written out in its join),
        so it does not wait for the moment steps, nor read their results a second time."""
        wd = 0.0 if self.decoupled else self.decay(name)
        own = self.moments("x0", "x0", _decayed("x1", "x2", wd))  # a moment's step: x0 its old value, x1 g, x2 W
        m = _ew(db, [state["m"], g, w], 0, own[0])
        v = _ew(db, [state["v"], g, w], 0, own[1])
        new_m, new_v = self.moments("x1", "x2", _decayed("x3", "x0", wd))
        step = f"x4 * {new_m} / (sqrt({new_v}) * x5 + {_f(self.eps)})"
        operands = [w, state["m"], state["v"], g, scalars["step_size"], scalars["inv_bc2"]]
        if self.decoupled and self.decay(name):
            new = _ew(db, operands + [scalars["lr"]], 3, f"x0 - x6 * {_f(self.decay(name))} * x0 - {step}")
        else:
            new = _ew(db, operands, 2, f"x0 - {step}")
        return {"param": new, "m": m, "v": v}


@dataclass
class AdamW(Adam):
    """Adam with decoupled weight decay: ``W -= lr * wd * W`` besides the Adam step."""

    decoupled = True
