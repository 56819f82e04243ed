"""Staged plans on Spark (``tra_sql.engines.staged`` through ``SparkStages``): each step's
table is a plain Parquet table of the warehouse, filled by one Spark job per band (its query's
views as in ``SparkEngine.steps``, the rows appended by ``insertInto``). Spark has no indexes:
a band's scans by key value read the row groups whose key statistics match."""

from __future__ import annotations

from sqlglot import exp

from tra_sql.backends import spark_udfs
from tra_sql.backends.warehouse import columns, quote, tile_schema, write_parquet
from tra_sql.engines.staged import Stages


class SparkStages(Stages):
    """The staged executor's tables on a ``SparkEngine``'s warehouse."""

    def __init__(self, engine):
        super().__init__(engine)
        self.dialect = engine.sql_dialect()
        self.ranks: dict[str, int] = {}  # of the tables created

    def create(self, table: str, rank: int, temp: bool = False) -> None:
        schema = tile_schema(rank)
        self.engine.warehouse.create(table, lambda d: write_parquet(schema.empty_table(), d), replace=True,
                                     schema=columns(schema))
        self.ranks[table] = rank

    def insert(self, table: str, query: exp.Select) -> None:
        steps = self.dialect.query_steps(query, self.ranks[table])
        with self.engine.steps(steps, f"a stage of '{table}'") as frame:
            try:
                frame.write.insertInto(quote(table))
            except Exception as err:
                raise spark_udfs.translate(err, f"computing '{table}'") from None

    def drop(self, tables: list[str]) -> None:
        for table in tables:
            self.engine.warehouse.drop(table)
            self.ranks.pop(table, None)
