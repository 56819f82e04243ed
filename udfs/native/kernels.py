"""Native kernels on a DuckDB connection: ``NativeKernels.attach`` loads tra_sql's extension on
it (``loader``) and registers the kinds of ``NATIVE`` (``protocol.Kernel`` kinds with a native
implementation) through the C API; every other kind stays an Arrow UDF (``udfs.register``).

A native scalar kernel is specialised per step when DuckDB binds a call: the bind callback
reads the call's constant step argument, and the call's bind data points to the step's plan
(an int64 array this object keeps for the connection's life). Aggregates have no bind: the
fused contraction aggregate (``fused``) asks this object for a step's plan while it runs, by
the step's text (``_lookup``). Callbacks are loaded from their images (``images``) and plans
built by ``plans``: registering kernels and binding steps import no Numba where every kernel
has its image."""

from __future__ import annotations

import ctypes
import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import duckdb
import numpy as np

from tra_sql.errors import SpecError
from tra_sql.udfs import blas
from tra_sql.udfs.native import capi, images, loader, plans
from tra_sql.udfs.native.capi import CAPI
from tra_sql.udfs.protocol import ATTENTIONS, CONTRACTIONS, PLACEMENTS, REDUCTIONS, ChainStep, EinsumStep, Kernel

_TYPES = {"VARCHAR": capi.VARCHAR, "BIGINT": capi.BIGINT, "BLOB": capi.BLOB}
_BIND = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@dataclass(frozen=True)
class Native:
    """A kind's native implementation: the scalar function callback's address and the plan of
    a step (its arrays: the first is the bind data) for its bind callback."""

    callback: Callable[[], int]
    plan: Callable[[str], tuple[np.ndarray, ...]]


def _row(kind: str) -> Native:
    """The per-row kernel (``contract.KERNEL``), specialised by its step's plan (``plans.plan``)."""
    return Native(partial(_callback, "contract", "KERNEL"),
                  lambda text: plans.plan(EinsumStep.decode(text), product=kind == "contract"))


def _chain() -> Native:
    """The chain kernel (``chain.KERNEL``), specialised by its chain's plan (``chain.plan``)."""
    def plan(text: str) -> tuple[np.ndarray, ...]:
        from tra_sql.udfs.native import chain

        return chain.plan(ChainStep.decode(text))
    return Native(partial(_callback, "chain", "KERNEL"), plan)


def _module(name: str) -> Native:
    """The kernel of module ``udfs.native.<name>`` (its ``KERNEL``), specialised by its step's
    plan (its ``plan``)."""
    def plan(text: str) -> tuple[np.ndarray, ...]:
        return importlib.import_module(f"tra_sql.udfs.native.{name}").plan(text)
    return Native(partial(_callback, name, "KERNEL"), plan)


def _callback(module: str, name: str) -> int:
    """The address of callback ``name`` of ``udfs.native.<module>``: its image's (``images``),
    the module imported (with Numba) only when there is none."""
    return images.callback(f"tra_sql.udfs.native.{module}", name)


#: kind -> its native implementation: the BLAS product (``contract.gemm_form``), the steps
#: ``contract.native_loop`` accepts and the chains ``contract.native_chain`` accepts
#: (``compile.dialect`` writes those as ``tra_loop_<n>`` and ``tra_loop_chain_<n>``), constant
#: tiles and dtype conversions
NATIVE: dict[str, Native] = {"contract": _row("contract"), "loop": _row("loop"), "loop_chain": _chain(),
                             "fill": _module("fill"), "cast": _module("cast")}


def requested() -> bool:
    """Whether native kernels are wanted: ``TRA_SQL_KERNELS`` is ``native`` (the default) or ``arrow``."""
    value = os.environ.get("TRA_SQL_KERNELS", "native").strip().lower()
    if value not in ("native", "arrow"):
        raise SpecError(f"TRA_SQL_KERNELS={value!r}: use 'native' or 'arrow'")
    return value == "native"


def _declare(kernel: Kernel, function, add_parameter, set_return_type) -> None:
    """Give ``function`` (a scalar or an aggregate function) ``kernel``'s parameter and
    result types through that kind's two C API calls."""
    calls = [(add_parameter, sql_type) for sql_type in kernel.params] + [(set_return_type, kernel.result)]
    for call, sql_type in calls:
        logical = _logical(sql_type)
        call(function, logical)
        CAPI.duckdb_destroy_logical_type(ctypes.byref(ctypes.c_void_p(logical)))


def _logical(sql_type: str) -> int:
    if sql_type.endswith("[]"):
        child = _logical(sql_type[:-2])
        try:
            return CAPI.duckdb_create_list_type(child)
        finally:
            CAPI.duckdb_destroy_logical_type(ctypes.byref(ctypes.c_void_p(child)))
    return CAPI.duckdb_create_logical_type(_TYPES[sql_type])


class NativeKernels:
    """The native kernels registered on one database (through a C API connection to it)."""

    def __init__(self, connection: int, same: int, keep_heap: int):
        self.connection = ctypes.c_void_p(connection)
        self.same = same  # the identity bind-data copy callback
        self.keep_heap = keep_heap  # a malloc_trim that trims nothing (tra_sql.allocator.keep_duckdb_heap)
        self.plans: dict[tuple[str, str], tuple[np.ndarray, ...]] = {}
        self._lock = threading.Lock()
        # one bind callback per kind and the fused aggregates' plan lookup, kept alive while DuckDB may call them
        self._binds = {kind: _BIND(partial(self._bind_call, kind)) for kind in NATIVE}
        self._extra: dict[Kernel, np.ndarray] = {}  # the aggregates' extra info
        self._lookups: dict[str, object] = {}  # per aggregate family, its plan lookup callback

    @classmethod
    def attach(cls, con: duckdb.DuckDBPyConnection) -> NativeKernels | None:
        """Native kernels for ``con``'s database, or None where they cannot run there (not
        requested, the extension not built, unsigned extensions not allowed, no NumPy BLAS)."""
        if not requested() or not blas.FOUND:
            return None
        loaded = loader.load(con, capi.LIB.duckdb_connect)
        return cls(*loaded) if loaded else None

    def close(self) -> None:
        if self.connection.value:
            CAPI.duckdb_disconnect(ctypes.byref(self.connection))
            self.connection = ctypes.c_void_p()

    @staticmethod
    def implements(kernel: Kernel) -> bool:
        return (kernel.kind in NATIVE or kernel in REDUCTIONS or kernel in CONTRACTIONS or kernel.kind in ATTENTIONS
                or kernel in PLACEMENTS)

    def register(self, kernel: Kernel) -> None:
        """Register ``kernel`` (a kind of ``NATIVE``, a whole-tile reduction, a fused
        contraction, attention or placement aggregate) under its SQL name."""
        if kernel in REDUCTIONS:
            self._register_reduction(kernel)
            return
        if kernel in PLACEMENTS:
            self._register_placement(kernel)
            return
        if kernel in CONTRACTIONS:
            self._register_contraction(kernel)
            return
        if kernel.kind in ATTENTIONS:
            self._register_attention(kernel)
            return
        native = NATIVE[kernel.kind]
        function = CAPI.duckdb_create_scalar_function()
        try:
            CAPI.duckdb_scalar_function_set_name(function, kernel.name.encode())
            _declare(kernel, function, CAPI.duckdb_scalar_function_add_parameter,
                     CAPI.duckdb_scalar_function_set_return_type)
            CAPI.duckdb_scalar_function_set_special_handling(function)  # NULL tiles reach the kernel
            CAPI.duckdb_scalar_function_set_function(function, native.callback())
            CAPI.duckdb_scalar_function_set_bind(function, ctypes.cast(self._binds[kernel.kind], ctypes.c_void_p))
            if CAPI.duckdb_register_scalar_function(self.connection, function) != 0:
                raise RuntimeError(f"DuckDB refused native kernel {kernel.name}")
        finally:
            CAPI.duckdb_destroy_scalar_function(ctypes.byref(ctypes.c_void_p(function)))

    def _register_reduction(self, kernel: Kernel) -> None:
        """The aggregate function of a whole-tile reduction (``aggregate``)."""
        _, agg, dtype = kernel.kind.split("_")
        self._register_aggregate(kernel, _callback("aggregate", "UPDATE"), plans.OPS[agg, dtype])

    def _register_contraction(self, kernel: Kernel) -> None:
        """The fused contraction aggregate of one dtype (``fused``)."""
        lookup = self._lookup_address("contract_agg", plans.found)
        self._register_aggregate(kernel, _callback("fused", "UPDATE"),
                                 plans.extra_info(kernel.kind.split("_")[-1], lookup))

    def _register_attention(self, kernel: Kernel) -> None:
        """The native attention aggregate of one dtype and arity (``native.attention``)."""
        from tra_sql.udfs.native import attention

        lookup = self._lookup_address("attention_agg", attention.found)
        self._register_aggregate(kernel, _callback("attention", "UPDATE"),
                                 plans.extra_info(kernel.kind.split("_")[-1], lookup),
                                 (_callback("attention", "COMBINE"), _callback("attention", "FINALIZE"),
                                  _callback("aggregate", "DESTROY")))

    def _register_placement(self, kernel: Kernel) -> None:
        """A placement aggregate (``native.placement``): its states combine as the tile sum's
        (summed pieces) or OR-ed (``plans.OVERLAY``: written pieces; dtype code -1)."""
        from tra_sql.udfs.native import placement

        lookup = self._lookup_address("place", placement.found)
        extra = (np.array([plans.OVERLAY, -1, lookup], dtype=np.int64) if kernel.kind == "place_agg"
                 else plans.extra_info(kernel.kind.split("_")[-1], lookup))
        self._register_aggregate(kernel, _callback("placement", "UPDATE"), extra)

    def _lookup_address(self, family: str, found: Callable[[str], tuple[np.ndarray, ...]]) -> int:
        """The address of ``family``'s plan lookup callback (``plans.LOOKUP``), made once."""
        if family not in self._lookups:
            self._lookups[family] = plans.LOOKUP(partial(self._lookup, family, found))
        return ctypes.cast(self._lookups[family], ctypes.c_void_p).value

    def _register_aggregate(self, kernel: Kernel, update: int, extra: np.ndarray, callbacks=None) -> None:
        """An aggregate function with a whole-tile sum's state (``aggregate``), the callback at
        ``update`` folding rows into it and ``extra`` (kept while the database may call it) as
        its extra info; ``callbacks``: the addresses of its own (combine, finalize, destructor)
        instead of the sum's."""
        sum_callbacks = ("COMBINE", "FINALIZE", "DESTROY")
        combine, finalize, destroy = callbacks or (_callback("aggregate", name) for name in sum_callbacks)
        self._extra[kernel] = extra
        function = CAPI.duckdb_create_aggregate_function()
        try:
            CAPI.duckdb_aggregate_function_set_name(function, kernel.name.encode())
            _declare(kernel, function, CAPI.duckdb_aggregate_function_add_parameter,
                     CAPI.duckdb_aggregate_function_set_return_type)
            CAPI.duckdb_aggregate_function_set_special_handling(function)  # NULL tiles reach the update
            state_size, init = _callback("aggregate", "STATE_SIZE"), _callback("aggregate", "INIT")
            CAPI.duckdb_aggregate_function_set_functions(function, state_size, init, update, combine, finalize)
            CAPI.duckdb_aggregate_function_set_destructor(function, destroy)
            CAPI.duckdb_aggregate_function_set_extra_info(function, extra.ctypes.data, None)
            if CAPI.duckdb_register_aggregate_function(self.connection, function) != 0:
                raise RuntimeError(f"DuckDB refused native aggregate {kernel.name}")
        finally:
            CAPI.duckdb_destroy_aggregate_function(ctypes.byref(ctypes.c_void_p(function)))

    def _lookup(self, family: str, found, at: int, length: int) -> int:
        """The aggregates' callback (``plans.LOOKUP``): the address of the ``found`` record
        (``plans.found``, ``attention.found``) of the step text at ``at``, built once per text
        (0 only if that fails)."""
        try:
            text = ctypes.string_at(at, length).decode(errors="replace")
            with self._lock:
                if (family, text) not in self.plans:
                    self.plans[family, text] = found(text)
                return self.plans[family, text][0].ctypes.data
        except Exception:  # an exception must not cross into DuckDB
            return 0

    def _bind_call(self, kind: str, info: int) -> None:
        """DuckDB binds a call of ``kind``: the plan of its step becomes the call's bind data
        (an error becomes the bind's)."""
        try:
            text = _constant_text(info)
            with self._lock:
                if (kind, text) not in self.plans:
                    self.plans[kind, text] = NATIVE[kind].plan(text)
                plan = self.plans[kind, text]
            CAPI.duckdb_scalar_function_set_bind_data(info, plan[0].ctypes.data, None)
            CAPI.duckdb_scalar_function_set_bind_data_copy(info, self.same)
        except Exception as err:  # reported to DuckDB, which raises it
            CAPI.duckdb_scalar_function_bind_set_error(info, f"{capi.ERROR_PREFIX}{type(err).__name__}: {err}"
                                                       .encode())


def _constant_text(info: int) -> str:
    """The value of a bound call's first argument, a constant VARCHAR."""
    expression = ctypes.c_void_p(CAPI.duckdb_scalar_function_bind_get_argument(info, 0))
    context, value = ctypes.c_void_p(), ctypes.c_void_p()
    CAPI.duckdb_scalar_function_get_client_context(info, ctypes.byref(context))
    try:
        if not CAPI.duckdb_expression_is_foldable(expression):
            raise ValueError("the step argument of a native kernel must be a constant")
        error = ctypes.c_void_p(CAPI.duckdb_expression_fold(context, expression, ctypes.byref(value)))
        failed = error.value and CAPI.duckdb_error_data_has_error(error)
        if error.value:
            CAPI.duckdb_destroy_error_data(ctypes.byref(error))
        if failed or not value.value:
            raise ValueError("the step argument of a native kernel cannot be evaluated")
        chars = CAPI.duckdb_get_varchar(value)
        try:
            return ctypes.string_at(chars).decode()
        finally:
            CAPI.duckdb_free(chars)
    finally:
        if value.value:
            CAPI.duckdb_destroy_value(ctypes.byref(value))
        CAPI.duckdb_destroy_expression(ctypes.byref(expression))
        CAPI.duckdb_destroy_client_context(ctypes.byref(context))
