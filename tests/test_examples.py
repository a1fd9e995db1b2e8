"""The examples run, on the default device, and say what they did."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``examples/script`` on the default device; it must exit 0."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        # PYTHONPATH: a process the example spawns imports this checkout too.
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none", "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("asyncio_fences.py", "stream 2: 30 ms of work, done after"),
        ("trio_fences.py", "done once released: True"),
        ("pinned_staging.py", "all verified"),
        ("anyio_pipeline.py", "20 batches through a budget of 4 buffers"),
        ("trio_pipeline.py", "20 buffers released, none pending"),
    ],
)
def test_example_runs(script: str, expected: str) -> None:
    assert expected in run_example(script).stdout


def test_the_cross_process_consumer_reads_each_batch_after_its_fence() -> None:
    result = run_example("cross_process.py")
    lines = result.stdout.splitlines()
    # Each batch checked (a batch read before its copy completed fails the run).
    assert sorted(line for line in lines if "read after its fence" in line) == [
        f"batch {index}: 65,536 bytes of {index + 1}, read after its fence" for index in range(6)
    ]
    assert lines[-1].startswith("6 batches from process ")
    assert lines[-1].endswith("producer exit 0")


def test_the_cross_process_example_on_cuda(driver_env: dict[str, str]) -> None:
    """On CUDA the producer's device writes the shared memory; the consumer's waits."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cross_process.py"), "cuda"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**driver_env, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum("read after its fence" in line for line in lines) == 6
    assert lines[-1].endswith("on cuda, producer exit 0")


def test_the_asyncio_example_reports_each_stream_once() -> None:
    result = run_example("asyncio_fences.py")
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout
    # In the order the streams finish, each with the work it was given.
    assert sorted(line.partition(",")[0] for line in lines) == [
        "stream 0: 10 ms of work",
        "stream 1: 20 ms of work",
        "stream 2: 30 ms of work",
    ]


def _load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / name)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("script", "loop"),
    [
        ("asyncio_fences.py", "asyncio"),
        ("anyio_pipeline.py", "asyncio"),
        ("anyio_pipeline.py", "trio"),
        ("trio_pipeline.py", "trio"),
    ],
)
def test_an_example_calibrates_before_it_times_work(
    script: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first launch_busy on a fresh device calibrates: timed, it reads far longer than asked.
    from asyncfence.testing import open_default_device

    from .calibration import CalibrationWatch

    trio = pytest.importorskip("trio") if loop == "trio" else None
    example = _load_example(script)
    watch = CalibrationWatch()
    # OpenCL, as the examples' own runs have it (they run without a CUDA driver).
    monkeypatch.setattr(
        example, "open_default_device", lambda: watch.watch(open_default_device("opencl"))
    )
    if script == "anyio_pipeline.py":
        anyio.run(example.main, loop, backend=loop)
    elif trio is not None:
        trio.run(example.main)
    else:
        asyncio.run(example.main())
    assert watch.launches > 0
    assert watch.calibrated_in_launch == [False], "the first launch_busy calibrated"


# -- pinned_staging.py: its staging pool really has buffers in flight ---------------------
#
# pyopencl's event for a copy between host and device, garbage-collected, waits for
# the copy with the GIL held: an example that drops it uploads synchronously, so its
# pool never has a buffer out, and on a held queue it stops the whole process for
# good. So the held-queue check runs in a child interpreter.

CHILD_TIMEOUT_S = 45


async def _staging_on_a_held_queue() -> dict[str, Any]:
    from asyncfence.testing import hold, open_default_device

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import pinned_staging
    finally:
        sys.path.remove(str(ROOT / "examples"))
    uploads = pinned_staging.OpenCLUploads(open_default_device("opencl"))
    pipeline = pinned_staging.Pipeline(uploads)
    report: dict[str, Any] = {}
    with hold(uploads.stream) as gate:
        running = asyncio.ensure_future(pipeline.run())
        # Nothing completes while the queue is held: every staging buffer goes out
        # with its copy queued, and the producer must wait for one to come back.
        for _ in range(100_000):
            if pipeline.producer_waited or running.done():
                break
            await asyncio.sleep(0)
        report["waited_while_held"] = pipeline.producer_waited
        report["available_while_held"] = pipeline.pool.available
        report["verified_while_held"] = pipeline.verified
        report["held"] = gate.held and not running.done()
        gate.release()
        await running
    report["verified"] = pipeline.verified
    report["batches"] = pipeline.batches
    return report


def staging_on_a_held_queue() -> dict[str, Any]:
    """In the child: :func:`_staging_on_a_held_queue` on asyncio."""
    return asyncio.run(_staging_on_a_held_queue())


def test_the_staging_producer_waits_for_a_buffer_while_the_queue_is_held() -> None:
    pytest.importorskip("pyopencl")
    code = (
        "import faulthandler, json, sys; "
        f"faulthandler.dump_traceback_later({CHILD_TIMEOUT_S}, exit=True); "
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
        "import test_examples as t; "
        "print(json.dumps(t.staging_on_a_held_queue()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=CHILD_TIMEOUT_S + 30,
    )
    if "Timeout (" in result.stderr:
        pytest.fail(
            f"the pipeline hung for {CHILD_TIMEOUT_S} s on the held queue: an upload "
            f"blocked (a dropped pyopencl event?). Its stacks:\n{result.stderr[-3000:]}"
        )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["held"]
    assert report["waited_while_held"] == 1  # the producer waits, once, for a free buffer
    assert report["available_while_held"] == 0  # all 4 out, their copies queued
    assert report["verified_while_held"] == 0
    assert report["verified"] == report["batches"]


# -- the PyTorch example: on a CUDA GPU, on CPU torch, and where torch is missing ----------

TORCH_EXAMPLE = ROOT / "examples" / "torch_pipeline.py"


def run_torch_example(
    *python_args: str, env: dict[str, str] | None = None, status: int = 0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *python_args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert result.returncode == status, result.stdout + result.stderr[-2000:]
    return result


def test_the_torch_example_without_pytorch_says_so() -> None:
    hide_torch = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = [{str(TORCH_EXAMPLE)!r}]; "
        f"runpy.run_path({str(TORCH_EXAMPLE)!r}, run_name='__main__')"
    )
    output = run_torch_example("-c", hide_torch).stdout
    assert "needs PyTorch (not installed)" in output


@pytest.mark.parametrize(
    "failure",
    [
        'ImportError("libc10.so: cannot open shared object file")',
        "ModuleNotFoundError(\"No module named 'sympy'\", name='sympy')",
    ],
    ids=["a-library-missing", "a-dependency-missing"],
)
def test_a_broken_pytorch_fails_the_torch_example(tmp_path: Path, failure: str) -> None:
    # Installed but broken is not "not installed": the example must fail, saying why.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"raise {failure}\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    result = run_torch_example(str(TORCH_EXAMPLE), env={"PYTHONPATH": path}, status=1)
    assert "needs PyTorch" not in result.stdout
    assert ("libc10.so" if "libc10" in failure else "sympy") in result.stderr


def test_the_torch_example_runs_on_cpu_torch() -> None:
    from .torch_support import import_torch

    import_torch()
    # No GPU visible: PyTorch runs it on the CPU, where every fence is done when recorded.
    output = run_torch_example(str(TORCH_EXAMPLE), env={"CUDA_VISIBLE_DEVICES": ""}).stdout
    assert "on the CPU (no CUDA" in output
    assert "32 batches of 4 MiB up, computed and down" in output
    assert "all verified; 32 batches' tensors released by the DropQueue" in output


def test_the_torch_example_runs_on_a_gpu(cuda_mode: str) -> None:
    if cuda_mode != "real":
        pytest.skip("needs a real GPU")
    from .torch_support import import_torch

    torch = import_torch()
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA (a CPU build)")
    output = run_torch_example(str(TORCH_EXAMPLE)).stdout
    assert "(CUDA, pinned staging)" in output
    assert "all verified" in output
