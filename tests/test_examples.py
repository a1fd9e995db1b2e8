"""The examples run, on the default device, and say what they did."""

from __future__ import annotations

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
