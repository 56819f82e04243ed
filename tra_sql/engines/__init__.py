"""The engines that store tensor relations and run compiled programs, behind one interface
(``base.Engine``): DuckDB here (``duckdb``, its catalog storage ``duckdb_catalog`` and the
staged executor ``staged``); Spark in ``tra_sql.backends.spark`` (pyspark is optional)."""
