"""The front doors, fuzzed: einsum specs, ``join=`` expressions, the tensor SQL and the CLI.

Every input ends in a correct result or a ``TraError`` that names the culprit: no other
exception, no hang, no crash, and a failed statement leaves the database as it was. The
oracles: ``numpy.einsum`` for specs; DuckDB itself for join expressions (they are SQL and
evaluate as DuckDB does, ``udfs/expr.py``); a model of the stored tensors (NumPy arrays)
for SQL statements. The example tests beside each fuzzer pin the bugs it found (and the
semantics it checks).
"""

from __future__ import annotations

import _thread
import io
import itertools
import math
import signal
import string
import threading
from collections import Counter
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from unittest.mock import patch

import duckdb
import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import tra_sql
from tra_sql import cli
from tra_sql.frontend.statements import split_statements, tokenize
from tra_sql.udfs.codegen import namespace
from tra_sql.udfs.expr import join_code

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -- join expressions: translated code against DuckDB evaluating the same SQL ---------------------------
def kernel(code: str, n: int = 2):
    """The join ``code`` compiled as a loop kernel writes it (``v = code`` into a float64 out,
    a kernel module's imports in scope: ``codegen.namespace``), without the disk cache."""
    names = ", ".join(f"X{m}" for m in range(n))
    reads = "".join(f"        x{m} = X{m}[i]\n" for m in range(n))
    source = f"def k(out, {names}):\n    for i in range(out.shape[0]):\n{reads}        out[i] = {code}\n"
    scope: dict = {}
    exec(source, namespace(), scope)
    return numba.njit(scope["k"])


def evaluate(join: str, *columns) -> np.ndarray:
    columns = [np.asarray(c) for c in columns]
    out = np.zeros(len(columns[0]))
    kernel(join_code(join, len(columns)), len(columns))(out, *columns)
    return out


def same(got, expected, rtol: float = 1e-9) -> bool:
    """Equal as floats, NaN equal to NaN, infinities exact, others to ``rtol``."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return bool(np.all(np.isclose(got, expected, rtol=rtol, atol=1e-300, equal_nan=True)))



UNARY = ["exp", "ln", "log", "sqrt", "abs", "tanh", "sin", "cos", "floor", "ceil", "sign", "round",
         "sigmoid", "relu", "erf"]
ARITHMETIC = ["+", "-", "*", "/", "%", "**", "^"]
COMPARISONS = ["=", "==", "<>", "!=", "<", "<=", ">", ">="]
LITERALS = ["0", "1", "2", "7", "0.5", "3.25", "1e-3", "1e300", "1e400", "4503599627370497", "pi()",
            "'inf'::DOUBLE", "'-inf'::DOUBLE", "'nan'::DOUBLE"]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 7.0, -7.0, 1e-300, 1e300, np.inf, -np.inf, np.nan]
INTS = [0, 1, -1, 2, -2, 3, 7, -7, 100]


@st.composite
def numeric(draw, depth: int = 3) -> tuple[str, str]:
    """A numeric SQL expression over x0, x1 as (tra_sql's text, DuckDB's text). The texts are
    the same but for atoms where tra_sql's documented semantics need other words in DuckDB:
    ``//`` truncates (DuckDB's only does on integers), CASE/IF without ELSE give 0."""
    kind = draw(st.integers(0, 9)) if depth > 0 else 0
    sub = numeric(depth - 1)
    if kind == 0:
        leaf = draw(st.sampled_from(["x0", "x1", *LITERALS]))
        return leaf, leaf
    if kind == 1:
        a = draw(sub)
        return same_text("{}({})", draw(st.sampled_from(UNARY)), a)
    if kind == 2:
        return same_text("{} {} {}", draw(grouped(sub)), draw(st.sampled_from(ARITHMETIC)), draw(grouped(sub)))
    if kind == 3:
        (a, oa), (b, ob) = draw(sub), draw(sub)
        return f"(({a}) // ({b}))", f"trunc(({oa}) / ({ob}))"
    if kind == 4:
        args = draw(st.lists(sub, min_size=2, max_size=3))
        name = draw(st.sampled_from(["greatest", "least"]))
        return tuple(f"{name}({', '.join(a[i] for a in args)})" for i in (0, 1))
    if kind == 5:
        (c, oc), (a, oa) = draw(boolean(depth - 1)), draw(sub)
        if draw(st.booleans()):
            return f"CASE WHEN {c} THEN {a} END", f"CASE WHEN {oc} THEN {oa} ELSE 0 END"
        b, ob = draw(sub)
        return f"CASE WHEN {c} THEN {a} ELSE {b} END", f"CASE WHEN {oc} THEN {oa} ELSE {ob} END"
    if kind == 6:
        (c, oc), (a, oa), (b, ob) = draw(boolean(depth - 1)), draw(sub), draw(sub)
        return f"IF({c}, {a}, {b})", f"IF({oc}, {oa}, {ob})"
    if kind == 7:
        return same_text("-{}", draw(grouped(sub)))
    if kind == 8:
        form = draw(st.sampled_from(["CAST({} AS DOUBLE)", "CAST({} AS FLOAT)", "({})::DOUBLE", "CAST({} AS REAL)"]))
        return same_text(form, draw(sub))
    form = draw(st.sampled_from(["log({}, {})", "pow({}, {})", "power({}, {})"]))
    return same_text(form, draw(sub), draw(sub))


@st.composite
def boolean(draw, depth: int) -> tuple[str, str]:
    kind = draw(st.integers(0, 4)) if depth > 0 else 0
    if kind <= 1:
        op = draw(st.sampled_from(COMPARISONS))
        return same_text("{} {} {}", draw(grouped(numeric(depth - 1))), op, draw(grouped(numeric(depth - 1))))
    if kind == 2:
        op = draw(st.sampled_from(["AND", "OR"]))
        return same_text("{} {} {}", draw(grouped(boolean(depth - 1))), op, draw(grouped(boolean(depth - 1))))
    if kind == 3:
        return same_text("NOT {}", draw(grouped(boolean(depth - 1))))
    return draw(st.sampled_from([("TRUE", "TRUE"), ("FALSE", "FALSE")]) | grouped(numeric(depth - 1)))


def same_text(form: str, *parts) -> tuple[str, str]:
    """``form`` filled with the parts' texts (plain strings are the same in both)."""
    return tuple(form.format(*(p if isinstance(p, str) else p[i] for p in parts)) for i in (0, 1))


def grouped(expression):
    """An operand, in parentheses or not: both texts the same way, so they parse alike
    wherever sqlglot and DuckDB agree on precedence (which this checks too)."""
    return st.tuples(expression, st.booleans()).map(lambda e: same_text("({})", e[0]) if e[1] else e[0])


_ORACLE: list = []


def oracle() -> duckdb.DuckDBPyConnection:
    """DuckDB with tra_sql's extra join functions: sigmoid, relu, erf."""
    if not _ORACLE:
        con = duckdb.connect()
        con.execute("CREATE MACRO sigmoid(x) AS 1.0 / (1.0 + exp(-x)); CREATE MACRO relu(x) AS greatest(x, 0)")
        con.create_function("erf", _erf, [duckdb.sqltypes.DOUBLE], duckdb.sqltypes.DOUBLE, type="arrow")
        _ORACLE.append(con)
    return _ORACLE[0]


def _erf(x):  # an Arrow UDF: a scalar one would hand back NaN as NULL
    import pyarrow as pa

    return pa.array(np.vectorize(math.erf, otypes=[float])(x.to_numpy(zero_copy_only=False)))


def duckdb_values(text: str, x0, x1) -> np.ndarray | None:
    """DuckDB's value of ``text`` per row (NaN for a row where it raises, e.g. ``% 0``; None
    where DuckDB rejects the text itself, e.g. a boolean added to a number)."""
    import pyarrow as pa

    con = oracle()
    con.register("xs", pa.table({"i": np.arange(len(x0)), "x0": x0, "x1": x1}))
    try:
        rows = con.execute(f"SELECT TRY(CAST(({text}) AS DOUBLE)) FROM xs ORDER BY i").fetchall()
    except duckdb.Error:
        return None
    finally:
        con.unregister("xs")
    return np.array([np.nan if r[0] is None else r[0] for r in rows]), np.array([r[0] is None for r in rows])


@pytest.mark.fuzz
@FUZZ
@given(numeric(depth=4), st.sampled_from(["float64", "int64"]), st.data())
def test_fuzz_join_expressions_evaluate_as_duckdb(expression, dtype, data):
    text, oracle_text = expression
    pool = FLOATS if dtype == "float64" else INTS
    x0, x1 = (np.array(data.draw(st.lists(st.sampled_from(pool), min_size=8, max_size=8)), dtype=dtype)
              for _ in range(2))
    expected = duckdb_values(oracle_text, x0, x1)
    assume(expected is not None)  # DuckDB's binder refuses it: no reference
    values, raised = expected
    got = evaluate(text, x0, x1)  # SpecError here: tra_sql refuses what DuckDB evaluates
    rtol = 1e-6 if "FLOAT" in text or "REAL" in text else 1e-9  # DuckDB goes on in float32 after such a cast
    if any(op in text for op in ("/", "log(", "**", "^", "pow")):  # a zero's sign is not kept as DuckDB's
        # integers keep it, which shows only as the sign of x / ±0 or ±0 ** -1
        got, values = (np.where(np.isinf(got) & np.isinf(values), np.abs(a), a) for a in (got, values))
    assert same(got[~raised], values[~raised], rtol), (text, x0, x1, got, values)



JUNK = list("()+-*/%,'\";:=<>!|&^~[]{} .0123456789exX") + [
    "x0", "x1", "x2", "x9", "xx", "y", "CASE", "WHEN", "THEN", "ELSE", "END", "AND", "OR", "NOT", "NULL", "IS",
    "IN", "BETWEEN", "::", "CAST", "AS", "INT", "DOUBLE", "VARCHAR", "(", ")", "sqrt(", "greatest(", "log(", "1e999",
    "'nan'", "SELECT", "FROM", "->", "**", "//", "$1", "?", "--", "/*", "\\", "\x00", "é",
]


@st.composite
def mutated(draw, text: str, edits: int = 4) -> str:
    """``text`` after a few deletions, insertions, duplications and swaps."""
    for _ in range(draw(st.integers(1, edits))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 8)))
        edit = draw(st.sampled_from(["delete", "insert", "duplicate", "swap"]))
        if edit == "delete":
            text = text[:i] + text[j:]
        elif edit == "insert":
            text = text[:i] + draw(st.sampled_from(JUNK)) + text[i:]
        elif edit == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        elif j > i:
            text = text[:i] + text[j:] + text[i:j]
    return text


@pytest.mark.fuzz
@FUZZ
@given(st.data())
def test_fuzz_broken_join_text_is_a_spec_error_or_runs(data):
    text = data.draw(numeric(depth=3).flatmap(lambda e: mutated(e[0])))
    try:
        code = join_code(text, 2)
    except tra_sql.SpecError as err:
        assert repr(text) in str(err) or "join expression" in str(err)
        event("SpecError")
        return
    event("compiled and ran")
    x = np.array(FLOATS)
    out = np.zeros(len(x))
    kernel(code)(out, x, x[::-1].copy())  # compiles (Numba) and runs without raising


@pytest.mark.parametrize("join, x0, x1, expected", [
    ("x0 % x1", [7.5, -7.5, 7.0], [2.0, 2.0, -2.0], [1.5, -1.5, 1.0]),  # math.fmod: no such function in Numba
    ("x0 / x1", [1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [np.inf, -np.inf, np.nan]),  # raised ZeroDivisionError
    ("x0 // x1", [-7.0, 7.0, 1.0], [2.0, 2.0, 0.0], [-3.0, 3.0, np.inf]),  # floored, and raised on 0
    ("x0 % x1", [1.0], [0.0], [np.nan]),
    ("x0 + 1e400", [1.0], [0.0], [np.inf]),  # the literal became the undefined name 'inf'
    ("x0 + 99999999999999999999999", [0.0], [0.0], [1e23]),  # too large for an int64 literal
    ("x0 + 4503599627370497 * 4503599627370497 * 0", [1.0], [0.0], [1.0]),  # Numba folded it: no compile
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
    ("exp(CAST(x0 AS FLOAT))", [1.0], [0.0], [np.e]),  # DuckDB's exp is float64's
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


def test_a_zero_remainder_has_duckdb_s_sign():
    """An integer % gives +0 as DuckDB's integer result does (fmod gave -0: found by the fuzzer
    as ``x0 // log(1, x0 / (x0 % x0))``, 0 against NaN); a float remainder keeps fmod's sign."""
    ints, floats = np.array([-4, 4]), np.array([-4.0, 4.0])
    assert list(evaluate("1 / (x0 % x1)", ints, np.array([2, 2]))) == [np.inf, np.inf]
    assert list(evaluate("1 / (x0 % x1)", floats, np.array([2.0, 2.0]))) == [-np.inf, np.inf]
    for x0, x1 in ((ints, ints), (floats, floats)):
        assert same(evaluate("1 / (x0 % x1)", x0, x1), duckdb_values("1 / (x0 % x1)", x0, x1)[0])


@pytest.mark.parametrize("join", ["x00", "x01 + x0", "x0 + x0001"])
def test_operand_names_are_exact(db, join):
    A = db.from_numpy("A", np.ones(2))
    with pytest.raises(tra_sql.SpecError, match="unknown name 'x0"):  # x00 passed, then Numba's NameError
        db.einsum("i,i->i", A, A, join=join)


@pytest.mark.parametrize("join, message", [
    ("(" * 400 + "x0" + ")" * 400, "nested too deeply"),  # RecursionError
    ("'abc", "does not parse"),  # sqlglot's TokenError
    ("CAST(1e+-3 AS DOUBLE)", "'1e' is not a number"),  # ValueError: sqlglot reads 1e as a number
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
SPEC_JUNK = [",", "->", "-", ">", ".", "...", " ", "a", "b", "c", "A", "z", "1", "é", "_", "->->", ",,"]


@st.composite
def einsum_cases(draw):
    """A spec (often valid, sometimes mutated), operand shapes that fit it (or not), tiles, dtype."""
    sizes = {c: draw(st.integers(1, 3)) for c in "abcA"}
    subs = [draw(st.text("abcA", max_size=3)) for _ in range(draw(st.integers(1, 3)))]
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    ellipsis = [draw(st.booleans()) and bool(batch) for _ in subs]
    shapes = [batch[len(batch) - draw(st.integers(0, len(batch))):] if e else () for e in ellipsis]
    shapes = [b + tuple(sizes[c] for c in sub) for b, sub in zip(shapes, subs)]
    subs = ["..." + sub if e else sub for sub, e in zip(subs, ellipsis)]
    spec = ",".join(subs)
    if draw(st.booleans()):
        used = sorted(set("".join(subs)) - {"."})
        spec += "->" + ("..." if any(ellipsis) and draw(st.booleans()) else "") + "".join(
            draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(spec)))
        spec = spec[:i] + draw(st.sampled_from(SPEC_JUNK)) + spec[i + draw(st.integers(0, 1)):]
    if draw(st.integers(0, 9)) == 0:
        shapes = shapes[:-1] if len(shapes) > 1 and draw(st.booleans()) else shapes + [(2,)]
    tiles = [tuple(draw(st.integers(1, n)) for n in shape) for shape in shapes]
    return spec, shapes, tiles, draw(st.sampled_from(["float64", "int64"]))


_SPECS: list = []


def spec_session() -> tra_sql.Session:
    if not _SPECS:
        _SPECS.append(tra_sql.connect())
    return _SPECS[0]


@pytest.mark.fuzz
@FUZZ
@given(einsum_cases())
def test_fuzz_einsum_specs_agree_with_numpy(case):
    spec, shapes, tiles, dtype = case
    rng = np.random.default_rng(len(spec))
    arrays = [rng.integers(-3, 4, shape).astype(dtype) for shape in shapes]
    try:
        expected = np.einsum(spec, *arrays)
    except (ValueError, TypeError):
        expected = None
    db = spec_session()
    operands = [db.from_numpy(f"t{m}", a, tile=t, replace=True) for m, (a, t) in enumerate(zip(arrays, tiles))]
    try:
        got = db.einsum(spec, *operands).numpy()
    except tra_sql.TraError as err:
        if "but no input has one" in str(err):  # numpy reads it as no dimensions; refused on purpose (test_errors)
            return
        assert expected is None, f"numpy computes {spec!r} on {shapes}, tra_sql raised {err!r}"
        assert "einsum" in str(err)
        event(f"both refuse: {type(err).__name__}")
        return
    assert expected is not None, f"numpy refuses {spec!r} on {shapes}, tra_sql computed it"
    np.testing.assert_array_equal(got, expected)
    event("computed, as numpy")



@pytest.mark.parametrize("spec, shapes, error, fragment", [
    ("...->", [(2,)], tra_sql.SpecError, "needs '...'"),  # summed the '...' dimensions away
    ("...a,...a->a", [(2, 3), (3,)], tra_sql.SpecError, "needs '...'"),
    ("ab- >ba", [(2, 2)], tra_sql.SpecError, "space inside"),  # read as 'ab->ba'
    (". ..a->a", [(2, 2)], tra_sql.SpecError, "space inside"),
    ("bb", [(2, 1)], tra_sql.ShapeError, r"repeats index 'b' over sizes \[1, 2\]"),  # broadcast a diagonal
])
def test_specs_numpy_refuses_are_errors(db, spec, shapes, error, fragment):
    operands = [db.from_numpy(f"t{m}", np.ones(shape)) for m, shape in enumerate(shapes)]
    with pytest.raises(ValueError):
        np.einsum(spec, *[np.ones(shape) for shape in shapes])
    with pytest.raises(error, match=fragment):
        db.einsum(spec, *operands)


def test_broadcasting_beyond_the_letters_is_a_shape_error():
    from tra_sql.einsum import broadcast, parse_spec

    spec = parse_spec(string.ascii_letters + ",a", 2)
    with pytest.raises(tra_sql.ShapeError, match="index letters"):  # was a bare StopIteration
        broadcast(spec, [(2,) * 52, (1,)], ["A", "B"])


def test_ellipsis_wider_than_the_free_letters(db):
    ones = ", ".join(["1"] * 60)
    with pytest.raises(tra_sql.ShapeError, match=r"'\.\.\.' stands for 59 dimensions"):  # was a rank mismatch
        db.sql(f"SELECT * FROM einsum('...a->a', tra_random(shape => [{ones}]))")

# -- the SQL front end: statements against a model of the stored tensors ------------------------------
JOINS = {None: None, "x0 * 2": lambda a: a * 2, "abs(x0) + 1": lambda a: np.abs(a) + 1,
         "greatest(x0, 0)": lambda a: np.maximum(a, 0)}
JOINS2 = {None: None, "x0 + x1": np.add, "x0 - 2 * x1": lambda a, b: a - 2 * b, "least(x0, x1)": np.minimum}
AGGS = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}
TOKENS = ["SELECT", "FROM", "WHERE", "TENSOR", "CREATE", "DROP", "OR", "REPLACE", "IF", "NOT", "EXISTS", "AS",
          "EXPLAIN", "ANALYZE", "TABLE", "(", ")", ",", ";", "=>", ":=", "*", "[", "]", "0", "1", "2", "-1", "1.5",
          "4000000000", "2147483648", "99999999999999999999", "NULL", "'ij->i'", "'ij,jk->ik'", "'i->'",
          "'x0 +'", "'x9'", "'max'", "'mean'", "'float32'", "'int32'", "'foo'", "'normal'", "A", "nope",
          "tra_tensors", "einsum", "tra_random", "tra_elements", "tra_from_elements", "grad", "shape", "tile",
          "seed", "dtype", "dist", '"join"', "agg", "jion", "k0", "k9", "'A'", "\"A\"", "t_plain"]
PLAIN = ["SELECT 42 AS answer", "CREATE TABLE IF NOT EXISTS t_plain AS SELECT 1 AS x",
         "INSERT INTO t_plain VALUES (2)", "SELECT count(*) FROM A", "DROP TABLE IF EXISTS t_plain",
         "SELECT k0, length(tile) FROM B ORDER BY ALL"]


class Expr:
    """A tensor in SQL (``sql``) and what it holds: a NumPy value (None: not known), its tile."""

    def __init__(self, sql: str, value: np.ndarray | None, tile: tuple[int, ...]):
        self.sql, self.value, self.tile = sql, value, tile


def reference(subs, out, arrays, join, agg):
    """numpy's value of an extended einsum without repeated indices (numpy.einsum's for a
    sum of products)."""
    if join is None and agg == "sum":
        return np.einsum(",".join(subs) + "->" + out, *arrays)
    letters = list(dict.fromkeys("".join(subs)))
    sizes = {c: n for sub, a in zip(subs, arrays) for c, n in zip(sub, a.shape)}
    views = [np.transpose(a, [sub.index(c) for c in letters if c in sub]).reshape(
             [sizes[c] if c in sub else 1 for c in letters]) for sub, a in zip(subs, arrays)]
    value = np.prod(np.broadcast_arrays(*views), axis=0) if join is None else join(*views)
    value = np.broadcast_to(value, [sizes[c] for c in letters])
    axes = tuple(d for d, c in enumerate(letters) if c not in out)
    value = AGGS[agg](value, axis=axes) if axes else value
    kept = [c for c in letters if c in out]
    return np.transpose(value, [kept.index(c) for c in out])


def random_reference(shape, tile, seed, dist, dtype):
    """tra_random's documented values: each tile drawn from default_rng([seed, *key])."""
    out = np.zeros(shape, dtype=dtype)
    for key in itertools.product(*(range(-(-n // t)) for n, t in zip(shape, tile))):
        region = tuple(slice(k * t, min(k * t + t, n)) for k, n, t in zip(key, shape, tile))
        rng = np.random.default_rng([seed, *key])
        size = tuple(r.stop - r.start for r in region)
        out[region] = rng.standard_normal(size) if dist == "normal" else rng.random(size)
    return out


class Model:
    """The stored tensors as NumPy arrays (None where not known), by lower-cased name."""

    def __init__(self, db):
        self.db, self.tensors = db, {}
        self.sync()

    def sync(self) -> None:
        self.tensors = {}
        try:
            names = self.db.tensors()
        except (tra_sql.TraError, duckdb.Error):  # the catalog table was dropped
            return
        for name in names:
            try:
                tensor = self.db.tensor(name)
                self.tensors[name.lower()] = (name, tensor.numpy(), tensor.tile)
            except tra_sql.TraError:  # too large to hold, or its table was changed by plain SQL
                self.tensors[name.lower()] = (name, None, None)

    def known(self) -> list[str]:
        return [name for name, value, _ in self.tensors.values() if value is not None]


@st.composite
def stored(draw, model: Model, names: list[str] | None = None) -> Expr:
    name = draw(st.sampled_from(names or model.known()))
    _, value, tile = model.tensors[name.lower()]
    spelled = draw(st.sampled_from([name, name.lower(), name.upper(), f"'{name}'", f'"{name}"']))
    return Expr(spelled, value, tile)


@st.composite
def random_call(draw, shape=None) -> Expr:
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3))) if shape is None else shape
    tile = tuple(draw(st.integers(1, n)) for n in shape) if draw(st.booleans()) else None
    seed, dist = draw(st.integers(0, 5)), draw(st.sampled_from(["uniform", "normal"]))
    dtype = draw(st.sampled_from(["float64", "float32"]))
    options = [f"shape => {list(shape)}"] if draw(st.booleans()) else [str(list(shape))]
    options += [f"tile => {list(tile)}"] if tile else []
    options += [f"seed => {seed}", f"dist => '{dist}'", f"dtype => '{dtype}'"]
    tile = tile or tra_sql.graph.default_tile(shape)
    return Expr(f"tra_random({', '.join(options)})", random_reference(shape, tile, seed, dist, dtype), tile)


@st.composite
def elements_call(draw, shape=None) -> Expr:
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3))) if shape is None else shape
    rows = draw(st.lists(st.tuples(*[st.integers(0, n - 1) for n in shape], st.integers(-3, 3)), min_size=1,
                         max_size=5))
    value = np.zeros(shape)
    for *index, v in rows:
        value[tuple(index)] += v
    tile = tuple(draw(st.integers(1, n)) for n in shape)
    values = ", ".join("(" + ", ".join(str(x) for x in row) + ")" for row in rows)
    return Expr(f"tra_from_elements((VALUES {values}), shape => {list(shape)}, tile => {list(tile)}, "
                f"duplicates => 'sum')", value, tile)


@st.composite
def tensor_expr(draw, model: Model, depth: int = 2) -> Expr:
    floats = [n for n in model.known() if model.tensors[n.lower()][1].dtype.kind == "f"]
    kinds = ["stored"] * 3 * bool(model.known()) + ["grad"] * bool(floats) + ["random", "elements"]
    kinds += ["einsum"] * 3 * bool(depth)
    kind = draw(st.sampled_from(kinds))
    if kind == "stored":
        return draw(stored(model))
    if kind == "grad":  # d/dW sum(W * W) = 2 W, W stored (grad follows a stored tensor's identity)
        w = draw(stored(model, floats))
        spec = string.ascii_lowercase[: w.value.ndim] + "->"
        return Expr(f"grad(einsum('{spec}', {w.sql}, \"join\" => 'x0 * x0'), {w.sql})", 2.0 * w.value, w.tile)
    if kind == "random":
        return draw(random_call())
    if kind == "elements":
        return draw(elements_call())
    a = draw(tensor_expr(model, depth - 1))
    letters = string.ascii_lowercase[: a.value.ndim]
    agg = draw(st.sampled_from(list(AGGS)))
    options = [] if agg == "sum" and draw(st.booleans()) else [draw(st.sampled_from([f"agg => '{agg}'",
                                                                                      f"agg := '{agg}'"]))]
    if draw(st.booleans()):  # one operand
        out = "".join(draw(st.permutations(letters))[: draw(st.integers(0, len(letters)))])
        join = draw(st.sampled_from(list(JOINS)))
        operands, subs, fn = [a], [letters], JOINS[join]
    else:  # two: element-wise, or a product over the last index
        product = bool(letters) and draw(st.booleans())
        shape = (a.value.shape[-1], draw(st.integers(1, 3))) if product else a.value.shape
        b = draw(st.one_of(random_call(shape), elements_call(shape)) if shape else random_call(shape))
        subs = [letters, letters[-1] + "z"] if product else [letters, letters]
        used = sorted(set(subs[0] + subs[1]))
        out = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
        join = None if product else draw(st.sampled_from(list(JOINS2)))
        operands, fn = [a, b], JOINS2[join]
    options += [f'"join" => \'{join}\''] if join else []
    spec = ",".join(subs) + "->" + out
    value = reference(subs, out, [o.value for o in operands], fn, agg)
    value = value.astype(np.float64) if join and value.dtype.kind != "f" else value
    sql = f"einsum('{spec}', {', '.join(o.sql for o in operands)}{''.join(', ' + o for o in options)})"
    return Expr(sql, value, None)


@dataclass
class Case:
    """A statement and what it must do: raise ``error``, or succeed, pass ``check`` on its
    rows and leave the tensors ``after``; a ``free`` one may do either (mutated, plain SQL)."""

    sql: str
    check: object = None  # rows -> None, raising AssertionError
    error: type | None = None
    after: dict | None = None  # the model's tensors after it (None: as before)
    free: bool = False


@st.composite
def statement(draw, model: Model) -> Case:
    kind = draw(st.sampled_from(["elements", "create", "create", "drop", "count", "plain", "explain"]))
    if kind == "explain":
        inner = draw(statement(model))
        return Case(f"EXPLAIN {inner.sql}", lambda rows: None if rows else pytest.fail("EXPLAIN gave no rows"),
                    free=True)
    if kind == "plain":
        return Case(draw(st.sampled_from(PLAIN)), free=True)
    if kind == "drop":
        name = draw(st.sampled_from([*model.tensors, "nope"]))
        exists, if_exists = name in model.tensors, draw(st.booleans())
        after = {k: v for k, v in model.tensors.items() if k != name}
        return Case(f"DROP TENSOR {'IF EXISTS ' if if_exists else ''}{name}",
                    error=None if exists or if_exists else tra_sql.UnknownTensorError, after=after)
    expr = draw(tensor_expr(model))
    if kind == "elements":
        return Case(f"SELECT * FROM tra_elements({expr.sql})", check=lambda rows: same_elements(rows, expr.value))
    if kind == "count":
        grid = int(np.prod([-(-n // t) for n, t in zip(expr.value.shape, expr.tile)])) if expr.tile else None
        sql = f"SELECT count(*) FROM {expr.sql}"
        return Case(sql, check=lambda rows: None if grid is None or rows[0][0] <= grid else
                    pytest.fail(f"{rows[0][0]} tiles, grid {grid}"))
    return create(draw, model, expr)


def create(draw, model: Model, expr: Expr) -> Case:
    name = draw(st.sampled_from(["N1", "n2", *model.tensors]))
    replace, if_not_exists = draw(st.booleans()), draw(st.booleans())
    source = expr.sql.strip("'\"") if expr.sql[0] in "'\"" else expr.sql
    where, value = "", expr.value
    if value.ndim and expr.tile and draw(st.booleans()):
        rows = draw(st.integers(0, value.shape[0]))
        where, value = f" WHERE k0 < {-(-rows // expr.tile[0])}", value.copy()
        value[-(-rows // expr.tile[0]) * expr.tile[0]:] = 0
    sql = (f"CREATE {'OR REPLACE ' if replace else ''}TENSOR {'IF NOT EXISTS ' if if_not_exists else ''}{name} "
           f"AS SELECT * FROM {source}{where}")
    exists = name.lower() in model.tensors
    if exists and if_not_exists:
        return Case(sql)
    if exists and not replace:
        return Case(sql, error=tra_sql.SQLError)
    return Case(sql, after={**model.tensors, name.lower(): (name, value, expr.tile)})


def same_elements(rows, value: np.ndarray) -> None:
    got = np.zeros(value.shape)
    for *index, v in rows:
        got[tuple(index)] = v
    np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6)


LIKE = {  # a token's kind (its first character) -> replacements of the same kind: still parses, means wrong
    "'": ["'ij->i'", "'ij,jk->ik'", "'i->'", "'...->...'", "'ij->ij'", "'x0 +'", "'x9'", "'x0 / x1'", "'max'",
          "'mean'", "'float32'", "'int32'", "'foo'", "'normal'", "'A'", "''"],
    "0": ["0", "1", "2", "-1", "1.5", "4000000000", "2147483648", "99999999999999999999", "1e400"],
    "a": ["A", "b", "nope", "tra_tensors", "einsum", "tra_random", "grad", "shape", "tile", "seed", "dtype", "dist",
          "agg", "jion", "k0", "k9", "t_plain", "N1"],
}


@st.composite
def mutated_tokens(draw, sql: str) -> str:
    """``sql`` with a few tokens deleted, duplicated, swapped, or replaced by any token or by
    one of the same kind (a string, a number, a name)."""
    try:
        tokens = [sql[t.start : t.end + 1] for t in tokenize(sql)]
    except tra_sql.SQLError:  # an unterminated string, say
        tokens = sql.split()
    for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):
        i = draw(st.integers(0, max(0, len(tokens) - 1)))
        edit = draw(st.sampled_from(["delete", "duplicate", "replace", "like", "like", "like", "swap"]))
        kind = "'" if tokens and tokens[i][0] == "'" else "0" if tokens and tokens[i][0].isdigit() else "a"
        if not tokens:
            tokens = [draw(st.sampled_from(TOKENS))]
        elif edit == "delete":
            del tokens[i]
        elif edit == "duplicate":
            tokens.insert(i, tokens[i])
        elif edit in ("replace", "like"):
            tokens[i] = draw(st.sampled_from(TOKENS if edit == "replace" or not tokens[i][0].isalnum() and kind == "a"
                                             else LIKE[kind]))
        elif i + 1 < len(tokens):
            tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
    return " ".join(tokens)


def snapshot(db) -> tuple:
    """The catalog's rows, and every table and view with its rows' count and hash."""
    con = db.engine.con
    tables = con.execute("SELECT database_name, schema_name, table_name FROM duckdb_tables() ORDER BY ALL").fetchall()
    contents = [con.execute(f'SELECT count(*), sum(hash(t)) FROM "{d}"."{s}"."{n}" AS t').fetchall()
                for d, s, n in tables]
    views = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal ORDER BY ALL").fetchall()
    return tables, contents, views


class Hang(Exception):
    """A statement ran over its time."""


def _hang(signum, frame):
    raise Hang("the statement ran over its time (Python side)")


@contextmanager
def bounded(db, seconds: float = 60):
    """Fail (a hang) if the statement runs over ``seconds``: DuckDB is interrupted, and Python
    code gets ``Hang`` raised (SIGUSR1: pytest-timeout keeps SIGALRM)."""
    hung: list = []

    def fire():
        hung.append(True)
        db.engine.con.interrupt()
        _thread.interrupt_main(signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, _hang)
    timer = threading.Timer(seconds, fire)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
        assert not hung, f"the statement ran over {seconds} s"


def run_sql(db, sql: str):
    """The statement's rows (None for CREATE/DROP TENSOR), eagerly: a TraError is raised here."""
    with bounded(db):
        result = db.execute(sql)
        return None if result is None else result.fetchall()


STATS: Counter = Counter()  # statements run, by origin and outcome (read by whoever runs the fuzzers long)


@pytest.mark.fuzz
@FUZZ
@given(st.data())
def test_fuzz_sql_statements(data):
    with tra_sql.connect() as db:
        db.from_numpy("A", np.arange(6.0).reshape(3, 2) - 2, tile=(2, 1))
        db.from_numpy("B", np.linspace(-1, 1, 6).reshape(2, 3), tile=(1, 2))
        db.from_numpy("v", np.array([1.0, -2.0, 3.0]), tile=(2,))
        db.from_numpy("I", np.array([[1, -2], [3, 4]], dtype=np.int64), tile=(1, 2))
        model = Model(db)
        for _ in range(data.draw(st.integers(1, 4))):
            case = data.draw(statement(model))
            if data.draw(st.integers(0, 2)) == 0:
                run_mutated(db, model, data.draw(mutated_tokens(case.sql)))
            else:
                run_case(db, model, case)


def run_mutated(db, model: Model, sql: str) -> None:
    """Each statement of a mutated text, as a free case (a TraError for the whole text if it
    does not even split into statements)."""
    try:
        statements = split_statements(sql)
    except tra_sql.TraError:
        statements = [None]
    before = snapshot(db)
    try:
        db.explain_sql(sql)
    except tra_sql.TraError:
        pass
    assert snapshot(db) == before, f"explaining {sql!r} changed the database"
    for statement in statements:
        run_case(db, model, Case(sql if statement is None else statement.text, free=True), "mutated")


def run_case(db, model: Model, case: Case, origin: str = "valid") -> None:
    before = snapshot(db)
    try:
        rows = run_sql(db, case.sql)
    except tra_sql.TraError as err:
        STATS[f"{origin}: {type(err).__name__}"] += 1
        event(f"{origin}: {type(err).__name__}")
        assert snapshot(db) == before, f"{case.sql!r} failed ({err}) and changed the database"
        assert "statement" in str(err) or "SQL" in str(err), err
        assert case.free or case.error is not None and isinstance(err, case.error), f"{case.sql!r}: {err!r}"
        return
    STATS[f"{origin}: ran"] += 1
    event(f"{origin}: ran")
    assert case.error is None, f"{case.sql!r} should raise {case.error.__name__}"
    if case.check is not None:
        case.check(rows)
    if case.sql.startswith("EXPLAIN"):
        assert snapshot(db) == before, f"{case.sql!r} changed the database"
    if case.after is not None:
        assert sorted(n for n, _, _ in case.after.values()) == sorted(db.tensors()), case.sql
        for name, value, _ in case.after.values():
            if value is not None:
                np.testing.assert_allclose(db.tensor(name).numpy(), value, rtol=1e-5, atol=1e-6, err_msg=case.sql)
    model.sync()


# -- the SQL front end: what the fuzzer found --------------------------------------------------------
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


def test_tensor_functions_under_a_join_that_needs_every_tile(db):
    db.from_numpy("v", np.array([1.0, 2.0, 3.0]), tile=(2,))
    rows = db.execute("""SELECT i0, value FROM tra_elements(einsum('i,i->i', v,
                         tra_from_elements((VALUES (1, 5.0)), shape => [3], tile => [2]), "join" => 'x0 + x1'))
                         ORDER BY i0""").fetchall()  # completing the operand read a table named after it
    assert rows == [(0, 1.0), (1, 7.0), (2, 3.0)]
    random = db.execute("SELECT * FROM tra_elements(einsum('i->', tra_random([3], seed => 2), "
                        "\"join\" => 'x0 - 1', agg => 'max'))").fetchall()
    assert -1 < random[0][0] < 0


def test_tensor_statements_without_the_catalog_table(db):
    db.from_numpy("v", np.ones(3))
    db.sql("DROP TABLE tra_tensors")
    for sql in ("DROP TENSOR v", "DROP TENSOR IF EXISTS v", "EXPLAIN DROP TENSOR v"):
        with pytest.raises(tra_sql.ExecutionError, match="statement 1 .*tra_tensors"):  # was duckdb's error
            db.sql(sql)
    with pytest.raises(tra_sql.ExecutionError, match="tra_tensors"):
        db.explain_sql("DROP TENSOR v")


# -- the CLI ------------------------------------------------------------------------------------------
def prompt(lines: str) -> tuple[int, str, str]:
    """Feed ``lines`` to the prompt as piped stdin: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with tra_sql.connect() as session, patch("sys.stdin", io.StringIO(lines)):
        status = cli.repl(session, out, err, interactive=False)
    return status, out.getvalue(), err.getvalue()


def test_dot_commands_check_their_name_and_arguments():
    status, out, err = prompt(".tensors x\n.foo\n.\n.HELP\n.tensors\nSELECT 42 AS answer;\n.exit\nSELECT 7;\n")
    assert status == 1  # piped: an error line makes the exit status 1, as a failed statement does
    assert err.splitlines() == ["Error: .tensors takes no arguments, got x",
                                "Error: unknown command .foo; the commands are .tensors, .views, .runs, .help, "
                                ".quit, .exit",
                                "Error: unknown command .; the commands are .tensors, .views, .runs, .help, .quit, "
                                ".exit"]
    assert "Commands:" in out and "tile_shape" in out and "42" in out and "7" not in out.split("42")[1]


def test_tensors_command_without_the_catalog_table():
    status, out, err = prompt("DROP TABLE tra_tensors;\n.tensors\nSELECT 5 AS five;\n")  # .tensors crashed the CLI
    assert status == 1 and err.startswith("Error: .tensors: Catalog Error") and "five" in out


def test_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "latin1.sql"
    path.write_bytes("SELECT 'é';".encode("latin-1"))
    assert cli.main(["-f", str(path)]) == 1  # was a UnicodeDecodeError traceback
    assert capsys.readouterr().err == f"Error: cannot read {path}: byte 8 is not UTF-8 text\n"


DOT = [".tensors", ".help", ".quit", ".exit", ".TENSORS", ".Help", ".foo", ".", "..", ".tensors extra", ".help me",
       "  .tensors  ", ".quit now", ".tables", ".tensors;", ". tensors"]
LINES = ["SELECT 1 AS one;", "SELECT 'a;b' AS s;", "SELECT", "1 AS two;", "-- a comment", "/* c */ SELECT 3;",
         "'unterminated", ";", "", "   ", "CREATE TENSOR X AS SELECT * FROM tra_random([2]);", "DROP TENSOR X;",
         "EXPLAIN SELECT * FROM einsum('i->', tra_random([2]));", "SELECT * FROM einsum('i->', nope);",
         "DROP TABLE tra_tensors;", ".5;", "SELECT 1; SELECT 2;", "SELECT * FROM tra_elements(X);",
         "SELECT count(*) FROM tra_random(shape => [4000000000]);", "EXPLAIN", "EXPLAIN ANALYZE SELECT 1;"]


@pytest.mark.fuzz
@FUZZ
@given(st.lists(st.sampled_from(DOT + LINES) | st.sampled_from(LINES).flatmap(mutated_tokens), max_size=7))
def test_fuzz_cli_prompt_and_dot_commands(lines):
    status, _, err = prompt("\n".join(lines) + "\n")
    errors = err.splitlines()
    assert all(line.startswith("Error: ") for line in errors), errors  # one line each, never a traceback
    assert status == (1 if errors else 0)
    event(f"{len(errors)} error line(s)")


@pytest.mark.fuzz
@FUZZ
@given(st.lists(st.sampled_from(LINES) | st.sampled_from(LINES).flatmap(mutated_tokens), min_size=1, max_size=4))
def test_fuzz_cli_command_line(lines):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = cli.main(["-c", "\n".join(lines)])
    errors = err.getvalue().splitlines()
    assert status == (1 if errors else 0) and len(errors) <= 1, errors  # -c stops at the first error
    assert all(line.startswith("Error: ") for line in errors), errors
