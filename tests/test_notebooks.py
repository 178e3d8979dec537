"""Every notebook in notebooks/ runs top to bottom (offline) and its plots are saved as PNG outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra is not installed")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    if "to_nnef" in path.read_text() and not all(importlib.util.find_spec(name) for name in ("torch_to_nnef", "tract")):
        pytest.skip("the export extra is not installed (pip install 'moelens[export]')")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [
        output for cell in notebook.cells if cell.cell_type == "code"
        for output in cell.get("outputs", []) if output.get("output_type") == "error"
    ]
    assert not errors, errors
    if "plot" in path.read_text():
        images = [
            output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", []) if "image/png" in output.get("data", {})
        ]
        assert images, f"{path.name} makes plots but saved no PNG output"
