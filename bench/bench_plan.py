"""EinDecomp: the planner's plan against the presets, predicted and measured in the same run.

    python bench/bench_plan.py                   # everything (about 4 minutes)
    python bench/bench_plan.py --section plans   # chain, MLP, transformer block: predicted vs measured
    python bench/bench_plan.py --section llama   # planning time of a LLaMA-7B-shaped decoder
    python bench/bench_plan.py --section ooc     # a matmul whose inputs are 4x DuckDB's memory_limit (1 GB)
    python bench/bench_plan.py --section ooc --ooc-mn 4096 --ooc-limit 512e6   # the same, 2 GB of inputs

Each executed plan runs ``Tensor.numpy(plan=...)`` (best of ``--repeat`` after a warm-up);
the constants come from ``db.calibrate()`` in the same run. Plans that split nothing more
than another are measured once.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile
import threading
import time
from math import ceil
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.catalog import TensorInfo  # noqa: E402
from tra_sql.decompose import Constants, graphs, make_plan  # noqa: E402
from tra_sql.tensor import Tensor  # noqa: E402

GB = 1e9


def stored_leaf(db, rng, dtype="float32"):
    """Inputs stored once per name in DuckDB's default tiling (small values: stable softmax)."""
    cache = {}

    def leaf(name, shape):
        if name not in cache:
            data = (rng.standard_normal(shape) * 0.1).astype(dtype)
            if name == "causal":
                data = np.tri(*shape, dtype=dtype)
            cache[name] = db.from_numpy(name, data, replace=True).node
        return cache[name]

    return leaf


def graphs_to_run(quick: bool):
    """(name, builder, memory per worker): the chain and the MLP under a tight budget (the
    presets that keep whole operands do not fit), the transformer block under an ample one."""
    s = 1 if quick else 2
    yield "matrix chain", lambda leaf: graphs.matrix_chain((1024 * s, 256, 1024 * s, 256, 1024 * s), leaf), 8e6 * s
    yield "MLP (4 layers)", lambda leaf: graphs.mlp(2048 * s, (512, 1024, 1024, 1024, 512), leaf), 2e7 * s
    yield "transformer block", lambda leaf: graphs.transformer_block(256 * s, 256, 4, 1024, leaf), 1e9


def section_plans(db, args) -> None:
    rng = np.random.default_rng(0)
    print("## Predicted vs measured: the DP plan against the presets (same run)\n")
    points = []
    for name, build, memory in graphs_to_run(args.quick):
        root = build(stored_leaf(db, rng))
        tensor = Tensor(db, root)
        plan = make_plan(root, args.workers, memory, db_consts(db))
        reference = tensor.numpy(plan=False)
        print(f"### {name}: {len(plan.ops)} ops, {args.workers} workers x {memory / 1e6:.0f} MB; "
              f"planned in {plan.seconds * 1e3:.0f} ms ({'tree' if plan.stats.tree else 'DAG'})\n")
        print("| plan | predicted s | measured s | predicted / DP | measured / DP |")
        print("|---|---|---|---|---|")
        rows, seen = [("DP (this planner)", plan.assign, plan.cost)], {}
        rows += [(y.name + (f" x{y.scale}" if y.scale > 1 else ""), y.assign, y.cost) for y in plan.yardsticks]
        measured_dp = None
        for label, assign, cost in rows:
            if assign is None or not np.isfinite(cost):
                why = "too many states to enumerate" if label == "exhaustive" and assign is None else "infeasible"
                print(f"| {label} | {why} | - | - | - |")
                continue
            key = tuple(assign)
            if key not in seen:
                variant = dataclasses.replace(plan, assign=list(assign), cost=cost)
                got = tensor.numpy(plan=variant)
                np.testing.assert_allclose(got, reference, rtol=2e-3, atol=2e-4)
                seen[key] = median_time(lambda v=variant, t=tensor: t.numpy(plan=v), args.repeat)
                points.append((name, label, cost, seen[key]))
            t = seen[key]
            measured_dp = t if measured_dp is None else measured_dp
            print(f"| {label} | {cost:.3f} | {t:.3f} | {cost / plan.cost:.2f} | {t / measured_dp:.2f} |", flush=True)
        print()
        print("```\n" + plan.explain() + "\n```\n")
    pred = np.array([p[2] for p in points])
    meas = np.array([p[3] for p in points])
    pearson = float(np.corrcoef(pred, meas)[0, 1])
    spearman = float(np.corrcoef(np.argsort(np.argsort(pred)), np.argsort(np.argsort(meas)))[0, 1])
    log_r = float(np.corrcoef(np.log(pred), np.log(meas))[0, 1])
    print(f"Predicted vs measured over {len(points)} distinct plans: Pearson r = {pearson:.3f}, "
          f"r of logs = {log_r:.3f}, Spearman rho = {spearman:.3f}; median measured/predicted = "
          f"{float(np.median(meas / pred)):.2f}\n")


def db_consts(db):
    return db.engine.constants() or Constants()


def section_llama(db, args) -> None:
    print("## LLaMA-7B-shaped decoder: planning time\n")
    start = time.perf_counter()
    root = graphs.llama_decoder()
    built = time.perf_counter() - start
    consts = db_consts(db)
    for workers, memory in ((args.workers, 8 * GB), (8, 0.25 * GB)):
        plan = make_plan(root, workers, memory, consts, yardsticks=False)
        start = time.perf_counter()
        full = make_plan(root, workers, memory, consts)
        with_yardsticks = time.perf_counter() - start
        print(f"{len(plan.ops)} ops (32 layers), {workers} workers x {memory / GB:.2g} GB: **planned in "
              f"{plan.seconds:.2f} s** (presets and DP; {plan.stats.passes} forest passes; graph built in "
              f"{built:.2f} s); {with_yardsticks:.2f} s with the published algorithm's plan beside it\n")
        print("| plan | predicted s | / DP |")
        print("|---|---|---|")
        print(f"| DP (this planner) | {plan.cost:.1f} | 1.00 |")
        for y in full.yardsticks:
            cost = (f"{y.cost:.1f} | {y.cost / plan.cost:.2f}" if np.isfinite(y.cost) else
                    "too many states to enumerate | -" if y.assign is None else "infeasible | -")
            print(f"| {y.name}{f' x{y.scale}' if y.scale > 1 else ''} | {cost} |")
        print()
        ops = {}
        for op in plan.ops:
            ops.setdefault(op.label.split(" join=")[0], op.parts)
        print("Tiles per index chosen for layer 0's ops:", "; ".join(
            f"`{k.replace('einsum ', '')}` " + " ".join(f"{c}={p}" for c, p in v.items()) for k, v in
            list(ops.items())[:12]), "\n")


class Peak:
    """Peak process RSS and peak DuckDB buffer memory while a block runs (polled)."""

    def __init__(self, con):
        self.cursor = con.cursor()
        self.proc = psutil.Process(os.getpid())
        self.rss = self.duck = 0
        self._stop = threading.Event()

    def _poll(self):
        while not self._stop.is_set():
            self.rss = max(self.rss, self.proc.memory_info().rss)
            used = self.cursor.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchall()[0][0]
            self.duck = max(self.duck, int(used))
            self._stop.wait(0.01)

    def __enter__(self):
        self.rss0 = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def ooc_tile(seed: int, key: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The float32 tile at ``key`` of an out-of-core input (standard normal, seeded by key)."""
    return np.random.default_rng((seed, *key)).standard_normal(shape, dtype=np.float32)


def store_streamed(db, name: str, shape: tuple[int, ...], tile: tuple[int, ...], seed: int) -> None:
    """Store a tensor tile by tile (never whole in memory), its tiles uncompressed."""
    info = TensorInfo(name, np.dtype("float32"), shape, tile)
    keys = ", ".join(f"0::INTEGER AS k{d}" for d in range(len(shape)))
    db.engine.create_table(info, f"SELECT {keys}, ''::BLOB AS tile WHERE false", replace=True)
    marks = ", ".join("?" * (len(shape) + 1))
    for key in itertools.product(*(range(g) for g in info.grid)):
        data = ooc_tile(seed, key, info.tile_shape(key))
        db.engine.con.execute(f'INSERT INTO "{name}" VALUES ({marks})', [*key, data.tobytes()]).fetchall()


def assemble(shape: tuple[int, ...], tile: tuple[int, ...], seed: int) -> np.ndarray:
    """The whole out-of-core input, in memory (for numpy)."""
    out = np.empty(shape, dtype=np.float32)
    info = TensorInfo("", out.dtype, shape, tile)
    for key in itertools.product(*(range(g) for g in info.grid)):
        region = tuple(slice(k * t, k * t + n) for k, t, n in zip(key, tile, info.tile_shape(key)))
        out[region] = ooc_tile(seed, key, info.tile_shape(key))
    return out


def section_ooc(args, consts) -> None:
    """C = A @ B with A m x K, B K x n float32 stored in a database file, K chosen so that the
    inputs total 4x DuckDB's memory_limit; planned by ``db.plan`` under that limit and run with
    ``store(plan=...)`` (median of at least 3; the memory columns from one more run, polled);
    against numpy's in-memory ``A @ B`` (same shape, same data), timed before and after."""
    limit = args.ooc_limit
    m = n = args.ooc_mn
    kt = args.ooc_k_tile
    K = kt * ceil(4 * limit / (4 * (m + n) * kt))  # inputs 4x the limit, in whole tiles
    print(f"## Out of core: C = A @ B, A {m}x{K}, B {K}x{n} float32 (inputs {(m + n) * K * 4 / 1e6:.0f} MB, "
          f"tiles {m}x{kt} and {kt}x{n}) with DuckDB memory_limit = {limit / 1e6:.0f} MB\n")
    def numpy_time() -> tuple[float, np.ndarray]:
        A, B = assemble((m, K), (m, kt), 1), assemble((K, n), (kt, n), 2)
        return median_time(lambda: A @ B, args.repeat), A @ B

    t_before, _ = numpy_time()  # numpy before and after: the machine's load drifts
    with tempfile.TemporaryDirectory(dir=args.ooc_dir) as tmp:
        db = tra_sql.connect(str(Path(tmp) / "ooc.duckdb"), threads=args.workers, memory_limit="4GB")
        db.engine.save_constants(consts)
        db.engine.con.execute(f"SET temp_directory = '{tmp}/spill'").fetchall()
        # tiles uncompressed: DuckDB would pick ZSTD for these blobs, and reading one tile of a
        # ZSTD segment decompresses most of it; one checkpoint at the end of the load
        db.engine.con.execute("SET force_compression = 'uncompressed'").fetchall()
        db.engine.con.execute("SET checkpoint_threshold = '16GB'").fetchall()
        start = time.perf_counter()
        store_streamed(db, "A", (m, K), (m, kt), 1)
        store_streamed(db, "B", (K, n), (kt, n), 2)
        db.engine.con.execute("CHECKPOINT").fetchall()
        db.engine.con.execute("RESET checkpoint_threshold").fetchall()
        size = os.path.getsize(Path(tmp) / "ooc.duckdb")
        print(f"stored tile by tile in {time.perf_counter() - start:.1f} s (database file {size / 1e6:.0f} MB)\n")
        db.engine.con.execute(f"SET memory_limit = '{limit / 1e6:.0f}MB'").fetchall()
        C = db.einsum("ij,jk->ik", db.tensor("A"), db.tensor("B"))
        plan = db.plan(C, workers=args.workers)
        print("```\n" + plan.explain() + "\n```\n")
        def run() -> float:
            start = time.perf_counter()
            C.store("C", plan=plan, replace=True)
            return time.perf_counter() - start

        # timed without the memory poller (its duckdb_memory() queries every 10 ms run beside
        # the statements), then once more under it for the memory columns
        times = sorted(run() for _ in range(max(3, args.repeat)))
        elapsed = times[len(times) // 2]
        with Peak(db.engine.con) as peak:
            polled = run()
        got = db.tensor("C").numpy()
        db.close()
    t_after, ref = numpy_time()
    t_np = (t_before + t_after) / 2
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    flops = 2.0 * m * K * n
    print(f"| run | s | GFLOP/s | peak RSS | RSS above start | peak DuckDB memory |\n|---|---|---|---|---|---|\n"
          f"| tra_sql, {plan.ops[0].bands} statements, memory_limit {limit / 1e6:.0f} MB (median of {len(times)}: "
          f"{', '.join(f'{t:.2f}' for t in times)}; {polled:.2f} under the poller) | {elapsed:.2f} | "
          f"{flops / elapsed / 1e9:.1f} | {peak.rss / 1e6:.0f} MB | {(peak.rss - peak.rss0) / 1e6:.0f} MB | "
          f"{peak.duck / 1e6:.0f} MB |\n"
          f"| numpy `A @ B` in memory (inputs {(m + n) * K * 4 / 1e6:.0f} MB), before / after | "
          f"{t_before:.2f} / {t_after:.2f} | {flops / t_before / 1e9:.1f} / {flops / t_after / 1e9:.1f} "
          f"| - | - | - |\n")
    print(f"tra_sql reaches {t_np / elapsed:.2f} of numpy's GFLOP/s (its mean time before and after; "
          f"predicted {plan.cost:.1f} s); "
          f"max relative error {err:.1e}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("plans", "llama", "ooc", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="smaller graphs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ooc-mn", type=int, default=2048, help="rows of A and columns of B in the ooc run")
    parser.add_argument("--ooc-k-tile", type=int, default=3125, help="tile of the ooc run's contracted index")
    parser.add_argument("--ooc-dir", default=None, help="where the ooc run's database file goes")
    parser.add_argument("--no-calibrate", action="store_true", help="use the default constants")
    parser.add_argument("--ooc-limit", type=float, default=256e6, help="DuckDB memory_limit (bytes) of the ooc run")
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    with tra_sql.connect(threads=args.workers) as db:
        if args.no_calibrate:
            consts = Constants()
            db.engine.save_constants(consts)
            print("constants: the defaults (no calibration in this run)\n")
        else:
            start = time.perf_counter()
            consts = db.calibrate()
            print(f"calibrated in {time.perf_counter() - start:.1f} s: " + ", ".join(
                f"{k}={v:.3g}" for k, v in consts.as_dict().items()) + "\n")
        if args.section in ("plans", "all"):
            section_plans(db, args)
        if args.section in ("llama", "all"):
            section_llama(db, args)
    if args.section in ("ooc", "all"):
        section_ooc(args, consts)


if __name__ == "__main__":
    main()
