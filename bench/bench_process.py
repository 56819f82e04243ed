"""Per-process costs, each measured in a fresh Python process:

- the first einsum in a new process, with a cold and with a warm Numba kernel cache
  (the difference is the JIT cost; warm is what users see after the first run), and what the
  required dependencies cost alone (their imports, and loading one trivial cached Numba
  ``cfunc``, as native kernels must);
- peak resident memory (RSS) of a 4096² float32 matmul through tra_sql against numpy's.

    python bench/bench_process.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

WARM_RUNS = 5
FIRST_EINSUM = textwrap.dedent("""
    import json, sys, time
    start = time.perf_counter()
    import numpy as np, tra_sql
    imported = time.perf_counter()
    db = tra_sql.connect()
    x = db.from_numpy("x", np.arange(12.0).reshape(3, 4), tile=(2, 2))
    if sys.argv[1] == "contraction":
        y = db.einsum("ij,kj->ik", x, x).numpy()
    else:
        y = db.einsum("ij,ij->i", x, x, join="exp(x0) * x1", agg="max").numpy()
    end = time.perf_counter()
    print(json.dumps({"import": imported - start, "first_einsum": end - imported, "total": end - start}))
""")

DEPENDENCIES = textwrap.dedent("""
    import json, time
    start = time.perf_counter()
    import numpy, duckdb, pyarrow, sqlglot
    imported = time.perf_counter()
    import numba
    numba_imported = time.perf_counter()

    @numba.cfunc(numba.types.int64(numba.types.int64), cache=True)
    def increment(x):
        return x + 1

    end = time.perf_counter()
    print(json.dumps({"others": imported - start, "numba": numba_imported - imported, "cfunc": end - numba_imported,
                      "total": end - start}))
""")

PEAK_RSS = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    n = 4096
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = np.random.default_rng(1).random((n, n), dtype=np.float32)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.argv[1] == "numpy":
        c = a @ b
    else:
        import tra_sql
        db = tra_sql.connect()
        A = db.from_numpy("A", a, tile=n)
        B = db.from_numpy("B", b, tile=n)
        del a, b
        c = db.einsum("ij,jk->ik", A, B).numpy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": peak / 1024, "inputs_mb": 2 * n * n * 4 / 2**20, "before_mb": base / 1024}))
""")


def python(*args: str, env: dict | None = None) -> str:
    """The output of a new Python process that reads and writes bytecode (``.pyc``) as an
    installed package's imports do, whatever ``PYTHONDONTWRITEBYTECODE`` says here."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONDONTWRITEBYTECODE"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True, env=env).stdout


def run(script: str, *args: str, env: dict | None = None) -> dict:
    out = python("-c", script, *args, env=env)
    return json.loads(out.strip().splitlines()[-1])


def dependencies() -> dict:
    """``DEPENDENCIES`` in a new process, its cfunc already in Numba's cache (a file's: a
    script given with ``-c`` has none)."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "dependencies.py"
        script.write_text(DEPENDENCIES)
        for _ in range(2):  # the first run compiles and caches the cfunc
            out = python(str(script))
        return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    print(f"machine: {machine()}\n")
    print("| first einsum in a new process | import s | first einsum s | total s |")
    print("|---|---|---|---|")
    for kind, label in (("contraction", "`ij,kj->ik` (BLAS kernel)"),
                        ("extended", "`ij,ij->i`, join `exp(x0) * x1`, agg max (Numba kernel)")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRA_SQL_CACHE_DIR=cache)
            cold = run(FIRST_EINSUM, kind, env=env)
            warm = sorted((run(FIRST_EINSUM, kind, env=env) for _ in range(WARM_RUNS)), key=lambda r: r["total"])
        print(f"| {label}, cold cache, includes JIT | {cold['import']:.2f} | {cold['first_einsum']:.2f} | "
              f"{cold['total']:.2f} |")
        r = warm[len(warm) // 2]
        print(f"| {label}, warm cache (median of {WARM_RUNS}; totals {warm[0]['total']:.2f}-{warm[-1]['total']:.2f}) "
              f"| {r['import']:.2f} | {r['first_einsum']:.2f} | {r['total']:.2f} |")
    deps = dependencies()
    imports = deps["others"] + deps["numba"]
    print(f"| the dependencies alone: numpy, duckdb, pyarrow, sqlglot {deps['others']:.2f} s, numba "
          f"{deps['numba']:.2f} s, then one cached cfunc | {imports:.2f} | {deps['cfunc']:.2f} | {deps['total']:.2f} |")
    print()
    numpy_rss, tra_rss = run(PEAK_RSS, "numpy"), run(PEAK_RSS, "tra_sql")
    print("| 4096² float32 matmul | peak RSS MB | ratio to numpy |")
    print("|---|---|---|")
    print(f"| numpy `a @ b` | {numpy_rss['peak_mb']:.0f} | 1.00 |")
    print(f"| tra_sql `einsum('ij,jk->ik')`, one tile | {tra_rss['peak_mb']:.0f} | "
          f"{tra_rss['peak_mb'] / numpy_rss['peak_mb']:.2f} |")


if __name__ == "__main__":
    main()
