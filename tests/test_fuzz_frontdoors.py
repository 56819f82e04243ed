"""The front doors, fuzzed: einsum specs, ``join=`` expressions, the tensor SQL and the CLI.

Every input ends in a correct result or a ``TraError`` that names the culprit: no other
exception, no hang, no crash, and a failed statement leaves the database as it was. The
oracles: ``numpy.einsum`` for specs; DuckDB itself for join expressions (they are SQL and
evaluate as DuckDB does, ``udfs/expr.py``); a model of the stored tensors (NumPy arrays)
for SQL statements. The example tests after each fuzzer are the bugs it found.
"""

from __future__ import annotations

import io
import math
import string
from contextlib import contextmanager

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import tra_sql
from tra_sql import cli
from tra_sql.udfs.expr import join_code

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -- join expressions: translated code against DuckDB evaluating the same SQL ---------------------------
def kernel(code: str, n: int = 2):
    """The join ``code`` compiled as a loop kernel writes it (``v = code`` into a float64 out,
    ``math`` and ``np`` in scope; see ``udfs/codegen.py``), without the disk cache."""
    names = ", ".join(f"X{m}" for m in range(n))
    reads = "".join(f"        x{m} = X{m}[i]\n" for m in range(n))
    source = f"def k(out, {names}):\n    for i in range(out.shape[0]):\n{reads}        out[i] = {code}\n"
    scope: dict = {}
    exec(source, {"math": math, "np": np, "numba": numba}, scope)
    return numba.njit(scope["k"])


def evaluate(join: str, *columns) -> np.ndarray:
    columns = [np.asarray(c) for c in columns]
    out = np.zeros(len(columns[0]))
    kernel(join_code(join, len(columns)), len(columns))(out, *columns)
    return out


def same(got, expected) -> bool:
    """Equal as floats, NaN equal to NaN, infinities exact, others to 1e-9."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return bool(np.all(np.isclose(got, expected, rtol=1e-9, atol=1e-300, equal_nan=True)))


@pytest.mark.parametrize("join, x0, x1, expected", [
    ("x0 % x1", [7.5, -7.5, 7.0], [2.0, 2.0, -2.0], [1.5, -1.5, 1.0]),  # math.fmod: no such function in Numba
    ("x0 / x1", [1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [np.inf, -np.inf, np.nan]),  # raised ZeroDivisionError
    ("x0 // x1", [-7.0, 7.0, 1.0], [2.0, 2.0, 0.0], [-3.0, 3.0, np.inf]),  # floored, and raised on 0
    ("x0 % x1", [1.0], [0.0], [np.nan]),
    ("x0 + 1e400", [1.0], [0.0], [np.inf]),  # the literal became the undefined name 'inf'
    ("x0 + 99999999999999999999999", [0.0], [0.0], [1e23]),  # too large for an int64 literal
    ("x0 AND x1", [2.0, 0.0], [3.0, 3.0], [1.0, 0.0]),  # Python's `and` gave the operand, 3
    ("x0 OR x1", [0.0, 0.0], [3.0, 0.0], [1.0, 0.0]),
    ("NOT x0", [np.nan, 0.0], [0.0, 0.0], [0.0, 1.0]),  # NaN is true
    ("CASE WHEN x0 THEN 1 ELSE 2 END", [np.nan, 0.0], [0.0, 0.0], [1.0, 2.0]),
    ("greatest(x0, x1)", [1.0, np.nan], [np.nan, 1.0], [np.nan, np.nan]),  # max() depended on the order
    ("least(x0, x1)", [1.0, np.nan], [np.nan, 1.0], [1.0, 1.0]),
    ("floor(x0) + ceil(x1)", [np.inf, 1.5], [-np.inf, 1.5], [np.nan, 3.0]),  # int64 garbage for inf
    ("round(x0)", [4503599627370497.0, 2.5, -2.5], [0.0] * 3, [4503599627370497.0, 3.0, -3.0]),
    ("x0 > x1", [np.nan, 1.0, np.nan], [1.0, np.nan, np.nan], [1.0, 0.0, 0.0]),  # NaN above every number
    ("x0 = x1", [np.nan, np.nan], [np.nan, 1.0], [1.0, 0.0]),
    ("x0 <> x1", [np.nan, np.nan], [np.nan, 1.0], [0.0, 1.0]),
    ("x0 <= x1", [1.0, np.nan], [np.nan, 1.0], [1.0, 0.0]),
    ("CAST(x0 AS FLOAT)", [0.1], [0.0], [np.float32(0.1)]),  # was float64
    ("pow(x0, x1)", [0.0, -8.0], [-1.0, 1 / 3], [np.inf, np.nan]),
    ("log(x0, x1)", [1.0], [8.0], [np.inf]),  # log(1) = 0 as a base raised ZeroDivisionError
])
def test_join_semantics_are_duckdb_s(join, x0, x1, expected):
    assert same(evaluate(join, x0, x1), expected), (join, evaluate(join, x0, x1))


def test_join_on_integers_divides_in_floats(db):
    X = db.from_numpy("X", np.array([2, -7, 0], dtype=np.int64))
    got = db.einsum("i,i->i", X, X, join="x0 ** -1 + x0 // 2 + x0 % 2").numpy()  # int ** -1 was 0
    np.testing.assert_array_equal(got[:2], [0.5 + 1 + 0, -1 / 7 - 3 - 1])
    assert np.isinf(got[2])


@pytest.mark.parametrize("join", ["x00", "x01 + x0", "x0 + x0001"])
def test_operand_names_are_exact(db, join):
    A = db.from_numpy("A", np.ones(2))
    with pytest.raises(tra_sql.SpecError, match="unknown name 'x0"):  # x00 passed, then Numba's NameError
        db.einsum("i,i->i", A, A, join=join)


@pytest.mark.parametrize("join, message", [
    ("(" * 400 + "x0" + ")" * 400, "nested too deeply"),  # RecursionError
    ("'abc", "does not parse"),  # sqlglot's TokenError
])
def test_join_errors_are_spec_errors(db, join, message):
    A = db.from_numpy("A", np.ones(2))
    with pytest.raises(tra_sql.SpecError, match=message):
        db.einsum("i->i", A, join=join)


def test_join_in_sql_runs_in_the_kernel(db):
    db.from_numpy("A", np.array([[4.0, -3.0], [1.0, 0.0]]), tile=(1, 2))
    rows = db.execute("""SELECT value FROM tra_elements(einsum('ij,ij->ij', A, A,
                         "join" => 'x0 % 3 + greatest(x0, 0) - least(x0 / 0, 1)')) ORDER BY i0, i1""").fetchall()
    assert [r[0] for r in rows] == [4.0, np.inf, 1.0, -1.0]


# -- einsum specs -------------------------------------------------------------------------------------
def test_broadcasting_beyond_the_letters_is_a_shape_error():
    from tra_sql.einsum import broadcast, parse_spec

    spec = parse_spec(string.ascii_letters + ",a", 2)
    with pytest.raises(tra_sql.ShapeError, match="index letters"):  # was a bare StopIteration
        broadcast(spec, [(2,) * 52, (1,)], ["A", "B"])


def test_ellipsis_wider_than_the_free_letters(db):
    ones = ", ".join(["1"] * 60)
    with pytest.raises(tra_sql.ShapeError, match=r"'\.\.\.' stands for 59 dimensions"):  # was a rank mismatch
        db.sql(f"SELECT * FROM einsum('...a->a', tra_random(shape => [{ones}]))")


# -- the SQL front end --------------------------------------------------------------------------------
@pytest.mark.parametrize("sql, error, fragment", [
    ("SELECT * FROM tra_random(shape => [5], dtype => 'foo')", tra_sql.DTypeError, "dtype 'foo'"),  # TypeError
    ("SELECT * FROM einsum('i->i', tra_random([2]), \"join\" => '" + "(" * 300 + "x0" + ")" * 300 + "')",
     tra_sql.SpecError, "nested too deeply"),  # RecursionError
    ("SELECT * FROM tra_random([2]) WHERE k0 = " + "(" * 300 + "0" + ")" * 300, tra_sql.SQLError,
     "nested too deeply"),
    ("SELECT * FROM tra_from_elements((SELECT 1, 1e300), shape => [3], dtype => 'int32')", tra_sql.DTypeError,
     r"value 1e\+300 is not a whole number that int32 holds"),  # was a garbage integer
    ("SELECT * FROM tra_from_elements((SELECT 0, 'nan'::DOUBLE), shape => [3], dtype => 'int64')",
     tra_sql.DTypeError, "value nan"),
    ("SELECT * FROM tra_from_elements((SELECT 0, 2.5), shape => [3], dtype => 'int64')", tra_sql.DTypeError,
     "value 2.5"),  # was truncated to 2
    ("SELECT tra_random_tile('{}', [1])", tra_sql.SpecError, "tra_random_tile\\(\\): meta '\\{\\}'"),  # KeyError
    ("SELECT tra_pack_tile('x', [1], [[1]], [1.0])", tra_sql.SpecError, "tra_pack_tile\\(\\): meta 'x'"),
    ("SELECT tra_random_tile('{\"name\": \"r\", \"dtype\": \"float64\", \"shape\": [4], \"tile\": [2], "
     "\"seed\": 0, \"dist\": \"uniform\"}', [7])", tra_sql.ShapeError, r"tile key \(7,\) is outside"),  # ValueError
])
def test_statement_errors_name_the_culprit(db, sql, error, fragment):
    with pytest.raises(error, match=fragment):
        db.execute(sql).fetchall()


def test_tensor_statements_without_the_catalog_table(db):
    db.from_numpy("v", np.ones(3))
    db.sql("DROP TABLE tra_tensors")
    for sql in ("DROP TENSOR v", "DROP TENSOR IF EXISTS v", "EXPLAIN DROP TENSOR v"):
        with pytest.raises(tra_sql.ExecutionError, match="statement 1 .*tra_tensors"):  # was duckdb's error
            db.sql(sql)
    with pytest.raises(tra_sql.ExecutionError, match="tra_tensors"):
        db.explain_sql("DROP TENSOR v")


# -- the CLI ------------------------------------------------------------------------------------------
def prompt(lines: str, db=None) -> tuple[int, str, str]:
    """Feed ``lines`` to the prompt as piped stdin: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    session = db or tra_sql.connect()
    with _stdin(lines):
        status = cli.repl(session, out, err, interactive=False)
    return status, out.getvalue(), err.getvalue()


@contextmanager
def _stdin(text: str):
    import sys

    saved, sys.stdin = sys.stdin, io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def test_dot_commands_check_their_name_and_arguments():
    status, out, err = prompt(".tensors x\n.foo\n.\n.HELP\n.tensors\nSELECT 42 AS answer;\n.exit\nSELECT 7;\n")
    assert status == 1  # piped: an error line makes the exit status 1, as a failed statement does
    assert err.splitlines() == ["Error: .tensors takes no arguments, got x",
                                "Error: unknown command .foo; the commands are .tensors, .help, .quit, .exit",
                                "Error: unknown command .; the commands are .tensors, .help, .quit, .exit"]
    assert "Commands:" in out and "tile_shape" in out and "42" in out and "7" not in out.split("42")[1]


def test_tensors_command_without_the_catalog_table():
    status, out, err = prompt("DROP TABLE tra_tensors;\n.tensors\nSELECT 5 AS five;\n")  # .tensors crashed the CLI
    assert status == 1 and err.startswith("Error: .tensors: Catalog Error") and "five" in out


def test_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "latin1.sql"
    path.write_bytes("SELECT 'é';".encode("latin-1"))
    assert cli.main(["-f", str(path)]) == 1  # was a UnicodeDecodeError traceback
    assert capsys.readouterr().err == f"Error: cannot read {path}: byte 8 is not UTF-8 text\n"
