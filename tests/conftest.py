from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence.testing import OpenCLDevice, open_default_device

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pyopencl as cl

_uvloop_missing = importlib.util.find_spec("uvloop") is None
_trio_missing = importlib.util.find_spec("trio") is None


def _uvloop_factory() -> Any:
    import uvloop

    return uvloop.new_event_loop()


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(
            ("asyncio", {"loop_factory": _uvloop_factory}),
            id="uvloop",
            marks=pytest.mark.skipif(_uvloop_missing, reason="uvloop is not installed"),
        ),
        pytest.param(
            ("trio", {}),
            id="trio",
            marks=pytest.mark.skipif(_trio_missing, reason="trio is not installed"),
        ),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    backend: tuple[str, dict[str, Any]] = request.param
    return backend


@pytest.fixture(scope="session")
def device() -> OpenCLDevice:
    return open_default_device()


@pytest.fixture
def queue(device: OpenCLDevice) -> Iterator[cl.CommandQueue]:
    stream = device.new_stream()
    yield stream
    stream.finish()


@pytest.fixture
def unordered_queue(device: OpenCLDevice) -> Iterator[cl.CommandQueue]:
    stream = device.new_stream(in_order=False)
    yield stream
    stream.finish()


async def poller_ticks(count: int) -> None:
    """Let the running loop's poller tick ``count`` more times (it must be running)."""
    target = asyncfence.current_statistics().ticks + count
    with anyio.fail_after(10):
        while asyncfence.current_statistics().ticks < target:  # noqa: ASYNC110 (a counter)
            await anyio.sleep(0.0005)


async def until(predicate: Any) -> None:
    """Yield to the loop until ``predicate()`` holds; a guard fails a hang after 10 s."""
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 (a predicate, not an event)
            await anyio.sleep(0.0005)
