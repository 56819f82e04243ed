"""The einsum kernels: ``tra_einsum_<n>`` (one output tile per joined row), ``tra_chain_<n>``
(a chain of einsums per joined row), ``tra_einsum_agg_<n>`` (one output tile per group of
joined rows: a fused join + aggregate) and ``tra_reduce`` (one output tile per group, from
the rows' partial results); each with its step's prologue and epilogue, if any (see
``protocol.EinsumStep``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import pyarrow as pa

from tra_sql.aggregates import AGGREGATES
from tra_sql.udfs import sparse
from tra_sql.udfs.arrowio import binary_array, binary_views, first_string, key_matrix, list_views
from tra_sql.udfs.contract import TileEinsum
from tra_sql.udfs.protocol import ChainStep, EinsumStep
from tra_sql.udfs.python_kernels import implements
from tra_sql.udfs.tiles import Operand, allocate_tiles, operand_tiles, out_view, uniform

BATCH_ELEMENTS = 1 << 22  # the most partial-result elements a batched group step may hold


@dataclass(frozen=True, eq=False)
class TileStep:
    """An ``EinsumStep`` as the kernels run it: its operands' and result's tile geometry and
    its tile einsum."""

    step: EinsumStep

    @staticmethod
    @lru_cache(maxsize=256)
    def parse(text: str) -> TileStep:
        return TileStep(EinsumStep.decode(text))

    @cached_property
    def epilogue(self) -> TileStep | None:
        return TileStep(self.step.epilogue) if self.step.epilogue is not None else None

    @cached_property
    def prologue(self) -> tuple[TileStep, ...]:
        return tuple(TileStep(step) for step in self.step.prologue)

    @cached_property
    def operands(self) -> list[Operand]:
        s = self.step
        layouts = s.layouts or ("dense",) * len(s.inputs)
        return [Operand.of(name, dt, sub, s.sizes, s.tiles, layout)
                for name, dt, sub, layout in zip(s.names, s.dtypes, s.inputs, layouts)]

    @cached_property
    def result(self) -> Operand:
        s = self.step
        return Operand.of("result", s.out_dtype, s.output, s.sizes, s.tiles, s.out_layout)

    @cached_property
    def pattern(self) -> int:
        """The CSR operand whose entries a CSR result has."""
        return next(m for m, (sub, op) in enumerate(zip(self.step.inputs, self.operands))
                    if op.layout == "csr" and sub == self.step.output)

    @cached_property
    def kernel(self) -> TileEinsum:
        s = self.step
        if not s.join:
            return TileEinsum(s.inputs, s.output, None, s.agg)
        from tra_sql.udfs.expr import join_code  # sqlglot, for join expressions only

        return TileEinsum(s.inputs, s.output, join_code(s.join, len(s.inputs)), s.agg)

    @cached_property
    def batched(self) -> TileEinsum:
        """The kernel over a leading batch index: one call for a stack of tile sets."""
        return self.kernel.batched()

    def tiles(self, columns, elements: np.ndarray, stack: bool, which: list[int] | None = None):
        """``operand_tiles`` of the operands ``which`` (default: all)."""
        which = range(len(self.step.inputs)) if which is None else which
        return operand_tiles([self.operands[m] for m in which], columns, elements, stack)


@lru_cache(maxsize=64)
def _chain(text: str) -> tuple[TileStep, tuple[TileStep, ...]]:
    chain = ChainStep.decode(text)
    return TileStep(chain.leaves), tuple(TileStep(step) for step in chain.steps)


def _finish(meta: TileStep, out_keys: np.ndarray, buf, offsets, shapes, columns) -> pa.Array:
    """The UDF's result: the computed tiles, or, with an epilogue, the epilogue's join
    applied to each of them and to its other operands' tiles (``columns``). The epilogue
    overwrites the computed tiles when its result has their dtype and it has no CSR operand
    (it is element-wise and laid out as they are, so each element is read before it is
    written; a CSR operand's kernel clears its output first)."""
    epilogue = meta.epilogue
    if epilogue is None:
        return binary_array(buf, offsets)
    if epilogue.result.dtype == meta.result.dtype and "csr" not in epilogue.step.layouts:
        out_buf, out_offsets = buf, offsets
    else:
        out_buf, out_offsets, _ = allocate_tiles(epilogue.result, out_keys)
    rows = np.arange(len(out_keys))
    position = epilogue.step.position
    others, stacked = epilogue.tiles(columns, rows, uniform(shapes), epilogue.step.others)
    if stacked:
        tiles = others[:position] + [buf.view(meta.result.dtype).reshape(len(rows), *shapes[0])] + others[position:]
        out = out_buf.view(epilogue.result.dtype).reshape(len(rows), *shapes[0])
        _stacked_call(epilogue, out, tiles)
        return binary_array(out_buf, out_offsets)
    for row in rows:
        inner = out_view(buf, offsets, row, shapes[row], meta.result.dtype)
        tiles = [t[row] for t in others]
        tiles.insert(position, inner)
        out = out_view(out_buf, out_offsets, row, shapes[row], epilogue.result.dtype)
        epilogue.kernel.compute(out, tiles)
    return binary_array(out_buf, out_offsets)


def _stacked_call(meta: TileStep, out: np.ndarray, tiles: list[np.ndarray]) -> None:
    """``out`` (stacked output tiles) computed from stacked operand tiles in one kernel call;
    a stack of one runs the plain kernel, whose loops can then be threaded."""
    if len(out) == 1:
        meta.kernel.compute(out[0, ...], [t[0, ...] for t in tiles])
    else:
        meta.batched.compute(out, tiles)


def _computed(step: TileStep, sources: list, stacked: bool, count: int):
    """``step``'s result for each of ``count`` rows from its operands' tiles ``sources``
    (stacked arrays, or lists of per-row tiles), in the same form."""
    dtype, inputs, output = step.result.dtype, step.step.inputs, step.step.output
    if stacked:
        extent = {c: n for sub, t in zip(inputs, sources) for c, n in zip(sub, t.shape[1:])}
        out = np.empty((count, *(extent[c] for c in output)), dtype=dtype)
        _stacked_call(step, out, sources)
        return out
    results = []
    for row in range(count):
        tiles = [t[row] for t in sources]
        extent = {c: n for sub, t in zip(inputs, tiles) for c, n in zip(sub, t.shape)}
        results.append(np.empty([extent[c] for c in output], dtype=dtype))
        step.kernel.compute(results[-1], tiles)
    return results


def _computed_into(step: TileStep, buf, offsets, shapes, tiles: list, stacked: bool) -> None:
    """``step``'s result for each row written into the output buffer ``buf`` (one tile per
    row at ``offsets``, of ``shapes``), from its operands' tiles (stacked, or per row)."""
    if stacked:
        _stacked_call(step, buf.view(step.result.dtype).reshape(len(shapes), *shapes[0]), tiles)
        return
    for row in range(len(shapes)):
        out = out_view(buf, offsets, row, shapes[row], step.result.dtype)
        step.kernel.compute(out, [t[row] for t in tiles])


def _with_prologue(meta: TileStep, tiles: list, stacked: bool, count: int) -> list:
    """Every operand's tiles, in operand order: the ``present`` ones (``tiles``) and the
    prologue's, computed from them (stacked, or per row)."""
    if not meta.prologue:
        return tiles
    full: list = [None] * len(meta.step.inputs)
    for m, operand in zip(meta.step.present, tiles):
        full[m] = operand
    for step in meta.prologue:
        full[step.step.position] = _computed(step, [full[s] for s in step.step.sources], stacked, count)
    return full


@implements("contract")
@implements("loop")
@implements("einsum")
def einsum_rows(meta_col, out_keys_col, *operand_cols):
    """``tra_einsum_<n>``: one output tile per joined row. When all tiles of an operand (and
    of the output) share a shape, the whole batch is one kernel call over stacked tiles."""
    meta = TileStep.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.step.output))
    rows = np.arange(len(out_keys))
    own = 2 * len(meta.step.present)
    if meta.result.layout == "csr":
        tiles, _ = meta.tiles(operand_cols[:own], rows, False)
        results = []
        for row in rows:
            buf, out = sparse.like(tiles[meta.pattern][row], meta.result.dtype)
            meta.kernel.compute(out, [t[row] for t in tiles])
            results.append(buf)
        return sparse.concat(results)
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    tiles, stacked = meta.tiles(operand_cols[:own], rows, uniform(shapes), meta.step.present)
    tiles = _with_prologue(meta, tiles, stacked, len(rows))
    _computed_into(meta, buf, offsets, shapes, tiles, stacked)
    return _finish(meta, out_keys, buf, offsets, shapes, operand_cols[own:])


@implements("loop_chain")
@implements("chain")
def chain_rows(meta_col, out_keys_col, *operand_cols):
    """``tra_chain_<n>``: per joined row, the chain's steps one after another; only the last
    one's tile is returned."""
    leaves, steps = _chain(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(leaves.step.output))
    rows = np.arange(len(out_keys))
    buf, offsets, shapes = allocate_tiles(leaves.result, out_keys)
    tiles, stacked = leaves.tiles(operand_cols, rows, uniform(shapes))
    results: list = []

    def operands(step: TileStep) -> list:
        return [tiles[s] if s >= 0 else results[-1 - s] for s in step.step.sources]

    for step in steps[:-1]:
        results.append(_computed(step, operands(step), stacked, len(rows)))
    _computed_into(steps[-1], buf, offsets, shapes, operands(steps[-1]), stacked)
    return binary_array(buf, offsets)


@implements("einsum_agg")
def einsum_groups(meta_col, out_keys_col, rows_col, *epilogue_cols):
    """``tra_einsum_agg_<n>``: one output tile per group of joined rows. Batches of small
    uniform tiles are computed in one kernel call and reduced per group (``ufunc.reduceat``)."""
    meta = TileStep.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.step.output))
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    group_offsets, rows = list_views(rows_col)
    elements = np.arange(len(rows))
    sizes = np.diff(group_offsets)
    small = uniform(shapes) and len(rows) * int(np.prod(shapes[0])) <= BATCH_ELEMENTS and (sizes > 0).all()
    tiles, stacked = meta.tiles(rows.flatten(), elements, small)
    if stacked:
        partial = np.empty((len(rows), *shapes[0]), dtype=meta.result.dtype)
        _stacked_call(meta, partial, tiles)
        out = buf.view(meta.result.dtype).reshape(len(out_keys), *shapes[0])
        AGGREGATES[meta.step.agg].ufunc.reduceat(partial, group_offsets[:-1], axis=0, out=out)
    else:
        for row in range(len(out_keys)):
            out = out_view(buf, offsets, row, shapes[row], meta.result.dtype)
            group = range(group_offsets[row], group_offsets[row + 1])
            if not group:
                meta.kernel.init(out)
            for n, element in enumerate(group):
                (meta.kernel.accumulate if n else meta.kernel.compute)(out, [t[element] for t in tiles])
    return _finish(meta, out_keys, buf, offsets, shapes, epilogue_cols)


@implements("reduce")
def reduce_partials(meta_col, out_keys_col, partials_col, *epilogue_cols):
    """``tra_reduce[_<k>]``: one output tile per group, the aggregate of its joined rows'
    partial results (each the einsum over one row's tiles, from ``tra_einsum_<n>``)."""
    meta = TileStep.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.step.output))
    group_offsets, partials = list_views(partials_col)
    counts = np.diff(group_offsets)
    keys = np.repeat(out_keys, counts, axis=0)
    elements = np.arange(len(keys))
    views = binary_views(partials)
    combine = AGGREGATES[meta.step.agg].ufunc
    if meta.result.layout == "csr":  # a group's partial results share their entries
        tiles = meta.result.views(*views, elements, keys)
        results = []
        for row in range(len(out_keys)):
            group = tiles[group_offsets[row] : group_offsets[row + 1]]
            buf, out = sparse.like(group[0], meta.result.dtype)
            combine.reduce(np.stack([t.data for t in group]), axis=0, out=out)
            results.append(buf)
        return sparse.concat(results)
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    stacked = meta.result.stacked(*views, elements, keys) if uniform(shapes) and (counts > 0).all() else None
    if stacked is not None:
        combine.reduceat(stacked, group_offsets[:-1], axis=0,
                         out=buf.view(meta.result.dtype).reshape(len(out_keys), *shapes[0]))
    else:
        tiles = meta.result.views(*views, elements, keys)
        for row in range(len(out_keys)):
            out = out_view(buf, offsets, row, shapes[row], meta.result.dtype)
            meta.kernel.init(out)
            for element in range(group_offsets[row], group_offsets[row + 1]):
                combine(out, tiles[element], out=out)
    return _finish(meta, out_keys, buf, offsets, shapes, epilogue_cols)
