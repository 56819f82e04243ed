"""Timing helpers shared by the benchmarks: medians of repeated runs, and the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np


def median_time(fn, repeat: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    import duckdb

    blas = "unknown BLAS"
    try:
        from threadpoolctl import threadpool_info

        info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if info:
            blas = f"{info[0]['internal_api']} {info[0].get('architecture', '')} x{info[0]['num_threads']}"
    except ImportError:
        pass
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, numpy {np.__version__} ({blas}), duckdb {duckdb.__version__}")
