"""What a Spark executor's Python worker does to run a tile UDF, in a fresh interpreter as the
worker is: it imports the kernels without the session, DuckDB, sqlglot or the planner, and
each UDF call freezes the worker's heap (``spark_udfs._settle``), so that the full garbage
collection PySpark runs before each UDF evaluation skips the modules and compiled kernels.
No Spark needed: the UDFs are the Python functions Spark ships by reference."""

import json
import subprocess
import sys

import numpy as np

HEAVY = ("duckdb", "sqlglot", "tra_sql.session", "tra_sql.tensor", "tra_sql.graph", "tra_sql.compile",
         "tra_sql.decompose", "tra_sql.engines", "tra_sql.udfs.register")

WORKER = """
import gc, json, sys
import numpy as np, pyarrow as pa
from tra_sql.backends import spark_udfs
from tra_sql.udfs.einsum_kernels import einsum_rows
from tra_sql.udfs.protocol import EinsumStep

a, b = np.arange(4.0).reshape(2, 2), np.arange(4.0, 8.0).reshape(2, 2)
step = EinsumStep(("ij", "jk"), "ik", {"i": 2, "j": 2, "k": 2}, {"i": 2, "j": 2, "k": 2}, ("float64",) * 2,
                  "float64", ("A", "B"), join=JOIN)
keys = pa.array([[0, 0]], pa.large_list(pa.int64()))
udf = spark_udfs._batch_udf(einsum_rows, pa.large_binary())
args = (pa.array([step.encode()]), keys, keys, pa.array([a.tobytes()], pa.large_binary()), keys,
        pa.array([b.tobytes()], pa.large_binary()))
udf(*args)  # the first call loads the kernel
out = udf(*args)
frozen = gc.get_freeze_count()
print(json.dumps({"tile": np.frombuffer(out[0].as_py()).tolist(), "modules": sorted(sys.modules),
                  "frozen": frozen, "tracked": len(gc.get_objects())}))
"""


def worker(join: str | None) -> dict:
    """Run ``WORKER`` (two ``tra_einsum_2`` calls, ``join`` its join expression) in a fresh
    interpreter; its result tile, modules, and objects frozen and still tracked by gc."""
    done = subprocess.run([sys.executable, "-c", WORKER.replace("JOIN", repr(join))], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_tile_udf_imports_no_session_duckdb_or_sqlglot():
    a, b = np.arange(4.0).reshape(2, 2), np.arange(4.0, 8.0).reshape(2, 2)
    run = worker(None)
    np.testing.assert_allclose(run["tile"], (a @ b).ravel())
    assert [m for m in run["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)] == []
    # a join expression is translated to Numba code there, by sqlglot: imported then, not before
    joined = worker("x0 * x1 + 1")
    np.testing.assert_allclose(joined["tile"], (a @ b + 2).ravel())
    assert "sqlglot" in joined["modules"] and "duckdb" not in joined["modules"]


def test_a_tile_udf_freezes_the_worker_heap():
    """After a second UDF call nearly every object is in gc's permanent generation: the
    collection before the next UDF evaluation visits the few that call made, not the modules'."""
    run = worker(None)
    assert run["frozen"] > 20_000 and run["tracked"] < run["frozen"] / 20


def test_import_tra_sql_is_public_and_lazy():
    code = ("import sys, tra_sql; before = 'tra_sql.session' in sys.modules; "
            "from tra_sql import Session, Tensor, connect; import tra_sql.session, tra_sql.tensor; "
            "assert connect is tra_sql.session.connect and Session is tra_sql.session.Session; "
            "assert Tensor is tra_sql.tensor.Tensor and set(tra_sql.__all__) <= set(dir(tra_sql)); "
            "from tra_sql.udfs import register_kernels; import tra_sql.udfs.register as r; "
            "assert register_kernels is r.register_kernels; print(before)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
