"""Native tile kernels: Numba ``cfunc``s that DuckDB calls through its C API, reading tiles
where DuckDB holds them (docs/kernels.md). ``kernels.NativeKernels`` registers them on a
connection whose database loaded tra_sql's extension (``loader``)."""
