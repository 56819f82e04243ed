"""Every benchmark script still imports against the package (a renamed function breaks a
script that no test runs; its ``main`` is not called here)."""

import runpy
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "bench").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_bench_script_imports(script):
    runpy.run_path(str(script), run_name="bench_import_check")
