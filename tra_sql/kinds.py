"""Per-kind rules: each layer keeps one ``Rules`` table (SQL lowering, gradient, planner
hooks, ...) keyed by node class, and reaches every kind through it, never by ``isinstance``
chains. A new node kind registers its rules next to its definition."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Rules(Generic[F]):
    """One rule per node kind for one job (``what``, for error messages)."""

    def __init__(self, what: str):
        self.what = what
        self._by_kind: dict[type, F] = {}

    def register(self, kind: type) -> Callable[[F], F]:
        """Decorator: ``rule`` is this job's rule for nodes of class ``kind`` (and subclasses)."""
        def add(rule: F) -> F:
            if kind in self._by_kind:
                raise ValueError(f"{kind.__name__} already has a {self.what} rule")
            self._by_kind[kind] = rule
            return rule
        return add

    def get(self, node) -> F | None:
        """The rule for ``node``'s class (the nearest registered base class), or None."""
        for kind in type(node).__mro__:
            if kind in self._by_kind:
                return self._by_kind[kind]
        return None

    def __call__(self, node) -> F:
        rule = self.get(node)
        if rule is None:
            raise TypeError(f"no {self.what} rule for {type(node).__name__}")
        return rule
