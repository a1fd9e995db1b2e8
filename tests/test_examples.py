"""The examples run, on the default device, and say what they did."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("asyncio_fences.py", "stream 2: done after"),
        ("trio_fences.py", "done once released: True"),
        ("pinned_staging.py", "all verified"),
        ("anyio_pipeline.py", "20 batches through a budget of 4 buffers"),
        ("trio_pipeline.py", "20 buffers released, none pending"),
    ],
)
def test_example_runs(script: str, expected: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert expected in result.stdout


# -- the PyTorch example: it runs on a GPU, and says what it needs elsewhere ------------

TORCH_EXAMPLE = ROOT / "examples" / "torch_pipeline.py"
NEEDS_TORCH = "needs a CUDA GPU with PyTorch"


def run_torch_example(*python_args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, *python_args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_torch_example_without_pytorch_says_so() -> None:
    hide_torch = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = [{str(TORCH_EXAMPLE)!r}]; "
        f"runpy.run_path({str(TORCH_EXAMPLE)!r}, run_name='__main__')"
    )
    output = run_torch_example("-c", hide_torch)
    assert NEEDS_TORCH in output
    assert "PyTorch is not installed" in output


def test_the_torch_example_without_a_gpu_says_so() -> None:
    # No GPU visible: PyTorch, where installed, finds none.
    output = run_torch_example(str(TORCH_EXAMPLE), env={"CUDA_VISIBLE_DEVICES": ""})
    assert NEEDS_TORCH in output


def test_the_torch_example_runs_on_a_gpu(cuda_mode: str) -> None:
    if cuda_mode != "real":
        pytest.skip("needs a real GPU")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch")
    output = run_torch_example(str(TORCH_EXAMPLE))
    assert "all verified" in output
