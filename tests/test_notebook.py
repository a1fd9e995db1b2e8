"""The notebook executes in a real Jupyter kernel, top-level awaits and all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "notebook.ipynb"


def test_the_notebook_executes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFENCE_CUDA_DRIVER", "none")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on any error
    text = "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert "fence done: True" in text
    for strategy in ("auto", "park", "poll"):
        assert f"{strategy}: p50" in text
    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert images, "the latency plot was not drawn"
    assert os.environ["ASYNCFENCE_CUDA_DRIVER"] == "none"
