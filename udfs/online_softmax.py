"""The online softmax of attention, one body for both wrappers (the Arrow UDF,
``udfs.attention``, and the native aggregate, ``udfs.native.attention``): Numba functions over
an output tile's state (row max, row sum and the weighted sum of V's rows, as (batch, rows)
and (batch, rows, cols) matrices of the probabilities' dtype) and one key tile's Q, K, V
matrices, contiguous (batch, rows, inner), (batch, keys, inner), (batch, keys, cols).

``fold`` computes the scaled scores of ``ROW_BLOCK`` query rows at a time with BLAS (NumPy's
OpenBLAS, ``blas``; each product under the kernels' mutex), each block only over the span of
keys its mask allows any of its rows (causal: about half the scores; a block with none is
skipped), then per row masks, takes the max, exponentiates and sums, and adds the weights
times V into the state with a second product. Masked positions (mask not > 0) get weight 0;
a row with every position masked so far has row max -inf and stays 0.
``merge`` folds one state into another (the softmax is associative: each side rescaled by
exp of its max's difference from the joint max); ``finish`` writes acc / row sum (0 for a
row without weight)."""

from __future__ import annotations

import numpy as np
from numba import njit

from tra_sql.udfs.blas import NO_TRANS, ROW_MAJOR, TRANS
from tra_sql.udfs.nopython import DGEMM, SGEMM, lock, unlock
from tra_sql.udfs.vector_exp import exp32, exp64

ROW_BLOCK = 128  # query rows per block; each computes only the span of keys its mask allows


@njit(cache=True, nogil=True)
def _exp32(x, top) -> None:
    """``x = exp(x - top)`` for float32 ``x`` (-inf: 0; NaN: NaN), a loop LLVM vectorizes."""
    for j in range(len(x)):
        x[j] = exp32(x[j] - top)


@njit(cache=True, nogil=True)
def _exp64(x, top) -> None:
    """``x = exp(x - top)`` for float64 ``x``, as ``_exp32``."""
    for j in range(len(x)):
        x[j] = exp64(x[j] - top)


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sum(x) -> float:
    total = 0.0
    for j in range(len(x)):
        total += x[j]
    return total


@njit(cache=True, nogil=True)
def _gemm(mutex, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, single) -> None:
    """``C = alpha A op(B) + beta C`` (row-major, addresses), float32 if ``single``, under ``mutex``."""
    lock(mutex)
    if single:
        SGEMM(ROW_MAJOR, NO_TRANS, trans_b, m, n, k, np.float32(alpha), a, lda, b, ldb, np.float32(beta), c, ldc)
    else:
        DGEMM(ROW_MAJOR, NO_TRANS, trans_b, m, n, k, np.float64(alpha), a, lda, b, ldb, np.float64(beta), c, ldc)
    unlock(mutex)


@njit(cache=True, nogil=True)
def _spans(allowed, rows, keys, spans) -> None:
    """Per mask matrix and row block, the first and last key + 1 any of its rows may see
    (0, 0: none)."""
    for mb in range(allowed.shape[0]):
        for block in range(spans.shape[1]):
            lo, hi = keys, 0
            for r in range(block * ROW_BLOCK, min(rows, (block + 1) * ROW_BLOCK)):
                for s in range(keys):
                    if allowed[mb, r, s]:
                        lo = min(lo, s)
                        break
                for s in range(keys - 1, lo - 1, -1):
                    if allowed[mb, r, s]:
                        hi = max(hi, s + 1)
                        break
            spans[mb, block, 0], spans[mb, block, 1] = (lo, hi) if hi > lo else (0, 0)


@njit(cache=True, nogil=True)
def fold(q, k, v, allowed, masked, scale, row_max, row_sum, acc, mutex) -> None:
    """Fold one key tile into the state: ``q`` (B, R, I), ``k`` (B, S, I), ``v`` (B, S, C),
    ``allowed`` (1 or B, R, S) uint8 where ``masked``, the state ``row_max``/``row_sum``
    (B, R) and ``acc`` (B, R, C); all contiguous, of one float dtype."""
    batch, rows, inner = q.shape
    keys, cols = k.shape[1], v.shape[2]
    single = q.itemsize == 4
    item = np.uint64(q.itemsize)
    blocks = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    spans = np.empty((allowed.shape[0] if masked else 1, blocks, 2), np.int64)
    if masked:
        _spans(allowed, rows, keys, spans)
    else:
        spans[:, :, 0] = 0
        spans[:, :, 1] = keys
    scores = np.empty(min(rows, ROW_BLOCK) * keys, q.dtype)
    at = np.uint64(scores.ctypes.data)
    for b in range(batch):
        mb = b if masked and allowed.shape[0] > 1 else 0
        for block in range(blocks):
            lo, hi = spans[mb, block, 0], spans[mb, block, 1]
            if hi == lo:
                continue
            r0 = block * ROW_BLOCK
            nr, span = min(rows, r0 + ROW_BLOCK) - r0, hi - lo
            _gemm(mutex, TRANS, nr, span, inner, scale, np.uint64(q.ctypes.data)
                  + item * np.uint64((b * rows + r0) * inner), inner,
                  np.uint64(k.ctypes.data) + item * np.uint64((b * keys + lo) * inner), inner, 0.0, at, span, single)
            for i in range(nr):
                r = r0 + i
                x = scores[i * span: (i + 1) * span]
                old = row_max[b, r]
                top = old
                if masked:  # a masked position's score -inf: its weight exp(-inf) = 0
                    seen = allowed[mb, r, lo: hi]
                    for j in range(span):
                        x[j] = x[j] if seen[j] else -np.inf
                for j in range(span):
                    top = max(top, x[j])
                if top == -np.inf:  # nothing to see yet: no weight
                    x[:] = 0
                    continue
                if single:
                    _exp32(x, top)
                else:
                    _exp64(x, top)
                total = _sum(x)
                carry = exp64(old - top)
                row_sum[b, r] = row_sum[b, r] * carry + total
                row_max[b, r] = top
                acc[b, r] *= carry
            _gemm(mutex, NO_TRANS, nr, cols, span, 1.0, at, span, np.uint64(v.ctypes.data)
                  + item * np.uint64((b * keys + lo) * cols), cols, 1.0,
                  np.uint64(acc.ctypes.data) + item * np.uint64((b * rows + r0) * cols), cols, single)


@njit(cache=True, nogil=True)
def merge(row_max, row_sum, acc, other_max, other_sum, other_acc) -> None:
    """Fold the state ``other_*`` into ``row_max``, ``row_sum``, ``acc`` (same shapes)."""
    batch, rows = row_max.shape
    for b in range(batch):
        for r in range(rows):
            top = max(row_max[b, r], other_max[b, r])
            if top == -np.inf:  # neither has weight
                continue
            mine, theirs = np.exp(row_max[b, r] - top), np.exp(other_max[b, r] - top)
            row_sum[b, r] = row_sum[b, r] * mine + other_sum[b, r] * theirs
            row_max[b, r] = top
            for c in range(acc.shape[2]):
                acc[b, r, c] = acc[b, r, c] * mine + other_acc[b, r, c] * theirs


@njit(cache=True, nogil=True)
def finish(row_sum, acc, out) -> None:
    """``out`` (B, R, C) = ``acc`` / ``row_sum``, 0 where the row sum is 0 (every position masked)."""
    batch, rows, cols = acc.shape
    for b in range(batch):
        for r in range(rows):
            total = row_sum[b, r]
            for c in range(cols):
                out[b, r, c] = acc[b, r, c] / total if total > 0 else 0
