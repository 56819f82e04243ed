"""``tra_attention_<n>``: ``softmax(scale * Q·K, mask) · V`` for one output tile per group.

A group's joined rows are its key tiles: (Q, K_j, V_j[, mask_j]) for every tile ``j`` of the
softmax index. The kernel views the tiles as stacks of matrices (``Roles``), computes the
scores a few matrices at a time with BLAS, in blocks of query rows that skip the keys their
mask hides, and folds them into a running row max, row sum and weighted sum of V (the online
softmax of flash attention), so the scores never leave the kernel. Masked positions (mask
not > 0) get weight 0, as in ``nn.softmax``; a row with every position masked gives 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import prod

import numpy as np

from tra_sql.udfs.arrowio import binary_array, first_string, key_matrix, list_views
from tra_sql.udfs.cores import all_cores
from tra_sql.udfs.protocol import AttentionStep
from tra_sql.udfs.python_kernels import implements
from tra_sql.udfs.tiles import Operand, allocate_tiles, operand_tiles, out_view

MASKED = -1e30  # a masked logit, as nn.MASKED
CHUNK_ELEMENTS = 1 << 18  # scores computed per pass: a few (batch, head) pairs, so they stay in cache
ROW_BLOCK = 128  # query rows per block; each computes only the span of keys its mask allows


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


def _matrices(x: np.ndarray, sub: str, *groups: str) -> np.ndarray:
    """``x`` with its indices in ``groups`` order, each group flattened to one axis."""
    order = "".join(groups)
    extent = dict(zip(sub, x.shape))
    return x.transpose([sub.index(c) for c in order]).reshape([prod(extent[c] for c in g) for g in groups])


def _blocks(allowed: np.ndarray | None, rows: int, keys: int):
    """(query rows, keys) blocks to compute: ``ROW_BLOCK`` rows at a time, each with the span
    of keys the mask allows any of them (causal: about half the scores); a block whose keys
    are all masked is skipped."""
    if allowed is None:
        yield slice(0, rows), slice(0, keys)
        return
    any_batch = allowed.any(axis=0)
    for start in range(0, rows, ROW_BLOCK):
        span = np.flatnonzero(any_batch[start : start + ROW_BLOCK].any(axis=0))
        if len(span):
            yield slice(start, min(start + ROW_BLOCK, rows)), slice(int(span[0]), int(span[-1]) + 1)


class OnlineSoftmax:
    """The running state of one output tile, over (batch, rows) matrices: the row max, the
    row sum and the weighted sum of V's rows."""

    def __init__(self, meta: AttentionMeta, q: np.ndarray):
        self.meta, r = meta, meta.roles
        self.extent = dict(zip(meta.step.inputs[0], q.shape))
        self.dtype = np.dtype(meta.step.probs_dtype)
        self.q = _matrices(q, meta.step.inputs[0], r.batch, r.rows, r.inner).astype(self.dtype, copy=False)
        self.row_max = np.full(self.q.shape[:2], MASKED, dtype=self.dtype)
        self.row_sum = np.zeros_like(self.row_max)
        self.acc: np.ndarray | None = None

    def add(self, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None) -> None:
        """Fold in one key tile, block by block (a few batch matrices at a time)."""
        meta, r, q = self.meta, self.meta.roles, self.q
        kt = np.ascontiguousarray(_matrices(k, meta.step.inputs[1], r.batch, r.keys, r.inner).transpose(0, 2, 1),
                                  dtype=self.dtype)
        v = _matrices(v, meta.step.inputs[2], r.batch, r.keys, r.cols)
        if self.acc is None:
            self.acc = np.zeros((*q.shape[:2], v.shape[2]), dtype=np.dtype(meta.step.out_dtype))
        allowed = None if mask is None else self._allowed(mask, dict(zip(meta.step.inputs[1], k.shape)))
        for rows, keys in _blocks(allowed, q.shape[1], kt.shape[2]):
            step = max(1, CHUNK_ELEMENTS // ((rows.stop - rows.start) * (keys.stop - keys.start)))
            for start in range(0, len(q), step):
                self._fold(slice(start, start + step), rows, keys, kt, v, allowed)

    def _fold(self, part: slice, rows: slice, keys: slice, kt: np.ndarray, v: np.ndarray,
              allowed: np.ndarray | None) -> None:
        """The scores of batch matrices ``part``, query ``rows`` and ``keys`` into the state."""
        scores = np.matmul(self.q[part, rows], kt[part, :, keys])
        scores *= self.meta.step.scale
        if allowed is not None:
            np.copyto(scores, MASKED, where=~allowed[part if len(allowed) > 1 else slice(0, 1), rows, keys])
        top = np.maximum(scores.max(axis=-1), self.row_max[part, rows])
        scores -= top[..., None]
        weights = np.exp(scores, out=scores)
        if allowed is not None:
            dead = top == MASKED  # rows with every key masked so far: exp gave them 1s
            if dead.any():
                np.copyto(weights, 0, where=dead[..., None])
        carry = np.exp(self.row_max[part, rows] - top)
        self.row_sum[part, rows] = self.row_sum[part, rows] * carry + weights.sum(axis=-1)
        acc = self.acc[part, rows]
        acc *= carry[..., None]
        acc += np.matmul(weights, v[part, keys])
        self.row_max[part, rows] = top

    def _allowed(self, mask: np.ndarray, key_extent: dict[str, int]) -> np.ndarray:
        """Where the mask tile is > 0, as (batch or 1, rows, keys) matrices."""
        r, sub = self.meta.roles, self.meta.step.inputs[3]
        extent = self.extent | key_extent
        batch = r.batch if set(sub) & set(r.batch) else ""
        shape = [extent[c] for c in batch + r.rows + r.keys]
        allowed = np.broadcast_to(_align(mask > 0, sub, batch + r.rows + r.keys), shape)
        return allowed.reshape(prod(shape[: len(batch)]), prod(shape[len(batch):-1]), shape[-1])

    def finish(self, out: np.ndarray) -> None:
        """``out = acc / row sum`` (0 where the row sum is 0: every position masked), in the
        output's index order."""
        r = self.meta.roles
        result = np.divide(self.acc, self.row_sum[..., None], out=np.zeros_like(self.acc),
                           where=self.row_sum[..., None] > 0)
        order = r.batch + r.rows + r.cols
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
    with all_cores():  # BLAS products of every head
        for row in range(len(out_keys)):
            first = group_offsets[row]
            state = OnlineSoftmax(meta, tiles[0][first])
            for e in range(first, group_offsets[row + 1]):
                state.add(tiles[1][e], tiles[2][e], tiles[3][e] if masked else None)
            state.finish(out_view(buf, offsets, row, shapes[row], meta.result.dtype))
    return binary_array(buf, offsets)
