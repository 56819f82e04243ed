"""Neural-network layers written in extended einsum.

Every function takes Tensors of one session and returns a lazy Tensor: each op is one or a
few ``db.einsum`` calls whose join expressions carry the elementwise work (bias, activation,
normalization, masking), so a whole model compiles to one SQL program.

Index letters: ``A, B, ...`` (upper case) stand for any number of leading batch axes, so the
functions are rank-generic; the lower-case letters name the axes an op works on.
Constant tensors (the causal mask) are data, stored with ``db.from_numpy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import sqrt
from typing import TYPE_CHECKING

import numpy as np

from tra_sql.errors import ShapeError, SpecError
from tra_sql.graph import Softmax
from tra_sql.tensor import Tensor

if TYPE_CHECKING:
    from tra_sql.session import Session

#: Activations as SQL templates over ``{x}``; GELU is the tanh approximation.
ACTIVATIONS: dict[str, str] = {
    "relu": "greatest({x}, 0.0)",
    "gelu": "0.5 * {x} * (1.0 + tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))",
    "tanh": "tanh({x})",
    "sigmoid": "sigmoid({x})",
    "silu": "{x} * sigmoid({x})",
}
MASKED = "-1e30"  # the logit of a masked position (a finite stand-in for -inf)
NEG_INF = "ln(0.0)"  # -inf as a join expression


def _lead(n: int) -> str:
    """``n`` index letters for leading batch axes."""
    if n > 26:
        raise ShapeError(f"at most 26 batch axes, got {n}")
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def _act(expr: str, activation: str | None) -> str:
    if activation is None:
        return expr
    if activation not in ACTIVATIONS:
        raise SpecError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[activation].format(x=f"({expr})")


def activate(db: Session, x: Tensor, activation: str) -> Tensor:
    """``activation`` applied elementwise: one einsum ``A->A``."""
    idx = _lead(x.ndim)
    return db.einsum(f"{idx}->{idx}", x, join=_act("x0", activation))


def add(db: Session, *xs: Tensor) -> Tensor:
    """Elementwise sum of equally shaped tensors (a residual connection): ``A,A->A``."""
    idx = _lead(xs[0].ndim)
    return db.einsum(",".join([idx] * len(xs)) + f"->{idx}", *xs,
                     join=" + ".join(f"x{m}" for m in range(len(xs))))


def linear(db: Session, x: Tensor, W: Tensor, b: Tensor | None = None,
           activation: str | None = None) -> Tensor:
    """``activation(x @ W + b)`` for ``x`` (..., i), ``W`` (i, o), ``b`` (o,).

    ``Ai,io->Ao`` (a BLAS contraction), then bias and activation fused in one ``Ao,o->Ao`` join.
    """
    lead = _lead(x.ndim - 1)
    y = db.einsum(f"{lead}i,io->{lead}o", x, W)
    if b is None:
        return y if activation is None else activate(db, y, activation)
    return db.einsum(f"{lead}o,o->{lead}o", y, b, join=_act("x0 + x1", activation))


def mlp(db: Session, x: Tensor, layers: Sequence[tuple[Tensor, Tensor | None]],
        activation: str | None = "relu", final_activation: str | None = None) -> Tensor:
    """A stack of ``linear`` layers ``(W, b)``: ``activation`` between them,
    ``final_activation`` after the last."""
    for n, (W, b) in enumerate(layers):
        x = linear(db, x, W, b, activation if n < len(layers) - 1 else final_activation)
    return x


def _softmax(db: Session, x: Tensor, mask: Tensor | None, scale: float, value: str, fill: str) -> Tensor:
    """Row max (``Az->A``, ``agg='max'``), row sum of ``exp(logit - max)`` (``Az,A->A``), then
    ``value`` (a template over ``{logit}``, ``{max}``, ``{sum}``) in one ``Az,A,A->Az`` join;
    positions where ``mask`` (the trailing axes of ``x``) is not > 0 get ``fill``."""
    lead = _lead(x.ndim - 1)
    full = lead + "z"
    ops, subs = [x], [full]
    if mask is not None:
        if mask.ndim > x.ndim or mask.shape != x.shape[x.ndim - mask.ndim:]:
            raise ShapeError(f"mask of shape {mask.shape} does not match the trailing axes of {x.shape}")
        ops.append(mask)
        subs.append(full[x.ndim - mask.ndim:])
    logit = "x0" if scale == 1 else f"x0 * {float(scale)!r}"

    def masked(expr: str, otherwise: str) -> str:
        return expr if mask is None else f"CASE WHEN x1 > 0 THEN {expr} ELSE {otherwise} END"

    n, inputs = len(ops), ",".join(subs)
    top = masked(logit, MASKED)
    m = db.einsum(f"{inputs}->{lead}", *ops, join=None if top == "x0" else top, agg="max")
    total = db.einsum(f"{inputs},{lead}->{lead}", *ops, m, join=masked(f"exp({logit} - x{n})", "0.0"))
    out = value.format(logit=logit, max=f"x{n}", sum=f"x{n + 1}")
    return db.einsum(f"{inputs},{lead},{lead}->{full}", *ops, m, total, join=masked(out, fill))


def softmax(db: Session, x: Tensor, *, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """Softmax of ``scale * x`` over the last axis, numerically stable (max subtracted): three
    einsums, ``exp(x - max) / sum``. ``mask`` (shaped like the trailing axes of ``x``) keeps
    positions where it is > 0; the others get probability 0."""
    probs = _softmax(db, x, mask, scale, "exp({logit} - {max}) / {sum}", "0.0")
    return Tensor(db, replace(probs.node, softmax=Softmax(float(scale), mask is not None)))


def log_softmax(db: Session, x: Tensor, *, mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """Log-softmax of ``scale * x`` over the last axis: ``x - max - ln(sum)``; masked
    positions are ``-inf``."""
    return _softmax(db, x, mask, scale, "{logit} - {max} - ln({sum})", NEG_INF)


def layer_norm(db: Session, x: Tensor, gain: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Layer norm over the last axis: mean (``Az->A``), variance about the mean (two-pass),
    then normalize, scale and shift in one ``Az,A,A,z,z->Az`` join."""
    lead, n = _lead(x.ndim - 1), x.shape[-1]
    mean = db.einsum(f"{lead}z->{lead}", x, join=f"x0 / {n}")
    var = db.einsum(f"{lead}z,{lead}->{lead}", x, mean, join=f"(x0 - x1) * (x0 - x1) / {n}")
    ops, expr = [x, mean, var], f"(x0 - x1) / sqrt(x2 + {eps!r})"
    for t, op in ((gain, "*"), (bias, "+")):
        if t is not None:
            expr = f"{expr} {op} x{len(ops)}"
            ops.append(t)
    subs = [lead + "z", lead, lead] + ["z"] * (len(ops) - 3)
    return db.einsum(f"{','.join(subs)}->{lead}z", *ops, join=expr)


def rms_norm(db: Session, x: Tensor, gain: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMS norm over the last axis: mean square (``Az->A``), then ``x / sqrt(ms + eps) * gain``."""
    lead, n = _lead(x.ndim - 1), x.shape[-1]
    ms = db.einsum(f"{lead}z->{lead}", x, join=f"x0 * x0 / {n}")
    if gain is None:
        return db.einsum(f"{lead}z,{lead}->{lead}z", x, ms, join=f"x0 / sqrt(x1 + {eps!r})")
    return db.einsum(f"{lead}z,{lead},z->{lead}z", x, ms, gain, join=f"x0 / sqrt(x1 + {eps!r}) * x2")


def causal_mask(db: Session, q: int, s: int | None = None, *, dtype=np.float64,
                tile: tuple[int, int] | None = None) -> Tensor:
    """The (q, s) 0/1 tensor with 1 where key ``j <= i`` (top-left aligned, as PyTorch's
    ``is_causal``). Stored once per shape, dtype and tile as ``nn_causal_...``."""
    s = q if s is None else s
    dtype = np.dtype(dtype)
    tile = (q, s) if tile is None else tuple(tile)
    name = f"nn_causal_{q}_{s}_{dtype.name}_{tile[0]}_{tile[1]}"
    if name in db.tensors():
        return db.tensor(name)
    return db.from_numpy(name, np.tri(q, s, dtype=dtype), tile=tile)


@dataclass(frozen=True)
class AttentionWeights:
    """Multi-head attention weights with the head axis kept in the shapes (no reshapes):
    ``Wq, Wk`` (d, heads, dk), ``Wv`` (d, heads, dv), ``Wo`` (heads, dv, d_out); optional
    biases ``bq, bk`` (heads, dk), ``bv`` (heads, dv), ``bo`` (d_out,)."""

    Wq: Tensor
    Wk: Tensor
    Wv: Tensor
    Wo: Tensor
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    bo: Tensor | None = None


def _project(db: Session, x: Tensor, W: Tensor, b: Tensor | None, pos: str, head: str) -> Tensor:
    """Per-head projection ``Apd,dhk->Aphk`` plus bias (``Aphk,hk->Aphk``)."""
    lead = _lead(x.ndim - 2)
    y = db.einsum(f"{lead}{pos}d,dh{head}->{lead}{pos}h{head}", x, W)
    if b is None:
        return y
    return db.einsum(f"{lead}{pos}h{head},h{head}->{lead}{pos}h{head}", y, b, join="x0 + x1")


def _attend(db: Session, x: Tensor, w: AttentionWeights, kv: Tensor | None, mask: Tensor | None,
            causal: bool) -> Tensor:
    """Attention before the output bias: ``(..., q, d_out)``."""
    kv = x if kv is None else kv
    lead = _lead(x.ndim - 2)
    Q = _project(db, x, w.Wq, w.bq, "q", "k")
    K = _project(db, kv, w.Wk, w.bk, "s", "k")
    V = _project(db, kv, w.Wv, w.bv, "s", "v")
    S = db.einsum(f"{lead}qhk,{lead}shk->{lead}hqs", Q, K)
    if causal:
        cm = causal_mask(db, S.shape[-2], S.shape[-1], dtype=S.dtype, tile=S.tile[-2:])
        mask = cm if mask is None else db.einsum("qs,qs->qs", mask, cm)
    P = softmax(db, S, mask=mask, scale=1 / sqrt(w.Wq.shape[-1]))
    heads = db.einsum(f"{lead}hqs,{lead}shv->{lead}qhv", P, V)
    return db.einsum(f"{lead}qhv,hve->{lead}qe", heads, w.Wo)


def attention(db: Session, x: Tensor, w: AttentionWeights, *, kv: Tensor | None = None,
              mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """Multi-head scaled dot-product attention of ``x`` (..., q, d) over ``kv`` (..., s, d)
    (default: ``x``, self-attention).

    ``Q = Aqd,dhk->Aqhk`` (same for K, V), scores ``Aqhk,Ashk->Ahqs``, a masked softmax
    over ``s`` scaled by ``1/sqrt(dk)``, ``Ahqs,Ashv->Aqhv``, ``Aqhv,hve->Aqe`` (+ ``bo``).
    ``mask`` is a (q, s) tensor, > 0 where attending is allowed; ``causal`` adds the causal
    mask (a stored constant tensor, see ``causal_mask``).
    """
    y = _attend(db, x, w, kv, mask, causal)
    if w.bo is None:
        return y
    lead = _lead(y.ndim - 1)
    return db.einsum(f"{lead}e,e->{lead}e", y, w.bo, join="x0 + x1")


@dataclass(frozen=True)
class BlockWeights:
    """A transformer block: attention, two layer norms, a two-layer FFN
    ``W1`` (d, f), ``b1`` (f,), ``W2`` (f, d), ``b2`` (d,)."""

    attn: AttentionWeights
    ln1_g: Tensor
    ln1_b: Tensor
    ln2_g: Tensor
    ln2_b: Tensor
    W1: Tensor
    W2: Tensor
    b1: Tensor | None = None
    b2: Tensor | None = None


def _residual(db: Session, x: Tensor, y: Tensor, b: Tensor | None) -> Tensor:
    """``x + y (+ b)`` in one join: the residual add fused with the last bias."""
    lead = _lead(x.ndim - 1)
    if b is None:
        return add(db, x, y)
    return db.einsum(f"{lead}e,{lead}e,e->{lead}e", x, y, b, join="x0 + x1 + x2")


def transformer_block(db: Session, x: Tensor, w: BlockWeights, *, mask: Tensor | None = None,
                      causal: bool = False, norm_first: bool = True, activation: str = "gelu",
                      eps: float = 1e-5) -> Tensor:
    """A transformer encoder block on ``x`` (..., seq, d), as PyTorch's
    ``TransformerEncoderLayer`` (no dropout). Pre-norm: ``h = x + attn(ln1(x))``,
    ``y = h + ffn(ln2(h))``; post-norm: ``h = ln1(x + attn(x))``, ``y = ln2(h + ffn(h))``.
    Residual adds are joins fused with the output biases."""
    def attn(t: Tensor) -> Tensor:
        return _attend(db, t, w.attn, None, mask, causal)

    def ffn(t: Tensor) -> Tensor:
        lead = _lead(t.ndim - 1)
        h = linear(db, t, w.W1, w.b1, activation)
        return db.einsum(f"{lead}f,fe->{lead}e", h, w.W2)

    def ln1(t: Tensor) -> Tensor:
        return layer_norm(db, t, w.ln1_g, w.ln1_b, eps)

    def ln2(t: Tensor) -> Tensor:
        return layer_norm(db, t, w.ln2_g, w.ln2_b, eps)

    if norm_first:
        h = _residual(db, x, attn(ln1(x)), w.attn.bo)
        return _residual(db, h, ffn(ln2(h)), w.b2)
    h = ln1(_residual(db, x, attn(x), w.attn.bo))
    return ln2(_residual(db, h, ffn(h), w.b2))
