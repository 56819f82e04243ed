"""The README's demo: tensors as tile tables, an einsum rewritten to SQL and run in DuckDB.

Run with ``python -m tra_sql.demo [DATABASE]``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import tra_sql


def main(database: str = ":memory:") -> None:
    rng = np.random.default_rng(0)
    a, b = rng.random((1000, 700)), rng.random((700, 300))
    with tra_sql.connect(database) as db:
        A = db.from_numpy("A", a, tile=(256, 256), replace=True)
        B = db.from_numpy("B", b, tile=(256, 128), replace=True)
        print(f"stored {A} and {B}: ragged boundary tiles included")
        C = db.einsum("ij,jk->ik", A, B)
        print("\nThe SQL that computes C = einsum('ij,jk->ik', A, B):\n")
        print(C.sql())
        start = time.perf_counter()
        c = C.numpy()
        print(f"\nran in DuckDB in {time.perf_counter() - start:.3f} s; "
              f"max |C - A @ B| = {np.abs(c - a @ b).max():.2e}")
        C.store("C", replace=True)
        print(f"stored as tensor relation 'C'; catalog holds {db.tensors()}")
        chain = db.einsum("ij,jk,kl->il", A, B, db.einsum("ij->ji", B))
        print(f"3-operand einsum via pairwise steps: max error "
              f"{np.abs(chain.numpy() - a @ b @ b.T).max():.2e}")
        relu = db.einsum("ik,k->ik", "C", db.from_numpy("bias", -rng.random(300) * 200, replace=True),
                         join="greatest(x0 + x1, 0)")
        expected = np.maximum(c + db.tensor("bias").numpy(), 0)
        print(f"extended einsum (bias + ReLU fused into the join): max error "
              f"{np.abs(relu.numpy() - expected).max():.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
