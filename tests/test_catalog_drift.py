"""Catalog drift and corrupt tiles: a tensor table or catalog row changed with plain SQL gives
a TraError naming the tensor (and the tile) on every path that uses it, and ``db.check()`` /
``tra_check()`` list it; ``repair`` drops the catalog rows whose table is gone."""

import numpy as np
import pytest

import tra_sql
import tra_sql.optim
from tra_sql import CatalogDriftError, CorruptTileError, UnknownTensorError

A = np.arange(16.0).reshape(4, 4)

# name: (SQL that corrupts tensor A (4x4 in 2x2 tiles), error on use, its message, check()'s finding)
CORRUPTIONS = {
    "table dropped": ('DROP TABLE "A"', CatalogDriftError, r"'A'.*table is gone", ("A", "no table")),
    "table renamed": ('ALTER TABLE "A" RENAME TO "Z"', CatalogDriftError, r"'A'.*table is gone", ("A", "no table")),
    "column dropped": ('ALTER TABLE "A" DROP COLUMN k1', CatalogDriftError, r"'A'.*columns \['k0', 'tile'\]",
                       ("A", "columns")),
    "column renamed": ('ALTER TABLE "A" RENAME COLUMN k1 TO j', CatalogDriftError, r"'A'.*columns \['k0', 'j'",
                       ("A", "columns")),
    "column added": ('ALTER TABLE "A" ADD COLUMN note VARCHAR', CatalogDriftError, r"'A'.*'note'", ("A", "columns")),
    "key made text": ('ALTER TABLE "A" ALTER COLUMN k0 TYPE VARCHAR', CatalogDriftError,
                      r"'A'.*key column k0 has type VARCHAR", ("A", "columns")),
    "key made double": ('ALTER TABLE "A" ALTER COLUMN k1 TYPE DOUBLE', CatalogDriftError,
                        r"'A'.*key column k1 has type DOUBLE", ("A", "columns")),
    "tile made text": ('ALTER TABLE "A" ALTER COLUMN tile TYPE VARCHAR', CatalogDriftError,
                       r"'A'.*tile column has type VARCHAR", ("A", "columns")),
    "table replaced by a view": ('DROP TABLE "A"; CREATE VIEW "A" AS SELECT 0 AS k0, 1 AS k1', CatalogDriftError,
                                 r"'A'.*view has columns", ("A", "columns")),
    "tile truncated": ('UPDATE "A" SET tile = unhex(substr(hex(tile), 1, 10)) WHERE k0 = 1 AND k1 = 0',
                       CorruptTileError, r"tile \(1, 0\).*'A'.* 5 bytes", ("A", "tile size")),
    "tile oversized": ('UPDATE "A" SET tile = tile || tile WHERE k0 = 0 AND k1 = 1', CorruptTileError,
                       r"tile \(0, 1\).*'A'.* 64 bytes", ("A", "tile size")),
    "tile NULL": ('UPDATE "A" SET tile = NULL WHERE k0 = 1 AND k1 = 1', CorruptTileError,
                  r"'A'.*tile \(1, 1\) is NULL", ("A", "null tile")),
    "key NULL": ('UPDATE "A" SET k0 = NULL WHERE k0 = 0 AND k1 = 1', CorruptTileError, r"'A'.*NULL key.*\(None, 1\)",
                 ("A", "null key")),
    "key repeated": ('INSERT INTO "A" SELECT * FROM "A" WHERE k0 = 1 AND k1 = 0', CorruptTileError,
                     r"'A'.*tile \(1, 0\) is stored 2 times", ("A", "duplicate key")),
    "key past the grid": ('UPDATE "A" SET k0 = 7 WHERE k0 = 1 AND k1 = 1', CorruptTileError,
                          r"'A'.*tile \(7, 1\) is outside the grid \(2, 2\)", ("A", "key outside grid")),
    "key negative": ('UPDATE "A" SET k1 = -1 WHERE k0 = 1 AND k1 = 1', CorruptTileError,
                     r"'A'.*tile \(1, -1\) is outside the grid", ("A", "key outside grid")),
    "catalog row deleted": ("DELETE FROM tra_tensors WHERE name = 'A'", UnknownTensorError, r"'A'",
                            ("A", "no catalog row")),
    "catalog shape of lower rank": ("UPDATE tra_tensors SET shape = [4], tile_shape = [2] WHERE name = 'A'",
                                    CatalogDriftError, r"'A'.*columns \['k0', 'k1', 'tile'\], not \['k0', 'tile'\]",
                                    ("A", "columns")),
    "catalog shape cutting a tile": ("UPDATE tra_tensors SET shape = [3, 4] WHERE name = 'A'", CorruptTileError,
                                     r"tile \(1, [01]\).*'A'.*32 bytes.*need 16", ("A", "tile size")),
    "catalog shape dropping tiles": ("UPDATE tra_tensors SET shape = [2, 4] WHERE name = 'A'", CorruptTileError,
                                     r"'A'.*tile \(1, [01]\) is outside the grid \(1, 2\)", ("A", "key outside grid")),
    "catalog dtype narrower": ("UPDATE tra_tensors SET dtype = 'float32' WHERE name = 'A'", CorruptTileError,
                               r"'A'.*32 bytes.*float32 need 16", ("A", "tile size")),
    "catalog dtype unknown": ("UPDATE tra_tensors SET dtype = 'complex64' WHERE name = 'A'", CatalogDriftError,
                              r"'A'.*dtype 'complex64'", ("A", "bad catalog row")),
    "catalog tile larger": ("UPDATE tra_tensors SET tile_shape = [3, 3] WHERE name = 'A'", CorruptTileError,
                            r"'A'.*holds (32|16|8) bytes", ("A", "tile size")),
    "catalog tile zero": ("UPDATE tra_tensors SET tile_shape = [0, 2] WHERE name = 'A'", CatalogDriftError,
                          r"'A'.*tile shape \(0, 2\)", ("A", "bad catalog row")),
    "catalog layout unknown": ("UPDATE tra_tensors SET layout = 'coo' WHERE name = 'A'", CatalogDriftError,
                               r"'A'.*layout 'coo'", ("A", "bad catalog row")),
}

USES = {
    "numpy": lambda db: db.tensor("A").numpy(),
    "einsum": lambda db: db.einsum("ij,jk->ik", "A", "B").numpy(),
    "store": lambda db: db.einsum("ij,jk->ik", "A", "B").store("C"),
    "sql einsum": lambda db: db.execute("SELECT * FROM einsum('ij,jk->ik', A, B)").fetchall(),
    "create tensor": lambda db: db.sql("CREATE TENSOR C AS SELECT * FROM einsum('ij->ji', A)"),
}


def corrupted(sql: str) -> tra_sql.Session:
    db = tra_sql.connect()
    db.from_numpy("A", A, tile=(2, 2))
    db.from_numpy("B", np.eye(4), tile=(2, 2))
    for statement in sql.split("; "):
        db.engine.con.execute(statement).fetchall()
    return db


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corruption_is_a_clear_error_on_every_use(corruption, use):
    sql, error, message, _ = CORRUPTIONS[corruption]
    with corrupted(sql) as db:
        with pytest.raises(error, match=message):
            USES[use](db)
        assert "C" not in db.tensors() and db.engine.con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'C'").fetchall() == [(0,)]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_check_finds_each_corruption(corruption):
    sql, _, _, expected = CORRUPTIONS[corruption]
    with corrupted(sql) as db:
        findings = db.check()
        assert expected in [(f.tensor, f.problem) for f in findings]
        assert {f.tensor for f in findings} <= {"A", "Z"}                 # B is whole
        assert db.sql("SELECT tensor, problem FROM tra_check()").fetchall() == [(f.tensor, f.problem)
                                                                              for f in findings]


def test_lazy_sql_reads_corrupt_tiles_as_an_engine_error():
    """``db.sql`` returns DuckDB's lazy relation: a tile kernel's CorruptTileError surfaces
    when it is read, as DuckDB's error that names the tile; ``db.execute`` raises it."""
    with corrupted(CORRUPTIONS["tile truncated"][0]) as db:
        relation = db.sql("SELECT * FROM einsum('ij,jk->ik', A, B)")
        with pytest.raises(Exception, match=r"CorruptTileError: tile \(1, 0\) of tensor 'A' holds 5 bytes"):
            relation.fetchall()


@pytest.mark.parametrize("sql, error, message", [
    ('ALTER TABLE "W" ADD COLUMN note VARCHAR', CatalogDriftError, r"'W'.*'note'"),
    ('DROP TABLE "W"', CatalogDriftError, r"'W'.*table is gone"),
    ('INSERT INTO "W" SELECT * FROM "W"', CorruptTileError, r"'W'.*tile \(0, 0\) is stored 2 times"),
    ('UPDATE "W" SET tile = NULL', CorruptTileError, r"'W'.*tile \(0, 0\) is NULL"),
    ('UPDATE "X" SET k0 = 5', CorruptTileError, r"'X'.*tile \(5, 0\) is outside the grid"),
])
def test_training_over_a_drifted_table_stops_before_its_first_step(db, sql, error, message):
    """The tensors a run reads are looked up again when it starts: a duplicated weight tile was
    trained twice (and the table doubled), a column added failed in the commit as DuckDB's
    error, a dropped table as DuckDB's error from the step."""
    x = db.from_numpy("X", np.ones((4, 3)))
    W = db.parameter("W", init=np.ones((3, 2)))
    loss = db.einsum("ni,ij->", x, W)
    db.engine.con.execute(sql).fetchall()
    with pytest.raises(error, match=message):
        db.train(loss, [W], tra_sql.optim.SGD(lr=0.1), 2, progress=False)
    assert db.engine.con.execute("SELECT count(*) FROM tra_run_log").fetchall() == [(0,)]


def test_a_whole_database_checks_clean(db, rng):
    db.from_numpy("ragged", rng.standard_normal((13, 7, 5)), tile=(4, 3, 5))
    db.from_numpy("ints", np.arange(10, dtype=np.int32), tile=3)
    db.from_numpy("scalar", np.float64(2.5))
    db.engine.con.execute("CREATE TABLE edges AS SELECT * FROM (VALUES (0, 1, 0.5), (2, 2, 1.5)) "
                          "t(dst, src, w)").fetchall()
    db.relation("edges", ("dst", "src"), "w", shape=(3, 3), name="E")
    db.relation("edges", ("dst", "src"), "w", shape=(3, 3), name="S", layout="csr").store("SC")
    db.einsum("ij,jk->ik", "E", "SC").store("P")
    db.sql("CREATE TENSOR R AS SELECT * FROM tra_random(shape => [5, 4], tile => [2, 3]) WHERE k0 < 2")
    assert db.check() == []
    assert db.sql("SELECT * FROM tra_check()").fetchall() == []


def test_bigint_keys_are_integer_keys(db):
    db.from_numpy("A", A, tile=(2, 2))
    db.engine.con.execute('ALTER TABLE "A" ALTER COLUMN k0 TYPE BIGINT').fetchall()
    assert db.check() == []
    np.testing.assert_array_equal(db.einsum("ij->ji", "A").numpy(), A.T)


def test_repair_drops_rows_whose_table_is_gone_and_reports_tables_without_a_row(db):
    for name in ("A", "B", "C", "D"):
        db.from_numpy(name, A, tile=(2, 2))
    db.engine.con.execute('DROP TABLE "A"').fetchall()
    db.engine.con.execute('ALTER TABLE "B" RENAME TO "B2"').fetchall()
    db.engine.con.execute("DELETE FROM tra_tensors WHERE name = 'C'").fetchall()
    db.engine.con.execute('UPDATE "D" SET tile = NULL WHERE k0 = 0').fetchall()
    expected = [("A", "no table"), ("B", "no table"), ("D", "null tile"), ("B2", "no catalog row"),
                ("C", "no catalog row")]
    assert [(f.tensor, f.problem, f.repaired) for f in db.check()] == [e + (False,) for e in expected]
    repaired = db.check(repair=True)
    assert [(f.tensor, f.problem, f.repaired) for f in repaired] == [
        e + (e[1] == "no table",) for e in expected]
    assert db.tensors() == ["D"]
    assert [(f.tensor, f.problem) for f in db.check()] == expected[2:]
    assert db.engine.con.execute('SELECT count(*) FROM "B2"').fetchall() == [(4,)]    # reported, not dropped
    with pytest.raises(UnknownTensorError, match="'C'.*exists without a catalog row"):
        db.tensor("C")


def test_repair_drops_staging_tables_a_killed_planned_store_left(db):
    db.from_numpy("A", A, tile=(2, 2))
    db.engine.con.execute('CREATE TABLE "_tra_stage_1f2e3d4c_2" AS SELECT * FROM "A"').fetchall()
    assert [(f.tensor, f.problem) for f in db.check()] == [("_tra_stage_1f2e3d4c_2", "stage table")]
    assert [f.repaired for f in db.check(repair=True)] == [True]
    assert db.check() == [] and db.tensors() == ["A"]


def test_tra_check_in_sql_repairs_only_when_it_runs(db):
    db.from_numpy("A", A, tile=(2, 2))
    db.engine.con.execute('DROP TABLE "A"').fetchall()
    result = db.sql("SELECT * FROM tra_check() WHERE problem = 'no table'")
    assert result.columns == ["tensor", "problem", "detail", "repaired"]
    assert result.fetchall() == [("A", "no table", "its table is gone (dropped or renamed outside tra_sql)", False)]
    assert "FALSE" in db.explain_sql("SELECT * FROM tra_check(repair => true)") and db.tensors() == ["A"]
    assert db.sql("SELECT tensor, repaired FROM tra_check(repair := true)").fetchall() == [("A", True)]
    assert db.tensors() == [] and db.sql("SELECT count(*) FROM tra_check()").fetchall() == [(0,)]
    with pytest.raises(tra_sql.SQLError, match="repair => true"):
        db.sql("SELECT * FROM tra_check(repair => 'yes')")


def test_a_relation_view_over_a_dropped_table(db):
    db.engine.con.execute("CREATE TABLE edges AS SELECT 0 AS dst, 1 AS src, 0.5 AS w").fetchall()
    db.relation("edges", ("dst", "src"), "w", shape=(2, 2), name="E")
    db.engine.con.execute("DROP TABLE edges").fetchall()
    with pytest.raises(CatalogDriftError, match="'E'.*view no longer binds.*edges"):
        db.einsum("ij->", "E").numpy()
    assert [(f.tensor, f.problem) for f in db.check()] == [("E", "view")]


def test_a_stored_csr_tile_that_does_not_decode(db):
    db.engine.con.execute("CREATE TABLE edges AS SELECT 0 AS dst, 1 AS src, 0.5 AS w").fetchall()
    db.relation("edges", ("dst", "src"), "w", shape=(2, 2), name="S", layout="csr").store("SC")
    db.engine.con.execute("UPDATE \"SC\" SET tile = unhex('0102')").fetchall()
    with pytest.raises(CorruptTileError, match=r"tile \(0, 0\) of tensor 'SC' is not a CSR tile"):
        db.tensor("SC").numpy()
    assert [(f.tensor, f.problem) for f in db.check()] == [("SC", "csr tile")]


def test_a_scalar_stored_twice(db):
    db.from_numpy("s", np.float64(1.0))
    db.engine.con.execute('INSERT INTO "s" SELECT * FROM "s"').fetchall()
    with pytest.raises(CorruptTileError, match=r"'s'.*tile \(\) is stored 2 times"):
        db.tensor("s")
    assert [(f.tensor, f.problem) for f in db.check()] == [("s", "duplicate key")]


def test_drifted_tensors_can_be_dropped_or_replaced(db):
    for name in ("A", "B", "C"):
        db.from_numpy(name, A, tile=(2, 2))
    db.engine.con.execute('DROP TABLE "A"').fetchall()
    db.engine.con.execute("UPDATE tra_tensors SET layout = 'coo' WHERE name = 'B'").fetchall()
    db.engine.con.execute('ALTER TABLE "C" DROP COLUMN k1').fetchall()
    db.drop("A")
    db.sql("DROP TENSOR B")
    db.from_numpy("C", np.ones(3), replace=True)
    assert db.tensors() == ["C"] and db.check() == []


def test_a_dropped_catalog_table(db):
    db.from_numpy("A", A, tile=(2, 2))
    db.engine.con.execute("DROP TABLE tra_tensors").fetchall()
    with pytest.raises(CatalogDriftError, match="catalog table tra_tensors cannot be read"):
        db.tensor("A")
    assert [(f.tensor, f.problem, f.repaired) for f in db.check(repair=True)] == [
        ("tra_tensors", "no catalog table", True), ("A", "no catalog row", False)]
    assert db.tensors() == [] and [f.problem for f in db.check()] == ["no catalog row"]
