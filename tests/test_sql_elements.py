"""tra_from_elements' rules (dtype from the value column, NULL values and repeated indices
refused unless asked for) and plan.explain('svg') with and without Graphviz on PATH."""

import os
import shutil

import numpy as np
import pytest

import tra_sql
from tra_sql.errors import SpecError, SQLError


@pytest.fixture
def db():
    with tra_sql.connect() as session:
        session.sql("CREATE TABLE e (i INTEGER, v REAL); "
                    "INSERT INTO e VALUES (0, 1.5), (0, 2.0), (1, NULL), (2, 3.25)")
        yield session


def test_float_column_keeps_float32_other_columns_float64(db):
    db.sql("CREATE TABLE src (i INTEGER, v FLOAT, d DOUBLE, n INTEGER); INSERT INTO src VALUES (0, 0.1, 0.1, 3)")
    db.sql("CREATE TENSOR F AS SELECT * FROM tra_from_elements((SELECT i, v FROM src), shape => [2]);"
           "CREATE TENSOR D AS SELECT * FROM tra_from_elements((SELECT i, d FROM src), shape => [2]);"
           "CREATE TENSOR N AS SELECT * FROM tra_from_elements((SELECT i, n FROM src), shape => [2]);"
           "CREATE TENSOR G AS SELECT * FROM tra_from_elements((SELECT i, v FROM src), shape => [2], "
           "dtype => 'float64')")
    assert db.tensor("F").dtype == np.float32 and db.tensor("F").numpy()[0] == np.float32(0.1)
    assert db.tensor("D").dtype == np.float64 and db.tensor("N").dtype == np.float64
    assert db.tensor("G").dtype == np.float64


def test_null_value_is_refused_naming_the_element(db):
    with pytest.raises(SQLError, match=r"element \(1,\) has a NULL value.*nulls => 'skip'"):
        db.sql("CREATE TENSOR T AS SELECT * FROM tra_from_elements((SELECT * FROM e WHERE i > 0), shape => [3])")
    assert "T" not in db.tensors()
    db.sql("CREATE TENSOR T AS SELECT * FROM tra_from_elements((SELECT * FROM e WHERE i > 0), shape => [3], "
           "nulls => 'skip')")
    np.testing.assert_array_equal(db.tensor("T").numpy(), [0, 0, 3.25])


def test_repeated_index_is_refused_unless_summed(db):
    with pytest.raises(SQLError, match=r"element \(0,\) is given 2 times.*duplicates => 'sum'"):
        db.sql("CREATE TENSOR T AS SELECT * FROM tra_from_elements(e, shape => [3], nulls => 'skip')")
    assert "T" not in db.tensors()
    db.sql("CREATE TENSOR T AS SELECT * FROM tra_from_elements(e, shape => [3], tile => [2], nulls => 'skip', "
           "duplicates => 'sum')")
    assert db.tensor("T").dtype == np.float32
    np.testing.assert_array_equal(db.tensor("T").numpy(), [3.5, 0, 3.25])


def test_repeated_index_in_a_matrix_names_it(db):
    with pytest.raises(SQLError, match=r"element \(1, 2\) is given 3 times"):
        db.sql("CREATE TENSOR M AS SELECT * FROM tra_from_elements("
               "(VALUES (0, 0, 1.0), (1, 2, 1.0), (1, 2, 2.0), (1, 2, 3.0)), "
               "shape => [2, 3], tile => [1, 2])")


@pytest.mark.parametrize("option", ["nulls => 'drop'", "duplicates => 'max'", "nulls => 1"])
def test_bad_options(db, option):
    with pytest.raises(SpecError, match=option.split()[0]):
        db.sql(f"SELECT * FROM tra_from_elements(e, shape => [3], {option})")


def test_wrong_column_count(db):
    with pytest.raises(SQLError, match="rows of 3 columns .* got 2: i, v"):
        db.sql("SELECT * FROM tra_from_elements(e, shape => [3, 3])")


def _plan(db):
    A = db.from_numpy("A", np.ones((4, 4)), tile=(2, 2))
    return db.plan(db.einsum("ij,jk->ik", A, A), workers=2, memory="1GB")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_svg_with_graphviz_on_path(db, tmp_path, monkeypatch):
    (tmp_path / "dot").symlink_to(shutil.which("dot"))
    monkeypatch.setenv("PATH", str(tmp_path))
    svg = _plan(db).explain("svg")
    assert svg.lstrip().startswith(("<?xml", "<svg", "<!DOCTYPE")) and "</svg>" in svg


def test_svg_without_graphviz_says_what_to_install(db, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("dot") is None and os.environ["PATH"] == str(tmp_path)
    with pytest.raises(tra_sql.TraError, match="install Graphviz"):
        _plan(db).explain("svg")
