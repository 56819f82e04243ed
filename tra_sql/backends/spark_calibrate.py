"""The planner's cost constants measured on a Spark application (``SparkEngine.calibrate``).

On Spark the model's per-statement and per-byte terms are a job's latency and the traffic of
shuffles, Arrow transfers to the Python workers and Parquet. Three element-wise einsums on
the session's executors, run into Spark's ``noop`` sink, price them: one 64² tile (``stmt``:
a query's latency), two 2048² float64 operands in 4 tiles (bytes: ``join_byte`` and every other
per-byte constant), and the same in 1024 tiles (``row`` and ``group``, per joined row). The
kernel constants are ``tra_sql.decompose.calibrate.kernels()`` measured on the driver, which
on a one-machine cluster is the executors' hardware. Broadcast joins are not modelled.
"""

from __future__ import annotations

import time

import numpy as np

from tra_sql.decompose import calibrate as duckdb_calibrate
from tra_sql.decompose.cost import Constants

RUNS = {"tiny": ((64, 64), (64, 64)), "bytes": ((2048, 2048), (1024, 1024)), "rows": ((2048, 2048), (64, 64))}


def _seconds(db, tensor) -> float:
    """The fastest of two runs after a warm-up."""
    def run():
        start = time.perf_counter()
        with db.engine.frame(tensor.program()) as frame:
            frame.write.format("noop").mode("overwrite").save()
        return time.perf_counter() - start

    run()
    return min(run(), run())


def calibrate(db) -> Constants:
    """Measure the constants on ``db``'s executors (about a minute on a small cluster)."""
    rng = np.random.default_rng(0)
    t = {}
    for name, (shape, tile) in RUNS.items():
        x, y = (db.from_numpy(f"tra_calibrate_{name}_{m}", rng.random(shape), tile=tile, replace=True) for m in "xy")
        t[name] = _seconds(db, db.einsum("ij,ij->ij", x, y, join="x0 + x1"))
        for m in "xy":
            db.drop(f"tra_calibrate_{name}_{m}")
    stmt = t["tiny"]
    nbytes = 3 * 8 * 2048**2  # two operands through the join, one result out
    byte = max(t["bytes"] - stmt, 0.0) / nbytes
    rows = (2048 // 64) ** 2 - (2048 // 1024) ** 2
    row = max(t["rows"] - t["bytes"], 0.0) / rows
    workers, _ = db.engine.budget()
    measured = {"stmt": stmt, "row": row, "group": row, "join_byte": byte, "list_byte": byte, "out_byte": byte,
                "place_byte": byte, "scan_byte": byte, "threads": workers}
    return Constants.from_dict({**Constants().as_dict(), **duckdb_calibrate.kernels(), **measured})
