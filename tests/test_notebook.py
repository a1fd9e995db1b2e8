"""The notebook executes in a real Jupyter kernel, top-level awaits and all."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"

# Run first in the kernel: every device the notebook opens is watched (tests/calibration.py).
WATCH = f"""\
import sys
sys.path.insert(0, {str(ROOT)!r})
import asyncfence.testing
from tests.calibration import CalibrationWatch
_watch, _open = CalibrationWatch(), asyncfence.testing.open_default_device
asyncfence.testing.open_default_device = lambda *a, **k: _watch.watch(_open(*a, **k))
"""
REPORT = (
    'print(f"watched: {_watch.launches} launches, '
    'calibrated in one: {_watch.calibrated_in_launch}")'
)


def test_the_notebook_executes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFENCE_CUDA_DRIVER", "none")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(WATCH))
    notebook.cells.append(nbformat.v4.new_code_cell(REPORT))
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
    assert "fence done: True: 50 ms of work asked for, awaited in" in text
    for strategy in ("auto", "park", "poll"):
        assert f"{strategy}: p50" in text
    # What the prose leaves to the run, the run prints.
    assert re.search(r"measured in this run: the lowest p50 was (auto|park|poll)'s, \d+ µs", text)
    # The first launch_busy calibrates: the notebook has it done before it times any work.
    watched = re.search(r"watched: (\d+) launches, calibrated in one: (.*)", text)
    assert watched, text
    assert int(watched[1]) > 0
    assert watched[2] == "[False]"
    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert images, "the latency plot was not drawn"
    assert os.environ["ASYNCFENCE_CUDA_DRIVER"] == "none"
