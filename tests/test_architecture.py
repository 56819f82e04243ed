"""The architecture holds: import-linter's contracts (pyproject.toml, ``[tool.importlinter]``:
the pipeline's layers, no import cycles) and small modules (docs/architecture.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def package_view(where: Path) -> Path:
    """``tra_sql`` as installed (``udfs/`` and ``sql/`` are its subpackages ``tra_sql.udfs`` and
    ``tra_sql.sql``, which the install maps), built from links so import-linter can walk it."""
    package = where / "tra_sql"
    package.mkdir()
    for entry in (ROOT / "tra_sql").iterdir():
        if entry.name not in ("__pycache__", "udfs", "sql"):
            (package / entry.name).symlink_to(entry)
    for name in ("udfs", "sql"):
        (package / name).symlink_to(ROOT / name)
    return where


def test_import_contracts_are_kept(tmp_path):
    view = package_view(tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=view,
                          env=dict(os.environ, PYTHONPATH=str(view)), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_module_is_over_500_lines():
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for folder in ("tra_sql", "udfs") for path in (ROOT / folder).rglob("*.py")}
    assert not {str(path): n for path, n in sizes.items() if n > MAX_LINES}
