"""An optimizer's per-step scalars as parameters of a Spark training step's query
(``backends.spark_parameters``), built without Spark; Spark's answers after several Adam steps
(each step binding new scalars) are compared with DuckDB's in ``test_spark.py``."""

import re

import pytest
from sqlglot import parse_one
from test_spark_siblings import adam_step

import tra_sql
from tra_sql.backends.spark_parameters import scalar_parameters
from tra_sql.backends.spark_sql import SparkDialect

SCALARS = frozenset({"r__step_size", "r__inv_bc2"})


@pytest.mark.parametrize("merged", [False, True])
def test_adams_scalars_are_parameters_not_tables(merged):
    """Each update's joins of the step size and bias correction are gone (no table to read),
    the kernels read the parameters instead; the steps are otherwise those without."""
    with tra_sql.connect() as db:
        program, results = adam_step(db)
        complete = db.engine.completeness() if merged else None
        dialect = SparkDialect(replicate=1 << 20)
        tables, parameters = dialect.union_steps(program, results, complete), \
            dialect.union_steps(program, results, complete, SCALARS)
    assert parameters.parameters == SCALARS and tables.parameters == frozenset()
    text = parameters.text()
    assert not re.search(r"`r__(step_size|inv_bc2)`", text) and re.search(r"`r__(step_size|inv_bc2)`", tables.text())
    assert len(re.findall(r":tra_r__step_size\b", text)) == len(re.findall(r"`r__step_size`", tables.text())) == 2
    assert len(re.findall(r":tra_r__inv_bc2\b", text)) == 2
    assert len(re.findall(r" ON TRUE", tables.text())) - len(re.findall(r" ON TRUE", text)) == 4
    assert parameters.kernels == tables.kernels and len(parameters.views) == len(tables.views)


def test_a_scalar_read_otherwise_stays_a_table():
    """A scalar in ``FROM``, or joined on a condition, or whose select reads more than its
    tile, is left as a table read."""
    for sql in ("SELECT f(s.tile, x.tile) FROM s JOIN x ON TRUE",
                "SELECT f(x.tile, s.tile) FROM x JOIN s ON s.k0 = x.k0",
                "SELECT f(x.tile, s.tile, s.k0) FROM x JOIN s ON TRUE",
                "SELECT f(x.tile, s.tile) FROM x LEFT JOIN s ON TRUE"):
        query = parse_one(sql, read="spark")
        assert scalar_parameters(query, {"s"}) == set()
        assert query.sql("spark") == parse_one(sql, read="spark").sql("spark")
    query = parse_one("SELECT f(x.tile, s.tile) FROM x JOIN s ON TRUE", read="spark")
    assert scalar_parameters(query, {"s"}) == {"s"}
    assert query.sql("spark") == "SELECT F(x.tile, :tra_s) FROM x"


def test_the_results_of_the_step_before_are_read_through_input_views():
    """The stored tables named as inputs (a step's parameters and optimizer state) are read
    through views of the step's own (``Steps.inputs``), which ``text`` defines over the tables;
    ``renamed`` gives every view, input or step, another name, and changes nothing else."""
    with tra_sql.connect() as db:
        program, results = adam_step(db)
        inputs = frozenset({"w", "b", "r__m__w", "r__v__w"})
        steps = SparkDialect(replicate=1 << 20).union_steps(program, results, None, SCALARS, inputs)
    assert sorted(steps.inputs) == sorted(inputs)
    body = "".join(sql for _, sql, _ in steps.views) + steps.final
    for table, view in steps.inputs.items():
        assert view.startswith(steps.prefix) and f"`{view}`" in body
        assert f"CREATE TEMPORARY VIEW {view} AS SELECT * FROM {table};" in steps.text()
    assert not re.search(r"`(W|b|r__m__W|r__v__W)`", body) and re.search(r"`r__m__b`", body)
    other = steps.renamed()
    assert other.prefix != steps.prefix and steps.prefix not in other.text()
    assert other.text() == steps.text().replace(steps.prefix, other.prefix)
    assert [reads for *_, reads in other.views] == [reads for *_, reads in steps.views]
    assert other.big == {name.replace(steps.prefix, other.prefix) for name in steps.big}
