"""Sparse aggregation: ``vu,uf->vf`` over an edge relation, tra_sql against scipy.sparse.

    python bench/bench_sparse.py            # 1M edges, 100k nodes, 128 float32 features
    python bench/bench_sparse.py --quick    # 100k edges, 10k nodes

The edges are a DuckDB table (dst, src, w). tra_sql views it as a CSR relation, stored once
(``A.store``: the packing time is reported apart, like building scipy's CSR matrix), in one
block and in row blocks, and as the 1x1-tile relation (one row per edge) for comparison; the
features are tiled to match (one tile; row blocks where the product runs over the blocked
index; rows for the 1x1 relation). tra_sql's time is ``Tensor.numpy()``. The peer is scipy's CSR matrix
times the dense features (``A @ X`` and ``A.T @ X``), in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    nodes, edges, features = (10_000, 100_000, 128) if args.quick else (100_000, 1_000_000, 128)
    rng = np.random.default_rng(0)
    dst, src = rng.integers(0, nodes, edges), rng.integers(0, nodes, edges)
    w = rng.random(edges).astype(np.float32)
    x = rng.standard_normal((nodes, features)).astype(np.float32)
    print(machine())
    print(f"{edges:,} edges, {nodes:,} nodes, {features} float32 features; median of {args.repeat}")

    db = tra_sql.connect()
    db.engine.con.register("_edges", pa.table({"dst": dst, "src": src, "w": w}))
    db.engine.con.execute("CREATE TABLE edges AS SELECT * FROM _edges").fetchall()
    tilings = {1: db.from_numpy("X", x, tile=x.shape), 4: db.from_numpy("X4", x, tile=(-(-nodes // 4), features)),
               "rows": db.from_numpy("Xrows", x, tile=(1, features))}
    S = sp.csr_matrix((w, (dst, src)), shape=(nodes, nodes))
    peers = {"vu,uf->vf": lambda: S @ x, "vu,vf->uf": lambda: S.T @ x}

    variants = []
    for blocks in (1, 4):
        view = db.relation("edges", ("dst", "src"), "w", (nodes, nodes), name=f"csr{blocks}_view", dtype="float32",
                           layout="csr", tile=(-(-nodes // blocks), nodes))
        start = time.perf_counter()
        variants.append((f"CSR, {blocks} block{'s' * (blocks > 1)}", view.store(f"csr{blocks}"), blocks, args.repeat))
        print(f"packing {blocks} CSR block(s) in SQL: {time.perf_counter() - start:.3f} s")
    one_by_one = db.relation("edges", ("dst", "src"), "w", (nodes, nodes), name="coo", dtype="float32")
    variants.append(("1x1 tiles (one row per edge)", one_by_one, "rows", 1))

    print("| einsum | relation | scipy s | tra_sql s | ratio |")
    print("|---|---|---|---|---|")
    for spec, peer in peers.items():
        expected = peer()
        peer_s = median_time(peer, args.repeat)
        for label, A, tiling, repeat in variants:
            Y = db.einsum(spec, A, tilings[tiling if spec == "vu,vf->uf" or tiling == "rows" else 1])
            np.testing.assert_allclose(Y.numpy(), expected, rtol=1e-3, atol=1e-3)
            ours = median_time(Y.numpy, repeat)
            print(f"| `{spec}` | {label} | {peer_s:.3f} | {ours:.3f} | {ours / peer_s:.2f} |")


if __name__ == "__main__":
    main()
