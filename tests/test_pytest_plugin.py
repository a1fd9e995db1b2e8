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
