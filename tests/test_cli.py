"""The ``tra-sql`` command: -c, -f, the prompt fed through stdin, and the example programs."""

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest

import tra_sql
from tra_sql import cli

EXAMPLES = Path(__file__).resolve().parent.parent / "sql" / "examples"


def tra_sql_command() -> list[str]:
    """The installed ``tra-sql`` script (next to this Python), or the module as a fallback."""
    script = Path(sys.executable).parent / "tra-sql"
    found = str(script) if script.exists() else shutil.which("tra-sql")
    return [found] if found else [sys.executable, "-m", "tra_sql.cli"]


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*tra_sql_command(), *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_command_line_sql(tmp_path):
    db = tmp_path / "t.db"
    done = run(str(db), "-c", """
        CREATE TENSOR A AS SELECT * FROM tra_from_elements((VALUES (0, 0, 1.0), (1, 1, 2.0)), shape => [2, 2]);
        CREATE TENSOR C AS SELECT * FROM einsum('ij,jk->ik', A, A);
        SELECT i0, i1, value FROM tra_elements(C) WHERE value <> 0 ORDER BY ALL;""")
    assert done.returncode == 0, done.stderr
    assert "4.0" in done.stdout and "i0" in done.stdout
    with tra_sql.connect(str(db)) as session:
        np.testing.assert_array_equal(session.tensor("C").numpy(), [[1, 0], [0, 4]])


def test_error_exits_non_zero_with_one_line():
    done = run("-c", "SELECT 1 AS first; SELECT * FROM einsum('ij->i', missing); SELECT 3 AS third;")
    assert done.returncode == 1
    assert "first" in done.stdout and "third" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: statement 2")
    assert "no tensor named 'missing'" in lines[0] and "einsum('ij->i', missing)" in lines[0]


def test_missing_file():
    done = run("-f", "/nonexistent/x.sql")
    assert done.returncode == 1 and done.stderr.startswith("Error: cannot read")


def test_prompt_through_stdin():
    script = """CREATE TENSOR X AS SELECT * FROM
    tra_random(shape => [3, 2], tile => [2, 2], seed => 4);
.tensors
SELECT count(*) AS n
  FROM tra_elements(X);
EXPLAIN SELECT * FROM einsum('ij->j', X);
SELECT * FROM einsum('ij->k', X);
SELECT 'still; running' AS s;
"""
    done = run(stdin=script)
    assert done.returncode == 1  # a piped statement failed; the rest still ran
    assert "tile_shape" in done.stdout and "│ X " in done.stdout
    assert re.search(r"│\s+6\s+│", done.stdout)
    assert "TRA_LOOP_1(" in done.stdout.upper() and "FROM (" in done.stdout  # the kernel DuckDB runs
    assert "still; running" in done.stdout
    assert done.stderr.count("Error:") == 1 and "output index 'k'" in done.stderr


def test_in_process_prompt_and_quit(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("SELECT 40 +\n 2 AS x;\n.quit\nSELECT 1/0;\n"))
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "42" in out


def test_output_closed_early_exits_quietly():
    """``tra-sql -c ... | head``: the reader goes away; no BrokenPipeError traceback."""
    command = subprocess.Popen([*tra_sql_command(), "-c", "SELECT 1 AS x;" * 3000],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert command.stdout.read(10)
    command.stdout.close()
    assert command.wait(timeout=120) == cli.BROKEN_PIPE
    assert command.stderr.read() == b""
    command.stderr.close()


def prompt(lines: str) -> tuple[int, str, str]:
    """Feed ``lines`` to the prompt as piped stdin: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with tra_sql.connect() as session, patch("sys.stdin", io.StringIO(lines)):
        status = cli.repl(session, out, err, interactive=False)
    return status, out.getvalue(), err.getvalue()


def test_command_inside_an_unfinished_statement_runs_at_once():
    """As psql's backslash commands: the command runs, the statement goes on (was glued onto it)."""
    status, out, err = prompt("SELECT 40 +\n.tensors\n  .help\n2 AS x;\nSELECT\n.5 AS half;\n")
    assert (status, err) == (0, "")
    assert out.index("tile_shape") < out.index("Commands:") < out.index("42") < out.index(".5")
    status, out, err = prompt("SELECT 1 +\n.tensors extra\n1 AS two;\n")
    assert status == 1 and err == "Error: .tensors takes no arguments, got extra\n" and "2" in out


def test_quit_inside_an_unfinished_statement_drops_it():
    status, out, err = prompt("SELECT 1/0,\n.quit\nSELECT 7 AS seven;\n")
    assert (status, out, err) == (0, "", "")


def test_error_while_printing_names_statement(capsys):
    assert cli.main(["-c", "SELECT * FROM tra_elements(tra_from_elements((SELECT 9, 1.0), shape => [2]));"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: statement 1") and "element (9,) is outside the shape (2,)" in err


# digits.sql reads CSV files: tests/test_sql_training.py writes them and runs it
@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.sql") if p.name != "digits.sql"))
def test_examples_run(example, tmp_path):
    db = tmp_path / "ex.db"
    done = run(str(db), "-f", str(EXAMPLES / example))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    with tra_sql.connect(str(db)) as session:
        check = CHECKS.get(example)
        if check:
            check(session, done.stdout)


def check_matmul(db, out):
    a = db.tensor("A").numpy()
    np.testing.assert_array_equal(db.tensor("C").numpy(), a @ db.tensor("B").numpy())
    assert "12.0" in out


def check_mlp(db, out):
    t = {name: db.tensor(name).numpy() for name in ("X", "W1", "b1", "W2", "Y")}
    h = np.maximum(t["X"] @ t["W1"] + t["b1"], 0)
    np.testing.assert_allclose(t["Y"], h @ t["W2"])
    assert f"{t['Y'].max(axis=1)[0]:.4f}" in out


def check_graph(db, out):
    lines = [line for line in out.splitlines() if "cy" in line]
    assert "3.0" in lines[0] and "7.0" in lines[1]


CHECKS = {"matmul.sql": check_matmul, "mlp.sql": check_mlp, "graph.sql": check_graph}
