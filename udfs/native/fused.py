"""The fused contraction aggregate (kinds ``contract_agg_<dtype>``, ``protocol.CONTRACTIONS``):
``tra_contract_agg_float32(step, keys, keys0, tile0, keys1, tile1)`` over a group's joined
rows multiplies each row's pair of tiles straight into the group's state (``?gemm`` with
beta = 1; the first with beta = 0), so no partial product is ever a BLOB. Its state is a
whole-tile sum's (``aggregate``: the output tile ``malloc``ed, outside DuckDB's memory_limit):
combine adds states element-wise, finalize writes each tile once.

DuckDB's C API gives aggregates no bind callback, so one function per dtype serves every
step: its update reads the step text of its first argument and asks the binding for that
step's plan (``plans.found``, the scalar product's) through a callback (``plans.LOOKUP``: text
address and length to the address of a ``found`` record), once per chunk and whenever the text
changes; the binding builds each plan once and keeps it. A text that is not a native BLAS
product's step, or one of another dtype, is an error, and every tile is checked against the
plan before it is read (``operands.operands``), so a call written by hand with any arguments
fails cleanly."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs.native.aggregate import corrupt, malloc
from tra_sql.udfs.native.contract import gemm
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import address, blob, call2, i64, u8, u64, valid
from tra_sql.udfs.native.operands import gemm_sizes, operands, plan_length, set_error
from tra_sql.udfs.native.plans import EXTRA, HEADER
from tra_sql.udfs.nopython import lock, unlock

FUSED = np.frombuffer(b"a fused contraction", np.uint8)  # the function, in its errors


@njit(cache=True)
def _say(start, noun, end):
    return np.concatenate((np.frombuffer(start, np.uint8), noun, np.frombuffer(end, np.uint8)))


@njit(cache=True)
def step_text(info, texts, validity, row, noun):
    """(address, length) of row ``row``'s step text; length -1 after reporting a NULL step
    (``noun`` names the function, as bytes: ``FUSED``)."""
    if not valid(validity, row):
        corrupt(info, _say(b"the step of ", noun, b" is NULL"))
        return np.uint64(0), np.int64(-1)
    return blob(texts, row)


@njit(cache=True)
def looked_up(info, extra, at, length, noun):
    """The address of the plan the binding keeps for the step text at ``at`` (``length``
    bytes; the ``LOOKUP`` callback of the function's extra info ``extra`` answers a ``found``
    record); 0 after reporting why there is none."""
    record = call2(np.uint64(extra[2]), at, np.uint64(length))
    if record == 0:  # the callback failed (it answers every text otherwise)
        corrupt(info, _say(b"no plan for the step of ", noun, b""))
        return np.uint64(0)
    if i64(record, 1)[0] != 0:
        set_error(info, True, u8(record + np.uint64(16), i64(record, 2)[1] + 1))
        return np.uint64(0)
    return record + np.uint64(8)


@njit(cache=True)
def step_plan(info, extra, at, length, noun):
    """``looked_up``'s plan, checked to be of the function's dtype; 0 after reporting why
    there is none."""
    plan_at = looked_up(info, extra, at, length, noun)
    if plan_at == 0:
        return plan_at
    if i64(plan_at, HEADER)[0] != extra[1]:
        corrupt(info, _say(b"the step of ", noun, b" has another dtype than the function"))
        return np.uint64(0)
    return plan_at


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def UPDATE(info_ptr, chunk_ptr, states_ptr):
    info, chunk, states = address(info_ptr), address(chunk_ptr), address(states_ptr)
    extra = i64(C.duckdb_aggregate_function_get_extra_info(info), EXTRA)
    steps = C.duckdb_data_chunk_get_vector(chunk, 0)
    texts, validity = C.duckdb_vector_get_data(steps), C.duckdb_vector_get_validity(steps)
    rows = C.duckdb_data_chunk_get_size(chunk)
    pointers = u64(states, rows)
    text_at, text_length = np.uint64(0), np.int64(-1)
    plan_at = np.uint64(0)
    tiles, extents, seen = np.empty(2, np.uint64), np.empty(0, np.int64), np.empty(0, np.int64)
    sizes = np.empty(4, np.int64)
    for row in range(rows):
        at, length = step_text(info, texts, validity, row, FUSED)
        if length < 0:
            return
        if at != text_at or length != text_length:  # a new step text: its plan from the binding
            plan_at = step_plan(info, extra, at, length, FUSED)
            if plan_at == 0:
                return
            head = i64(plan_at, HEADER)
            extents, seen = np.empty(max(head[13], 1), np.int64), np.empty(2 * head[14], np.int64)
            text_at, text_length = at, length
        steps_plan = i64(plan_at, plan_length(i64(plan_at, HEADER)))
        if not operands(info, True, steps_plan, chunk, row, tiles, extents, seen):
            return
        gemm_sizes(steps_plan, extents, sizes)
        batch, m, k, n = sizes[0], sizes[1], sizes[2], sizes[3]
        nbytes = batch * m * n * steps_plan[1]
        state = u64(pointers[row], 2)
        beta = 1.0
        if state[0] == 0:
            state[0] = malloc(max(nbytes, 1))
            state[1] = nbytes
            beta = 0.0
        elif state[1] != nbytes:
            corrupt(info, np.frombuffer(b"the products of one output tile differ in size", np.uint8))
            return
        if nbytes:
            lock(np.uint64(steps_plan[5]))  # BLAS uses every core: one product at a time
            gemm(steps_plan, steps_plan[6:9], tiles[0], tiles[1], state[0], batch, m, n, k, beta)
            unlock(np.uint64(steps_plan[5]))

