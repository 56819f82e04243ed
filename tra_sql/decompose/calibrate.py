"""Measure the cost model's constants on DuckDB and this machine (``DuckDBEngine.calibrate``
runs ``measure`` on a fresh database and keeps them in table ``tra_calibration``).

1. Tile kernels, outside the engine: BLAS products of a small and a large tile (peak flop/s
   and the tile flops of half efficiency), a loop kernel (seconds per element), a copy.
2. The engine: single-op programs on a fresh database file (tables in the buffer manager, as
   out-of-core runs have them), in pairs that differ mostly in one feature (rows, bytes,
   list() bytes, BLAS calls); each constant is a difference of times over a difference of
   that feature, after the kernel's predicted share. On native kernels the split product
   runs as the fused contraction aggregate (no list(): ``cost.fusible``), so its BLAS call
   constant is the fused update's. Re-tilings give the per-piece and
   per-byte constants by least squares (clipped at zero). Peak memory (polled from
   ``duckdb_memory()`` while each runs) gives the bytes held per byte of list() and join.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from tra_sql.decompose.cost import Constants, features, fusible, kernel_seconds, retile_traffic
from tra_sql.decompose.problem import extract
from tra_sql.graph import Einsum

if TYPE_CHECKING:
    from tra_sql.session import Session

def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kernels() -> dict[str, float]:
    """BLAS peak and half-efficiency tile flops, loop-kernel seconds per element, copy speed
    (each the best of several short runs, as the machine may be shared)."""
    from tra_sql.udfs.contract import TileEinsum
    from tra_sql.udfs.expr import join_code

    rng = np.random.default_rng(0)
    # loop kernels first: OpenBLAS threads spin for a while after a large product
    kernel = TileEinsum(("ab", "ab"), "ab", join_code("x0 + x1", 2), "sum")
    x, y = rng.random((1024, 1024)), rng.random((1024, 1024))
    out = np.zeros_like(x)
    kernel.accumulate(out, [x, y])
    elem = _best(lambda: kernel.accumulate(out, [x, y]), 25) / (2 * x.size)
    big = rng.random(2**20)
    acc = np.zeros_like(big)
    copy = _best(lambda: np.add(acc, big, out=acc), 15) / big.nbytes
    rates = {}
    for n in (64, 1024):
        a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
        reps = max(1, int(1e8 / n**3))
        rates[n] = 2.0 * n**3 / (_best(lambda a=a, b=b, reps=reps: [a @ b for _ in range(reps)], 7) / reps)
    peak = max(rates.values())
    half = 2.0 * 64**3 * max(peak / rates[64] - 1.0, 0.0)
    return {"peak_flops": peak, "half_flops": half, "elem": elem, "copy_byte": copy}


def _retile_cases():
    n = 1024
    for a, b in (((4, 4), (1, 1)), ((4, 4), (3, 5)), ((16, 16), (8, 8)), ((64, 64), (2, 2)), ((1, 1), (4, 4))):
        yield (n, n), a, b


def _timed(fn, budget: float = 0.6, most: int = 7) -> float:
    """The fastest of a few runs (the machine may be shared: the minimum is the least noisy)."""
    fn()
    times, spent = [], 0.0
    while len(times) < 2 or (spent < budget and len(times) < most):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times)


#: name: (spec, join, shapes, dtype, tiles per index). Pairs of runs that differ in one
#: feature identify one constant each (see ``engine``).
RUNS = {
    "tiny": ("ij,ij->ij", "x0 + x1", [(64, 64)] * 2, "float64", (1, 1)),
    "few_rows": ("ij,ij->ij", "x0 + x1", [(1024, 1024)] * 2, "float64", (8, 8)),
    "many_rows": ("ij,ij->ij", "x0 + x1", [(1024, 1024)] * 2, "float64", (128, 128)),
    "bytes": ("ij,ij->ij", "x0 + x1", [(2048, 2048)] * 2, "float64", (1, 1)),
    "reduce": ("ij->i", "x0 * 2.0", [(2048, 2048)], "float64", (8, 1)),
    "reduce_split": ("ij->i", "x0 * 2.0", [(2048, 2048)], "float64", (8, 8)),
    "matmul": ("ij,jk->ik", None, [(1024, 1024)] * 2, "float32", (1, 1, 1)),
    "matmul_split": ("ij,jk->ik", None, [(1024, 1024)] * 2, "float32", (8, 8, 8)),
    "join_memory": ("ij,jk->ik", None, [(1024, 1024)] * 2, "float32", (16, 1, 16)),
}


def engine(db: Session, threads: int, kern: dict[str, float]) -> dict[str, float]:
    """Time the ``RUNS`` and the re-tilings on ``db`` (a fresh DuckDB database); each constant
    comes from the difference between two runs that differ (mostly) in the feature it prices."""
    c = Constants(**{**Constants().as_dict(), **kern, "threads": threads, "fused": fused(db)})
    rng = np.random.default_rng(0)
    t, f, ops, mem_list, mem_join = {}, {}, {}, [], []
    for k, (name, (spec, join, shapes, dtype, q)) in enumerate(RUNS.items()):
        subs = spec.split("->")[0].split(",")
        parts = dict(zip(dict.fromkeys("".join(subs)), q))
        ts = [db.from_numpy(f"c{k}_{m}", rng.random(shape).astype(dtype),
                            tile=tuple(-(-n // parts[ch]) for ch, n in zip(sub, shape)))
              for m, (sub, shape) in enumerate(zip(subs, shapes))]
        result = db.einsum(spec, *ts, join=join)
        op = extract(result.node).ops[0]
        assert isinstance(op.node, Einsum)
        feats = features(op, np.array([[parts[ch] for ch in op.indices]], dtype=np.int64),
                         bool(c.fused) and fusible(op))
        f[name] = {key: float(v[0]) for key, v in feats.items()}
        f[name]["kernel"] = float(kernel_seconds(op, feats, c, threads)[0])
        ops[name] = op
        with db.engine.peak_memory() as mem:
            t[name] = _timed(result.arrow)
        held = mem.peak - mem.base - op.out_bytes
        if f[name]["list_byte"] > 0:
            mem_list.append(held / f[name]["list_byte"])
        elif name == "join_memory":
            mem_join.append(held / min(x.nbytes for x in op.inputs))
    retiles = []
    for k, (shape, a, b) in enumerate(_retile_cases()):
        x = db.from_numpy(f"r{k}", rng.random(shape), tile=tuple(-(-n // p) for n, p in zip(shape, a)))
        y = x.retile(tuple(-(-n // p) for n, p in zip(shape, b)))
        pieces, listed = retile_traffic(shape, x.node.dtype.itemsize, x.tile, y.tile)
        retiles.append((1.0, float(pieces), listed, _timed(y.arrow)))

    def rest(name: str, **known: float) -> float:
        """Run ``name``'s time less its kernel and the features already priced."""
        return t[name] - f[name]["kernel"] - sum(f[name][k] * v for k, v in known.items())

    def diff(a: str, b: str, feature: str, **known: float) -> float:
        return max((rest(a, **known) - rest(b, **known)) / max(f[a][feature] - f[b][feature], 1e-30), 0.0)

    out: dict[str, float] = {"stmt": max(rest("tiny"), 0.0)}
    out["row"] = diff("many_rows", "few_rows", "row")
    out["group"] = out["row"]
    known = {"stmt": out["stmt"], "row": out["row"]}
    byte = max(rest("bytes", **known) / (f["bytes"]["join_byte"] + f["bytes"]["out_byte"]), 0.0)
    out["join_byte"] = out["out_byte"] = out["scan_byte"] = byte
    known |= {"join_byte": byte, "out_byte": byte, "group": out["group"]}
    out["list_byte"] = diff("reduce_split", "reduce", "list_byte", **known)
    known["list_byte"] = out["list_byte"]
    partial = ops["matmul_split"].out_bytes * (f["matmul_split"]["agg_parts"] - 1) * c.copy_byte
    out["blas_call"] = max((rest("matmul_split", **known) - partial - rest("matmul", **known))
                           / (f["matmul_split"]["blas_call"] - f["matmul"]["blas_call"]), 0.0)
    # re-tilings: time = statement + piece * pieces + place_byte * bytes carried (least squares
    # on the last two after the statement's share, clipped at zero)
    A = np.array([r[1:3] for r in retiles])
    y = np.array([r[3] for r in retiles]) - out["stmt"]
    scale = A.max(axis=0)
    coef = np.linalg.lstsq(A / scale, y, rcond=None)[0] / scale
    if coef.min() < 0:  # one term alone explains the runs better
        fits = [(float(np.sum((y - A[:, k] * max(float(A[:, k] @ y) / float(A[:, k] @ A[:, k]), 0.0)) ** 2)), k)
                for k in range(2)]
        k = min(fits)[1]
        coef = np.zeros(2)
        coef[k] = max(float(A[:, k] @ y) / float(A[:, k] @ A[:, k]), 0.0)
    out["piece"], out["place_byte"] = coef.tolist()
    out["mem_list"] = max(float(statistics.median(mem_list)), 1.0) if mem_list else c.mem_list
    out["mem_join"] = max(float(statistics.median(mem_join)), 1.0) if mem_join else c.mem_join
    out["measured"] = {k: v for k, v in t.items()}  # type: ignore[assignment]
    return out


def measure(db: Session, threads: int) -> Constants:
    """The constants measured on ``db`` (a fresh DuckDB database, ``threads`` threads; about
    10-20 s): the kernels first, then the engine's probes."""
    kern = kernels()
    fitted = engine(db, threads, kern)
    fitted.pop("measured", None)
    return Constants.from_dict({**Constants().as_dict(), **kern, **fitted, "threads": threads, "fused": fused(db)})


def fused(db: Session) -> int:
    """``Constants.fused`` of ``db``'s engine: 1 where its kernels are native."""
    return int(db.engine.kernels == "native")
