"""Model forward passes in tra_sql against NumPy and PyTorch CPU, in the same run.

    python bench/bench_nn.py            # MLP (batch 4096, three 2048-wide layers + ReLU) and a
                                        # transformer block (d=512, 8 heads, seq 512, batch 4, causal)
    python bench/bench_nn.py --quick    # smaller shapes, for a fast look

tra_sql's time is ``Tensor.numpy()`` of the whole forward program (one SQL script run by
DuckDB); weights and inputs are stored tensor relations with whole-tensor tiles.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql import nn  # noqa: E402


def mlp_case(db, rng, batch, width, layers):
    x = rng.standard_normal((batch, width), dtype=np.float32)
    weights = [((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
                rng.standard_normal(width, dtype=np.float32)) for _ in range(layers)]
    X = db.from_numpy("mlp_x", x, tile=x.shape, replace=True)
    stored = [(db.from_numpy(f"mlp_W{i}", w, tile=w.shape, replace=True),
               db.from_numpy(f"mlp_b{i}", b, replace=True))
              for i, (w, b) in enumerate(weights)]
    program = nn.mlp(db, X, stored, activation="relu", final_activation="relu")

    def numpy_forward():
        h = x
        for w, b in weights:
            h = np.maximum(h @ w + b, 0)
        return h

    import torch
    tx, tw = torch.from_numpy(x), [(torch.from_numpy(w), torch.from_numpy(b)) for w, b in weights]

    def torch_forward():
        h = tx
        with torch.no_grad():
            for w, b in tw:
                h = torch.relu(torch.addmm(b, h, w))
        return h

    flops = 2 * batch * width * width * layers
    return f"MLP {batch}x{width}, {layers} layers", program, numpy_forward, torch_forward, flops


def block_case(db, rng, batch, seq, d, heads):
    dk = d // heads
    f = 4 * d
    r = lambda *s: (rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[0])).astype(np.float32)
    x = rng.standard_normal((batch, seq, d), dtype=np.float32)
    p = {"Wq": r(d, heads, dk), "Wk": r(d, heads, dk), "Wv": r(d, heads, dk), "Wo": r(heads, dk, d),
         "W1": r(d, f), "W2": r(f, d), "b1": np.zeros(f, np.float32), "b2": np.zeros(d, np.float32),
         "g1": np.ones(d, np.float32), "c1": np.zeros(d, np.float32), "g2": np.ones(d, np.float32),
         "c2": np.zeros(d, np.float32)}
    t = {k: db.from_numpy(f"block_{k}", v, tile=v.shape, replace=True) for k, v in p.items()}
    X = db.from_numpy("block_x", x, tile=x.shape, replace=True)
    weights = nn.BlockWeights(nn.AttentionWeights(t["Wq"], t["Wk"], t["Wv"], t["Wo"]), t["g1"], t["c1"],
                              t["g2"], t["c2"], t["W1"], t["W2"], t["b1"], t["b2"])
    program = nn.transformer_block(db, X, weights, causal=True, activation="gelu")

    def layer_norm(h, g, c):
        mu = h.mean(-1, keepdims=True)
        return (h - mu) / np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * g + c

    def gelu(h):
        return 0.5 * h * (1 + np.tanh(0.7978845608028654 * (h + 0.044715 * h**3)))

    mask = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)

    def numpy_forward():
        h = layer_norm(x, p["g1"], p["c1"])
        q, k, v = (np.einsum("bsd,dhk->bhsk", h, p[w], optimize=True) for w in ("Wq", "Wk", "Wv"))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dk) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        h = x + np.einsum("bhsk,hke->bse", a, p["Wo"], optimize=True)
        return h + gelu(layer_norm(h, p["g2"], p["c2"]) @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]

    import torch
    import torch.nn.functional as F
    T = {k: torch.from_numpy(v) for k, v in p.items()}
    tx = torch.from_numpy(x)

    def torch_forward():
        with torch.no_grad():
            h = F.layer_norm(tx, (d,), T["g1"], T["c1"])
            q, k, v = (torch.einsum("bsd,dhk->bhsk", h, T[w]) for w in ("Wq", "Wk", "Wv"))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = tx + torch.einsum("bhsk,hke->bse", a, T["Wo"])
            return h + F.linear(F.gelu(F.linear(F.layer_norm(h, (d,), T["g2"], T["c2"]), T["W1"].T, T["b1"]),
                                       approximate="tanh"), T["W2"].T, T["b2"])

    flops = batch * seq * (2 * d * d * 4 + 2 * 2 * d * f) + batch * heads * 2 * 2 * seq * seq * dk
    return f"transformer block b{batch} s{seq} d{d} h{heads}", program, numpy_forward, torch_forward, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"machine: {machine()}; median of {args.repeat}\n")
    print("| model | numpy s | torch s | tra_sql s | tra_sql GFLOP/s | tra_sql / numpy | tra_sql / torch |")
    print("|---|---|---|---|---|---|---|")
    with tra_sql.connect() as db:
        cases = [mlp_case(db, rng, 512, 512, 3), block_case(db, rng, 2, 128, 128, 4)] if args.quick else \
            [mlp_case(db, rng, 4096, 2048, 3), block_case(db, rng, 4, 512, 512, 8)]
        for name, program, numpy_forward, torch_forward, flops in cases:
            np.testing.assert_allclose(program.numpy(), numpy_forward(), rtol=2e-3, atol=2e-3)
            t_np = median_time(numpy_forward, args.repeat)
            t_torch = median_time(torch_forward, args.repeat)
            t_tra = median_time(program.numpy, args.repeat)
            print(f"| {name} | {t_np:.3f} | {t_torch:.3f} | {t_tra:.3f} | {flops / t_tra / 1e9:.0f} | "
                  f"{t_tra / t_np:.2f} | {t_tra / t_torch:.2f} |", flush=True)


if __name__ == "__main__":
    main()
