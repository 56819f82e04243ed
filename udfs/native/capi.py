"""DuckDB's C API, from the ``duckdb`` package's own extension module (``_duckdb`` exports it
whole): ``LIB``, ctypes functions for Python (``CAPI.<name>``), and the functions' signatures
(``SIGNATURES``; native kernels call them as ``duckdb_calls.NATIVE.<name>``)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import _duckdb
from llvmlite import binding

# C types by code: p pointer, s C string, i idx_t, b bool, n int (an enum or duckdb_state), v void
_CTYPES = {"p": ctypes.c_void_p, "s": ctypes.c_char_p, "i": ctypes.c_uint64, "b": ctypes.c_bool,
           "n": ctypes.c_int, "v": None}

#: name -> result code, parameter codes
SIGNATURES = {
    # connections and logical types
    "duckdb_connect": "n p p",
    "duckdb_disconnect": "v p",
    "duckdb_create_logical_type": "p n",
    "duckdb_create_list_type": "p p",
    "duckdb_destroy_logical_type": "v p",
    # scalar functions
    "duckdb_create_scalar_function": "p",
    "duckdb_destroy_scalar_function": "v p",
    "duckdb_scalar_function_set_name": "v p s",
    "duckdb_scalar_function_add_parameter": "v p p",
    "duckdb_scalar_function_set_return_type": "v p p",
    "duckdb_scalar_function_set_special_handling": "v p",
    "duckdb_scalar_function_set_function": "v p p",
    "duckdb_scalar_function_set_bind": "v p p",
    "duckdb_register_scalar_function": "n p p",
    # binding a scalar function call: its constant step argument, the parameters it derives
    "duckdb_scalar_function_bind_get_argument": "p p i",
    "duckdb_scalar_function_get_client_context": "v p p",
    "duckdb_destroy_client_context": "v p",
    "duckdb_expression_is_foldable": "b p",
    "duckdb_expression_fold": "p p p p",
    "duckdb_destroy_expression": "v p",
    "duckdb_error_data_has_error": "b p",
    "duckdb_destroy_error_data": "v p",
    "duckdb_get_varchar": "p p",
    "duckdb_destroy_value": "v p",
    "duckdb_free": "v p",
    "duckdb_scalar_function_set_bind_data": "v p p p",
    "duckdb_scalar_function_set_bind_data_copy": "v p p",
    "duckdb_scalar_function_bind_set_error": "v p s",
    # aggregate functions
    "duckdb_create_aggregate_function": "p",
    "duckdb_destroy_aggregate_function": "v p",
    "duckdb_aggregate_function_set_name": "v p s",
    "duckdb_aggregate_function_add_parameter": "v p p",
    "duckdb_aggregate_function_set_return_type": "v p p",
    "duckdb_aggregate_function_set_functions": "v p p p p p p",
    "duckdb_aggregate_function_set_destructor": "v p p",
    "duckdb_aggregate_function_set_special_handling": "v p",
    "duckdb_aggregate_function_set_extra_info": "v p p p",
    "duckdb_register_aggregate_function": "n p p",
    # what kernels call on DuckDB's threads
    "duckdb_data_chunk_get_size": "i p",
    "duckdb_data_chunk_get_column_count": "i p",
    "duckdb_data_chunk_get_vector": "p p i",
    "duckdb_vector_get_data": "p p",
    "duckdb_vector_get_validity": "p p",
    "duckdb_vector_ensure_validity_writable": "v p",
    "duckdb_validity_set_row_invalid": "v p i",
    "duckdb_list_vector_get_child": "p p",
    "duckdb_vector_assign_string_element_len": "v p i p i",
    "duckdb_scalar_function_get_bind_data": "p p",
    "duckdb_scalar_function_set_error": "v p s",
    "duckdb_aggregate_function_get_extra_info": "p p",
    "duckdb_aggregate_function_set_error": "v p s",
}

BIGINT, BLOB, VARCHAR = 5, 18, 17  # duckdb_type codes (duckdb.h)
ERROR_PREFIX = "tra_sql kernel: "  # of the errors kernels report; tra_sql.engines.duckdb translates them

LIB = ctypes.CDLL(_duckdb.__file__)
binding.load_library_permanently(_duckdb.__file__)  # native kernels resolve the API by name


def _python(name: str, codes: str):
    result, *params = codes.split()
    function = getattr(LIB, name)
    function.restype = _CTYPES[result]
    function.argtypes = [_CTYPES[c] for c in params]
    return function


CAPI = SimpleNamespace(**{name: _python(name, codes) for name, codes in SIGNATURES.items()})
