"""``tra_attention_<n>``: ``softmax(scale * Q·K, mask) · V`` for one output tile per group.

A group's joined rows are its key tiles: (Q, K_j, V_j[, mask_j]) for every tile ``j`` of the
softmax index. The kernel computes each row's score tile with BLAS and folds it into a
running row max, row sum and weighted sum of V (the online softmax of flash attention), so
the scores never leave the kernel. Masked positions (mask not > 0) get weight 0, as in
``nn.softmax``; a row with every position masked gives 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from tra_sql.udfs.arrowio import binary_array, first_string, key_matrix, list_views
from tra_sql.udfs.contract import TileEinsum
from tra_sql.udfs.register import Operand, _allocate, _operand_tiles, _out_view

MASKED = -1e30  # a masked logit, as nn.MASKED


def _align(x: np.ndarray, sub: str, target: str) -> np.ndarray:
    """``x`` (subscript ``sub``) transposed and expanded to broadcast against ``target``."""
    x = x.transpose([sub.index(c) for c in target if c in sub])
    extents = iter(x.shape)
    return x.reshape([next(extents) if c in sub else 1 for c in target])


@dataclass(frozen=True)
class AttentionMeta:
    """The parsed ``meta`` of ``tra_attention_<n>``: operand subscripts (Q, K, V[, mask]),
    the scores' and the output's, sizes and tiles per index, dtypes, names, the scale."""

    inputs: tuple[str, ...]
    scores: str
    output: str
    sizes: dict[str, int]
    tiles: dict[str, int]
    dtypes: tuple[str, ...]
    out_dtype: str
    names: tuple[str, ...]
    scale: float

    @staticmethod
    @lru_cache(maxsize=64)
    def parse(text: str) -> AttentionMeta:
        m = json.loads(text)
        return AttentionMeta(tuple(m["inputs"]), m["scores"], m["output"], m["sizes"], m["tiles"],
                             tuple(m["dtypes"]), m["out_dtype"], tuple(m["names"]), m["scale"])

    def _operand(self, name: str, dtype: str, sub: str) -> Operand:
        return Operand(name, np.dtype(dtype), np.array([self.sizes[c] for c in sub], np.int64),
                       np.array([self.tiles[c] for c in sub], np.int64))

    @cached_property
    def operands(self) -> list[Operand]:
        return [self._operand(*spec) for spec in zip(self.names, self.dtypes, self.inputs)]

    @cached_property
    def result(self) -> Operand:
        return self._operand("result", self.out_dtype, self.output)

    @cached_property
    def scores_kernel(self) -> TileEinsum:
        return TileEinsum(self.inputs[:2], self.scores)

    @cached_property
    def values_kernel(self) -> TileEinsum:
        return TileEinsum((self.scores, self.inputs[2]), self.output)

    @property
    def rows(self) -> str:
        """The scores' indices but the softmax one (the last)."""
        return self.scores[:-1]


class OnlineSoftmax:
    """The running state of one output tile: row max, row sum and the weighted sum of V."""

    def __init__(self, meta: AttentionMeta, out: np.ndarray):
        self.meta, self.out = meta, out
        self.acc = np.zeros(out.shape, dtype=out.dtype)
        self.row_max: np.ndarray | None = None
        self.row_sum: np.ndarray | None = None

    def add(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None) -> None:
        """Fold in one key tile."""
        meta = self.meta
        extent = dict(zip(meta.inputs[0], q.shape)) | dict(zip(meta.inputs[1], k.shape))
        scores = np.zeros([extent[c] for c in meta.scores], dtype=np.result_type(q, k))
        meta.scores_kernel.accumulate(scores, [q, k], scratch=False)
        scores *= meta.scale
        blocked = None if mask is None else ~_align(mask > 0, meta.inputs[3], meta.scores)
        if blocked is not None:
            np.copyto(scores, MASKED, where=blocked)
        row_max = scores.max(axis=-1)
        if self.row_max is not None:
            np.maximum(row_max, self.row_max, out=row_max)
        scores -= row_max[..., None]
        weights = np.exp(scores, out=scores)
        if blocked is not None:
            np.copyto(weights, 0, where=blocked)
        row_sum = weights.sum(axis=-1)
        if self.row_max is not None:
            carry = np.exp(self.row_max - row_max)
            row_sum += self.row_sum * carry
            self.acc *= _align(carry, meta.rows, meta.output)
        meta.values_kernel.accumulate(self.acc, [weights, v], scratch=self.row_max is not None)
        self.row_max, self.row_sum = row_max, row_sum

    def finish(self) -> None:
        """``out = acc / row sum`` (0 where the row sum is 0: every position masked)."""
        total = _align(self.row_sum, self.meta.rows, self.meta.output)
        self.out[...] = 0
        np.divide(self.acc, total, out=self.out, where=np.broadcast_to(total > 0, self.out.shape))


def attention_groups(meta_col, out_keys_col, rows_col):
    """``tra_attention_<n>(meta, out_keys, list({keys0, tile0, ...}))``: one output tile per
    group, the softmax folded over the group's key tiles."""
    meta = AttentionMeta.parse(first_string(meta_col))
    out_keys = key_matrix(out_keys_col, len(meta.output))
    buf, offsets, shapes = _allocate(meta.result, out_keys)
    group_offsets, rows = list_views(rows_col)
    tiles, _ = _operand_tiles(meta, rows.flatten(), np.arange(len(rows)), False)
    masked = len(meta.inputs) == 4
    for row in range(len(out_keys)):
        state = OnlineSoftmax(meta, _out_view(buf, offsets, row, shapes[row], meta.result.dtype))
        for e in range(group_offsets[row], group_offsets[row + 1]):
            state.add(tiles[0][e], tiles[1][e], tiles[2][e], tiles[3][e] if masked else None)
        state.finish()
    return binary_array(buf, offsets)
