"""The pytest plugin, in users' own suites: under pytest-asyncio, and under anyio.

Each suite runs through pytester in a subprocess, as a user's would: there is
no emulated driver there, so the default device is PoCL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

USER_SUITE = """
import asyncfence
import pytest


def test_the_fixtures_exist(fence_device, fence_stream, held_stream):
    assert fence_device.backend == "opencl"
    assert held_stream.held
    assert held_stream.stream is not fence_stream


{marker}
async def test_held_work_completes_when_released(held_stream):
    fence = asyncfence.record(held_stream.stream)
    assert not fence.done()
    held_stream.release()
    await fence
    assert fence.done()


{marker}
async def test_work_on_a_fresh_stream(fence_device, fence_stream):
    fence_device.launch_busy(fence_stream, 0.005)
    await asyncfence.record(fence_stream)


@pytest.mark.gpu
def test_needs_a_gpu():
    raise AssertionError("runs only on a GPU")
"""


def run_suite(pytester: pytest.Pytester, marker: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_user_suite=USER_SUITE.format(marker=marker))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    os.environ.setdefault("ASYNCFENCE_CUDA_DRIVER", "none")
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", *args)


def test_the_plugin_under_pytest_asyncio(pytester: pytest.Pytester) -> None:
    result = run_suite(pytester, "@pytest.mark.asyncio", "-p", "asyncio", "-p", "no:anyio", "-rs")
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["*test_needs_a_gpu SKIPPED*needs a GPU*"])
    # The skip is reported at the test, not inside the plugin.
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_user_suite.py:*: needs a GPU*"])


def test_the_plugin_under_anyio_on_asyncio_and_trio(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
import pytest

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param
"""
    )
    result = run_suite(pytester, "@pytest.mark.anyio", "-p", "no:asyncio")
    result.assert_outcomes(passed=5, skipped=1)  # 2 async tests x 2 backends, 1 sync


def test_fence_device_can_be_chosen(pytester: pytest.Pytester) -> None:
    result = run_suite(pytester, "@pytest.mark.asyncio", "--fence-device=cuda", "-p", "asyncio")
    # No NVIDIA driver here: every test that needs the device skips, with the reason.
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(["*no CUDA device*"])


def test_the_testing_page_example_module_passes(pytester: pytest.Pytester) -> None:
    # docs/testing.md shows a user's test module; the docs' snippet run only
    # imports it, so it is run here as pytest would run it.
    page = (Path(__file__).parent.parent / "docs" / "testing.md").read_text()
    found = re.search(
        r"<!-- tests/test_pytest_plugin.py runs this module with pytest -->\n```python\n(.*?)```",
        page,
        re.DOTALL,
    )
    assert found, "docs/testing.md lost its example test module"
    pytester.makepyfile(test_from_the_docs=found.group(1))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    os.environ.setdefault("ASYNCFENCE_CUDA_DRIVER", "none")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "asyncio", "-p", "no:anyio", "-W", "error"
    )
    result.assert_outcomes(passed=2)


def _docs_module(marker: str) -> str:
    page = (Path(__file__).parent.parent / "docs" / "testing.md").read_text()
    found = re.search(re.escape(marker) + r"\n```python\n(.*?)```", page, re.DOTALL)
    assert found, f"docs/testing.md lost its example module ({marker})"
    return found.group(1)


ANYIO_MODULE = (
    "<!-- tests/test_pytest_plugin.py runs this module with pytest, under anyio on asyncio "
    "and trio -->"
)


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def test_the_testing_page_anyio_module_passes_on_asyncio_and_trio(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_from_the_docs=_docs_module(ANYIO_MODULE))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    os.environ.setdefault("ASYNCFENCE_CUDA_DRIVER", "none")
    # pytest-asyncio loaded too, in its default strict mode: it leaves anyio's tests alone.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "asyncio", "-v")
    torch = 2 if _torch_installed() else 0  # CI installs it: the torch test runs on both
    result.assert_outcomes(passed=4 + torch, skipped=2 - torch)
    result.stdout.fnmatch_lines(["*test_the_handler_waits_for_the_device?trio? PASSED*"])
    result.stdout.fnmatch_lines(["*test_a_device_fault_reaches_the_handler?trio? PASSED*"])


LIBRARY_STREAMS = """
import asyncfence
import pytest


@pytest.mark.anyio
async def test_torch(torch_stream):
    fence = asyncfence.record(torch_stream)
    await fence
    assert fence.done()


@pytest.mark.anyio
async def test_cuda_core(cuda_core_stream):
    await asyncfence.record(cuda_core_stream)
"""


def test_the_library_stream_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user_suite=LIBRARY_STREAMS)
    os.environ.setdefault("ASYNCFENCE_CUDA_DRIVER", "none")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio", "-rs")
    # anyio's default anyio_backend runs each test on asyncio and trio (installed here).
    # No NVIDIA driver in a user's suite here: cuda.core's tests skip, saying why.
    if _torch_installed():
        result.assert_outcomes(passed=2, skipped=2)
    else:
        result.assert_outcomes(skipped=4)
        result.stdout.fnmatch_lines(["*PyTorch is not installed*"])
    result.stdout.fnmatch_lines(["*no CUDA device*"])
