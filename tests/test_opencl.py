"""The OpenCL backend's own behaviour (PoCL): what the generic fence tests cannot see."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import asyncfence
from asyncfence._native import shim, unavailable_reason
from asyncfence.testing import StreamGate, hold

from .conftest import HANG_GUARD_S

if sys.version_info < (3, 11):
    pass

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice


async def test_fence_waits_for_work_queued_before_it(
    device: OpenCLDevice, queue: cl.CommandQueue
) -> None:
    import pyopencl as cl

    size = 8 << 20
    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, size=size)
    result = np.zeros(size, dtype=np.uint8)
    with hold(queue) as gate:
        cl.enqueue_fill_buffer(queue, buffer, np.full(1, 7, dtype=np.uint8), 0, size)
        # Kept: pyopencl's transfer event, dropped before its transfer ends,
        # waits for it with the GIL held (behind this gate, for ever).
        download = cl.enqueue_copy(queue, result, buffer, is_blocking=False)
        fence = asyncfence.record(queue)
        assert not result.any()  # held: nothing was written yet
        gate.release()
        await fence
    assert (result == 7).all()
    del download


def test_dropping_a_pending_fence_keeps_its_marker_until_it_settles(
    queue: cl.CommandQueue,
) -> None:
    import gc

    def held() -> int:
        (stats,) = [s for s in asyncfence.backend_statistics() if s.backend == "opencl"]
        return stats.held_markers

    held_before = held()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        del fence
        gc.collect()
        assert held() == held_before + 1
        # Failing the gate with the marker released would abort on PoCL 3.0.
        gate.fail()
    survivor = asyncfence.record(queue)
    survivor.wait_sync(timeout=30)


@pytest.mark.parametrize("state", ["pending", "done"])
def test_enqueue_wait_refuses_a_queue_of_another_context(device: OpenCLDevice, state: str) -> None:
    import pyopencl as cl

    queue = device.new_stream()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        if state == "done":
            gate.release()
            fence.wait_sync(timeout=30)
        other_context = cl.CommandQueue(cl.Context(device.context.devices))
        with pytest.raises(ValueError, match="context"):
            fence.enqueue_wait(other_context)


# -- enqueue_wait on failed fences ---------------------------------------------


def test_enqueue_wait_on_a_failed_fence_raises_and_leaves_the_stream_running(
    device: Any, queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    gate.fail(-5)
    queue.finish()
    other = device.new_stream()
    try:
        with pytest.raises(asyncfence.DeviceError) as failure:
            fence.enqueue_wait(other)  # not polled yet: found failed here
        assert failure.value.name == "CL_FAILED"
        later = asyncfence.record(other)
        later.wait_sync(timeout=HANG_GUARD_S)
    finally:
        device.close_stream(other)


def test_a_fence_that_fails_after_enqueue_wait_fails_the_waiting_stream(
    device: Any, queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    other = device.new_stream()
    try:
        fence.enqueue_wait(other)
        later = asyncfence.record(other)
        gc.collect()  # nothing but the backend keeps the barrier alive now
        gate.fail(-5)  # PoCL 3.0 aborted the process here when the barrier was gone
        with pytest.raises(asyncfence.DeviceError):
            fence.wait_sync(timeout=HANG_GUARD_S)
        with pytest.raises(asyncfence.DeviceError) as failure:
            later.wait_sync(timeout=HANG_GUARD_S)
        assert (failure.value.code, failure.value.name) == (-1, "CL_FAILED")
    finally:
        device.close_stream(other)


def run_fresh_python(code: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, on OpenCL alone, bounded by the hang guard."""
    return subprocess.run(
        [sys.executable, "-c", code, *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=HANG_GUARD_S,
        check=False,
    )


def test_a_fence_failing_while_enqueue_wait_runs_raises_saying_so() -> None:
    # In a fresh process, left with os._exit: the waiting queue may be wedged
    # for good, and releasing a wedged PoCL queue waits for it.
    code = """
import inspect, os, sys, threading
import asyncfence
from asyncfence import _core
from asyncfence.testing import StreamGate, open_default_device
device = open_default_device("opencl")
queue, other = device.new_stream(), device.new_stream()
gate = StreamGate(queue)
fence = asyncfence.record(queue)
lines, first = inspect.getsourcelines(_core.FenceCore.enqueue_wait)
target = first + next(i for i, line in enumerate(lines) if "marker = self._pin()" in line)
paused, go, result = threading.Event(), threading.Event(), []
def local(frame, event, arg):
    if event == "line" and frame.f_lineno == target:
        paused.set(); go.wait(30)
    return local
def calls(frame, event, arg):
    return local if frame.f_code is _core.FenceCore.enqueue_wait.__code__ else None
def enqueue_wait():
    sys.settrace(calls)
    try:
        fence.enqueue_wait(other)
        result.append("returned")
    except asyncfence.DeviceError as error:
        result.append(error.detail)
    finally:
        sys.settrace(None)
thread = threading.Thread(target=enqueue_wait)
thread.start()
assert paused.wait(30)  # past its own check: the fence was still pending
gate.fail(-5)
queue.finish()  # the fence has failed now
go.set()
thread.join(30)
print(result)
sys.stdout.flush()
os._exit(0)
"""
    result = run_fresh_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "failed while enqueue_wait ran" in result.stdout


async def test_warm_up_takes_a_queue_and_refuses_what_is_no_stream(queue: Any) -> None:
    await anyio.to_thread.run_sync(asyncfence.warm_up, queue)  # it blocks: off the loop
    asyncfence.warm_up()
    await asyncfence.record(queue)
    with pytest.raises(TypeError, match="expected"):
        asyncfence.warm_up(queue, object())


_FIRST_PARK_UNDER_BLOCKBUSTER = """
import asyncio, sys
from blockbuster import blockbuster_ctx
import asyncfence
from asyncfence.testing import StreamGate, open_default_device

device = open_default_device("opencl")
queue = device.new_stream()
if sys.argv[1] == "warmed":
    asyncfence.warm_up(queue)

async def main():
    gate = StreamGate(queue)
    with blockbuster_ctx("asyncfence"):
        fence = asyncfence.record(queue)
        waiter = asyncio.ensure_future(fence.wait(strategy="park"))
        while asyncfence.current_statistics().parked < 1:
            await asyncio.sleep(0.001)
        armed = asyncfence.current_statistics().armed
        gate.release()
        await waiter
    print(armed, asyncfence.current_statistics().signals)

asyncio.run(main())
"""


@pytest.mark.parametrize("start", ["cold", "warmed"])
def test_after_warm_up_the_first_park_arms_its_signal_without_blocking(start: str) -> None:
    pytest.importorskip("blockbuster")
    if shim() is None:
        pytest.skip(f"the native shim is not in use: {unavailable_reason()}")
    result = run_fresh_python(_FIRST_PARK_UNDER_BLOCKBUSTER, start)
    assert result.returncode == 0, result.stderr[-3000:]
    if start == "cold":  # the first arm finds the OpenCL library: blocked, so re-checked
        assert result.stdout.split() == ["0", "0"]
    else:  # armed at once, and woken by its signal
        assert result.stdout.split() == ["1", "1"]
