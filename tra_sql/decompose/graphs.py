"""Graphs to plan: a matrix chain, an MLP, a transformer block and a LLaMA-shaped decoder.

Each builder takes ``leaf(name, shape) -> Node`` for its inputs: by default a ``Source``
that is never read (planning needs shapes only); the benchmarks pass stored tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from math import sqrt

import numpy as np

from tra_sql import graph
from tra_sql.graph import Node, Source, default_tile

Leaf = Callable[[str, tuple[int, ...]], Node]


def shape_leaf(dtype: str = "float32", max_tile_bytes: int | None = None) -> Leaf:
    """Inputs known by shape only (tables never read), stored in the default tiling, or in
    tiles of at most ``max_tile_bytes`` (largest dimension halved first)."""
    dt = np.dtype(dtype)

    def leaf(name: str, shape: tuple[int, ...]) -> Node:
        tile = list(default_tile(tuple(shape)))
        while max_tile_bytes and dt.itemsize * int(np.prod(tile)) > max_tile_bytes:
            d = int(np.argmax(tile))
            tile[d] = -(-tile[d] // 2)
        return Source(tuple(shape), dt, tuple(tile), name)

    return leaf


def _e(spec: str, *ops: Node, join: str | None = None, agg: str = "sum") -> Node:
    return graph.einsum(spec, list(ops), [getattr(o, "table", f"x{m}") for m, o in enumerate(ops)], join, agg)


def matrix_chain(dims: tuple[int, ...] = (4096, 512, 4096, 512, 4096), leaf: Leaf | None = None) -> Node:
    """``A1 @ A2 @ ... @ Ak`` with ``Ai`` of shape ``(dims[i-1], dims[i])`` (opt_einsum's order)."""
    leaf = leaf or shape_leaf()
    letters = "abcdefghijklmnopqrstuvwxyz"
    mats = [leaf(f"A{i}", (dims[i], dims[i + 1])) for i in range(len(dims) - 1)]
    spec = ",".join(letters[i : i + 2] for i in range(len(mats))) + f"->a{letters[len(mats)]}"
    return _e(spec, *mats)


def mlp(batch: int = 8192, widths: tuple[int, ...] = (1024, 4096, 4096, 4096, 1024), leaf: Leaf | None = None,
        activation: str = "greatest({x}, 0.0)") -> Node:
    """``len(widths) - 1`` layers ``act(x @ W + b)`` (no activation after the last)."""
    leaf = leaf or shape_leaf()
    x = leaf("x", (batch, widths[0]))
    for n in range(len(widths) - 1):
        W = leaf(f"W{n}", (widths[n], widths[n + 1]))
        b = leaf(f"b{n}", (widths[n + 1],))
        y = _e("bi,io->bo", x, W)
        join = "x0 + x1" if n == len(widths) - 2 else activation.format(x="(x0 + x1)")
        x = _e("bo,o->bo", y, b, join=join)
    return x


def _norm(x: Node, gain: Node, rms: bool) -> Node:
    n = x.shape[-1]
    if rms:
        ms = _e("sz->s", x, join=f"x0 * x0 / {n}")
        return _e("sz,s,z->sz", x, ms, gain, join="x0 / sqrt(x1 + 1e-06) * x2")
    mean = _e("sz->s", x, join=f"x0 / {n}")
    var = _e("sz,s->s", x, mean, join=f"(x0 - x1) * (x0 - x1) / {n}")
    return _e("sz,s,s,z->sz", x, mean, var, gain, join="(x0 - x1) / sqrt(x2 + 1e-05) * x3")


def _softmax(S: Node, mask: Node | None, scale: float) -> Node:
    """Softmax over ``s`` of ``S[h, q, s] * scale`` where ``mask[q, s] > 0``."""
    logit = f"x0 * {scale!r}"
    if mask is None:
        m = _e("hqs->hq", S, agg="max")
        total = _e("hqs,hq->hq", S, m, join=f"exp({logit} - x1)")
        return _e("hqs,hq,hq->hqs", S, m, total, join=f"exp({logit} - x1) / x2")
    m = _e("hqs,qs->hq", S, mask, join=f"CASE WHEN x1 > 0 THEN {logit} ELSE -1e30 END", agg="max")
    total = _e("hqs,qs,hq->hq", S, mask, m, join=f"CASE WHEN x1 > 0 THEN exp({logit} - x2) ELSE 0.0 END")
    return _e("hqs,qs,hq,hq->hqs", S, mask, m, total, join=f"CASE WHEN x1 > 0 THEN exp({logit} - x2) / x3 ELSE 0.0 END")


def transformer_block(seq: int = 1024, d: int = 1024, heads: int = 16, ffn: int = 4096,
                      leaf: Leaf | None = None, layer: str = "", x: Node | None = None,
                      llama: bool = False) -> Node:
    """A pre-norm transformer block on ``x`` (seq, d). ``llama``: RMS norm, rotary embedding,
    a causal mask and a SwiGLU FFN (LLaMA); else layer norm, no mask and a GELU FFN."""
    leaf = leaf or shape_leaf()
    dk = d // heads
    x = x if x is not None else leaf("x", (seq, d))
    h = _norm(x, leaf(f"g1{layer}", (d,)), llama)
    Q = _e("sd,dhk->shk", h, leaf(f"Wq{layer}", (d, heads, dk)))
    K = _e("sd,dhk->shk", h, leaf(f"Wk{layer}", (d, heads, dk)))
    V = _e("sd,dhk->shk", h, leaf(f"Wv{layer}", (d, heads, dk)))
    mask = None
    if llama:
        rot, cos, sin = leaf("rope_rot", (dk, dk)), leaf("rope_cos", (seq, dk)), leaf("rope_sin", (seq, dk))
        Q = _e("shk,shk,sk,sk->shk", Q, _e("shj,jk->shk", Q, rot), cos, sin, join="x0 * x2 + x1 * x3")
        K = _e("shk,shk,sk,sk->shk", K, _e("shj,jk->shk", K, rot), cos, sin, join="x0 * x2 + x1 * x3")
        mask = leaf("causal", (seq, seq))
    S = _e("qhk,shk->hqs", Q, K)
    P = _softmax(S, mask, 1 / sqrt(dk))
    heads_out = _e("hqs,shv->qhv", P, V)
    attn = _e("qhv,hve->qe", heads_out, leaf(f"Wo{layer}", (heads, dk, d)))
    x = _e("qe,qe->qe", x, attn, join="x0 + x1")
    h = _norm(x, leaf(f"g2{layer}", (d,)), llama)
    if llama:
        gate = _e("sd,df->sf", h, leaf(f"W1{layer}", (d, ffn)))
        up = _e("sd,df->sf", h, leaf(f"W3{layer}", (d, ffn)))
        act = _e("sf,sf->sf", gate, up, join="x0 * sigmoid(x0) * x1")
    else:
        up = _e("sd,df->sf", h, leaf(f"W1{layer}", (d, ffn)))
        act = _e("sf,f->sf", up, leaf(f"b1{layer}", (ffn,)),
                 join="0.5 * (x0 + x1) * (1.0 + tanh(0.7978845608028654 * ((x0 + x1) + 0.044715 * (x0 + x1) * "
                      "(x0 + x1) * (x0 + x1))))")
    down = _e("sf,fd->sd", act, leaf(f"W2{layer}", (ffn, d)))
    return _e("sd,sd->sd", x, down, join="x0 + x1")


def llama_decoder(layers: int = 32, d: int = 4096, heads: int = 32, ffn: int = 11008, seq: int = 2048,
                  leaf: Leaf | None = None) -> Node:
    """A LLaMA-7B-shaped decoder stack (no embedding or LM head)."""
    leaf = leaf or shape_leaf()
    x = leaf("x", (seq, d))
    for n in range(layers):
        x = transformer_block(seq, d, heads, ffn, leaf, layer=str(n), x=x, llama=True)
    return x
