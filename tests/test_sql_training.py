"""Training from SQL: tensor views (lazy), CREATE PARAMETER, TRAIN and TRAIN STEP, against the
Python API (db.parameter, db.train, tra_sql.optim); sql/examples/digits.sql through the CLI."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tra_sql
from tra_sql.errors import DTypeError, ShapeError, SpecError, SQLError, TensorExistsError, UnknownTensorError
from tra_sql.optim import SGD, Adam
from tra_sql.train import cross_entropy

EXAMPLES = Path(__file__).resolve().parent.parent / "sql" / "examples"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The ``tra-sql`` command (the module where the script is not installed)."""
    script = Path(sys.executable).parent / "tra-sql"
    found = str(script) if script.exists() else shutil.which("tra-sql")
    command = [found] if found else [sys.executable, "-m", "tra_sql.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=600)

RNG = np.random.default_rng(7)
FEATURES = RNG.standard_normal((24, 3))
CLASSES = (FEATURES @ np.array([1.0, -2.0, 0.5]) > 0).astype(int)
MODEL = """
CREATE TENSOR T AS SELECT * FROM tra_from_elements(labels, shape => [24, 2], tile => [8, 2]);
CREATE PARAMETER W WITH (shape := [3, 2], seed := 3);
CREATE PARAMETER b WITH (shape := [2], init := 'zeros');
CREATE TENSOR VIEW logits AS SELECT * FROM einsum('nc,c->nc', einsum('nf,fc->nc', X, W), b, "join" => 'x0 + x1');
CREATE TENSOR VIEW loss AS SELECT * FROM einsum('nc,nc,n->', T, logits,
    einsum('nc->n', logits, agg => 'logsumexp'), "join" => 'x0 * (x2 - x1) / 24.0');
"""


def session():
    db = tra_sql.connect()
    db.from_numpy("X", FEATURES, tile=(8, 3))
    db.sql("CREATE TABLE labels AS SELECT * FROM (VALUES "
           + ", ".join(f"({i}, {c}, 1.0)" for i, c in enumerate(CLASSES)) + ") AS t(i, c, v)")
    return db


@pytest.fixture
def db():
    with session() as s:
        s.sql(MODEL)
        yield s


def python_run(optimizer, epochs):
    """The same model trained through the Python API: (W, b, per-epoch losses)."""
    with session() as db:
        onehot = np.eye(2)[CLASSES]
        y = db.from_numpy("T", onehot, tile=(8, 2))
        w, b = db.parameter("W", (3, 2), seed=3), db.parameter("b", (2,), init="zeros")
        logits = db.einsum("nc,c->nc", db.einsum("nf,fc->nc", "X", w), b, join="x0 + x1")
        history = db.train(cross_entropy(db, logits, y, 24), [w, b], optimizer, epochs, run="py", progress=False)
        return db.tensor("W").numpy(), db.tensor("b").numpy(), history.losses


def scalar(db, sql):
    return db.sql(f"SELECT value FROM tra_elements({sql})").fetchall()[0][0]


@pytest.mark.parametrize("options, optimizer", [
    ("optimizer := 'sgd', lr := 0.5, momentum := 0.9", SGD(lr=0.5, momentum=0.9)),
    ("optimizer := 'adam', lr := 0.1, betas := [0.8, 0.99]", Adam(lr=0.1, betas=(0.8, 0.99))),
])
def test_train_matches_the_python_api(db, options, optimizer):
    rows = db.sql(f"TRAIN loss PARAMETERS W, b WITH ({options}, epochs := 6)").fetchall()
    w, b, losses = python_run(optimizer, 6)
    assert [r[1] for r in rows] == list(range(6)) and {r[0] for r in rows} == {"loss"}
    np.testing.assert_allclose([r[2] for r in rows], losses, rtol=1e-9)
    np.testing.assert_allclose(db.tensor("W").numpy(), w, rtol=1e-9)
    np.testing.assert_allclose(db.tensor("b").numpy(), b, rtol=1e-9, atol=1e-12)
    logged = db.sql("SELECT loss FROM tra_run_log WHERE run = 'loss' ORDER BY epoch").fetchall()
    np.testing.assert_allclose([r[0] for r in logged], losses, rtol=1e-9)


def test_resume_and_step_continue_the_run(db):
    db.sql("TRAIN loss PARAMETERS W, b WITH (optimizer := 'sgd', lr := 0.5, epochs := 2)")
    db.sql("TRAIN STEP loss PARAMETERS W, b WITH (optimizer := 'sgd', lr := 0.5)")
    rows = db.sql("TRAIN loss PARAMETERS W, b WITH (optimizer := 'sgd', lr := 0.5, epochs := 5)").fetchall()
    w, _, losses = python_run(SGD(lr=0.5), 5)
    np.testing.assert_allclose([r[2] for r in rows], losses, rtol=1e-9)
    np.testing.assert_allclose(db.tensor("W").numpy(), w, rtol=1e-9)
    with pytest.raises(SpecError, match="was started with"):
        db.sql("TRAIN STEP loss PARAMETERS W, b WITH (optimizer := 'adam')")


def test_a_tensor_view_is_evaluated_where_it_is_read(db):
    before = scalar(db, "loss")
    assert before == pytest.approx(python_run(SGD(lr=0.0), 1)[2][0])
    db.sql("CREATE OR REPLACE TENSOR b AS SELECT * FROM einsum('c->c', b, \"join\" => 'x0 + 1.0')")
    assert scalar(db, "loss") == pytest.approx(before)  # a shift of every logit leaves softmax alone
    db.from_numpy("W", np.zeros((3, 2)), replace=True)
    assert scalar(db, "loss") == pytest.approx(np.log(2))
    assert db.sql("SELECT count(*) FROM logits").fetchall() == [(3,)]  # FROM reads a view's tiles
    assert "loss" not in db.tensors()  # no tiles are stored


def test_grad_of_a_view_in_sql_matches_finite_differences(db):
    g = np.array(db.sql("SELECT value FROM tra_elements(grad(loss, W)) ORDER BY i0, i1").fetchall())[:, 0]
    w0 = db.tensor("W").numpy()
    numeric = []
    for i in range(w0.size):
        values = []
        for h in (1e-6, -1e-6):
            w = w0.copy().ravel()
            w[i] += h
            db.from_numpy("W", w.reshape(w0.shape), replace=True)
            values.append(scalar(db, "loss"))
        numeric.append((values[0] - values[1]) / 2e-6)
    np.testing.assert_allclose(g, numeric, rtol=1e-5, atol=1e-8)


def test_parameters_are_kept_replaced_and_checked(db):
    w = db.tensor("W").numpy()
    db.sql("CREATE PARAMETER W WITH (shape := [3, 2], seed := 9)")  # stored: kept (a rerun resumes)
    np.testing.assert_array_equal(db.tensor("W").numpy(), w)
    db.sql("CREATE OR REPLACE PARAMETER W WITH (shape := [3, 2], seed := 9, init := 'normal', scale := 0.5)")
    with tra_sql.connect() as other:
        np.testing.assert_array_equal(db.tensor("W").numpy(),
                                      other.parameter("W", (3, 2), "normal", seed=9, scale=0.5).numpy())
    with pytest.raises(ShapeError, match="stored with shape"):
        db.sql("CREATE PARAMETER W WITH (shape := [4, 2])")
    kept = db.tensor("W").numpy()
    with pytest.raises(SpecError, match="initializer 'bogus'"):  # a failed replace keeps the stored one
        db.sql("CREATE OR REPLACE PARAMETER W WITH (shape := [3, 2], init := 'bogus')")
    np.testing.assert_array_equal(db.tensor("W").numpy(), kept)
    with pytest.raises(SpecError, match="initializer 'ones_please'"):
        db.sql("CREATE PARAMETER V WITH (shape := [2], init := 'ones_please')")
    with pytest.raises(SQLError, match="CREATE .*PARAMETER name WITH"):
        db.sql("CREATE PARAMETER V")


@pytest.mark.parametrize("statement, error, message", [
    ("CREATE PARAMETER W WITH (shape := [3, 2], init := 'bogus')", SpecError, "initializer 'bogus'"),
    ("CREATE PARAMETER W WITH (shape := [3, 2], dtype := 'float16')", DTypeError, "float16 is not supported"),
    ("CREATE PARAMETER W WITH (shape := [3, 2], dtype := 'float32')", DTypeError, "'W' is stored as float64"),
    ("CREATE PARAMETER W WITH (shape := [3, 2], tile := [1, 2])", ShapeError, r"'W' is stored in tiles of \(3, 2\)"),
    ("CREATE PARAMETER W WITH (shape := [3, 2], tile := [0, 2])", ShapeError, "tile"),
])
def test_a_stored_parameter_is_kept_only_if_it_is_what_the_statement_asks_for(db, statement, error, message):
    """A rerun's CREATE PARAMETER keeps the stored tensor, but not silently one of another dtype or
    tiling than it names, and never with options that would fail on a fresh database."""
    w = db.tensor("W").numpy()
    with pytest.raises(error, match=message):
        db.sql(statement)
    np.testing.assert_array_equal(db.tensor("W").numpy(), w)
    db.sql("CREATE PARAMETER W WITH (shape := [3, 2], dtype := 'float64', tile := [3, 2])")  # what it is: kept
    np.testing.assert_array_equal(db.tensor("W").numpy(), w)


def test_view_names_and_errors(db):
    with pytest.raises(TensorExistsError, match="exists already"):
        db.sql("CREATE TENSOR VIEW loss AS SELECT * FROM X")
    with pytest.raises(TensorExistsError, match="table or tensor named 'X'"):
        db.sql("CREATE TENSOR VIEW X AS SELECT * FROM W")
    with pytest.raises(SQLError, match="is a tensor view"):
        db.sql("CREATE TENSOR loss AS SELECT * FROM X")
    with pytest.raises(SQLError, match="defined as SELECT"):
        db.sql("CREATE TENSOR VIEW v AS SELECT * FROM X WHERE k0 = 0")
    with pytest.raises(UnknownTensorError, match="no tensor named 'nope'"):
        db.sql("CREATE TENSOR VIEW v AS SELECT * FROM einsum('ij->i', nope)")
    db.sql("CREATE TENSOR VIEW v1 AS SELECT * FROM einsum('ij->j', X);"
           "CREATE TENSOR VIEW v2 AS SELECT * FROM einsum('j->j', v1);"
           "CREATE OR REPLACE TENSOR VIEW v1 AS SELECT * FROM einsum('j->j', v2)")
    with pytest.raises(SQLError, match="reads itself"):
        db.sql("SELECT * FROM v2")
    db.sql("DROP TENSOR VIEW v1; DROP TENSOR VIEW IF EXISTS v1")
    with pytest.raises(UnknownTensorError, match="no tensor view named 'v1'"):
        db.sql("DROP TENSOR VIEW v1")
    db.sql("CREATE TENSOR stored AS SELECT * FROM logits")  # materialized once
    assert db.tensor("stored").shape == (24, 2)


@pytest.mark.parametrize("statement, error, message", [
    ("TRAIN loss PARAMETERS W WITH (optimizer := 'rmsprop')", SpecError, "not one of sgd, adam, adamw"),
    ("TRAIN loss PARAMETERS W WITH (optimizer := 'sgd', betas := [0.9, 0.9])", SpecError, "no option 'betas'"),
    ("TRAIN loss PARAMETERS W WITH (colour := 1)", SpecError, "TRAIN has no option 'colour'"),
    ("TRAIN logits PARAMETERS W", ShapeError, "must be a scalar"),
    ("TRAIN loss PARAMETERS logits", SQLError, "not tensor views"),
    ("TRAIN einsum('ij->', X) PARAMETERS W", SpecError, "name the run"),
    ("TRAIN loss WITH (epochs := 2)", SQLError, "TRAIN \\[STEP\\] <loss> PARAMETERS"),
    ("TRAIN STEP loss PARAMETERS W WITH (epochs := 2)", SpecError, "takes no epochs"),
])
def test_train_errors(db, statement, error, message):
    with pytest.raises(error, match=message):
        db.sql(statement)
    assert db.sql("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'tra_runs'").fetchall() == [(0,)]


def test_train_through_relation_and_random_literals():
    """Tensor functions inside the loss are read by every step and leave nothing behind."""
    with session() as db:
        db.sql("CREATE TABLE edges AS SELECT * FROM (VALUES (0, 1, 1.0), (1, 2, 2.0), (2, 0, 1.0)) AS t(s, d, w);"
               "CREATE PARAMETER H WITH (shape := [3, 2], init := 'zeros');"
               "CREATE TENSOR VIEW fit AS SELECT * FROM einsum('ij,jf,if->', tra_relation(edges, keys => ['s', 'd'], "
               "value => 'w', layout => 'csr'), H, tra_random(shape => [3, 2], seed => 1), "
               "\"join\" => 'pow(x0 * x1 - x2, 2)')")
        before = set(db.tensors())
        rows = db.sql("TRAIN fit PARAMETERS H WITH (optimizer := 'adam', lr := 0.05, epochs := 60)").fetchall()
        assert rows[-1][2] < rows[0][2] / 5
        assert {t for t in db.tensors() if not t.startswith("fit__")} == before


def test_explain_describes_training_statements(db):
    text = db.explain_sql("CREATE PARAMETER V WITH (shape := [2]); CREATE TENSOR VIEW z AS SELECT * FROM X;"
                          "TRAIN loss PARAMETERS W, b WITH (epochs := 3)")
    assert "parameter V" in text and "tensor view z" in text and "run 'loss': up to 3 epochs of Adam" in text
    assert "V" not in db.tensors() and "tra_runs" not in text.lower().split("--")[0]


def test_digits_example_through_the_cli_reaches_the_python_api(tmp_path):
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    header = "id,label," + ",".join(f"p{j}" for j in range(64))
    for name, rows in (("train", slice(0, 1500)), ("test", slice(1500, None))):
        lines = [header] + [f"{i},{c}," + ",".join(str(int(v)) for v in x)
                            for i, (x, c) in enumerate(zip(digits.data[rows], digits.target[rows]))]
        (tmp_path / f"digits_{name}.csv").write_text("\n".join(lines) + "\n")
    done = cli("d.duckdb", "-f", str(EXAMPLES / "digits.sql"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    accuracy = float(re.search(r"test_accuracy.*?(\d\.\d+)", done.stdout, re.S).group(1))
    with tra_sql.connect() as db:  # the same model and optimizer through the Python API
        x, y = digits.data / 16.0, digits.target
        X = db.from_numpy("X", x[:1500], tile=(500, 64))
        Y = db.from_numpy("Y", np.eye(10)[y[:1500]], tile=(500, 10))
        w, b = db.parameter("W", (64, 10), init="zeros"), db.parameter("b", (10,), init="zeros")
        logits = db.einsum("nc,c->nc", db.einsum("nf,fc->nc", X, w), b, join="x0 + x1")
        db.train(cross_entropy(db, logits, Y, 1500), [w, b], Adam(lr=0.05), 40, run="py", progress=False)
        expected = ((x[1500:] @ db.tensor("W").numpy() + db.tensor("b").numpy()).argmax(axis=1) == y[1500:]).mean()
    assert accuracy > 0.85 and abs(accuracy - expected) <= 0.005
    with tra_sql.connect(str(tmp_path / "d.duckdb")) as db:
        assert db.sql("SELECT count(*) FROM tra_run_log WHERE run = 'digits'").fetchall() == [(40,)]
    again = cli("d.duckdb", "-f", str(EXAMPLES / "digits.sql"), cwd=tmp_path)  # the run is complete: resumed
    assert again.returncode == 0, again.stderr
    assert float(re.search(r"test_accuracy.*?(\d\.\d+)", again.stdout, re.S).group(1)) == accuracy


def test_parameter_and_train_statements_on_spark(tmp_path):
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java")
    with tra_sql.connect(str(tmp_path / "warehouse"), engine="spark", master="local[1]", driver_memory="1g",
                         config={"spark.sql.shuffle.partitions": "1"}) as db:
        db.from_numpy("X", np.arange(6.0).reshape(3, 2))
        db.sql("CREATE PARAMETER w WITH (shape := [2], init := 'zeros')")
        rows = db.sql("""TRAIN einsum('nf,f->', X, w, "join" => 'pow(x0 * x1 - 1, 2)') PARAMETERS w
                         WITH (optimizer := 'sgd', lr := 0.01, epochs := 3, run := 'r')""").collect()
        assert [(r["epoch"], r["loss"]) for r in rows][0] == (0, 6.0) and rows[2]["loss"] < rows[1]["loss"] < 6
        with pytest.raises(SQLError, match="DuckDB's catalog"):
            db.sql("CREATE TENSOR VIEW v AS SELECT * FROM X")
