"""Where the driver's time goes in a GCN training step on Spark: ``bench_spark``'s GCN on
``local[2]``, one warm-up epoch, then ``--epochs`` more under cProfile (the driver's Python
only; the JVM's work shows as the py4j calls that wait for it; ``--jfr`` records the JVM with
Java Flight Recorder). Prints a step's temporary views and checkpoints, per epoch the wall time,
the CPU time of the driver and its JVM (local mode: the tasks run there too), the time spent
making the step's views, planning until its job's first stage, in the job, and dropping the
views, then the profile's top functions.

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
from tra_sql.backends.spark import JAVA_OPTIONS, SparkEngine  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process and of its child processes (the driver's JVM), from ``/proc``."""
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
    parser.add_argument("--stats", help="write the profile here too (pstats)")
    parser.add_argument("--jfr", help="record the driver's JVM with Java Flight Recorder into this file")
    args = parser.parse_args()
    n, e, f, h, c = args.gcn
    data = bench_spark.gcn_data(n, e, f, c)
    records: list[dict] = []  # per program: its views and checkpoints, and where its time went
    steps = SparkEngine.steps

    def timed_steps(self, program_steps, what):  # the views: entering the block; the job: inside it
        tracker = self.spark.sparkContext._jsc.statusTracker()

        class Timed:
            def __enter__(inner):
                start = time.perf_counter()
                inner.block = steps(self, program_steps, what)
                frame = inner.block.__enter__()
                inner.record = {"views": len(program_steps.views), "views_s": time.perf_counter() - start,
                                "checkpoints": sum(reads > 1 for _, _, reads in program_steps.views)}
                inner.start, inner.wall = time.perf_counter(), time.time()
                return frame

            def __exit__(inner, *exc):
                elapsed = time.perf_counter() - inner.start
                job = max(tracker.getJobIdsForGroup(self.spark.sparkContext.getLocalProperty(spark_jobs.GROUP)))
                submitted = min(tracker.getStageInfo(s).submissionTime() for s in tracker.getJobInfo(job).stageIds()
                                if tracker.getStageInfo(s) is not None) / 1e3
                start = time.perf_counter()
                out = inner.block.__exit__(*exc)
                planning = submitted - inner.wall
                records.append(inner.record | {"plan_s": planning, "job_s": elapsed - planning,
                                               "drop_s": time.perf_counter() - start})
                return out
        return Timed()

    with tra_sql.connect(threads=2, memory_limit="2GB") as duck:
        bench_spark.gcn_tables(duck, data)
        config = {"spark.sql.shuffle.partitions": str(args.partitions)}
        if args.jfr:
            config["spark.driver.extraJavaOptions"] = (f"{JAVA_OPTIONS} -XX:StartFlightRecording=filename={args.jfr},"
                                                       "settings=profile -XX:FlightRecorderOptions=stackdepth=2048")
        db = tra_sql.connect(engine="spark", master="local[2]", driver_memory="2g", config=config)
        try:
            for table in ("adj", "labels"):
                transfer.copy(duck, db, table, replace=True)
            SparkEngine.steps = timed_steps
            ends: list[tuple[float, float]] = []
            profile = cProfile.Profile()

            def on_epoch(epoch, _loss):
                ends.append((time.perf_counter(), cpu_seconds(), time.time()))
                if epoch == 0:
                    records.clear()
                    profile.enable()

            with spark_jobs.jobs(db.engine.spark) as jobs:
                _train(db, n, f, h, c, args.block, data[3], 1 + args.epochs, on_epoch)
            profile.disable()
            njobs = jobs.count
        finally:
            SparkEngine.steps = steps
            db.close()
    print(f"GCN {n} nodes, {e} edges, block {args.block}, local[2], {args.partitions} shuffle partitions; "
          f"load {os.getloadavg()[0]:.1f}; {njobs} Spark jobs in {1 + args.epochs} epochs; "
          f"a step's temporary views and local checkpoints: {records[-1]['views']} and {records[-1]['checkpoints']}")
    for i in range(1, len(ends)):
        r = records[i - 1]
        print(f"epoch {i + 1}: {ends[i][0] - ends[i - 1][0]:.2f} s wall, {ends[i][1] - ends[i - 1][1]:.2f} s CPU "
              f"(driver and its JVM); views {r['views_s']:.2f} s, then planning until the job's first stage "
              f"{r['plan_s']:.2f} s, the job {r['job_s']:.2f} s, dropping the views {r['drop_s']:.2f} s")
    print(f"profiled from {ends[0][2]:.3f} to {ends[-1][2]:.3f} (seconds since the Unix epoch)")
    if args.stats:
        profile.dump_stats(args.stats)
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
