"""Causal attention alone: the native attention aggregate against the Arrow UDF (the same
online-softmax body, ``udfs/online_softmax.py``) and torch's ``scaled_dot_product_attention``,
same run (issue 18: the transformer block's attention).

    python bench/bench_native_attention.py          # batch 4, 8 heads, seq 512, head dim 64, float32
    python bench/bench_native_attention.py --quick  # batch 2, 4 heads, seq 128, head dim 32: a smoke run

Q, K, V are stored as ``bench_nn``'s block has them, (batch, seq, heads, dim); the scores
``Aqhk,Ashk->Ahqs``, ``nn.softmax`` with ``nn.causal_mask`` and ``Ahqs,Ashv->Aqhv`` compile to one
attention step (``tra_attention_agg_float32_4`` on both paths: native, or the Arrow macro over
``tra_attention_4``). Tilings: whole tensors (one joined row per output tile, the block's
case), and query and key tiles of a quarter (128; several key tiles folded into each output tile's
state; blocks above the diagonal skipped). Each repetition times torch, the native session and
the Arrow session one after another; prints medians and the ratios to torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_native import _medians, _row, session  # noqa: E402
from common import machine  # noqa: E402

from tra_sql import nn  # noqa: E402


def attention(db, q, k, v, tile: int):
    """The attention einsums over Q, K, V stored in (batch, ``tile``, heads, dim) tiles."""
    b, s, h, d = q.shape
    Q, K, V = (db.from_numpy(f"att_{n}", a, (b, tile, h, d), replace=True) for n, a in zip("qkv", (q, k, v)))
    mask = nn.causal_mask(db, s, s, dtype=q.dtype, tile=(tile, tile))
    scores = db.einsum("Aqhk,Ashk->Ahqs", Q, K)
    return db.einsum("Ahqs,Ashv->Aqhv", nn.softmax(db, scores, mask=mask, scale=d ** -0.5), V)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 2, 4 heads, seq 128, head dim 32")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 5; 3 quick)")
    args = parser.parse_args()
    repeat = args.repeat or (3 if args.quick else 5)
    import torch
    import torch.nn.functional as F

    b, h, s, d = (2, 4, 128, 32) if args.quick else (4, 8, 512, 64)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(a.transpose(0, 2, 1, 3).copy()) for a in (q, k, v))

    def sdpa():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    want = sdpa().numpy().transpose(0, 2, 1, 3)
    print(f"machine: {machine()}; causal attention b{b} h{h} s{s} d{d} float32, median of {repeat} interleaved\n")
    print("| tiles (seq) | torch s | native s | arrow s | native/torch | arrow/torch |")
    print("|---|---|---|---|---|---|")
    sessions = {kind: session(kind) for kind in ("native", "arrow")}
    for tile in (s, s // 4):
        runs = {"torch": sdpa}
        for kind, db in sessions.items():
            out = attention(db, q, k, v, tile)
            if "TRA_ATTENTION_AGG_FLOAT32_4(" not in out.sql():
                raise SystemExit("the attention is not one attention aggregate")
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-3, atol=1e-4)  # (and the warm-up)
            runs[kind] = out.numpy
        _row(f"{tile}", _medians(runs, repeat), "torch")
    for db in sessions.values():
        db.close()


if __name__ == "__main__":
    main()
