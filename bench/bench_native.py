"""Native kernels against the Arrow UDF path, ``x @ y`` and the floor, same run (issue 18).

    python bench/bench_native.py            # 4096² float32, one tile / 2048² / 1024² / 512² tiles
    python bench/bench_native.py --quick    # 256², tiles 256 / 128 / 64 / 32: a smoke run
    python bench/bench_native.py --batched  # bij,bjk->bik 64x512² float32 against numpy.matmul
    python bench/bench_native.py --batched --quick  # 8x64²: a smoke run
    python bench/bench_native.py --epilogue # relu(x @ w + b) 4096² float32, row tiles of 4096/2048/1024
    python bench/bench_native.py --epilogue --quick  # 256²: a smoke run

Per tiling, each repetition times, one after another (interleaved): ``x @ y``; the floor (the
same BLAS calls on NumPy tiles: one product per pair of tiles, summed per output tile, then
assembled, in this process); and ``db.einsum("ij,jk->ik").numpy()`` on a session with native
kernels and on one with Arrow UDFs (``TRA_SQL_KERNELS=arrow``). Prints medians and the ratios
to ``x @ y`` (the issue's first row) and to the floor (its second row). Split contractions
run as the fused contraction aggregate on the native path (docs/kernels.md).

``--batched`` (the issue's third row): ``db.einsum("bij,bjk->bik")`` against
``numpy.matmul(x, y)``, batch tiles of 8 with the whole 512² matrices, and with ``j`` split in
two (the fused aggregate), native and Arrow.

``--epilogue``: ``relu(x @ w + b)`` (``db.einsum("Ao,o->Ao", db.einsum("Ai,io->Ao", x, w), b,
join="greatest(x0 + x1, 0.0)")``, one ``tra_loop_3`` call per output tile: the BLAS product and
the epilogue, docs/kernels.md) against ``numpy.maximum(x @ w + b, 0)``; ``x`` in row tiles, ``w``
in column tiles (``i`` whole), native and Arrow.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

import tra_sql  # noqa: E402


def floor(x: np.ndarray, y: np.ndarray, t: int) -> np.ndarray:
    """The relational plan's BLAS calls on NumPy tiles: a partial product per joined pair of
    tiles, summed per output tile, the tiles assembled into one array."""
    n = x.shape[0]
    out = np.empty((n, y.shape[1]), dtype=x.dtype)
    for i in range(0, n, t):
        for k in range(0, y.shape[1], t):
            tile = None
            for j in range(0, x.shape[1], t):
                partial = x[i:i + t, j:j + t] @ y[j:j + t, k:k + t]
                tile = partial if tile is None else tile + partial
            out[i:i + t, k:k + t] = tile
    return out


def session(kernels: str):
    os.environ["TRA_SQL_KERNELS"] = kernels
    try:
        db = tra_sql.connect()
    finally:
        os.environ.pop("TRA_SQL_KERNELS")
    if db.engine.kernels != kernels:
        raise SystemExit(f"no {kernels} kernels here (is the extension built? see docs/kernels.md)")
    return db


def _medians(runs: dict, repeat: int) -> dict[str, float]:
    """Each run timed ``repeat`` times, interleaved; the medians."""
    times = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def batched(quick: bool, repeat: int) -> None:
    b, n = (8, 64) if quick else (64, 512)
    rng = np.random.default_rng(0)
    x, y = rng.random((b, n, n), dtype=np.float32), rng.random((b, n, n), dtype=np.float32)
    print(f"machine: {machine()}; bij,bjk->bik {b}x{n}² float32, median of {repeat} interleaved\n")
    print("| tiles (b, i, j) x (b, j, k) | matmul s | native s | arrow s | native/matmul | arrow/matmul |")
    print("|---|---|---|---|---|---|")
    sessions = {kind: session(kind) for kind in ("native", "arrow")}
    for bt, jt in ((b // 8, n), (b // 8, n // 2)):
        runs = {"matmul": lambda: np.matmul(x, y)}
        for kind, db in sessions.items():
            product = db.einsum("bij,bjk->bik", db.from_numpy("x", x, (bt, n, jt), replace=True),
                                db.from_numpy("y", y, (bt, jt, n), replace=True))
            np.testing.assert_allclose(product.numpy(), np.matmul(x, y), rtol=1e-3)  # (and the warm-up)
            runs[kind] = product.numpy
        _row(f"({bt}, {n}, {jt}) x ({bt}, {jt}, {n})", _medians(runs, repeat), "matmul")
    for db in sessions.values():
        db.close()


def _row(label: str, m: dict[str, float], peer: str) -> None:
    """A table row: the peer's, the native and the Arrow medians, and their ratios to the peer."""
    print(f"| {label} | {m[peer]:.3f} | {m['native']:.3f} | {m['arrow']:.3f} | {m['native'] / m[peer]:.2f} | "
          f"{m['arrow'] / m[peer]:.2f} |", flush=True)


def epilogue(quick: bool, repeat: int) -> None:
    n = 256 if quick else 4096
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    want = np.maximum(x @ w + b, 0)
    print(f"machine: {machine()}; relu(x @ w + b) {n}² float32, median of {repeat} interleaved\n")
    print("| tiles x, w | numpy s | native s | arrow s | native/numpy | arrow/numpy |")
    print("|---|---|---|---|---|---|")
    sessions = {kind: session(kind) for kind in ("native", "arrow")}
    for t in (n, n // 2, n // 4):
        runs = {"numpy": lambda: np.maximum(x @ w + b, 0)}
        for kind, db in sessions.items():
            h = db.einsum("Ai,io->Ao", db.from_numpy("x", x, (t, n), replace=True),
                          db.from_numpy("w", w, (n, t), replace=True))
            out = db.einsum("Ao,o->Ao", h, db.from_numpy("b", b, (t,), replace=True), join="greatest(x0 + x1, 0.0)")
            if kind == "native" and "tra_loop_3(" not in out.sql().lower():
                raise SystemExit("the product with its epilogue is not one native call")
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-3, atol=1e-3)  # (and the warm-up)
            runs[kind] = out.numpy
        _row(f"({t}, {n}), ({n}, {t})", _medians(runs, repeat), "numpy")
    for db in sessions.values():
        db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256² (batched: 8x64²), 3 repetitions")
    parser.add_argument("--batched", action="store_true", help="bij,bjk->bik against numpy.matmul")
    parser.add_argument("--epilogue", action="store_true", help="relu(x @ w + b) against numpy")
    parser.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 5; 3 quick)")
    args = parser.parse_args()
    repeat = args.repeat or (3 if args.quick else 5)
    if args.batched:
        batched(args.quick, repeat)
        return
    if args.epilogue:
        epilogue(args.quick, repeat)
        return
    n = 256 if args.quick else 4096
    rng = np.random.default_rng(0)
    x, y = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    print(f"machine: {machine()}; {n}² float32 ij,jk->ik, median of {repeat} interleaved\n")
    print("| tile | x @ y s | floor s | native s | arrow s | floor/x@y | native/x@y | arrow/x@y | "
          "native/floor | arrow/floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sessions = {kind: session(kind) for kind in ("native", "arrow")}
    for t in (n, n // 2, n // 4, n // 8):
        runs = {"x @ y": lambda: x @ y, "floor": lambda t=t: floor(x, y, t)}
        for kind, db in sessions.items():
            product = db.einsum("ij,jk->ik", db.from_numpy("x", x, (t, t), replace=True),
                                db.from_numpy("y", y, (t, t), replace=True))
            np.testing.assert_allclose(product.numpy(), x @ y, rtol=1e-3)  # (and the warm-up)
            runs[kind] = product.numpy
        m = _medians(runs, repeat)
        print(f"| {t}² | {m['x @ y']:.3f} | {m['floor']:.3f} | {m['native']:.3f} | {m['arrow']:.3f} | "
              f"{m['floor'] / m['x @ y']:.2f} | {m['native'] / m['x @ y']:.2f} | {m['arrow'] / m['x @ y']:.2f} | "
              f"{m['native'] / m['floor']:.2f} | {m['arrow'] / m['floor']:.2f} |", flush=True)
    for db in sessions.values():
        db.close()


if __name__ == "__main__":
    main()
