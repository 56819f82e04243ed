"""EinDecomp: the planner's plan against the presets, predicted and measured in the same run.

    python bench/bench_plan.py                   # everything (about 4 minutes)
    python bench/bench_plan.py --section plans   # chain, MLP, transformer block: predicted vs measured
    python bench/bench_plan.py --section llama   # planning time of a LLaMA-7B-shaped decoder
    python bench/bench_plan.py --section ooc     # a matmul whose inputs are 4x DuckDB's memory_limit

Each executed plan runs ``Tensor.numpy(plan=...)`` (best of ``--repeat`` after a warm-up);
the constants come from ``db.calibrate()`` in the same run. Plans that split nothing more
than another are measured once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median_time  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.decompose import Constants, graphs, make_plan  # noqa: E402
from tra_sql.decompose.calibrate import save  # noqa: E402
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
    from tra_sql.decompose.calibrate import load

    return load(db.con)


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
    """Peak DuckDB buffer memory (polled) and peak process RSS while a block runs."""

    def __init__(self, con):
        self.cursor = con.cursor()
        self.proc = psutil.Process(os.getpid())
        self.duck = self.rss = 0
        self._stop = False

    def _poll(self):
        while not self._stop:
            used = self.cursor.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchall()[0][0]
            self.duck = max(self.duck, int(used))
            self.rss = max(self.rss, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self):
        self.rss0 = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self.thread.join()


def section_ooc(args, consts) -> None:
    limit = args.ooc_limit
    m, k, n = (2048, 8192, 2048) if args.quick else (4096, 8192, 4096)
    # inputs of 4x memory_limit: pick k so that (m + n) * k * 4 bytes = 4 * limit
    k = int(4 * limit / (4 * (m + n)))
    print(f"## Out of core: C = A @ B, A {m}x{k}, B {k}x{n} float32 (inputs {(m + n) * k * 4 / 1e6:.0f} MB) "
          f"with DuckDB memory_limit = {limit / 1e6:.0f} MB\n")
    rng = np.random.default_rng(0)
    A = rng.standard_normal((m, k), dtype=np.float32)
    B = rng.standard_normal((k, n), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        # load with room for one input's transaction, then checkpoint and lower the limit
        db = tra_sql.connect(str(Path(tmp) / "ooc.duckdb"), threads=args.workers, memory_limit="4GB")
        db.con.execute(f"SET temp_directory = '{tmp}/spill'").fetchall()
        # small tiles: DuckDB loads a scanned table a 2048-row vector at a time (see cost.scan_memory)
        tile = tuple(args.ooc_tile)
        tA, tB = db.from_numpy("A", A, tile=tile), db.from_numpy("B", B, tile=tile[::-1])
        db.con.execute("CHECKPOINT").fetchall()
        db.con.execute(f"SET memory_limit = '{limit / 1e6:.0f}MB'").fetchall()
        C = db.einsum("ij,jk->ik", tA, tB)
        try:
            plan = make_plan(C.node, args.workers, limit / args.workers, consts)
        except tra_sql.TraError as err:
            print(f"no plan: {err}\n")
            db.close()
            return
        print("```\n" + plan.explain() + "\n```\n")
        if plan.cost > args.ooc_max_seconds:
            print(f"skipped: predicted {plan.cost:.0f} s > --ooc-max-seconds {args.ooc_max_seconds:.0f}\n")
            db.close()
            return
        with Peak(db.con) as peak:
            start = time.perf_counter()
            out = C.store("C", plan=plan)
            elapsed = time.perf_counter() - start
        got = out.numpy()
        db.close()
    start = time.perf_counter()
    ref = A @ B
    t_np = time.perf_counter() - start
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    flops = 2.0 * m * k * n
    print(f"| run | s | GFLOP/s | peak DuckDB memory | peak RSS above start |\n|---|---|---|---|---|\n"
          f"| tra_sql, staged plan ({plan.staged and 'staged' or 'one statement'}) | {elapsed:.2f} | "
          f"{flops / elapsed / 1e9:.1f} | {peak.duck / 1e6:.0f} MB | {(peak.rss - peak.rss0) / 1e6:.0f} MB |\n"
          f"| numpy in memory | {t_np:.2f} | {flops / t_np / 1e9:.1f} | - | - |\n")
    print(f"ratio tra_sql / numpy time: {elapsed / t_np:.1f}x; max relative error {err:.1e}; "
          f"statement budget {limit / 1e6:.0f} MB\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("plans", "llama", "ooc", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="smaller graphs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ooc-max-seconds", type=float, default=120, help="skip an ooc plan predicted slower")
    parser.add_argument("--ooc-tile", type=int, nargs=2, default=(64, 64), help="tile of the ooc inputs")
    parser.add_argument("--no-calibrate", action="store_true", help="use the default constants")
    parser.add_argument("--ooc-limit", type=float, default=256e6, help="DuckDB memory_limit (bytes) of the ooc run")
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    with tra_sql.connect(threads=args.workers) as db:
        if args.no_calibrate:
            consts = Constants()
            save(db.con, consts)
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
