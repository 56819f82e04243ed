"""The native attention aggregate (kinds ``attention_agg_<dtype>``, ``protocol.ATTENTIONS``):
``tra_attention_agg_float32_<n>(step, keys, keys0, tile0, ..., keys<n-1>, tile<n-1>)`` over an
output tile's joined rows (Q, K_j, V_j[, mask_j], one per key tile) folds each row into the
group's online-softmax state (``online_softmax``, the body the Arrow UDF runs too): no
``list()``, the tiles read where DuckDB holds them. Combine merges two states, finalize
writes acc / row sum in the output's index order, each tile once.

The state (16 bytes in DuckDB's state memory, as ``aggregate``'s) holds the address and length
of one ``malloc``ed block: a header (B, R, C, itemsize, the output's rank, then per output
dimension its extent and its stride in the (batch, rows, cols) result), then the row max
(B, R), the row sum (B, R) and acc (B, R, C), of the step's one float dtype. Like the fused
contraction aggregate (``fused``), one function per dtype and arity serves every step: the
update asks the binding for the step's record (``found``: 0, then the plan ``plans.plan``
checks tiles with, then the geometry ``GEOMETRY``) by the step's text."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs import cores, online_softmax
from tra_sql.udfs.attention import AttentionMeta, native_attention
from tra_sql.udfs.native.aggregate import corrupt, malloc
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.fused import step_plan, step_text
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import address, i64, u8, u64
from tra_sql.udfs.native.operands import operands, plan_length
from tra_sql.udfs.native.plans import EXTRA, HEADER, OPERAND, error_record, indices, sources, tables
from tra_sql.udfs.protocol import AttentionStep

# geometry: its length, scale (float64 bits), the letters per role (batch, rows, inner, keys,
# cols), masked, whether the mask has batch letters, the output's rank, the kernels' mutex;
# then the letters' index numbers in role order; then per operand target (Q: batch rows inner,
# K: batch keys inner, V: batch keys cols, the mask: [batch] rows keys) each letter's
# dimension in the operand (-1: broadcast) and position in role order; then per output
# dimension its letter's position in batch rows cols
GEOMETRY = 11
ATTENTION = np.frombuffer(b"a native attention", np.uint8)  # the function, in its errors
STATE_HEADER = 5


def plan(step: AttentionStep) -> tuple[np.ndarray, ...]:
    """(the plan ``operands.operands`` checks a row's tiles with, its text, the geometry)."""
    if not native_attention(step):
        raise ValueError(f"attention over {step.dtypes} to {step.out_dtype} is not native")
    r = AttentionMeta(step).roles
    index = indices(step.inputs, step.output)
    dims = [(step.sizes[c], step.tiles[c], index[c], 0) for sub in step.inputs for c in sub]
    product, text = tables(step.out_dtype, list(step.inputs), list(step.names), dims, sources(step.inputs, step.output),
                           [], (0, 0, 0), 0, 0, len(step.inputs), len(index))
    masked = len(step.inputs) == 4
    *targets, order = ("".join(groups) for groups in r.matrices(step.inputs[3] if masked else None))
    mask_batch = masked and len(targets[3]) > len(r.rows + r.keys)
    roles = r.batch + r.rows + r.inner + r.keys + r.cols
    words = [int(np.float64(step.scale).view(np.int64)), *map(len, (r.batch, r.rows, r.inner, r.keys, r.cols)),
             int(masked), int(mask_batch), len(step.output), cores.MUTEX, *(index[c] for c in roles),
             *(w for sub, target in zip(step.inputs, targets) for c in target for w in (sub.find(c), roles.index(c))),
             *(order.index(c) for c in step.output)]
    return product, text, np.array([len(words) + 1, *words], dtype=np.int64)


def found(text: str) -> tuple[np.ndarray, ...]:
    """What the lookup answers for step text ``text``: a word 0, the plan, the geometry (then
    the arrays they point to); or ``fused.error_record``'s."""
    try:
        product, names, geometry = plan(AttentionStep.decode(text))
    except Exception as err:  # not a native attention's step: the update reports it
        return (error_record(err, "the step of a native attention"),)
    return np.concatenate([np.zeros(1, np.int64), product, geometry]), names


@njit(cache=True)
def _gather(src, dst, extents, strides) -> None:
    """``dst`` (contiguous, of ``extents``) from ``src`` read at ``strides`` (0: broadcast)."""
    rank = len(extents)
    if rank == 0:  # a scalar
        dst[0] = src[0]
        return
    at = np.zeros(rank, np.int64)
    inner = extents[rank - 1]
    for start in range(0, len(dst), max(inner, 1)):
        offset = 0
        for d in range(rank - 1):
            offset += at[d] * strides[d]
        for i in range(inner):
            dst[start + i] = src[offset + i * strides[rank - 1]]
        for d in range(rank - 2, -1, -1):
            at[d] += 1
            if at[d] < extents[d]:
                break
            at[d] = 0


@njit(cache=True)
def _target(plan, geometry, m, at, count, extents, seen):
    """(extents, strides) of operand ``m``'s ``count`` target letters (their entries from ``at``
    in the geometry) in its checked tile."""
    rank, first = plan[HEADER + OPERAND * m], plan[HEADER + OPERAND * m + 1]
    own = np.empty(rank, np.int64)
    stride = 1
    for d in range(rank - 1, -1, -1):
        own[d] = stride
        stride *= extents[first + d]
    shape, strides = np.empty(count, np.int64), np.empty(count, np.int64)
    for t in range(count):
        d, letter = geometry[at + 2 * t], geometry[at + 2 * t + 1]
        strides[t] = own[d] if d >= 0 else 0
        shape[t] = extents[first + d] if d >= 0 else seen[2 * geometry[GEOMETRY + letter]]
    return shape, strides


@njit(cache=True)
def _starts(geometry):
    """Where the geometry's target entries of Q, K, V, the mask and the output's start, and
    the mask's count of target letters."""
    nb, nr, ni, ns, nc = geometry[2], geometry[3], geometry[4], geometry[5], geometry[6]
    q = GEOMETRY + nb + nr + ni + ns + nc
    k = q + 2 * (nb + nr + ni)
    v = k + 2 * (nb + ns + ni)
    mask = v + 2 * (nb + ns + nc)
    count = ((nb if geometry[8] else 0) + nr + ns) if geometry[7] else 0
    return q, k, v, mask, mask + 2 * count, count


@njit(cache=True)
def _floats(proto, at, n):
    """``n`` elements of ``proto``'s dtype at address ``at``."""
    return u8(at, n * proto.itemsize).view(proto.dtype)


@njit(cache=True)
def _matrix(proto, plan, geometry, m, at, count, tile, extents, seen):
    """Operand ``m``'s checked tile at ``tile`` gathered into a contiguous vector in its
    target order, and the number of its target letters' elements in each of its groups."""
    shape, strides = _target(plan, geometry, m, at, count, extents, seen)
    held = 1
    for d in range(plan[HEADER + OPERAND * m]):
        held *= extents[plan[HEADER + OPERAND * m + 1] + d]
    out = np.empty(max(np.prod(shape), 1), proto.dtype)
    _gather(_floats(proto, tile, max(held, 1)), out, shape, strides)
    return out, shape


@njit(cache=True)
def _size(shape, start, stop) -> int:
    n = 1
    for d in range(start, stop):
        n *= shape[d]
    return n


@njit(cache=True)
def _fold_row(proto, info, plan, geometry, tiles, extents, seen, state) -> bool:
    """Fold a row's checked tiles into ``state`` (allocated by the group's first row); False
    with the error set if the row's geometry differs from the state's."""
    nb, nr, ni, ns, nc = geometry[2], geometry[3], geometry[4], geometry[5], geometry[6]
    masked, mask_batch, rank = geometry[7], geometry[8], geometry[9]
    q_at, k_at, v_at, mask_at, out_at, count = _starts(geometry)
    q, qs = _matrix(proto, plan, geometry, 0, q_at, nb + nr + ni, tiles[0], extents, seen)
    k, ks = _matrix(proto, plan, geometry, 1, k_at, nb + ns + ni, tiles[1], extents, seen)
    v, vs = _matrix(proto, plan, geometry, 2, v_at, nb + ns + nc, tiles[2], extents, seen)
    batch, rows, inner = _size(qs, 0, nb), _size(qs, nb, nb + nr), _size(qs, nb + nr, nb + nr + ni)
    keys, cols = _size(ks, nb, nb + ns), _size(vs, nb + ns, nb + ns + nc)
    allowed = np.zeros((1, 1, 1), np.uint8)
    if masked:
        mask, _ = _matrix(proto, plan, geometry, 3, mask_at, count, tiles[3], extents, seen)
        allowed = (mask > 0).astype(np.uint8).reshape((batch if mask_batch else 1, rows, keys))
    head = STATE_HEADER + 2 * rank
    item = plan[1]
    if state[0] == 0:
        nbytes = 8 * head + item * batch * rows * (2 + cols)
        state[0], state[1] = malloc(nbytes), nbytes
        words = i64(state[0], head)
        words[0], words[1], words[2], words[3], words[4] = batch, rows, cols, item, rank
        order = np.empty(nb + nr + nc, np.int64)  # the result's extents in role order
        order[: nb + nr] = qs[: nb + nr]
        order[nb + nr:] = vs[nb + ns:]
        stride = np.ones(nb + nr + nc, np.int64)
        for d in range(nb + nr + nc - 2, -1, -1):
            stride[d] = stride[d + 1] * order[d + 1]
        for d in range(rank):
            p = geometry[out_at + d]
            words[STATE_HEADER + d], words[STATE_HEADER + rank + d] = order[p], stride[p]
        arrays = _floats(proto, state[0] + np.uint64(8 * head), batch * rows * (2 + cols))
        arrays[: batch * rows] = -np.inf
        arrays[batch * rows:] = 0
    words = i64(state[0], head)
    if words[0] != batch or words[1] != rows or words[2] != cols:
        corrupt(info, np.frombuffer(b"the key tiles of one output tile differ in their query or value extents",
                                    np.uint8))
        return False
    arrays = _floats(proto, state[0] + np.uint64(8 * head), batch * rows * (2 + cols))
    online_softmax.fold(q.reshape((batch, rows, inner)), k.reshape((batch, keys, inner)),
                        v.reshape((batch, keys, cols)), allowed, masked == 1,
                        np.array([geometry[1]]).view(np.float64)[0], arrays[: batch * rows].reshape((batch, rows)),
                        arrays[batch * rows: 2 * batch * rows].reshape((batch, rows)),
                        arrays[2 * batch * rows:].reshape((batch, rows, cols)), np.uint64(geometry[10]))
    return True


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
    tiles, extents, seen = np.empty(4, np.uint64), np.empty(0, np.int64), np.empty(0, np.int64)
    for row in range(rows):
        at, length = step_text(info, texts, validity, row, ATTENTION)
        if length < 0:
            return
        if at != text_at or length != text_length:  # a new step text: its record from the binding
            plan_at = step_plan(info, extra, at, length, ATTENTION)
            if plan_at == 0:
                return
            head = i64(plan_at, HEADER)
            if head[2] != C.duckdb_data_chunk_get_column_count(chunk) // 2 - 1:
                corrupt(info, np.frombuffer(b"the step of a native attention has another number of operands "
                                            b"than the function", np.uint8))
                return
            extents, seen = np.empty(head[13], np.int64), np.empty(2 * head[14], np.int64)
            text_at, text_length = at, length
        words = plan_length(i64(plan_at, HEADER))
        plan = i64(plan_at, words)
        geometry_at = plan_at + np.uint64(8 * words)
        geometry = i64(geometry_at, i64(geometry_at, 1)[0])
        if not operands(info, True, plan, chunk, row, tiles, extents, seen):
            return
        state = u64(pointers[row], 2)
        ok = _fold_row(np.empty(0, np.float32), info, plan, geometry, tiles, extents, seen, state) if plan[0] == 0 \
            else _fold_row(np.empty(0, np.float64), info, plan, geometry, tiles, extents, seen, state)
        if not ok:
            return


@njit(cache=True)
def _merge(proto, target, source, head, batch, rows, cols) -> None:
    n = batch * rows
    mine = _floats(proto, target + np.uint64(8 * head), n * (2 + cols))
    theirs = _floats(proto, source + np.uint64(8 * head), n * (2 + cols))
    online_softmax.merge(mine[:n].reshape((batch, rows)), mine[n:2 * n].reshape((batch, rows)),
                         mine[2 * n:].reshape((batch, rows, cols)), theirs[:n].reshape((batch, rows)),
                         theirs[n:2 * n].reshape((batch, rows)), theirs[2 * n:].reshape((batch, rows, cols)))


@native(types.void(types.voidptr, types.voidptr, types.voidptr, types.uint64))
def COMBINE(info_ptr, sources_ptr, targets_ptr, count):
    info = address(info_ptr)
    sources, targets = u64(address(sources_ptr), count), u64(address(targets_ptr), count)
    for i in range(count):
        source, target = u64(sources[i], 2), u64(targets[i], 2)
        if source[0] == 0:
            continue
        if target[0] == 0:  # the target takes the source's block
            target[0], target[1] = source[0], source[1]
            source[0], source[1] = 0, 0
            continue
        words = i64(target[0], STATE_HEADER)
        head = STATE_HEADER + 2 * words[4]
        if target[1] != source[1] or np.any(i64(source[0], head) != i64(target[0], head)):
            corrupt(info, np.frombuffer(b"the key tiles of one output tile differ in their query or value extents",
                                        np.uint8))
            return
        if words[3] == 4:
            _merge(np.empty(0, np.float32), target[0], source[0], head, words[0], words[1], words[2])
        else:
            _merge(np.empty(0, np.float64), target[0], source[0], head, words[0], words[1], words[2])


@njit(cache=True)
def _finish(proto, state, words, head):
    """The result tile of the state at ``state``: acc / row sum in the output's index order."""
    batch, rows, cols, rank = words[0], words[1], words[2], words[4]
    n = batch * rows
    arrays = _floats(proto, state + np.uint64(8 * head), n * (2 + cols))
    result = np.empty(n * cols, proto.dtype)
    online_softmax.finish(arrays[n:2 * n].reshape((batch, rows)), arrays[2 * n:].reshape((batch, rows, cols)),
                          result.reshape((batch, rows, cols)))
    out = np.empty(n * cols, proto.dtype)
    _gather(result, out, words[STATE_HEADER: STATE_HEADER + rank].copy(),
            words[STATE_HEADER + rank: STATE_HEADER + 2 * rank].copy())
    return out


@native(types.void(types.voidptr, types.voidptr, types.voidptr, types.uint64, types.uint64))
def FINALIZE(info_ptr, sources_ptr, result_ptr, count, offset):
    result = address(result_ptr)
    sources = u64(address(sources_ptr), count)
    for i in range(count):
        state = u64(sources[i], 2)
        if state[0] == 0:  # a group without rows: no tile
            C.duckdb_vector_ensure_validity_writable(result)
            C.duckdb_validity_set_row_invalid(C.duckdb_vector_get_validity(result), offset + i)
            continue
        words = i64(state[0], STATE_HEADER)
        head = STATE_HEADER + 2 * words[4]
        words = i64(state[0], head)
        if words[3] == 4:
            out = _finish(np.empty(0, np.float32), state[0], words, head)
            C.duckdb_vector_assign_string_element_len(result, offset + i, np.uint64(out.ctypes.data),
                                                      np.uint64(4 * len(out)))
        else:
            out = _finish(np.empty(0, np.float64), state[0], words, head)
            C.duckdb_vector_assign_string_element_len(result, offset + i, np.uint64(out.ctypes.data),
                                                      np.uint64(8 * len(out)))
