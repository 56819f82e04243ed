"""Training data no executor holds: one epoch of a 2-layer MLP (cross-entropy, Adam) on a
Spark standalone cluster whose executors each have less memory than the training features,
under the planner's tiling; and PyTorch in one process under the same memory cap, which cannot
hold them.

    python bench/bench_spark_memory.py                                   # 1 GiB of features, 512m executors
    python bench/bench_spark_memory.py --rows 4096 --features 32 --quick  # a smoke run
    python bench/bench_spark_memory.py --rows 65536 --tile-rows 4096 --metrics  # 16 MiB tiles, measured

The cluster: a master and two 1-core workers on 127.0.0.1 (``tra_sql.backends.standalone``),
``--executor-memory`` each. The features (``--rows`` × ``--features`` float64) are stored in
the tiles that ``db.plan`` picks for the first layer's product under the cluster's budget
(``db.engine.budget()``: a task's share of an executor's heap; Spark's statements stream and
spill, so only a task's piece of the product must fit), with EinDecomp's default constants
or ``--calibrate``d ones; or in tiles of ``--tile-rows`` rows and all features. The epoch's
time is the second epoch's (forward, backward, Adam, commit), with its Spark jobs.
PyTorch: a subprocess imports torch, then caps its address space
(``resource.setrlimit(RLIMIT_AS)``) at what it maps already plus the executor memory, and
allocates the features as one tensor; a control run under a cap of twice the features must
succeed (so the failure is the cap's, not the check's).

``--metrics`` logs Spark's events and prints, from them, the executors lost (and why) and the
peaks that the executors' metrics poller saw (every 100 ms) over the run: JVM heap, Spark's
execution and storage memory within it, the direct buffer pool (Arrow batches to and from the
Python workers) and the Python workers' resident memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_spark_stages import events  # noqa: E402
from common import machine  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.backends import spark_jobs  # noqa: E402
from tra_sql.backends.spark import jvm_bytes  # noqa: E402
from tra_sql.backends.standalone import StandaloneCluster  # noqa: E402
from tra_sql.decompose import choose  # noqa: E402

TORCH_CHECK = textwrap.dedent("""
    import resource, sys
    import torch
    pages = int(open("/proc/self/statm").read().split()[0])
    mapped = pages * resource.getpagesize()
    cap = mapped + int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        x = torch.empty((int(sys.argv[1]), int(sys.argv[2])), dtype=torch.float64)
        x.normal_()
        print(f"held {x.numel() * 8} bytes (mapped before: {mapped})")
    except (RuntimeError, MemoryError) as err:
        print(f"cannot hold: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
""")


def torch_holds(rows: int, features: int, cap: int) -> str:
    """What the PyTorch subprocess says under a cap of ``cap`` bytes beyond what it maps."""
    run = subprocess.run([sys.executable, "-c", TORCH_CHECK, str(rows), str(features), str(cap)],
                         capture_output=True, text=True, timeout=600)
    said = run.stdout.strip() or run.stderr.strip()
    return said.splitlines()[-1] if said else f"exit status {run.returncode}"


METRICS = ("JVMHeapMemory", "OnHeapExecutionMemory", "OnHeapStorageMemory", "DirectPoolMemory",
           "ProcessTreePythonRSS")


def metrics_config(directory: str) -> dict[str, str]:
    """Spark settings that log the events ``memory_report`` reads to ``directory``."""
    return {"spark.eventLog.enabled": "true", "spark.eventLog.dir": Path(directory).as_uri(),
            "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false",
            "spark.eventLog.logStageExecutorMetrics": "true", "spark.executor.processTreeMetrics.enabled": "true",
            "spark.executor.metrics.pollingInterval": "100ms"}


def memory_report(log: list[dict]) -> str:
    """The executors lost and the peak of each of ``METRICS`` over the run (MiB)."""
    lost = [e.get("Removed Reason", "") for e in log if e["Event"] == "SparkListenerExecutorRemoved"]
    peaks = {m: 0 for m in METRICS}
    for e in log:
        if e["Event"] == "SparkListenerStageExecutorMetrics" and e.get("Executor ID") != "driver":
            for m in METRICS:
                peaks[m] = max(peaks[m], e["Executor Metrics"].get(m, 0))
    reasons = "; ".join(sorted({r[:100] for r in lost}))
    return (f"executors lost: {len(lost)}{' (' + reasons + ')' if lost else ''}\npeaks of one executor (MiB): "
            + ", ".join(f"{m} {v / 2**20:.0f}" for m, v in peaks.items()))


def data(rows: int, features: int, classes: int):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, features))
    labels = (x[:, :classes] @ rng.standard_normal((classes, classes))).argmax(axis=1)
    return x, np.eye(classes)[labels]


def epoch(db, x, y, hidden: int, tile: tuple[int, int]) -> dict:
    """Two epochs of the MLP; the second's seconds and jobs, both losses."""
    from tra_sql.optim import Adam
    from tra_sql.train import cross_entropy

    rows, features = x.shape
    classes = y.shape[1]
    xt = db.from_numpy("mX", x, tile=tile, replace=True)
    yt = db.from_numpy("mY", y, tile=(tile[0], classes), replace=True)
    rng = np.random.default_rng(1)
    params = [db.from_numpy("mW1", rng.uniform(-1, 1, (features, hidden)) * np.sqrt(6 / (features + hidden)),
                            tile=(tile[1], hidden), replace=True),
              db.from_numpy("mb1", np.zeros(hidden), replace=True),
              db.from_numpy("mW2", rng.uniform(-1, 1, (hidden, classes)) * np.sqrt(6 / (hidden + classes)),
                            replace=True),
              db.from_numpy("mb2", np.zeros(classes), replace=True)]
    hid = db.einsum("nh,h->nh", db.einsum("nf,fh->nh", xt, params[0]), params[1], join="greatest(x0 + x1, 0)")
    z = db.einsum("nc,c->nc", db.einsum("nh,hc->nc", hid, params[2]), params[3], join="x0 + x1")
    loss = cross_entropy(db, z, yt, rows)
    marks = []
    with spark_jobs.jobs(db.engine.spark) as jobs:
        run = db.train(loss, params, Adam(lr=0.01), 2, run="mem", progress=False,
                       on_epoch=lambda *_: marks.append((time.perf_counter(), jobs.count)))
    return {"seconds": marks[1][0] - marks[0][0], "jobs": marks[1][1] - marks[0][1], "losses": run.losses}


def planned_tile(db, rows: int, features: int, hidden: int) -> tuple[int, int]:
    """The tiles of the features in EinDecomp's plan of the first layer's product under the
    cluster's budget (parts up to 256 per index)."""
    probe = db.einsum("nf,fh->nh", db.zeros((rows, features), "float64", (rows, features)),
                      db.zeros((features, hidden), "float64", (features, hidden)))
    plan = choose.plan(db.engine, probe, base=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    if not np.isfinite(plan.cost):
        raise SystemExit(f"the planner found no tiling that fits {plan.memory / 2**20:.0f} MiB per core; "
                         f"pass --tile-rows")
    print(plan.explain(), flush=True)
    return plan.ops[0].tile["n"], plan.ops[0].tile["f"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=262144)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--executor-memory", default="512m", help="per executor (and worker)")
    parser.add_argument("--tile-rows", type=int, help="store the features in tiles of this many rows (all features) "
                        "instead of the planner's")
    parser.add_argument("--calibrate", action="store_true", help="calibrate the planner on the cluster first")
    parser.add_argument("--quick", action="store_true", help="smoke run: skip the PyTorch control run")
    parser.add_argument("--metrics", action="store_true", help="log Spark's events: executors lost, memory peaks")
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    cap = int(jvm_bytes(args.executor_memory))
    x, y = data(args.rows, args.features, args.classes)
    bigger = "data larger than an executor" if x.nbytes > cap else "NOT larger: a smoke size"
    print(f"features: {args.rows} × {args.features} float64 = {x.nbytes / 2**20:.0f} MiB; executors: 2 × 1 core × "
          f"{args.executor_memory} ({bigger})", flush=True)
    logs = tempfile.TemporaryDirectory(prefix="tra_spark_events_") if args.metrics else nullcontext()
    with logs as directory, StandaloneCluster(workers=2, cores=1, memory=args.executor_memory) as cluster:
        config = {"spark.cores.max": "2", "spark.sql.shuffle.partitions": "4"}
        db = tra_sql.connect(engine="spark", master=cluster.url, executor_memory=args.executor_memory,
                             executor_cores=1, driver_memory="2g",
                             config=config | (metrics_config(directory) if directory else {}))
        try:
            db.engine.wait_for_executors(2)
            task = db.engine.budget()[1]
            if args.tile_rows:
                tile, how = (min(args.tile_rows, args.rows), args.features), "given"
            else:
                if args.calibrate:
                    db.calibrate()
                tile, how = planned_tile(db, *x.shape, args.hidden), "the planner's"
            print(f"tiles of the features ({how}): {tile}, {tile[0] * tile[1] * 8 / 2**20:.1f} MiB each; "
                  f"{task / 2**20:.0f} MiB per task", flush=True)
            t = epoch(db, x, y, args.hidden, tile)
        finally:
            db.close()
            if directory:
                print(memory_report(events(Path(directory))), flush=True)
    print(f"\n| run | s | Spark jobs |\n|---|---|---|\n| tra_sql on Spark, one MLP epoch | {t['seconds']:.2f} | "
          f"{t['jobs']} |\nlosses: {t['losses']}")
    print(f"\nPyTorch, one process capped at {args.executor_memory} beyond what torch maps: "
          f"{torch_holds(args.rows, args.features, cap)}")
    if not args.quick:
        print(f"PyTorch control, capped at twice the features: {torch_holds(args.rows, args.features, 2 * x.nbytes)}")


if __name__ == "__main__":
    main()
