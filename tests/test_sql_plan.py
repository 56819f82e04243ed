"""tra_plan(...): the planner's plan of a tensor, as rows, the same as db.plan(...).explain()."""

import json
import re

import numpy as np
import pytest

import tra_sql
from tra_sql.errors import SpecError, SQLError


@pytest.fixture
def db():
    with tra_sql.connect() as session:
        session.from_numpy("A", np.ones((8, 8)), tile=(4, 4))
        yield session


def lines(db, sql):
    return [r[0] for r in db.sql(sql).fetchall()]


def strip_timing(text: str) -> str:
    return re.sub(r"planned in \d+ ms", "", text)


def test_text_and_json_as_the_python_api(db):
    text = lines(db, "SELECT plan FROM tra_plan(einsum('ij,jk->ik', A, A), workers => 2, memory => '1GB')")
    a = db.tensor("A")  # one node, named twice, as in the statement
    expected = db.plan(db.einsum("ij,jk->ik", a, a), workers=2, memory="1GB").explain()
    assert strip_timing("\n".join(text)) == strip_timing(expected)
    described = json.loads("\n".join(lines(db, "SELECT * FROM tra_plan(einsum('ij,jk->ik', A, A), workers => 3, "
                                               "format => 'json')")))
    assert described["workers"] == 3 and described["ops"][0]["parts"]


def test_bad_calls(db):
    with pytest.raises(SpecError, match="'png'"):
        db.sql("SELECT * FROM tra_plan(A, format => 'png')")
    with pytest.raises(SpecError, match="workers"):
        db.sql("SELECT * FROM tra_plan(A, workers => 0)")
    with pytest.raises(SQLError, match="takes one tensor"):
        db.sql("SELECT * FROM tra_plan()")
    with pytest.raises(SpecError, match="no option 'cores'"):
        db.sql("SELECT * FROM tra_plan(A, cores => 2)")
