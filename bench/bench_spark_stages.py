"""Where a GCN training step's time goes on Spark: one epoch of ``bench_spark``'s GCN on
``local[2]`` with Spark's event log on, then the second epoch's jobs and stages read back
from the log (a profile, not a timing: run it on a quiet machine for times that mean much).

    python bench/bench_spark_stages.py                        # 2048 nodes, the step as one Spark job
    python bench/bench_spark_stages.py --adaptive             # under Spark's own settings
    python bench/bench_spark_stages.py --gcn 8192 81920 128 16 8 --block 2048

Prints the epoch's seconds, Spark jobs, classes compiled by Spark's code generator and Python
workers started and exited (``spark_jobs.python_workers``), where
the epoch's wall time went (the driver before its job: views, checkpoints, planning; the job;
the commit after it), the physical operators of its queries (joins, exchanges, exchanges
reused, Python UDF evaluations), a table of its stages: tasks, wall time (submission to
completion), the tasks' run, CPU and deserialization time, shuffle bytes, and the operators
each stage runs (from the RDD scopes); then the totals and the Python workers' SQL metrics
summed over the stages (their start, initialization, run and Python code time, data sent and
returned). A reused worker's "start" is the full garbage collection PySpark's daemon runs before
each UDF evaluation (``spark_udfs._settle`` freezes the heap it would scan).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_spark  # noqa: E402

import tra_sql  # noqa: E402
from tra_sql.backends import transfer  # noqa: E402

OPERATORS = ("SortMergeJoin", "ShuffledHashJoin", "BroadcastHashJoin", "BroadcastNestedLoopJoin",
             "CartesianProduct", "Exchange", "ReusedExchange", "BroadcastExchange", "ArrowEvalPython",
             "ArrowAggregatePython", "SortAggregate", "HashAggregate", "Sort ", "Scan parquet")
#: The SQL metrics of Spark's Python UDF operators (``PythonSQLMetrics``), as the event log names them.
PYTHON_METRICS = ("time to start Python workers", "time to initialize Python workers", "time to run Python workers",
                  "time to execute Python code", "data sent to Python workers", "data returned from Python workers")


def events(directory: Path) -> list[dict]:
    """The events of the one application logged under ``directory``."""
    (log,) = [p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def scopes(stage: dict) -> str:
    """The operators a stage runs, in RDD order (their scopes' names, repeats dropped)."""
    names = []
    for rdd in sorted(stage.get("RDD Info", []), key=lambda r: r["RDD ID"]):
        scope = json.loads(rdd["Scope"])["name"] if rdd.get("Scope") else rdd["Name"]
        scope = re.sub(r"\s*\(\d+\)$", "", scope)
        if not names or names[-1] != scope:
            names.append(scope)
    return " > ".join(names)


def report(log: list[dict], window: tuple[float, float]) -> None:
    """The jobs, queries and stages whose submission lies in ``window`` (seconds since the epoch)."""
    lo, hi = (w * 1000 for w in window)
    jobs = [e for e in log if e["Event"] == "SparkListenerJobStart" and lo <= e["Submission Time"] <= hi]
    stage_ids = {s for job in jobs for s in job["Stage IDs"]}
    done = {e["Stage Info"]["Stage ID"]: e["Stage Info"] for e in log
            if e["Event"] == "SparkListenerStageCompleted" and e["Stage Info"]["Stage ID"] in stage_ids}
    tasks: dict[int, list[dict]] = {}
    for e in log:
        if e["Event"] == "SparkListenerTaskEnd" and e["Stage ID"] in done:
            tasks.setdefault(e["Stage ID"], []).append(e["Task Metrics"])
    if jobs:
        start = min(j["Submission Time"] for j in jobs)
        end = max(e["Completion Time"] for e in log if e["Event"] == "SparkListenerJobEnd"
                  and e["Job ID"] in {j["Job ID"] for j in jobs})
        print(f"wall: {(start - lo) / 1e3:.2f} s on the driver before the first job (views, checkpoints, planning), "
              f"{(end - start) / 1e3:.2f} s from it to the last job's end, {(hi - end) / 1e3:.2f} s after (commit)")
    plans = [e["physicalPlanDescription"] for e in log if e["Event"].endswith("SparkListenerSQLExecutionStart")
             and lo <= e["time"] <= hi]
    ops = Counter({op.strip(): sum(p.count(f"{op}(") + p.count(f"{op} (") for p in plans) for op in OPERATORS})
    print(f"{len(jobs)} jobs, {len(done)} stages run ({len(stage_ids) - len(done)} skipped), "
          f"{len(plans)} SQL queries; operators in their plans: "
          + ", ".join(f"{k} {v}" for k, v in ops.items() if v))
    print("\n| stage | tasks | wall ms | run ms | CPU ms | deserialize ms | shuffle read KB | shuffle write KB | "
          "operators |")
    print("|---|---|---|---|---|---|---|---|---|")
    total, python = Counter(), Counter()
    for sid, info in sorted(done.items()):
        wall = info["Completion Time"] - info["Submission Time"]
        metrics = tasks.get(sid, [])
        run = sum(m["Executor Run Time"] for m in metrics)
        cpu = sum(m["Executor CPU Time"] for m in metrics) / 1e6
        deser = sum(m["Executor Deserialize Time"] for m in metrics)
        python.update({a["Name"]: float(a["Value"]) for a in info.get("Accumulables", [])
                       if a.get("Name") in PYTHON_METRICS})
        read = sum(m["Shuffle Read Metrics"]["Remote Bytes Read"] + m["Shuffle Read Metrics"]["Local Bytes Read"]
                   for m in metrics) / 1e3
        wrote = sum(m["Shuffle Write Metrics"]["Shuffle Bytes Written"] for m in metrics) / 1e3
        total.update(tasks=info["Number of Tasks"], wall=wall, run=run, cpu=cpu, deser=deser, read=read, wrote=wrote)
        print(f"| {sid} | {info['Number of Tasks']} | {wall} | {run} | {cpu:.0f} | {deser} | {read:.0f} | "
              f"{wrote:.0f} | {scopes(info)[:150]} |")
    print(f"| all | {total['tasks']} | {total['wall']} | {total['run']} | {total['cpu']:.0f} | {total['deser']} | "
          f"{total['read']:.0f} | {total['wrote']:.0f} | |")
    print("\nPython workers (summed over tasks and UDF operators; a task's operators run at once): " + ", ".join(
        f"{name} {python[name] / 1e6:.1f} MB" if name.startswith("data") else f"{name} {python[name] / 1e3:.2f} s"
        for name in PYTHON_METRICS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gcn", type=int, nargs=5, default=(2048, 20480, 128, 16, 8),
                        metavar=("NODES", "EDGES", "FEATURES", "HIDDEN", "CLASSES"))
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--partitions", type=int, default=4, help="spark.sql.shuffle.partitions")
    parser.add_argument("--adaptive", action="store_true", help="Spark's own settings (spark_jobs.adaptive), not "
                        "one Spark job per program")
    args = parser.parse_args()
    n, e, f, h, c = args.gcn
    data = bench_spark.gcn_data(n, e, f, c)
    with tempfile.TemporaryDirectory(prefix="tra_spark_events_") as logs, \
            tra_sql.connect(threads=2, memory_limit="2GB") as duck:
        bench_spark.gcn_tables(duck, data)
        db = tra_sql.connect(engine="spark", master="local[2]", driver_memory="2g", config={
            "spark.sql.shuffle.partitions": str(args.partitions), "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": Path(logs).as_uri(), "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false"})
        try:
            if args.adaptive:
                db.engine.program_settings = {}  # as spark_jobs.adaptive
            for table in ("adj", "labels"):
                transfer.copy(duck, db, table, replace=True)
            epoch = bench_spark.gcn_epoch(db, n, f, h, c, args.block, data[3])
        finally:
            db.close()
        mode = "Spark's own settings" if args.adaptive else "one job per program"
        print(f"GCN {n} nodes, {e} edges, block {args.block}, local[2], {args.partitions} shuffle partitions, "
              f"{mode}: second epoch "
              f"{epoch['seconds']:.2f} s, {epoch['jobs']} Spark jobs, {epoch['compiled']} classes compiled, "
              "{} Python workers started, {} exited".format(*epoch["workers"]))
        report(events(Path(logs)), epoch["window"])


if __name__ == "__main__":
    main()
