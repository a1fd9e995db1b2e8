"""The public API: what __all__ names exists, reads as public, and is typed."""

from __future__ import annotations

import os
import re
from pathlib import Path

import asyncfence
import asyncfence.testing


def test_every_public_name_exists_and_reads_as_public() -> None:
    for module in (asyncfence, asyncfence.testing):
        assert isinstance(module.__all__, tuple)
        for name in module.__all__:
            value = getattr(module, name)
            assert value.__module__ == module.__name__, name
    assert sorted(asyncfence.__all__) == list(asyncfence.__all__)


def test_private_modules_stay_private() -> None:
    # (pytest rewrites the modules of plugin packages, adding "@py_..." names)
    public = {name for name in dir(asyncfence) if not name.startswith(("_", "@"))}
    modules = {"testing", "pytest_plugin"}
    assert public - modules == set(asyncfence.__all__)


def test_the_package_is_typed() -> None:
    assert (Path(asyncfence.__file__).parent / "py.typed").exists()


# Installed by the dev extra but not by `pip install asyncfence[opencl]`
# (sniffio came with anyio once, and no longer does).
NOT_A_RUNTIME_DEPENDENCY = (
    "sniffio",
    "trio",
    "uvloop",
    "rich",
    "matplotlib",
    "pytest",
    "hypothesis",
    "numba",
    "torch",
    "cupy",
)


def test_the_command_line_runs_with_only_the_runtime_dependencies() -> None:
    import subprocess
    import sys

    blocker = "; ".join(f"sys.modules[{name!r}] = None" for name in NOT_A_RUNTIME_DEPENDENCY)
    program = f"import runpy, sys; {blocker}; runpy.run_module('asyncfence', run_name='__main__')"
    for args in (["--version"], ["bench", "--help"], ["demo"]):
        result = subprocess.run(
            [sys.executable, "-c", program, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        )
        assert result.returncode == 0, (args, result.stderr[-2000:])
    assert "parked waits wake through" in result.stdout  # the demo ran to its end
    # The work is timed from its launch, and the heartbeat reported as measured.
    assert re.search(r"done \d+ ms after the launch; meanwhile a 1 ms heartbeat", result.stdout)
    assert re.search(r"ran [\d,]+ times?, its longest gap [\d.]+ ms", result.stdout)


def test_version_answers_to_both_flags() -> None:
    import subprocess
    import sys

    for flag in ("-V", "--version"):
        result = subprocess.run(
            [sys.executable, "-m", "asyncfence", flag],
            capture_output=True,
            text=True,
            env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"asyncfence {asyncfence.__version__}"


def test_a_fence_says_it_belongs_to_its_process_when_pickled() -> None:
    import copy
    import pickle

    from asyncfence.testing import open_default_device

    device = open_default_device("opencl")
    stream = device.new_stream()
    try:
        fence = asyncfence.record(stream)
        import pytest

        with pytest.raises(TypeError, match="belongs to the process that recorded it"):
            pickle.dumps(fence)
        assert copy.copy(fence) is fence
        assert copy.deepcopy([fence])[0] is fence
        fence.wait_sync(timeout=30)
    finally:
        device.close_stream(stream)
