"""The placement aggregates (kinds ``place_agg`` and ``place_add_<dtype>``, ``protocol.PLACEMENTS``):
``tra_place_agg(step, keys, origin, shape, part, tile)`` over an output tile's pieces (a
re-tiling's, slice's, concatenation's or reshape's: ``compile.placement``) copies each piece's
overlap with the tile straight into the group's state, ``place_add_<dtype>`` adds it (a keyed
sum), as ``tra_place`` assembles them from a list, without the list.

The state is a whole-tile sum's (``aggregate``: the output tile ``malloc``ed, zeroed, outside
DuckDB's memory_limit), and so are its combine, finalize and destructor: written pieces do not
overlap, so two states of one tile combine by OR-ing their bytes (``aggregate.OVERLAY``: exact
for every dtype, ``-0.0`` included); summed pieces combine as the tile sum's states do. The
step comes as text, as the fused contraction's does: its plan (``found``: the layout below)
from the binding's ``LOOKUP`` callback, refused if it is the other function's. Every argument is
checked before a byte is copied: the output keys inside the result's grid, the piece's origin
and shape of the placement's rank, its part one of the step's sources, its tile exactly as long
as its shape needs; a bad one is a ``CorruptTileError`` naming the source tensor."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from tra_sql.udfs.native.aggregate import corrupt, memcpy
from tra_sql.udfs.native.duckdb_calls import NATIVE as C
from tra_sql.udfs.native.fused import looked_up, step_text
from tra_sql.udfs.native.images import native
from tra_sql.udfs.native.memory import (
    CORRUPT,
    address,
    blob,
    f32,
    f64,
    grid_tile,
    i64,
    put_int,
    put_text,
    u8,
    u64,
    valid,
)
from tra_sql.udfs.native.operands import list_entry, set_error
from tra_sql.udfs.native.plans import EXTRA, MESSAGE, error_record
from tra_sql.udfs.protocol import FLOATS, PlaceStep, placement_aggregate

calloc = types.ExternalFunction("calloc", types.uint64(types.uint64, types.uint64))

# plan: itemsize, add, flat, the result's rank, the text's address (the sources' names), the
# sources, the flat length of one row of the first dimension (flat), the dtype code (0
# float32, 1 float64, -1 another); then shape and tile per dimension, per source the offset
# and length of its name in the text
HEADER = 8
PLACED = np.frombuffer(b"a placement", np.uint8)  # the function, in its errors
MAX_EXTENT = 1 << 31  # a piece's extent per dimension is less (so the byte counts cannot overflow)


def found(text: str) -> tuple[np.ndarray, ...]:
    """What ``LOOKUP`` answers for step text ``text``: a word 0 and the plan, then its text;
    or ``fused.error_record``'s."""
    try:
        step = PlaceStep.decode(text)
        if placement_aggregate(step) is None:
            raise ValueError("its sources' dtypes differ from the result's, or it sums pieces of "
                             f"{step.dtype}")
    except Exception as err:  # not a placement aggregate's step: the update reports it
        return (error_record(err, "the step of a placement"),)
    words = [name.encode() for name in step.names]
    names = np.frombuffer(b"".join(words) + b"\x00", dtype=np.uint8).copy()
    starts = np.cumsum([0] + [len(w) for w in words])
    row = int(np.prod(step.shape[1:], dtype=np.int64))
    dtype = FLOATS.index(step.dtype) if step.dtype in FLOATS else -1
    head = [np.dtype(step.dtype).itemsize, int(step.add), int(step.flat), len(step.shape), names.ctypes.data,
            len(step.names), row, dtype]
    body = [*step.shape, *step.tile] + [v for m in range(len(words)) for v in (int(starts[m]), len(words[m]))]
    return np.array([0, *head, *body], dtype=np.int64), names


@njit(cache=True)
def _report(info, plan, part, origin, extents, rank, what, held, need):
    """Set the call's error: source ``part``'s piece at element ``origin`` is NULL (``what`` 0)
    or holds ``held`` bytes, not the ``need`` of its ``extents`` (1); the output keys are NULL
    or outside the result's grid (2); the piece's geometry is NULL or of another rank (3);
    its part is not a source of the step (4)."""
    out = np.zeros(MESSAGE, np.uint8)
    at = put_text(out, 0, CORRUPT)
    if what == 2:
        at = put_text(out, at, np.frombuffer(b"a placement's output keys are NULL or outside the result's "
                                             b"tile grid", np.uint8))
    elif what == 3:
        at = put_text(out, at, np.frombuffer(b"a placement's piece has a NULL origin or shape, or one of "
                                             b"another rank than the placement's", np.uint8))
    elif what == 4:
        at = put_text(out, at, np.frombuffer(b"a placement's piece names source ", np.uint8))
        at = put_int(out, at, part)
        at = put_text(out, at, np.frombuffer(b", which the step does not have", np.uint8))
    else:
        name_at = HEADER + 2 * plan[3] + 2 * part
        text = u8(plan[4], plan[name_at] + plan[name_at + 1])
        at = put_text(out, at, np.frombuffer(b"the tile of tensor '", np.uint8))
        at = put_text(out, at, text[plan[name_at]:])
        at = put_text(out, at, np.frombuffer(b"' at element (", np.uint8))
        for d in range(rank):
            at = put_text(out, at, np.frombuffer(b", " if d else b"", np.uint8))
            at = put_int(out, at, origin[d])
        if what == 0:
            at = put_text(out, at, np.frombuffer(b") is NULL", np.uint8))
        else:
            at = put_text(out, at, np.frombuffer(b") holds ", np.uint8))
            at = put_int(out, at, held)
            at = put_text(out, at, np.frombuffer(b" bytes; its shape (", np.uint8))
            for d in range(rank):
                at = put_text(out, at, np.frombuffer(b", " if d else b"", np.uint8))
                at = put_int(out, at, extents[d])
            at = put_text(out, at, np.frombuffer(b") needs ", np.uint8))
            at = put_int(out, at, need)
    out[at] = 0
    set_error(info, True, out)


@njit(cache=True)
def _output(plan, keys, origin, extents) -> int:
    """The output tile at ``keys``: its element origin and extents in the placement's
    coordinates (flat: one dimension), and its bytes; -1 if the keys are outside the grid."""
    rank = plan[3]
    n = grid_tile(plan[HEADER: HEADER + rank], plan[HEADER + rank: HEADER + 2 * rank], keys, extents)
    if n < 0:
        return -1
    for d in range(rank):
        origin[d] = keys[d] * plan[HEADER + rank + d]
    nbytes = plan[0] * n
    if plan[2]:  # flat: the tile's rows, row-major
        origin[0], extents[0] = (origin[0] * plan[6], extents[0] * plan[6]) if rank else (0, 1)
    return nbytes


@njit(cache=True)
def _add(acc, v) -> None:
    for i in range(len(acc)):
        acc[i] += v[i]


@njit(cache=True)
def _copy(plan, out, out_origin, out_extents, piece, origin, extents, rank, lo, hi, at) -> None:
    """Copy (add, ``plan[1]``) the overlap of the piece at ``piece`` with the output tile at
    ``out`` (both row-major; ``lo``, ``hi``, ``at``: scratch of ``rank`` words)."""
    for d in range(rank):
        lo[d] = max(out_origin[d], origin[d])
        hi[d] = min(out_origin[d] + out_extents[d], origin[d] + extents[d])
        if hi[d] <= lo[d]:
            return
        at[d] = lo[d]
    item = plan[0]
    run = hi[rank - 1] - lo[rank - 1] if rank else 1
    while True:
        dst, src = 0, 0
        for d in range(rank):
            dst = dst * out_extents[d] + at[d] - out_origin[d]
            src = src * extents[d] + at[d] - origin[d]
        to, start = out + np.uint64(dst * item), piece + np.uint64(src * item)
        if not plan[1]:
            memcpy(to, start, np.uint64(run * item))
        elif plan[7] == 0:
            _add(f32(to, run), f32(start, run))
        else:
            _add(f64(to, run), f64(start, run))
        d = rank - 2  # the next run: an odometer over the dimensions before the last
        while d >= 0:
            at[d] += 1
            if at[d] < hi[d]:
                break
            at[d] = lo[d]
            d -= 1
        if d < 0:
            return


@native(types.void(types.voidptr, types.voidptr, types.voidptr))
def UPDATE(info_ptr, chunk_ptr, states_ptr):
    info, chunk, states = address(info_ptr), address(chunk_ptr), address(states_ptr)
    extra = i64(C.duckdb_aggregate_function_get_extra_info(info), EXTRA)
    steps = C.duckdb_data_chunk_get_vector(chunk, 0)
    texts, validity = C.duckdb_vector_get_data(steps), C.duckdb_vector_get_validity(steps)
    parts = C.duckdb_data_chunk_get_vector(chunk, 4)
    part_at, part_valid = C.duckdb_vector_get_data(parts), C.duckdb_vector_get_validity(parts)
    tiles = C.duckdb_data_chunk_get_vector(chunk, 5)
    tile_at, tile_valid = C.duckdb_vector_get_data(tiles), C.duckdb_vector_get_validity(tiles)
    rows = C.duckdb_data_chunk_get_size(chunk)
    pointers = u64(states, rows)
    text_at, text_length, plan = np.uint64(0), np.int64(-1), np.empty(0, np.int64)
    scratch = np.empty((7, 1), np.int64)
    for row in range(rows):
        at, length = step_text(info, texts, validity, row, PLACED)
        if length < 0:
            return
        if at != text_at or length != text_length:  # a new step text: its plan from the binding
            plan_at = looked_up(info, extra, at, length, PLACED)
            if plan_at == 0:
                return
            head = i64(plan_at, HEADER)
            if (head[7] if head[1] else -1) != extra[1]:  # the function's extra info: its dtype code, -1 writing
                corrupt(info, np.frombuffer(b"the step of a placement is another function's (it sums or "
                                            b"writes its pieces, or has another dtype)", np.uint8))
                return
            plan = i64(plan_at, HEADER + 2 * head[3] + 2 * head[5])
            scratch = np.empty((7, max(head[3], 1)), np.int64)
            text_at, text_length = at, length
        rank = 1 if plan[2] else plan[3]  # the placement's coordinates
        out_origin, out_extents, origin, extents = scratch[0], scratch[1], scratch[2], scratch[3]
        keys, ok = list_entry(chunk, 1, row)
        nbytes = _output(plan, keys, out_origin, out_extents) if ok else -1
        if nbytes < 0:
            _report(info, plan, 0, keys, keys, 0, 2, 0, 0)
            return
        given, ok = list_entry(chunk, 2, row)
        shape, ok_shape = list_entry(chunk, 3, row)
        if not (ok and ok_shape and len(given) == rank and len(shape) == rank):
            _report(info, plan, 0, keys, keys, 0, 3, 0, 0)
            return
        part = i64(part_at, row + 1)[row]
        if not valid(part_valid, row) or part < 0 or part >= plan[5]:
            _report(info, plan, part, keys, keys, 0, 4, 0, 0)
            return
        if not valid(tile_valid, row):
            _report(info, plan, part, given, shape, rank, 0, 0, 0)
            return
        piece, held = blob(tile_at, row)
        need = plan[0]
        for d in range(rank):
            origin[d], extents[d] = given[d], shape[d]
            if shape[d] < 0 or shape[d] >= MAX_EXTENT:
                need = -1
            elif 0 <= need <= held:  # (past ``held``, the count only has to stay wrong)
                need *= shape[d]
        if need != held:
            _report(info, plan, part, given, shape, rank, 1, held, need)
            return
        state = u64(pointers[row], 2)
        if state[0] == 0:
            state[0] = calloc(np.uint64(max(nbytes, 1)), np.uint64(1))
            state[1] = nbytes
        elif state[1] != nbytes:
            corrupt(info, np.frombuffer(b"a placement's states of one output tile differ in size", np.uint8))
            return
        _copy(plan, state[0], out_origin, out_extents, piece, origin, extents, rank, scratch[4], scratch[5],
              scratch[6])
