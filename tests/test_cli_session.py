"""A user who knows SQL and no Python: load data, define a model, train it, inspect a gradient
and a plan, and read the results, all through ``tra-sql`` (its prompt fed through stdin)."""

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import tra_sql
from tra_sql.optim import SGD

SESSION = """
CREATE TABLE points AS SELECT * FROM read_csv('points.csv');
.tensors
CREATE TENSOR X AS SELECT * FROM tra_from_elements(
    (SELECT id, 0, x FROM points UNION ALL SELECT id, 1, 1.0 FROM points), shape => [6, 2]);
CREATE TENSOR y AS SELECT * FROM tra_from_elements((SELECT id, y FROM points), shape => [6]);
CREATE PARAMETER w WITH (shape := [2], init := 'zeros');
CREATE TENSOR VIEW loss AS SELECT * FROM einsum('nf,f,n->', X, w, y,
    "join" => 'pow(x0 * x1 - x2, 2) / 6.0');  -- the sum over n and f of (x_nf w_f - y_n)^2 / 6
.views
SELECT round(value, 6) AS dloss_dw FROM tra_elements(grad(loss, w)) ORDER BY i0;
EXPLAIN SELECT * FROM grad(loss, w);
SELECT plan FROM tra_plan(einsum('nf,f->n', X, w), workers => 2, memory => '1GB') LIMIT 1;
TRAIN loss PARAMETERS w WITH (optimizer := 'sgd', lr := 0.1, epochs := 3, run := 'fit');
.runs
SELECT epoch, round(loss, 6) AS logged FROM tra_run_log WHERE run = 'fit' ORDER BY epoch;
SELECT i0, round(value, 6) AS trained FROM tra_elements(w) ORDER BY i0;
"""
POINTS = [(0, -1.0, -1.5), (1, 0.0, 0.5), (2, 1.0, 2.5), (3, 2.0, 4.5), (4, 3.0, 6.5), (5, 4.0, 8.0)]


def cli(database: Path, stdin: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "tra-sql"
    found = str(script) if script.exists() else shutil.which("tra-sql")
    command = [found] if found else [sys.executable, "-m", "tra_sql.cli"]
    return subprocess.run([*command, str(database)], input=stdin, cwd=database.parent, capture_output=True,
                          text=True, timeout=300)


def test_a_whole_session_through_the_cli(tmp_path):
    (tmp_path / "points.csv").write_text("id,x,y\n" + "".join(f"{i},{x},{y}\n" for i, x, y in POINTS))
    done = cli(tmp_path / "s.duckdb", SESSION)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    out = done.stdout
    x = np.array([[p[1], 1.0] for p in POINTS])
    y = np.array([p[2] for p in POINTS])
    # the loss einsum sums (x_nf w_f - y_n)^2 over n and f: its gradient at w = 0
    grad = np.array([sum(2 * (x[n, f] * 0 - y[n]) * x[n, f] / 6 for n in range(6)) for f in range(2)])
    for g in grad:
        assert f"{g:.6f}".rstrip("0") in out
    assert "einsum('nf,f,n->'" in out  # .views
    assert "TRA_LOOP_" in out.upper()  # EXPLAIN: the gradient's SQL, in the kernels DuckDB runs
    assert "Plan for einsum nf,f->n" in out  # tra_plan
    with tra_sql.connect() as db:  # the same model through the Python API
        X, Y = db.from_numpy("X", x), db.from_numpy("y", y)
        w = db.parameter("w", (2,), init="zeros")
        loss = db.einsum("nf,f,n->", X, w, Y, join="pow(x0 * x1 - x2, 2) / 6.0")
        history = db.train(loss, [w], SGD(lr=0.1), 3, run="fit", progress=False)
        trained = db.tensor("w").numpy()
    for value in [*history.losses, *trained]:
        assert f"{value:.6f}".rstrip("0").rstrip(".") in out
    assert "fit" in out and "SGD(lr=0.1" in out  # .runs
    with tra_sql.connect(str(tmp_path / "s.duckdb")) as db:  # the results stay in the database
        np.testing.assert_allclose(db.tensor("w").numpy(), trained, rtol=1e-12)
        assert db.sql("SELECT count(*) FROM tra_run_log WHERE run = 'fit'").fetchall() == [(3,)]


def test_dot_commands_on_a_fresh_database(tmp_path):
    done = cli(tmp_path / "e.duckdb", ".views\n.runs\n.tensors\n.help\n")
    assert done.returncode == 0 and done.stderr == ""
    assert "TRAIN [STEP]" in done.stdout and "tra_relation" in done.stdout and ".views" in done.stdout
