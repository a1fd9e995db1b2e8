"""``asyncfence.from_event``: a fence at an event the user's own code recorded.

On OpenCL (PoCL, the default device): a marker's, a non-blocking copy's, a
kernel's and a ``UserEvent``; each held behind a ``UserEvent`` gate, so the test decides when
the work completes or fails. Every guarantee of a recorded fence, on
asyncio, uvloop and trio.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import asyncfence
from asyncfence import DeviceError, DropQueue

from .conftest import HANG_GUARD_S, let_loop_run, until

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import pyopencl as cl

pytestmark = pytest.mark.usefixtures("opencl_queue")


@pytest.fixture
def cl_gate(opencl_queue: cl.CommandQueue) -> Iterator[cl.UserEvent]:
    """A UserEvent that the events under test wait for; completed at teardown."""
    import pyopencl as cl

    gate = cl.UserEvent(opencl_queue.context)
    yield gate
    if gate.command_execution_status != cl.command_execution_status.COMPLETE:
        with contextlib.suppress(cl.Error):
            gate.set_status(cl.command_execution_status.COMPLETE)


def _marker(queue: cl.CommandQueue, gate: cl.UserEvent) -> cl.Event:
    import pyopencl as cl

    return cl.enqueue_marker(queue, wait_for=[gate])


def _copy(queue: cl.CommandQueue, gate: cl.UserEvent) -> cl.Event:
    """A non-blocking device-to-host copy's own event (a NannyEvent, holding the host array)."""
    import pyopencl as cl

    device_buffer = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, 4096)
    host = np.zeros(1024, np.float32)
    return cl.enqueue_copy(queue, host, device_buffer, is_blocking=False, wait_for=[gate])


_FILL = "__kernel void fill(__global float *out) { out[get_global_id(0)] = 1.0f; }"


def _kernel(queue: cl.CommandQueue, gate: cl.UserEvent) -> cl.Event:
    """A kernel's own event: its call's."""
    import pyopencl as cl

    program = cl.Program(queue.context, _FILL)
    try:
        program.build()
    except cl.Error as error:
        # PyPI's PoCL 3.0 (LLVM 14) cannot build for CPUs newer than its LLVM;
        # CI runs these again on Debian's PoCL, where a skip is a failure.
        if os.environ.get("ASYNCFENCE_REQUIRE_KERNELS") == "1":
            pytest.fail(f"ASYNCFENCE_REQUIRE_KERNELS=1, but the device cannot build: {error}")
        pytest.skip(f"this OpenCL device cannot build kernels: {error}")
    out = cl.Buffer(queue.context, cl.mem_flags.WRITE_ONLY, 4 * 256)
    return program.fill(queue, (256,), None, out, wait_for=[gate])


EVENTS: dict[str, Callable[[cl.CommandQueue, cl.UserEvent], Any]] = {
    "marker": _marker,
    "copy": _copy,
    "kernel": _kernel,
    "user event": lambda queue, gate: gate,
}


@pytest.fixture(params=list(EVENTS))
def event_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


def _release(gate: cl.UserEvent) -> None:
    import pyopencl as cl

    gate.set_status(cl.command_execution_status.COMPLETE)


async def test_an_adopted_event_is_awaited_once_done_never_before(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent, event_kind: str, strategy: str
) -> None:
    fence = asyncfence.from_event(EVENTS[event_kind](opencl_queue, cl_gate))
    resumed: list[bool] = []

    async def wait() -> None:
        await fence
        resumed.append(True)

    with anyio.fail_after(HANG_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await let_loop_run()
            assert not fence.done()
            assert resumed == []
            _release(cl_gate)
    assert resumed == [True]
    assert fence.done()


async def test_an_adopted_event_gets_a_signal_of_its_own_when_parked(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent, wake_path: str
) -> None:
    # A recorded fence behind it on the same queue, parked first: the adopted
    # event is watched on its own, never left for that one's sweep.
    import pyopencl as cl

    later_gate = cl.UserEvent(opencl_queue.context)
    adopted = asyncfence.from_event(_copy(opencl_queue, cl_gate))
    recorded = asyncfence.record(opencl_queue)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(recorded.wait, strategy="park"))
            tg.start_soon(partial(adopted.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 2)
            if wake_path == "native":
                assert asyncfence.current_statistics().armed == 2
            _release(cl_gate)
            with anyio.fail_after(HANG_GUARD_S):
                await until(adopted.done)
    finally:
        _release(later_gate)
    assert recorded.done()


async def test_a_failed_event_raises_device_error_everywhere(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent
) -> None:
    # A marker's: a failed copy's own event complains, as pyopencl collects it.
    fence = asyncfence.from_event(_marker(opencl_queue, cl_gate))
    cl_gate.set_status(-5)
    with anyio.fail_after(HANG_GUARD_S), pytest.raises(DeviceError) as raised:
        await fence
    assert raised.value.backend == "opencl"
    with pytest.raises(DeviceError):
        fence.done()
    with pytest.raises(DeviceError):
        fence.wait_sync(timeout=HANG_GUARD_S)


async def test_timeouts_and_cancellation_leave_an_adopted_fence_awaitable(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent
) -> None:
    fence = asyncfence.from_event(_marker(opencl_queue, cl_gate))
    with pytest.raises(TimeoutError):
        await fence.wait(timeout=0.01)
    with anyio.move_on_after(0.01) as scope:
        await fence
    assert scope.cancelled_caught
    _release(cl_gate)
    with anyio.fail_after(HANG_GUARD_S):
        await fence
    assert asyncfence.current_statistics().waiters == 0


def test_wait_sync_on_an_adopted_event(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent
) -> None:
    fence = asyncfence.from_event(_copy(opencl_queue, cl_gate))
    with pytest.raises(TimeoutError):
        fence.wait_sync(timeout=0.01)
    releaser = threading.Thread(target=_release, args=(cl_gate,))
    releaser.start()
    fence.wait_sync(timeout=HANG_GUARD_S)
    releaser.join()
    assert fence.done()


async def test_another_queue_waits_on_the_device_for_an_adopted_event(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent, device: Any
) -> None:
    other = device.new_stream()
    asyncfence.from_event(_copy(opencl_queue, cl_gate)).enqueue_wait(other)
    after = asyncfence.record(other)
    await let_loop_run()
    assert not after.done()
    _release(cl_gate)
    with anyio.fail_after(HANG_GUARD_S):
        await after


async def test_a_drop_queue_keeps_a_copys_host_array_until_its_event_completes(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent
) -> None:
    freed: list[object] = []
    host = np.zeros(1024, np.float32)
    import pyopencl as cl

    device_buffer = cl.Buffer(opencl_queue.context, cl.mem_flags.READ_WRITE, host.nbytes)
    copy = cl.enqueue_copy(opencl_queue, host, device_buffer, is_blocking=False, wait_for=[cl_gate])
    async with DropQueue() as dq:
        dq.defer(asyncfence.from_event(copy), host, free=freed.append)
        await let_loop_run()
        assert freed == []
        _release(cl_gate)
    assert freed == [host]


def test_the_fence_keeps_the_event_alive_until_it_settles(
    opencl_queue: cl.CommandQueue, cl_gate: cl.UserEvent
) -> None:
    # A non-blocking copy's event, dropped by the user's code at once, is held
    # by the fence (collecting it early would block, GIL held, in pyopencl),
    # and let go once its work is done.
    event = _copy(opencl_queue, cl_gate)
    alone = sys.getrefcount(event)
    fence = asyncfence.from_event(event)
    assert sys.getrefcount(event) == alone + 1
    _release(cl_gate)
    fence.wait_sync(timeout=HANG_GUARD_S)
    assert sys.getrefcount(event) == alone


@pytest.mark.parametrize(
    "not_an_event",
    [None, 3, "event", object(), np.zeros(2)],
    ids=["None", "int", "str", "object", "ndarray"],
)
def test_what_is_no_event_is_a_type_error_naming_what_is_accepted(not_an_event: object) -> None:
    with pytest.raises(TypeError, match=r"from_event\(\) expects a pyopencl\.Event"):
        asyncfence.from_event(not_an_event)


def test_a_queue_is_no_event(opencl_queue: cl.CommandQueue) -> None:
    with pytest.raises(TypeError, match=r"pyopencl\.Event"):
        asyncfence.from_event(opencl_queue)
