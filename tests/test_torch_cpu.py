"""torch's CPU streams: a fence on one is done when recorded, and awaiting it a checkpoint.

Device-agnostic PyTorch code asks ``torch.get_device_module(device)`` for its
stream; on CPU-only PyTorch that is a ``torch.cpu.Stream``, whose work is done
when the call that queues it returns. Runs on CPU PyTorch (CI installs
``torch==2.13.0``, the CPU build) under asyncio, uvloop and trio.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import anyio
import pytest

import asyncfence
from asyncfence._backend import backend_names
from asyncfence.testing import hold

from .torch_support import import_torch

torch = import_torch()


def cpu_streams() -> list[Any]:
    return [
        torch.get_device_module("cpu").current_stream(),
        torch.get_device_module(torch.device("cpu")).Stream(),
        torch.cpu.current_stream(),
        torch.Stream(device="cpu"),
    ]


@pytest.fixture(
    params=range(len(cpu_streams())), ids=lambda i: ["module", "new", "cpu", "generic"][i]
)
def stream(request: pytest.FixtureRequest) -> Any:
    return cpu_streams()[request.param]


async def test_a_fence_on_a_cpu_stream_is_done_when_recorded(stream: Any) -> None:
    x = torch.ones(256, 256)
    y = x @ x  # CPU work: done when this returns
    fence = asyncfence.record(stream)
    assert fence.done()
    assert repr(fence).endswith("done>")
    fence.wait_sync(timeout=0)
    await fence
    await fence.wait(timeout=0)
    assert y[0, 0].item() == 256
    assert asyncfence.current_statistics().pending_fences == 0


async def test_awaiting_a_cpu_fence_is_still_a_checkpoint(stream: Any) -> None:
    fence = asyncfence.record(stream)
    ran = []

    async def other() -> None:
        ran.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        assert ran == []
        # Nothing else here yields: only the awaits of the done fence let `other`
        # run (trio may run this task first at a checkpoint, asyncio never does).
        for _ in range(100):
            await fence
            if ran:
                break
        assert ran == ["other"]

    with anyio.CancelScope() as scope:
        scope.cancel()
        await fence  # the cancellation is delivered here
        pytest.fail("a cancelled await of a done fence returned")
    assert scope.cancelled_caught


def test_cpu_streams_wait_for_cpu_fences_trivially(stream: Any) -> None:
    fence = asyncfence.record(stream)
    for other in cpu_streams():
        fence.enqueue_wait(other)
    assert asyncfence.record(stream).done()


async def test_the_drop_queue_and_the_staging_pool_release_at_once(stream: Any) -> None:
    drops = asyncfence.DropQueue()
    freed: list[object] = []
    drops.defer(asyncfence.record(stream), "kept", free=freed.append)
    await drops.aclose()
    assert freed == ["kept"]
    pool = asyncfence.StagingPool(lambda: torch.empty(16), 1)
    buffer = await pool.acquire()
    pool.release_after(asyncfence.record(stream), buffer)
    with anyio.fail_after(10):
        assert await pool.acquire() is buffer
    await pool.aclose()


def test_a_torch_stream_on_another_device_is_refused_saying_what_to_pass() -> None:
    meta = torch.Stream(device="meta")
    with pytest.raises(TypeError, match=r"got a torch\.Stream on 'meta'.*current_stream\(\)"):
        asyncfence.record(meta)
    fence = asyncfence.record(torch.cpu.Stream())
    with pytest.raises(TypeError, match=r"torch\.Stream on 'meta'"):
        fence.enqueue_wait(meta)


class Stream:
    """Not torch's: the messages must tell the two apart."""


def test_every_expected_a_stream_message_names_the_full_type() -> None:
    with pytest.raises(
        TypeError, match=r"expected a device stream .*; got tests\.test_torch_cpu\.Stream object$"
    ):
        asyncfence.record(Stream())
    fence = asyncfence.record(torch.cpu.Stream())
    with pytest.raises(
        TypeError,
        match=r"PyTorch CPU fences can only be waited on by .*; "
        r"got tests\.test_torch_cpu\.Stream object$",
    ):
        fence.enqueue_wait(Stream())
    with pytest.raises(TypeError, match=r"got int object$"):
        fence.enqueue_wait(7)


def test_an_opencl_fence_names_the_full_type_of_a_torch_cpu_stream(opencl_queue: Any) -> None:
    fence = asyncfence.record(opencl_queue)
    with pytest.raises(TypeError, match=r"got torch\.cpu\.Stream object$"):
        fence.enqueue_wait(torch.cpu.Stream())


def test_a_cpu_stream_cannot_be_held() -> None:
    with (
        pytest.raises(TypeError, match=r"cannot hold a torch\.cpu\.Stream: work on torch's CPU"),
        hold(torch.cpu.Stream()),
    ):
        pytest.fail("held a CPU stream")


def test_the_cpu_backend_is_no_device_of_the_registry() -> None:
    assert "torch-cpu" not in backend_names()  # not a --fence-device, nor a default device
    assert "torch-cpu" not in {stats.backend for stats in asyncfence.backend_statistics()}


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (no CUDA driver); it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_torch_is_imported_only_for_a_stream_of_torchs() -> None:
    program = """
import sys
import asyncfence

class Stream:
    pass

Stream.__module__ = "torchlike"
for stream in (Stream(), object(), 3.5):
    try:
        asyncfence.record(stream)
    except TypeError:
        pass
print("torch imported:", "torch" in sys.modules)
"""
    assert "torch imported: False" in run_python(program).stdout


def test_a_forked_child_records_on_cpu_streams_as_its_parent_did() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("needs fork()")
    # In a fresh process: forking this multi-threaded one is what the test is not about.
    code = """
import os
import torch
import asyncfence
assert asyncfence.record(torch.cpu.Stream()).done()  # the parent used the backend
pid = os.fork()
if pid == 0:
    os._exit(0 if asyncfence.record(torch.cpu.current_stream()).done() else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    run_python(code)
