"""Native tile aggregates (kinds ``reduce_<agg>_<dtype>``, ``protocol.TILE_REDUCTIONS``): one
tile of state per group, each row's tile folded into it element-wise, as ``tra_reduce`` folds a
group's ``ARRAY_AGG`` list with the aggregate's ufunc, without the list. A group's tiles are
its partial results (one output tile's), so they share one size: the first sets the state's,
and a tile of another size or a NULL one is a ``CorruptTileError``.

The state (16 bytes in DuckDB's state memory) holds the address and length of a buffer of its
own (``malloc``): DuckDB's ``memory_limit`` does not count it and DuckDB cannot spill it
(``tra_sql.decompose.cost`` charges it). One set of callbacks serves every kind; a function's
extra info says its aggregate and dtype (``OPS``). The fused contraction aggregate (``fused``)
and the placement aggregates (``placement``) have the same state, combine and finalize, with
updates of their own."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import CORRUPT, address, blob, f32, f64, put_text, u8, u64, valid
from tra_sql.udfs.native.plans import OVERLAY, STATE

malloc = types.ExternalFunction("malloc", types.uint64(types.uint64))
free = types.ExternalFunction("free", types.void(types.uint64))
memcpy = types.ExternalFunction("memcpy", types.uint64(types.uint64, types.uint64, types.uint64))


@njit(cache=True)
def _fold(agg, acc, v):
    """``acc`` = agg(acc, v) element-wise; NaN wins in max and min, as in NumPy's."""
    if agg == 0:
        for i in range(len(acc)):
            acc[i] += v[i]
    elif agg == 1:
        for i in range(len(acc)):
            if not (acc[i] != acc[i] or acc[i] >= v[i]):
                acc[i] = v[i]
    elif agg == 2:
        for i in range(len(acc)):
            if not (acc[i] != acc[i] or acc[i] <= v[i]):
                acc[i] = v[i]
    else:
        for i in range(len(acc)):
            acc[i] *= v[i]


@njit(cache=True)
def _overlay(target, source, nbytes) -> None:
    """OR the ``nbytes`` at ``source`` into those at ``target``."""
    words = nbytes // 8
    to, of = u64(target, words), u64(source, words)
    for i in range(words):
        to[i] |= of[i]
    rest, start = u8(target, nbytes), u8(source, nbytes)
    for i in range(8 * words, nbytes):
        rest[i] |= start[i]


@njit(cache=True)
def _combine(ops, target, source, nbytes):
    """Fold the ``nbytes`` of tile elements at ``source`` into those at ``target``."""
    if ops[0] == OVERLAY:
        _overlay(target, source, nbytes)
    elif ops[1] == 0:
        _fold(ops[0], f32(target, nbytes // 4), f32(source, nbytes // 4))
    else:
        _fold(ops[0], f64(target, nbytes // 8), f64(source, nbytes // 8))


@njit(cache=True)
def corrupt(info, text):
    """Set the call's error: a ``CorruptTileError`` saying ``text``."""
    out = np.zeros(len(CORRUPT) + len(text) + 1, np.uint8)
    put_text(out, put_text(out, 0, CORRUPT), text)
    C.duckdb_aggregate_function_set_error(info, out.ctypes.data)


@native(types.uint64(types.voidptr))
def STATE_SIZE(info):
    return STATE


@native(types.void(types.voidptr, types.voidptr))
def INIT(info, state):
    u64(address(state), 2)[:] = 0


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def UPDATE(info_ptr, chunk_ptr, states_ptr):
    info, chunk, states = address(info_ptr), address(chunk_ptr), address(states_ptr)
    ops = u64(C.duckdb_aggregate_function_get_extra_info(info), 2)
    tiles = C.duckdb_data_chunk_get_vector(chunk, 2)
    data, validity = C.duckdb_vector_get_data(tiles), C.duckdb_vector_get_validity(tiles)
    n = C.duckdb_data_chunk_get_size(chunk)
    pointers = u64(states, n)
    item = 4 if ops[1] == 0 else 8
    for row in range(n):
        if not valid(validity, row):
            corrupt(info, np.frombuffer(b"a partial result tile is NULL", np.uint8))
            return
        at, held = blob(data, row)
        state = u64(pointers[row], 2)
        if held % item:
            corrupt(info, np.frombuffer(b"a partial result tile's size is not "
                                        b"a whole number of elements", np.uint8))
            return
        if state[0] == 0:
            state[0] = malloc(max(held, 1))
            state[1] = held
            memcpy(state[0], at, held)
        elif state[1] != held:
            corrupt(info, np.frombuffer(b"partial result tiles of one output "
                                        b"tile differ in size", np.uint8))
            return
        else:
            _combine(ops, state[0], at, held)


@native(types.void(types.voidptr, types.voidptr, types.voidptr, types.uint64))
def COMBINE(info_ptr, sources_ptr, targets_ptr, count):
    info = address(info_ptr)
    ops = u64(C.duckdb_aggregate_function_get_extra_info(info), 2)
    sources, targets = u64(address(sources_ptr), count), u64(address(targets_ptr), count)
    for i in range(count):
        source, target = u64(sources[i], 2), u64(targets[i], 2)
        if source[0] == 0:
            continue
        if target[0] == 0:  # the target takes the source's buffer
            target[0], target[1] = source[0], source[1]
            source[0], source[1] = 0, 0
        elif target[1] != source[1]:
            corrupt(info, np.frombuffer(b"partial result tiles of one output "
                                        b"tile differ in size", np.uint8))
            return
        else:
            _combine(ops, target[0], source[0], target[1])


@native(types.void(types.voidptr, types.voidptr, types.voidptr, types.uint64, types.uint64))
def FINALIZE(info_ptr, sources_ptr, result_ptr, count, offset):
    result = address(result_ptr)
    sources = u64(address(sources_ptr), count)
    for i in range(count):
        state = u64(sources[i], 2)
        if state[0] == 0:  # a group without rows: no tile
            C.duckdb_vector_ensure_validity_writable(result)
            C.duckdb_validity_set_row_invalid(C.duckdb_vector_get_validity(result), offset + i)
        else:
            C.duckdb_vector_assign_string_element_len(result, offset + i, state[0], state[1])


@native(types.void(types.voidptr, types.uint64))
def DESTROY(states_ptr, count):
    states = u64(address(states_ptr), count)
    for i in range(count):
        state = u64(states[i], 2)
        if state[0] != 0:
            free(state[0])
            state[0] = 0

