"""Sizes known before a run that the session cannot hold raise MemoryBudgetError at once
(tra_sql.budget), instead of allocating until the OOM killer ends the process. Every test
here asks for tens of GB and must use next to nothing."""

import resource
import subprocess
import sys

import numpy as np
import pytest

import tra_sql
from tra_sql import budget
from tra_sql.errors import MemoryBudgetError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def allocates_nothing():
    """The test's peak memory stays far below the sizes it asks for."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < 2**30, f"the process grew by {grown / 2**30:.1f} GiB"


def tables(db) -> list:
    return db.engine.con.execute("SELECT table_name FROM duckdb_tables() ORDER BY ALL").fetchall()


@pytest.mark.parametrize("sql", [
    "SELECT count(*) FROM tra_random(shape => [4000000000])",  # the CLI repro: grew to 22 GB, killed
    "SELECT * FROM tra_random(shape => [100000, 100000], seed => 3)",
    "SELECT * FROM tra_random([1000000000], tile => [1000000000])",  # one 8 GB tile
    "SELECT * FROM tra_random(shape => [2147483648], tile => [1])",  # 2^31 rows: their overhead
    "SELECT * FROM einsum('ij->i', tra_random(shape => [100000, 100000]))",
    "SELECT * FROM tra_from_elements((SELECT 1, 2, 1.0), shape => [100000, 100000], tile => [100000, 100000])",
    "SELECT count(*) FROM einsum('i,j->ij', tra_from_elements((SELECT 1, 1.0), shape => [4000000000]), "
    "tra_from_elements((SELECT 2, 1.0), shape => [4000000000]))",  # its product's tiles: 2^40 elements
    "SELECT count(*) FROM einsum('i->i', tra_from_elements((SELECT 1, 2.0), shape => [4000000000], tile => [2]), "
    "\"join\" => 'x0 + 1')",  # the zeros completing the operand: 2e9 tiles
])
def test_sql_generators_refuse_what_does_not_fit(db, sql):
    with pytest.raises(MemoryBudgetError, match=r"statement 1 .* (does not fit|tile kernel)"):
        db.sql(sql)


def test_create_tensor_refused_leaves_nothing(db):
    db.from_numpy("A", np.ones(3))
    before = (tables(db), db.tensors())
    with pytest.raises(MemoryBudgetError, match=r"tra_random\(shape => \[4000000000\]\).*32.0 GB"):
        db.sql("CREATE TENSOR R AS SELECT * FROM tra_random(shape => [4000000000])")
    assert (tables(db), db.tensors()) == before


def test_explain_shows_what_running_refuses(db):
    assert "tra_random_tile" in db.explain_sql("SELECT count(*) FROM tra_random(shape => [4000000000])").lower()


def test_cli_repro_is_one_error_line():
    done = subprocess.run([sys.executable, "-m", "tra_sql.cli", "-c",
                           "SELECT count(*) FROM tra_random(shape => [4000000000]);"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("Error: statement 1") and "does not fit" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("make", [
    lambda db: db.full((4_000_000_000,), 1.0),
    lambda db: db.zeros((100000, 100000)),
    lambda db: db.ones((100000, 100000), dtype="int32", tile=(100, 100)),
])
def test_constants_refuse_what_does_not_fit(db, make):
    with pytest.raises(MemoryBudgetError, match=r"full\(\(.*\)\).* GB"):
        make(db)


def test_one_tile_must_fit_the_memory_limit():
    with tra_sql.connect(memory_limit="64MB") as db:
        with pytest.raises(MemoryBudgetError, match=r"tile of shape \(3000, 3000\).*memory_limit"):
            db.full((3000, 3000), 1.0, tile=(3000, 3000))
        v = db.from_numpy("v", np.ones(3000))
        outer = db.einsum("i,j->ij", v, v)  # one 72 MB tile
        for run in (outer.numpy, outer.arrow, lambda: outer.store("P")):
            with pytest.raises(MemoryBudgetError, match=r"einsum i,j->ij: a tile of shape \(3000, 3000\)"):
                run()
        with pytest.raises(MemoryBudgetError, match="tile of shape"):
            db.sql("SELECT count(*) FROM einsum('i,j->ij', v, v)")
        assert db.tensors() == ["v"]
        db.einsum("i,j->ij", v[:100], v[:100]).store("small")  # a 80 KB tile is fine


def test_results_must_fit_in_memory_available(db):
    v = db.from_numpy("v", np.ones(100000), tile=(1000,))
    outer = db.einsum("i,j->ij", v, v)  # 80 GB in 8 MB tiles
    for method in ("numpy", "arrow"):
        with pytest.raises(MemoryBudgetError, match=rf"einsum i,j->ij.{method}\(\): .*80.0 GB.*MemAvailable"):
            getattr(outer, method)()


def test_budget_follows_memory_available(db, monkeypatch):
    x = db.from_numpy("x", np.ones((1000, 1000)), tile=(500, 500))  # 8 MB
    monkeypatch.setattr(budget, "available", lambda: 10 * 10**6)
    with pytest.raises(MemoryBudgetError, match=r"'x'.numpy\(\).*16.0 MB does not fit in MemAvailable 10.0 MB"):
        x.numpy()
    db.sql("CREATE TENSOR part AS SELECT * FROM x WHERE k0 = 0 AND k1 = 0")
    assert db.tensor("part").arrow().num_rows == 1  # lacks tiles: holds only those present
    with pytest.raises(MemoryBudgetError, match=r"'part'.numpy\(\)"):
        db.tensor("part").numpy()  # the array itself is dense
    monkeypatch.setattr(budget, "available", lambda: 100 * 10**6)
    np.testing.assert_array_equal(x.numpy(), np.ones((1000, 1000)))


def test_error_is_a_tra_error_and_a_memory_error():
    assert issubclass(MemoryBudgetError, tra_sql.TraError) and issubclass(MemoryBudgetError, MemoryError)
    assert tra_sql.MemoryBudgetError is MemoryBudgetError


def test_a_csr_tile_holds_its_entries_only(db):
    db.sql("CREATE TABLE edges AS SELECT range AS dst, (range * 7) % 1000000 AS src, 1.0 AS w FROM range(100)")
    E = db.relation("edges", keys=("dst", "src"), value="w", shape=(1000000, 1000000), layout="csr")
    assert E.tile == (1000000, 1000000)  # dense, 8 TB: not what it holds
    x = db.from_numpy("x", np.ones((1000000, 1)), tile=(1000000, 1))
    y = db.einsum("vu,uf->vf", E, x).numpy()
    assert y.shape == (1000000, 1) and y.sum() == 100
