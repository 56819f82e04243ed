"""The Python implementations of the kernel kinds (Arrow arrays in, an Arrow array out, one
call per batch of rows): each kernel module declares its functions with ``@implements``."""

from __future__ import annotations

from collections.abc import Callable

from tra_sql.udfs.protocol import SIGNATURES

#: kind -> the function computing a batch of calls of that kind
IMPLEMENTATIONS: dict[str, Callable] = {}


def implements(kind: str) -> Callable[[Callable], Callable]:
    """Decorator: the function computes kernels of ``kind`` (a kind of ``protocol.SIGNATURES``)."""
    if kind not in SIGNATURES:
        raise ValueError(f"no kernel kind {kind!r}")

    def add(function: Callable) -> Callable:
        if kind in IMPLEMENTATIONS:
            raise ValueError(f"kernel kind {kind!r} already has an implementation")
        IMPLEMENTATIONS[kind] = function
        return function
    return add
