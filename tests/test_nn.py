"""tra_sql.nn layers against NumPy / PyTorch references at small shapes, with ragged tilings."""

from __future__ import annotations

import re
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql import SpecError, nn
from tra_sql.errors import ShapeError

DTYPES = [np.float64, np.float32]
ACTS = [None, "relu", "gelu", "tanh", "sigmoid", "silu"]


def close(got, want, dtype):
    tol = dict(rtol=1e-9, atol=1e-10) if np.dtype(dtype) == np.float64 else dict(rtol=3e-4, atol=3e-5)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, np.asarray(want), **tol)


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def put(db, rng):
    """Store a random (or given) array as a fresh tensor; returns (Tensor, ndarray)."""
    count = iter(range(10**6))

    def put(shape_or_array, tile=None, dtype=np.float64, scale=1.0):
        a = (np.asarray(shape_or_array) if isinstance(shape_or_array, np.ndarray)
             else scale * rng.standard_normal(shape_or_array)).astype(dtype)
        return db.from_numpy(f"t{next(count)}", a, tile=tile), a

    return put


def np_act(x, name):
    if name is None:
        return x
    return {
        "relu": lambda: np.maximum(x, 0),
        "gelu": lambda: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
        "tanh": lambda: np.tanh(x),
        "sigmoid": lambda: 1 / (1 + np.exp(-x)),
        "silu": lambda: x / (1 + np.exp(-x)),
    }[name]()


# -- linear / mlp ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_linear_matches_torch(db, put, torch, activation, dtype):
    F = torch.nn.functional
    X, x = put((5, 7), tile=(2, 3), dtype=dtype)
    W, w = put((7, 6), tile=(4, 4), dtype=dtype)
    B, b = put((6,), tile=(5,), dtype=dtype)
    ref = F.linear(torch.from_numpy(x), torch.from_numpy(w.T.copy()), torch.from_numpy(b))
    ref = {None: lambda t: t, "relu": F.relu, "gelu": lambda t: F.gelu(t, approximate="tanh"),
           "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu}[activation](ref)
    close(nn.linear(db, X, W, B, activation).numpy(), ref.numpy(), dtype)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_linear_rank3_without_bias(db, put, activation):
    X, x = put((2, 5, 7), tile=(1, 3, 4))
    W, w = put((7, 3), tile=(7, 2))
    close(nn.linear(db, X, W, activation=activation).numpy(), np_act(x @ w, activation), np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp(db, put, dtype):
    X, x = put((4, 6), tile=(3, 4), dtype=dtype)
    dims = [6, 5, 7, 2]
    layers, ref = [], x
    for n, (i, o) in enumerate(pairwise(dims)):
        W, w = put((i, o), tile=(3, 3), dtype=dtype)
        B, b = put((o,), tile=(2,), dtype=dtype) if n != 1 else (None, 0)
        layers.append((W, B))
        ref = ref @ w + b
        ref = np_act(ref, "tanh" if n < 2 else "sigmoid")
    got = nn.mlp(db, X, layers, activation="tanh", final_activation="sigmoid")
    close(got.numpy(), ref, dtype)


def test_unknown_activation(db, put):
    X, _ = put((2, 2))
    W, _ = put((2, 2))
    with pytest.raises(SpecError, match="activation"):
        nn.linear(db, X, W, activation="swish")


# -- softmax -------------------------------------------------------------------------------


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tile", [((5, 7), (2, 3)), ((2, 3, 9), (1, 2, 4)), ((11,), (4,))])
def test_softmax_and_log_softmax(db, put, torch, shape, tile, dtype):
    X, x = put(shape, tile=tile, dtype=dtype, scale=30.0)  # large logits: needs the max shift
    t = torch.from_numpy(x)
    close(nn.softmax(db, X).numpy(), torch.softmax(t, -1).numpy(), dtype)
    close(nn.log_softmax(db, X).numpy(), torch.log_softmax(t, -1).numpy(), dtype)


def test_softmax_stable_on_huge_logits(db, put):
    X, x = put(np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1003.0]]), tile=(1, 2))
    got = nn.softmax(db, X).numpy()
    assert np.isfinite(got).all()
    close(got, np_softmax(x), np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_scaled_softmax(db, put, torch, dtype):
    X, x = put((2, 5, 6), tile=(2, 2, 4), dtype=dtype)
    keep = (np.random.default_rng(1).random((5, 6)) > 0.4).astype(dtype)
    keep[:, 0] = 1  # no fully masked row
    M, _ = put(keep, tile=(3, 3), dtype=dtype)
    t = torch.from_numpy(x) * 0.5
    t = t.masked_fill(torch.from_numpy(keep) == 0, float("-inf"))
    close(nn.softmax(db, X, mask=M, scale=0.5).numpy(), torch.softmax(t, -1).numpy(), dtype)
    got = nn.log_softmax(db, X, mask=M, scale=0.5).numpy()
    want = torch.log_softmax(t, -1).numpy()
    assert np.array_equal(np.isneginf(got), keep[None].repeat(2, 0) == 0)
    close(np.where(np.isinf(got), 0, got), np.where(np.isinf(want), 0, want), dtype)


def test_softmax_mask_shape_checked(db, put):
    X, _ = put((3, 4))
    M, _ = put((4, 3))
    with pytest.raises(ShapeError, match="mask"):
        nn.softmax(db, X, mask=M)


# -- normalization -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(db, put, torch, affine, dtype):
    F = torch.nn.functional
    X, x = put((2, 5, 7), tile=(1, 2, 3), dtype=dtype, scale=3.0)
    G, g = put((7,), tile=(4,), dtype=dtype)
    B, b = put((7,), tile=(5,), dtype=dtype)
    args = (torch.from_numpy(g), torch.from_numpy(b)) if affine else (None, None)
    want = F.layer_norm(torch.from_numpy(x) + 10, (7,), *args, eps=1e-5).numpy()
    shifted = db.einsum("abc->abc", X, join="x0 + 10")  # an offset the two-pass variance handles
    got = nn.layer_norm(db, shifted, *((G, B) if affine else (None, None)), eps=1e-5)
    close(got.numpy(), want, dtype)


@pytest.mark.parametrize("tile", [(2, 3, 7), (3, 4, 7)])  # rows in uniform tiles (one stacked call), ragged ones
def test_row_statistics_computed_in_the_step_that_reads_them(db, put, tile):
    """With the normalized axis in one tile, layer norm's mean and variance and softmax's row
    max and sum are computed inside the step that reads them: one step each. A statistic
    read by two steps stays a step of its own."""
    X, x = put((4, 6, 7), tile=tile, scale=3.0)
    G, g = put((7,), tile=(7,))
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    e = np.exp(0.5 * x - (0.5 * x).max(-1, keepdims=True))
    cases = [(nn.layer_norm(db, X, G), (x - mu) / np.sqrt(var + 1e-5) * g),
             (nn.softmax(db, X, scale=0.5), e / e.sum(-1, keepdims=True)),
             (nn.log_softmax(db, X), np.log(np_softmax(x)))]
    for got, want in cases:
        assert "MATERIALIZED" not in got.sql() and got.sql().count("TRA_LOOP_CHAIN_") == 1
        close(got.numpy(), want, np.float64)
    mean = db.einsum("abz->ab", X, join="x0 / 7")  # statistics out of their order, an operand after them
    var = db.einsum("abz,ab->ab", X, mean, join="(x0 - x1) * (x0 - x1) / 7")
    normed = db.einsum("abz,ab,ab,z->abz", X, var, mean, G, join="(x0 - x2) / sqrt(x1 + 1e-5) * x3")
    assert "MATERIALIZED" not in normed.sql()
    close(normed.numpy(), cases[0][1], np.float64)
    top = db.einsum("abz->ab", X, agg="max")
    twice = db.einsum("abz,ab->abz", db.einsum("abz,ab->abz", X, top, join="x0 - x1"), top, join="x0 + x1")
    sql = twice.sql()
    assert sql.count("AS MATERIALIZED") == 1 and "TRA_LOOP_CHAIN_3(" in sql  # the max a step, the two joins chained
    close(twice.numpy(), x, np.float64)


def test_layer_norm_gain_only_rank4(db, put):
    X, x = put((2, 2, 3, 5), tile=(1, 2, 2, 2))
    G, g = put((5,), tile=(3,))
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    close(nn.layer_norm(db, X, G).numpy(), (x - mu) / np.sqrt(var + 1e-5) * g, np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(db, put, torch, dtype):
    F = torch.nn.functional
    X, x = put((3, 4, 6), tile=(2, 3, 4), dtype=dtype)
    G, g = put((6,), tile=(4,), dtype=dtype)
    want = F.rms_norm(torch.from_numpy(x), (6,), torch.from_numpy(g), eps=1e-6).numpy()
    close(nn.rms_norm(db, X, G, eps=1e-6).numpy(), want, dtype)
    close(nn.rms_norm(db, X).numpy(), x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6), dtype)


# -- attention -----------------------------------------------------------------------------


def attention_weights(put, d, heads, dk, dtype, tile=None, bias=True, scale=0.4):
    """(AttentionWeights, dict of the arrays)."""
    shapes = {"Wq": (d, heads, dk), "Wk": (d, heads, dk), "Wv": (d, heads, dk), "Wo": (heads, dk, d),
              "bq": (heads, dk), "bk": (heads, dk), "bv": (heads, dk), "bo": (d,)}
    tensors, arrays = {}, {}
    for name, shape in shapes.items():
        if name.startswith("b") and not bias:
            continue
        tensors[name], arrays[name] = put(shape, tile=tile and tile[: len(shape)], dtype=dtype, scale=scale)
    return nn.AttentionWeights(**tensors), arrays


def torch_mha(torch, a, d, heads, dtype):
    mha = torch.nn.MultiheadAttention(d, heads, batch_first=True, dtype=torch.from_numpy(a["Wq"]).dtype)
    hk = heads * a["Wq"].shape[-1]
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.from_numpy(
            np.concatenate([a[w].reshape(d, hk).T for w in ("Wq", "Wk", "Wv")])))
        mha.in_proj_bias.copy_(torch.from_numpy(np.concatenate([a[b].ravel() for b in ("bq", "bk", "bv")])))
        mha.out_proj.weight.copy_(torch.from_numpy(a["Wo"].reshape(hk, d).T.copy()))
        mha.out_proj.bias.copy_(torch.from_numpy(a["bo"]))
    return mha.eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_torch_mha(db, put, torch, causal, dtype):
    b, s, d, heads = 2, 6, 8, 2
    X, x = put((b, s, d), tile=(1, 4, 3), dtype=dtype)
    w, a = attention_weights(put, d, heads, d // heads, dtype, tile=(5, 1, 3))
    mha = torch_mha(torch, a, d, heads, dtype)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1) if causal else None
    t = torch.from_numpy(x)
    with torch.no_grad():
        want = mha(t, t, t, attn_mask=mask, need_weights=False)[0].numpy()
    close(nn.attention(db, X, w, causal=causal).numpy(), want, dtype)


def test_cross_attention_with_mask_and_causal(db, put, torch):
    F = torch.nn.functional
    b, q, s, d, heads, dk = 2, 5, 7, 6, 3, 4
    X, x = put((b, q, d), tile=(2, 3, 4))
    KV, kv = put((b, s, d), tile=(1, 4, 6))
    w, a = attention_weights(put, d, heads, dk, np.float64, bias=False)
    keep = np.random.default_rng(2).random((q, s)) > 0.3
    keep[:, 0] = True
    M, _ = put(keep.astype(np.float64), tile=(2, 5))
    Q, K, V = (torch.from_numpy(np.einsum("bsd,dhk->bhsk", t, a[n])) for t, n in
               ((x, "Wq"), (kv, "Wk"), (kv, "Wv")))
    allowed = torch.from_numpy(keep & np.tri(q, s, dtype=bool))
    o = F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed).numpy()
    want = np.einsum("bhqv,hve->bqe", o, a["Wo"])
    close(nn.attention(db, X, w, kv=KV, mask=M, causal=True).numpy(), want, np.float64)


def np_attention(x, a, causal):
    """Reference with any number of leading batch axes, written in NumPy."""
    Q, K, V = (np.einsum("...sd,dhk->...hsk", x, a[n]) + a[b][:, None] for n, b in
               (("Wq", "bq"), ("Wk", "bk"), ("Wv", "bv")))
    S = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    if causal:
        S = np.where(np.tri(S.shape[-1], dtype=bool), S, -np.inf)
    return np.einsum("...hqv,hve->...qe", np_softmax(S) @ V, a["Wo"]) + a["bo"]


def test_attention_two_batch_axes(db, put):
    X, x = put((2, 3, 5, 4), tile=(1, 2, 3, 3))
    w, a = attention_weights(put, 4, 2, 3, np.float64)
    close(nn.attention(db, X, w, causal=True).numpy(), np_attention(x, a, True), np.float64)


def np_heads(q, k, v, keep, scale):
    """softmax(scale * q·k, keep) · v per head (``...qhk``), rows with nothing kept giving 0."""
    S = np.einsum("...qhk,...shk->...hqs", q, k) * scale
    S = np.where(keep, S, -np.inf)
    top = S.max(-1, keepdims=True)
    E = np.exp(S - np.where(np.isfinite(top), top, 0))
    total = E.sum(-1, keepdims=True)
    P = np.divide(E, total, out=np.zeros_like(E), where=total > 0)
    return np.einsum("...hqs,...shv->...qhv", P, v)


def fused_attention(db, Q, K, V, mask, scale):
    """The einsums of ``nn._attend`` between the projections and the output projection."""
    S = db.einsum("Aqhk,Ashk->Ahqs", Q, K)
    return db.einsum("Ahqs,Ashv->Aqhv", nn.softmax(db, S, mask=mask, scale=scale), V)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_tile,s_tile,h_tile", [(7, 9, 3), (3, 4, 2), (2, 9, 1), (7, 2, 3)])
def test_attention_is_one_fused_step(db, put, q_tile, s_tile, h_tile, dtype):
    """softmax(Q·K)·V compiles to one tra_attention step (online softmax across key tiles),
    ragged query and key tiles included; a query row with every key masked gives 0."""
    b, q, s, h, dk, dv = 2, 7, 9, 3, 4, 5
    Q, q_ = put((b, q, h, dk), tile=(1, q_tile, h_tile, dk), dtype=dtype)
    K, k_ = put((b, s, h, dk), tile=(2, s_tile, h_tile, dk), dtype=dtype)
    V, v_ = put((b, s, h, dv), tile=(2, s_tile, h_tile, 2), dtype=dtype)
    keep = np.random.default_rng(3).random((q, s)) > 0.4
    keep[2] = False
    M, _ = put(keep.astype(dtype), tile=(q_tile, s_tile), dtype=dtype)
    out = fused_attention(db, Q, K, V, M, 0.7)
    sql = out.sql()
    assert re.search(r"TRA_ATTENTION_(AGG_FLOAT\d+_)?4\(", sql) and "max" not in sql
    assert out.tile == (1, q_tile, h_tile, 2)
    got = out.numpy()
    close(got, np_heads(q_, k_, v_, keep, 0.7), dtype)
    assert not got[:, 2].any()


def test_fused_attention_integer_operands(db, rng):
    """Integer Q, K, V: the scores' softmax is float64 (as unfused), fused all the same."""
    q, k, v = (rng.integers(-3, 4, shape) for shape in ((2, 5, 2, 3), (2, 6, 2, 3), (2, 6, 2, 4)))
    Q, K, V = (db.from_numpy(name, a) for name, a in (("q", q), ("k", k), ("v", v)))
    out = fused_attention(db, Q, K, V, None, 0.5)
    assert "TRA_ATTENTION_3" in out.sql() and out.dtype == np.float64
    close(out.numpy(), np_heads(q, k, v, True, 0.5), np.float64)


def test_attention_steps_stay_apart_when_read_elsewhere(db, put):
    """When the probabilities are read again (here: by the backward pass), the contracted
    head dimension is split over tiles, or V is shared by the heads, the steps compile one
    by one, with the same result."""
    Q, q_ = put((2, 5, 2, 4))
    K, k_ = put((2, 6, 2, 4))
    V, v_ = put((2, 6, 2, 3))
    out = fused_attention(db, Q, K, V, None, 0.5)
    assert re.search(r"TRA_ATTENTION_(AGG_FLOAT\d+_)?3\(", out.sql())
    (dQ,) = db.grad(db.einsum("Aqhv->", out, join="x0 * x0"), [Q])
    assert "TRA_ATTENTION" not in dQ.sql()
    Qs, Ks = Q.retile((2, 5, 2, 3)), K.retile((2, 6, 2, 3))
    split = fused_attention(db, Qs, Ks, V, None, 0.5)
    assert "TRA_ATTENTION" not in split.sql()
    close(split.numpy(), out.numpy(), np.float64)
    close(out.numpy(), np_heads(q_, k_, v_, True, 0.5), np.float64)
    shared = db.einsum("Ahqs,Asv->Aqhv", nn.softmax(db, db.einsum("Aqhk,Ashk->Ahqs", Q, K), scale=0.5), V[:, :, 0])
    assert "TRA_ATTENTION" not in shared.sql()  # values shared by the heads: not the kernel's pattern
    close(shared.numpy(), np_heads(q_, k_, np.repeat(v_[:, :, :1], 2, axis=2), True, 0.5), np.float64)


def test_attention_gradients_match_torch(db, put, torch):
    """Gradients through causal multi-head attention (the unfused steps) against autograd."""
    b, s, d, heads = 2, 5, 6, 2
    X, x = put((b, s, d), tile=(1, 3, 4))
    w, a = attention_weights(put, d, heads, 3, np.float64)
    loss = db.einsum("Aqe->", nn.attention(db, X, w, causal=True), join="x0 * x0")
    got = db.grad(loss, [X, w.Wq, w.Wv, w.bo])
    T = {n: torch.from_numpy(v).requires_grad_() for n, v in a.items()}
    tx = torch.from_numpy(x).requires_grad_()
    Qt, Kt, Vt = (torch.einsum("bsd,dhk->bhsk", tx, T[n]) + T[c][:, None] for n, c in
                  (("Wq", "bq"), ("Wk", "bk"), ("Wv", "bv")))
    o = torch.nn.functional.scaled_dot_product_attention(Qt, Kt, Vt, is_causal=True)
    (torch.einsum("bhqv,hve->bqe", o, T["Wo"]) + T["bo"]).pow(2).sum().backward()
    for g, want in zip(got, (tx.grad, T["Wq"].grad, T["Wv"].grad, T["bo"].grad)):
        close(g.numpy(), want.numpy(), np.float64)


def test_causal_mask_is_stored_once(db):
    m = nn.causal_mask(db, 4, 6, tile=(3, 4))
    assert nn.causal_mask(db, 4, 6, tile=(3, 4)).name == m.name
    np.testing.assert_array_equal(m.numpy(), np.tri(4, 6))
    assert sum(n.startswith("nn_causal") for n in db.tensors()) == 1


# -- transformer block ---------------------------------------------------------------------


def block_weights(put, d, heads, f, dtype, tile):
    attn, a = attention_weights(put, d, heads, d // heads, dtype, tile=tile)
    tensors = {}
    for name, shape, scale in (("ln1_g", (d,), 1.0), ("ln1_b", (d,), 1.0), ("ln2_g", (d,), 1.0),
                               ("ln2_b", (d,), 1.0), ("W1", (d, f), 0.4), ("b1", (f,), 0.4),
                               ("W2", (f, d), 0.4), ("b2", (d,), 0.4)):
        tensors[name], a[name] = put(shape, tile=tile[: len(shape)], dtype=dtype, scale=scale)
    return nn.BlockWeights(attn=attn, **tensors), a


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_first,causal", [(True, True), (False, False), (True, False)])
def test_transformer_block_matches_torch(db, put, torch, norm_first, causal, dtype):
    F = torch.nn.functional
    b, s, d, heads, f = 2, 6, 8, 2, 12
    X, x = put((b, s, d), tile=(1, 4, 5), dtype=dtype)
    w, a = block_weights(put, d, heads, f, dtype, tile=(3, 2, 3))
    layer = torch.nn.TransformerEncoderLayer(
        d, heads, f, dropout=0.0, activation=lambda t: F.gelu(t, approximate="tanh"),
        batch_first=True, norm_first=norm_first, dtype=torch.from_numpy(x).dtype).eval()
    layer.self_attn.load_state_dict(torch_mha(torch, a, d, heads, dtype).state_dict())
    with torch.no_grad():
        for module, weight, bias in ((layer.norm1, "ln1_g", "ln1_b"), (layer.norm2, "ln2_g", "ln2_b"),
                                     (layer.linear1, "W1", "b1"), (layer.linear2, "W2", "b2")):
            module.weight.copy_(torch.from_numpy(a[weight].T.copy() if weight[0] == "W" else a[weight]))
            module.bias.copy_(torch.from_numpy(a[bias]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(s, dtype=layer.linear1.weight.dtype)
        want = layer(torch.from_numpy(x), src_mask=mask if causal else None, is_causal=causal).numpy()
    got = nn.transformer_block(db, X, w, causal=causal, norm_first=norm_first)
    close(got.numpy(), want, dtype)


def test_block_is_one_lazy_program(db, put):
    X, _ = put((2, 6, 8), tile=(1, 4, 5))
    w, _ = block_weights(put, 8, 2, 12, np.float64, tile=(3, 2, 3))
    before = set(db.tensors())
    y = nn.transformer_block(db, X, w, causal=True)
    assert set(db.tensors()) - before == {"nn_causal_6_6_float64_4_4"}  # only the constant mask
    sql = y.sql()
    assert sql.count("AS MATERIALIZED") > 20 and "nn_causal_6_6_float64_4_4" in sql
    assert y.shape == (2, 6, 8) and y.tile == (1, 4, 5)


@st.composite
def attention_cases(draw):
    """Shapes (b, q, s, h, dk, dv), a tile per axis (ragged ones included), a mask or none."""
    sizes = dict(zip("bqshkv", (draw(st.integers(1, n)) for n in (2, 7, 9, 3, 4, 4))))
    tiles = {c: draw(st.integers(1, n)) for c, n in sizes.items()}
    tiles["k"] = sizes["k"]  # the fused kernel needs whole score tiles
    keep = draw(st.none() | st.lists(st.booleans(), min_size=sizes["q"] * sizes["s"],
                                     max_size=sizes["q"] * sizes["s"]))
    return sizes, tiles, keep, draw(st.floats(0.1, 2.0))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_cases())
def test_fused_attention_property(case):
    sizes, tiles, keep, scale = case
    rng = np.random.default_rng(sum(sizes.values()))
    with tra_sql.connect() as db:
        def put(name, sub):
            a = rng.standard_normal(tuple(sizes[c] for c in sub))
            return db.from_numpy(name, a, tile=tuple(tiles[c] for c in sub)), a

        (Q, q), (K, k), (V, v) = put("q", "bqhk"), put("k", "bshk"), put("v", "bshv")
        mask = None if keep is None else np.array(keep, dtype=np.float64).reshape(sizes["q"], sizes["s"])
        M = None if mask is None else db.from_numpy("m", mask, tile=(tiles["q"], tiles["s"]))
        out = fused_attention(db, Q, K, V, M, scale)
        assert "TRA_ATTENTION" in out.sql()
        close(out.numpy(), np_heads(q, k, v, True if mask is None else mask > 0, scale), np.float64)


NORMALIZATIONS = ["layer_norm", "rms_norm", "softmax", "log_softmax"]


@st.composite
def normalization_cases(draw):
    """A shape of rank 1-3, a tile per axis (the last axis whole or split), an op."""
    shape = tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 3))))
    tile = tuple(draw(st.integers(1, n)) for n in shape[:-1]) + (draw(st.sampled_from([shape[-1], 1, 2])),)
    return shape, tuple(min(t, n) for t, n in zip(tile, shape)), draw(st.sampled_from(NORMALIZATIONS))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(normalization_cases())
def test_normalizations_property(case):
    """Normalizations over random shapes and tilings (statistics in the normalizing step when
    the last axis is one tile, separate steps otherwise) against NumPy."""
    shape, tile, op = case
    x = np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape) * 3
    mu, ms = x.mean(-1, keepdims=True), (x * x).mean(-1, keepdims=True)
    want = {"layer_norm": (x - mu) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
            "rms_norm": x / np.sqrt(ms + 1e-6), "softmax": np_softmax(x), "log_softmax": np.log(np_softmax(x))}[op]
    with tra_sql.connect() as db:
        X = db.from_numpy("x", x, tile=tile)
        got = getattr(nn, op)(db, X)
        assert ("MATERIALIZED" not in got.sql()) == (tile[-1] == shape[-1])
        close(got.numpy(), want, np.float64)
