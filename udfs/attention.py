"""``tra_attention_<n>``: ``softmax(scale * Q·K, mask) · V`` for one output tile per group.

A group's joined rows are its key tiles: (Q, K_j, V_j[, mask_j]) for every tile ``j`` of the
softmax index. The kernel views the tiles as stacks of matrices (``Roles``) and folds them
into a running row max, row sum and weighted sum of V (the online softmax of flash attention,
``online_softmax``: the body the native aggregate runs too), so the scores never leave the
kernel. Masked positions (mask not > 0) get weight 0, as in ``nn.softmax``; a row with every
position masked gives 0. ``Roles`` and ``AttentionMeta`` are the geometry both wrappers share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import prod

import numpy as np

from tra_sql.udfs import cores
from tra_sql.udfs.arrowio import binary_array, first_string, key_matrix, list_views
from tra_sql.udfs.protocol import FLOATS, AttentionStep
from tra_sql.udfs.python_kernels import implements
from tra_sql.udfs.tiles import Operand, allocate_tiles, operand_tiles, out_view


def _align(x: np.ndarray, sub: str, target: str) -> np.ndarray:
    """``x`` (subscript ``sub``) transposed and expanded to broadcast against ``target``."""
    x = x.transpose([sub.index(c) for c in target if c in sub])
    extents = iter(x.shape)
    return x.reshape([next(extents) if c in sub else 1 for c in target])


@dataclass(frozen=True)
class Roles:
    """The indices of ``softmax(Q·K over inner, over keys) · V`` by role, each a string:
    ``batch`` (in Q, K, V and the output), ``rows`` (Q's own), ``inner`` (Q's and K's,
    contracted), ``keys`` (the softmax index, K's and V's), ``cols`` (V's own)."""

    batch: str
    rows: str
    inner: str
    keys: str
    cols: str

    @staticmethod
    def of(inputs: tuple[str, ...], output: str, softmax: str) -> Roles | None:
        """The roles in an attention step's subscripts (Q, K, V[, mask]), or ``None`` if its
        indices play other parts (then it is not fused)."""
        q, k, v = inputs[:3]
        roles = Roles("".join(c for c in q if c in k and c in output), "".join(c for c in q if c not in k),
                      "".join(c for c in q if c in k and c not in output), softmax,
                      "".join(c for c in v if c not in k))
        fits = (set(k) == set(roles.batch + roles.inner + softmax) and set(v) == set(roles.batch + softmax + roles.cols)
                and sorted(output) == sorted(roles.batch + roles.rows + roles.cols) and softmax not in q
                and len(set(q + k + v)) == len(roles.batch + roles.rows + roles.inner + softmax + roles.cols)
                and all(set(m) <= set(roles.batch + roles.rows + softmax) for m in inputs[3:]))
        return roles if fits else None

    def matrices(self, mask: str | None = None) -> tuple[tuple[str, ...], ...]:
        """The groups of indices each operand's tile is viewed as (a matrix per group: Q
        (batch, rows, inner), K (batch, keys, inner), V (batch, keys, cols), then the mask
        (subscript ``mask``, if any) as (batch, rows, keys), its batch empty (broadcast) unless
        it has batch indices) and the result's (batch, rows, cols)."""
        groups = ((self.batch, self.rows, self.inner), (self.batch, self.keys, self.inner),
                  (self.batch, self.keys, self.cols))
        if mask is not None:
            groups += ((self.batch if set(mask) & set(self.batch) else "", self.rows, self.keys),)
        return (*groups, (self.batch, self.rows, self.cols))


@dataclass(frozen=True, eq=False)
class AttentionMeta:
    """An ``AttentionStep`` as the kernel runs it: its operands' and result's tile geometry
    and the indices' roles."""

    step: AttentionStep

    @staticmethod
    @lru_cache(maxsize=64)
    def parse(text: str) -> AttentionMeta:
        return AttentionMeta(AttentionStep.decode(text))

    @cached_property
    def operands(self) -> list[Operand]:
        s = self.step
        return [Operand.of(name, dt, sub, s.sizes, s.tiles) for name, dt, sub in zip(s.names, s.dtypes, s.inputs)]

    @cached_property
    def result(self) -> Operand:
        return Operand.of("result", self.step.out_dtype, self.step.output, self.step.sizes, self.step.tiles)

    @cached_property
    def roles(self) -> Roles:
        return Roles.of(self.step.inputs, self.step.output, self.step.scores[-1])


def native_attention(step: AttentionStep) -> bool:
    """Whether the native attention aggregate (``native.attention``) computes ``step``: every
    operand, the result and the probabilities of one float dtype."""
    return step.out_dtype in FLOATS and set(step.dtypes) | {step.probs_dtype} == {step.out_dtype}


def _matrices(x: np.ndarray, sub: str, *groups: str) -> np.ndarray:
    """``x`` with its indices in ``groups`` order, each group flattened to one axis."""
    order = "".join(groups)
    extent = dict(zip(sub, x.shape))
    return x.transpose([sub.index(c) for c in order]).reshape([prod(extent[c] for c in g) for g in groups])


class OnlineSoftmax:
    """The running state of one output tile (``online_softmax``: the row max, the row sum and
    the weighted sum of V's rows), folded key tile by key tile."""

    def __init__(self, meta: AttentionMeta, q: np.ndarray):
        self.meta, r = meta, meta.roles
        self.extent = dict(zip(meta.step.inputs[0], q.shape))
        self.dtype = np.dtype(meta.step.probs_dtype)
        self.groups = r.matrices(meta.step.inputs[3] if len(meta.step.inputs) == 4 else None)
        self.q = np.ascontiguousarray(_matrices(q, meta.step.inputs[0], *self.groups[0]), dtype=self.dtype)
        self.row_max = np.full(self.q.shape[:2], -np.inf, dtype=self.dtype)
        self.row_sum = np.zeros_like(self.row_max)
        self.acc: np.ndarray | None = None

    def add(self, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None) -> None:
        """Fold in one key tile."""
        meta = self.meta
        km = np.ascontiguousarray(_matrices(k, meta.step.inputs[1], *self.groups[1]), dtype=self.dtype)
        vm = np.ascontiguousarray(_matrices(v, meta.step.inputs[2], *self.groups[2]), dtype=self.dtype)
        if self.acc is None:
            self.acc = np.zeros((*self.q.shape[:2], vm.shape[2]), dtype=self.dtype)
        allowed = np.zeros((1, 1, 1), np.uint8) if mask is None else \
            np.ascontiguousarray(self._allowed(mask, dict(zip(meta.step.inputs[1], k.shape))), dtype=np.uint8)
        from tra_sql.udfs import online_softmax  # Numba's: imported when attention runs

        online_softmax.fold(self.q, km, vm, allowed, mask is not None, meta.step.scale, self.row_max, self.row_sum,
                            self.acc, cores.MUTEX)

    def _allowed(self, mask: np.ndarray, key_extent: dict[str, int]) -> np.ndarray:
        """Where the mask tile is > 0, as (batch or 1, rows, keys) matrices."""
        sub = self.meta.step.inputs[3]
        extent = self.extent | key_extent
        batch, rows, keys = self.groups[3]
        shape = [extent[c] for c in batch + rows + keys]
        allowed = np.broadcast_to(_align(mask > 0, sub, batch + rows + keys), shape)
        return allowed.reshape(prod(shape[: len(batch)]), prod(shape[len(batch):-1]), shape[-1])

    def finish(self, out: np.ndarray) -> None:
        """``out = acc / row sum`` (0 where the row sum is 0: every position masked), in the
        output's index order."""
        from tra_sql.udfs import online_softmax

        result = np.empty_like(self.acc)
        online_softmax.finish(self.row_sum, self.acc, result)
        order = "".join(self.groups[-1])
        extent = dict(zip(self.meta.step.output, out.shape))
        out[...] = result.reshape([extent[c] for c in order]).transpose([order.index(c) for c in self.meta.step.output])


@implements("attention")
def attention_groups(meta_col, out_keys_col, rows_col):
    """``tra_attention_<n>(meta, out_keys, list({keys0, tile0, ...}))``: one output tile per
    group, the softmax folded over the group's key tiles."""
    meta = AttentionMeta.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.step.output))
    buf, offsets, shapes = allocate_tiles(meta.result, out_keys)
    group_offsets, rows = list_views(rows_col)
    tiles, _ = operand_tiles(meta.operands, rows.flatten(), np.arange(len(rows)), False)
    masked = len(meta.step.inputs) == 4
    for row in range(len(out_keys)):
        first = group_offsets[row]
        state = OnlineSoftmax(meta, tiles[0][first])
        for e in range(first, group_offsets[row + 1]):
            state.add(tiles[1][e], tiles[2][e], tiles[3][e] if masked else None)
        state.finish(out_view(buf, offsets, row, shapes[row], meta.result.dtype))
    return binary_array(buf, offsets)
