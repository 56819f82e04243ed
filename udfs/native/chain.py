"""The native chain kernel (kind ``loop_chain``, ``tra_loop_chain_<n>``): per joined row, the
chain's einsums one after another (``protocol.ChainStep``), each step's result in a buffer of
its own that later steps read, the last one written once as the row's tile.

``plan`` is the leaves' plan (``plans.plan``'s layout, no output of its own: the leaves are
checked as a step's operands are, ``operands.operands``) followed by the chain's section: the
number of steps, the section's words, the most operands and dimensions a step has, the
largest rank of a step's result, then per step the offset of its record: the step's loop body
(``loops``; 0: the BLAS product), trans_a, trans_b, swap, operands, the result's rank,
dimensions; per operand its source (leaf ``m``, or ``-1 - k``: step ``k``'s result), rank and
first dimension; per dimension its BLAS group; per result dimension the dimension its extent
is read from."""

from __future__ import annotations

import numpy as np
from numba import types

from tra_sql.udfs.contract import gemm_form, native_chain
from tra_sql.udfs.native import loops
from tra_sql.udfs.native.contract import gemm
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import address, call3, i64
from tra_sql.udfs.native.operands import fold_dim, operands, plan_length
from tra_sql.udfs.native.plans import HEADER, OPERAND, code, dimensions, indices, sources, tables
from tra_sql.udfs.native.results import finish, reserve
from tra_sql.udfs.nopython import lock, unlock
from tra_sql.udfs.protocol import ChainStep

SECTION = 5  # words of the chain section's header


def plan(chain: ChainStep) -> tuple[np.ndarray, np.ndarray]:
    """(the plan, the text it points to) of a chain ``contract.native_chain`` accepts."""
    if not native_chain(chain):
        raise ValueError("the chain is not one of dense float steps a native kernel computes")
    leaves, dtype = chain.leaves, chain.leaves.out_dtype
    index = indices(leaves.inputs, leaves.output)
    last = chain.steps[-1]
    largest = np.dtype(dtype).itemsize * int(np.prod([min(last.tiles[c], last.sizes[c]) for c in last.output],
                                                     dtype=np.int64))
    head, text = tables(dtype, leaves.inputs, leaves.names, dimensions(leaves, index), [], [], (0, 0, 0), 0, 0,
                        len(leaves.inputs), len(index), largest=largest)
    records = []
    for step in chain.steps:
        form = gemm_form(step)
        blas = (form.trans_a, form.trans_b, form.swap) if form else (0, 0, 0)
        body = 0 if form else loops.body(step.inputs, step.output, code(step), step.agg, dtype)
        firsts = np.cumsum([0] + [len(sub) for sub in step.inputs])
        ops = [v for sub, source, first in zip(step.inputs, step.sources, firsts) for v in (source, len(sub), first)]
        groups = [g for groups in form.groups for g in groups] if form else [0] * int(firsts[-1])
        records.append([body, *blas, len(step.inputs), len(step.output), int(firsts[-1]), *ops, *groups,
                        *sources(step.inputs, step.output)])
    offsets = np.cumsum([SECTION + len(records)] + [len(r) for r in records])
    section = [len(records), int(offsets[-1]), max(len(s.inputs) for s in chain.steps),
               max(sum(map(len, s.inputs)) for s in chain.steps), max(len(s.output) for s in chain.steps),
               *(int(o) for o in offsets[:-1])]
    return np.concatenate([head, np.array(section + [v for r in records for v in r], dtype=np.int64)]), text


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def KERNEL(info_ptr, chunk_ptr, output_ptr):
    info, chunk, output = address(info_ptr), address(chunk_ptr), address(output_ptr)
    bind = C.duckdb_scalar_function_get_bind_data(info)
    c = plan_length(i64(bind, HEADER))
    plan = i64(bind, c + i64(bind + np.uint64(8 * c), 2)[1])
    count = plan[c]
    tiles, extents = np.empty(plan[2], np.uint64), np.empty(max(plan[13], 1), np.int64)
    seen, sizes = np.empty(2 * plan[14], np.int64), np.empty(4, np.int64)
    step_tiles, step_extents = np.empty(plan[c + 2], np.uint64), np.empty(max(plan[c + 3], 1), np.int64)
    result_extents = np.zeros((count, max(plan[c + 4], 1)), np.int64)
    results = np.zeros(count, np.uint64)
    buffers = [np.empty(0, np.uint8) for _ in range(count)]
    nbytes = 0
    for row in range(C.duckdb_data_chunk_get_size(chunk)):
        if not operands(info, False, plan, chunk, row, tiles, extents, seen):
            return
        for k in range(count):
            r = c + plan[c + SECTION + k]
            n = plan[r + 4]
            for j in range(n):
                source, rank, first = plan[r + 7 + 3 * j], plan[r + 8 + 3 * j], plan[r + 9 + 3 * j]
                if source >= 0:
                    step_tiles[j] = tiles[source]
                    leaf = plan[HEADER + OPERAND * source + 1]
                    for d in range(rank):
                        step_extents[first + d] = extents[leaf + d]
                else:
                    step_tiles[j] = results[-1 - source]
                    for d in range(rank):
                        step_extents[first + d] = result_extents[-1 - source, d]
            groups = r + 7 + 3 * n
            outs = groups + plan[r + 6]
            nbytes = plan[1]
            for d in range(plan[r + 5]):
                result_extents[k, d] = step_extents[plan[outs + d]]
                nbytes *= result_extents[k, d]
            if k == count - 1:  # the last result is written in the BLOB DuckDB allocates (``reserve``)
                results[k] = reserve(output, row, np.uint64(plan[18]), nbytes)
            else:
                if nbytes > len(buffers[k]):
                    buffers[k] = np.empty(nbytes, np.uint8)
                results[k] = buffers[k].ctypes.data
            if nbytes and plan[r] == 0:
                sizes[:] = 1
                for j in range(2):
                    first = plan[r + 9 + 3 * j]
                    for d in range(plan[r + 8 + 3 * j]):
                        fold_dim(sizes, j, plan[groups + first + d], step_extents[first + d])
                lock(np.uint64(plan[5]))  # BLAS uses every core: one product at a time
                gemm(plan, plan[r + 1: r + 4], step_tiles[0], step_tiles[1], results[k], sizes[0], sizes[1], sizes[3],
                     sizes[2], 0.0)
                unlock(np.uint64(plan[5]))
            elif nbytes:
                call3(np.uint64(plan[r]), results[k], step_tiles.ctypes.data, step_extents.ctypes.data)
        finish(output, row)
