"""The documentation's examples run as written."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def first_python_block(path: Path) -> str:
    return re.search(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S).group(1)


def test_training_guide_first_example(tmp_path, monkeypatch):
    """docs/training.md's first example (it used an undefined ``n`` and CSV files nobody had),
    with 3 epochs instead of 100; run twice, as a training run resumes."""
    pytest.importorskip("sklearn")
    code = first_python_block(DOCS / "training.md")
    assert "epochs=100" in code
    monkeypatch.chdir(tmp_path)
    for epochs in (2, 3):
        scope: dict = {}
        exec(compile(code.replace("epochs=100", f"epochs={epochs}"), "training.md", "exec"), scope)
        scope["db"].close()
    history = scope["history"]
    assert history.steps == 3 and history.losses[-1] < history.losses[0]
