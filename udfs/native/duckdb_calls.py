"""DuckDB's C API as Numba external functions for native kernels: ``NATIVE.<name>`` for every
function of ``capi.SIGNATURES``, every pointer a ``uint64`` address (LLVM resolves them in the
library ``capi`` loads)."""

from __future__ import annotations

from types import ModuleType

from numba import types

from tra_sql.udfs.native.capi import SIGNATURES

# C type codes of ``capi.SIGNATURES`` -> Numba's
_NUMBA = {"p": types.uint64, "s": types.uint64, "i": types.uint64, "b": types.boolean, "n": types.int32,
          "v": types.void}

NATIVE = ModuleType(f"{__name__}.NATIVE")  # a module: nopython code resolves its attributes
for _name, _codes in SIGNATURES.items():
    _result, *_params = _codes.split()
    setattr(NATIVE, _name, types.ExternalFunction(_name, _NUMBA[_result](*(_NUMBA[c] for c in _params))))
