"""Where the driver's time goes in a GCN training step on Spark: ``bench_spark``'s GCN on
``local[2]``, one warm-up epoch, then ``--epochs`` more under cProfile (the driver's Python
only; the JVM's work shows as the py4j calls that wait for it). Prints per epoch the wall time,
the driver process's CPU time (its JVM included in local mode: the tasks run there too), the
time spent making the step's views before the write and the write itself, then the profile's
top functions.

    python bench/bench_spark_driver.py                                # 2048 nodes in 512² tiles
    python bench/bench_spark_driver.py --gcn 8192 81920 128 16 8 --block 2048 --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_spark  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.backends import spark_jobs, transfer  # noqa: E402
from tra_sql.backends.spark import SparkEngine  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process and its children that have been waited for (the driver's JVM
    is a child: its time shows in ``/proc``, read here)."""
    total = sum(os.times()[:2])
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == os.getpid():
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gcn", type=int, nargs=5, default=(2048, 20480, 128, 16, 8),
                        metavar=("NODES", "EDGES", "FEATURES", "HIDDEN", "CLASSES"))
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--partitions", type=int, default=4, help="spark.sql.shuffle.partitions")
    parser.add_argument("--epochs", type=int, default=3, help="profiled epochs after the warm-up")
    parser.add_argument("--top", type=int, default=30, help="functions printed, by cumulative time")
    args = parser.parse_args()
    n, e, f, h, c = args.gcn
    data = bench_spark.gcn_data(n, e, f, c)
    timings: list[tuple[str, float]] = []
    steps = SparkEngine.steps

    def timed_steps(self, steps_, what):  # the views' time: entering the block; the write's: inside it
        class Timed:
            def __enter__(inner):
                start = time.perf_counter()
                inner.block = steps(self, steps_, what)
                frame = inner.block.__enter__()
                timings.append(("views", time.perf_counter() - start))
                inner.start = time.perf_counter()
                return frame

            def __exit__(inner, *exc):
                timings.append(("job", time.perf_counter() - inner.start))
                start = time.perf_counter()
                out = inner.block.__exit__(*exc)
                timings.append(("drop", time.perf_counter() - start))
                return out
        return Timed()

    with tra_sql.connect(threads=2, memory_limit="2GB") as duck:
        bench_spark.gcn_tables(duck, data)
        db = tra_sql.connect(engine="spark", master="local[2]", driver_memory="2g",
                             config={"spark.sql.shuffle.partitions": str(args.partitions)})
        try:
            for table in ("adj", "labels"):
                transfer.copy(duck, db, table, replace=True)
            SparkEngine.steps = timed_steps
            ends: list[tuple[float, float]] = []
            profile = cProfile.Profile()

            def on_epoch(epoch, _loss):
                ends.append((time.perf_counter(), cpu_seconds()))
                if epoch == 0:
                    timings.clear()
                    profile.enable()

            with spark_jobs.jobs(db.engine.spark) as jobs:
                _train(db, n, f, h, c, args.block, data[3], 1 + args.epochs, on_epoch)
            profile.disable()
        finally:
            SparkEngine.steps = steps
            db.close()
    print(f"GCN {n} nodes, {e} edges, block {args.block}, local[2], {args.partitions} shuffle partitions; "
          f"load {os.getloadavg()[0]:.1f}; {jobs.count} Spark jobs in {1 + args.epochs} epochs")
    for i in range(1, len(ends)):
        views, job, drop = (timings[3 * (i - 1) + k][1] for k in range(3))
        print(f"epoch {i + 1}: {ends[i][0] - ends[i - 1][0]:.2f} s wall, {ends[i][1] - ends[i - 1][1]:.2f} s CPU "
              f"(driver and its JVM); views {views:.2f} s, write {job:.2f} s, drop {drop:.2f} s")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


def _train(db, n, f, h, c, block, x, epochs, on_epoch) -> None:
    from tra_sql.optim import Adam
    from tra_sql.train import cross_entropy

    a = db.relation("adj", ("dst", "src"), "w", (n, n), name="gA", tile=(block, block), layout="csr", replace=True)
    y = db.relation("labels", ("node", "label"), None, (n, c), name="gY", tile=(block, c), replace=True)
    xt = db.from_numpy("gX", x, tile=(block, f), replace=True)
    p = {k: db.from_numpy(f"g{k}", v, replace=True) for k, v in bench_spark.gcn_params(f, h, c).items()}
    hid = db.einsum("mh,h->mh", db.einsum("mn,nh->mh", a, db.einsum("nf,fh->nh", xt, p["W1"])), p["b1"],
                    join="greatest(x0 + x1, 0)")
    z = db.einsum("mc,c->mc", db.einsum("mn,nc->mc", a, db.einsum("nh,hc->nc", hid, p["W2"])), p["b2"],
                  join="x0 + x1")
    loss = cross_entropy(db, z, y, len(range(0, n, 10)))
    db.train(loss, list(p.values()), Adam(lr=0.01), epochs, run="gcn", progress=False, on_epoch=on_epoch)


if __name__ == "__main__":
    main()
