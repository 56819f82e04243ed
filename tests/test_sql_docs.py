"""docs/sql.md's and the README's SQL examples run as written, and give what they say."""

import re
from pathlib import Path

import numpy as np

import tra_sql

ROOT = Path(__file__).resolve().parent.parent


def sql_blocks(path: Path) -> list[str]:
    return re.findall(r"```sql\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def test_reference_examples_run_in_order():
    with tra_sql.connect() as db:
        for block in sql_blocks(ROOT / "docs" / "sql.md"):
            db.sql(block)
        r = db.tensor("R")
        assert r.dtype == np.float32
        np.testing.assert_array_equal(r.numpy(), [[4, 0, 5], [0, 4, 0]])
        edges = np.zeros((4, 4))
        edges[0, 1], edges[1, 2], edges[2, 0], edges[3, 3] = 2, 3, -1, 0.5
        np.testing.assert_allclose(db.tensor("AF").numpy(), edges @ db.tensor("F").numpy())
        x = db.tensor("X").numpy()
        np.testing.assert_array_equal(db.tensor("X_kept").numpy(), x)
        top = np.zeros_like(x)
        top[:3] = x[:3]
        np.testing.assert_array_equal(db.tensor("X_top").numpy(), top)
        losses = [r[0] for r in db.sql("SELECT loss FROM tra_run_log WHERE run = 'loss' ORDER BY epoch").fetchall()]
        assert len(losses) == 5 and abs(losses[0] - np.log(3)) < 1e-12 and losses[-1] < losses[0]


def test_readme_examples_run():
    """The SQL of the README's sections on SQL (its other SQL shows what programs compile to)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (?:Einsum queries in SQL|Training in SQL)\n(.*?)(?=^## )", readme, re.S | re.M)
    blocks = [b for section in sections for b in re.findall(r"```sql\n(.*?)```", section, re.S)]
    assert len(sections) == 2 and len(blocks) >= 2
    with tra_sql.connect() as db:
        for block in blocks:
            db.sql(block)
