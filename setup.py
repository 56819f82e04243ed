"""The optional native part of the build: the loadable DuckDB extension of tra_sql's native
kernels (``udfs/native/extension.c``). Without a C compiler the install still succeeds and
tra_sql runs its kernels as Arrow UDFs (docs/kernels.md)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tra_sql.udfs.native._extension", ["udfs/native/extension.c"], optional=True)])
