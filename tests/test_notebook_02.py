"""The training notebook runs top to bottom (its cells assert as they go)."""

from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")
pytest.importorskip("sklearn")  # the notebook reads scikit-learn's bundled digits file

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "02-training-in-sql.ipynb"


def test_training_in_sql_notebook_runs(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert (tmp_path / "digits.duckdb").exists()
