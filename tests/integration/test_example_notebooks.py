"""Every notebook under examples/ runs from top to bottom in a real Jupyter kernel (nbclient, ipykernel),
and its attention views come out as HTML with token text escaped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
"""Per cell; the slowest trains a tiny model, seconds on a loaded 2-core machine."""


def test_the_examples_have_a_notebook():
    assert "attention_in_a_notebook.ipynb" in [path.name for path in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_a_committed_notebook_has_no_outputs(path):
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_a_notebook_runs_top_to_bottom(path, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the traceback, at the first cell that fails
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(output.output_type != "error" for cell in code for output in cell.outputs)
    views = [cell for cell in code if "attnlab.show" in cell.source]
    assert views
    for cell in views:
        html = [output.data["text/html"] for output in cell.outputs if "text/html" in output.get("data", {})]
        assert len(html) == 1, cell.source
        assert 'class="attnlab-nb"' in html[0]
        assert len(re.findall("<script", html[0], re.I)) == 2  # the data and the drawing code, nothing else
    texts = [output.data["text/html"] for cell in views for output in cell.outputs if "data" in output]
    markup = [html for html in texts if "\\u003cb\\u003e" in html]  # the input's "<b>", escaped
    assert markup and all("<b>" not in html for html in markup)
    assert list(tmp_path.iterdir()) == []  # nothing written where the notebook runs
