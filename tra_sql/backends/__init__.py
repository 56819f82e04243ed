"""Engines that execute tra_sql programs other than the embedded DuckDB default.

- ``spark``: Spark SQL (``local[N]`` or a standalone cluster); tensor relations are Parquet
  tables in a warehouse directory (``tra_sql.backends.spark``, ``.warehouse``);
- ``transfer``: copying tensor relations and plain tables between a DuckDB session and a
  Spark session;
- ``standalone``: starting a Spark standalone master and workers on this machine (tests,
  benchmarks, trying a cluster out).

Nothing here is imported by ``import tra_sql``: pyspark is an optional dependency.
"""

ENGINES = ("duckdb", "spark")
