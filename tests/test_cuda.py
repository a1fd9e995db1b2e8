"""The CUDA backend: against the emulated driver in CI, the real one on a GPU.

Each run's header says which driver it used. Tests that need the emulator's
hooks (faults, live-object counts), and those that pass handles a real driver
would take as undefined behaviour (a destroyed stream, say), skip on a real
driver.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import pytest

import asyncfence
from asyncfence import (
    DeviceBuffer,
    DeviceError,
    DropQueue,
    FenceError,
    PinnedBuffer,
    StagingPool,
    _blocking,
)
from asyncfence._backend import backend_for
from asyncfence._backends.cuda import CudaBackend
from asyncfence._backends.cuda._driver import current_context, per_thread_default_stream
from asyncfence._native import shim
from asyncfence.testing import StreamGate, hold

from .conftest import HANG_GUARD_S, let_loop_run, pause_at, until

if sys.version_info < (3, 11):
    pass

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from asyncfence.testing import CudaDevice

    from .cuda_emulator import Emulator


ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


# Every test here runs under each strategy: the semantics do not depend on it.
pytestmark = pytest.mark.usefixtures("strategy")


class ProtocolStream:
    """A stream from a library that speaks ``__cuda_stream__`` (as cuda.core does)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cuda_backend() -> CudaBackend:
    backend = backend_for(0)
    assert isinstance(backend, CudaBackend)
    return backend


# -- waiting ---------------------------------------------------------------------


async def test_waiter_stays_pending_until_the_stream_is_released(cuda_stream: Any) -> None:
    resumed = anyio.Event()
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)

        async def waiter() -> None:
            await fence
            resumed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            await let_loop_run()
            assert not resumed.is_set()
            assert not fence.done()
            gate.release()
    assert fence.done()


async def test_fence_waits_for_work_queued_before_it(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    from cuda.bindings import driver

    size = 1 << 20
    host = driver.cuMemAllocHost(size)[1]
    try:
        with hold(cuda_stream) as gate:
            assert driver.cuMemsetD8Async(host, 9, size, cuda_stream)[0] == 0
            fence = asyncfence.record(cuda_stream)
            gate.release()
            await fence
        assert (ctypes.c_uint8 * size).from_address(host)[size - 1] == 9
    finally:
        driver.cuMemFreeHost(host)


async def test_many_waiters_and_a_cancelled_one(cuda_stream: Any) -> None:
    resumed = 0
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)

        async def waiter() -> None:
            nonlocal resumed
            await fence
            resumed += 1

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(waiter)
            # Under load the 50 may not all have reached their await yet.
            await until(lambda: asyncfence.current_statistics().waiters == 50)
            with anyio.move_on_after(0.01):
                await fence  # this one times out; the others keep waiting
            assert asyncfence.current_statistics().waiters == 50
            gate.release()
    assert resumed == 50


async def test_timeout_then_wait_sync(cuda_stream: Any) -> None:
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)
        with pytest.raises(TimeoutError):
            await fence.wait(timeout=0.01)
        with pytest.raises(TimeoutError):
            fence.wait_sync(timeout=0.01)
        gate.release()
        await anyio.to_thread.run_sync(fence.wait_sync, 30)
    assert fence.done()


# -- stream objects ----------------------------------------------------------------


async def test_accepts_every_form_of_stream(cuda_stream: Any) -> None:
    handle = int(cuda_stream)
    for stream in (cuda_stream, handle, ProtocolStream(handle)):
        with hold(stream) as gate:
            fence = asyncfence.record(stream)
            assert not fence.done()
            gate.release()
            await fence


async def test_default_streams_with_a_current_context(cuda_device: CudaDevice) -> None:
    for handle in (0, 1, 2):
        fence = asyncfence.record(handle)
        await fence
        assert fence.done()


@pytest.mark.parametrize("handle", [-1, 1 << 64])
def test_out_of_range_handles_are_refused(cuda_mode: str, handle: int) -> None:
    with pytest.raises(ValueError, match="handle"):
        asyncfence.record(handle)


@pytest.mark.usefixtures("emulated_driver")
def test_a_destroyed_stream_is_a_device_error(cuda_device: CudaDevice) -> None:
    # Emulator only: a real driver documents a destroyed handle as undefined behaviour.
    from cuda.bindings import driver

    stream = cuda_device.new_stream()
    handle = int(stream)
    driver.cuStreamDestroy(stream)
    with pytest.raises(DeviceError) as caught:
        asyncfence.record(handle)
    assert caught.value.backend == "cuda"
    assert caught.value.name == "CUDA_ERROR_INVALID_HANDLE"


@pytest.mark.usefixtures("emulated_driver")
def test_the_emulated_driver_is_the_version_asked_for() -> None:
    """CI runs this file on both: 13.2 (the default) and 13.0 (no cuLaunchHostFunc_v2)."""
    from cuda.bindings import driver

    expected = int(os.environ.get("ASYNCFENCE_EMULATED_DRIVER_VERSION", "13020"))
    assert driver.cuDriverGetVersion()[1] == expected
    assert cuda_backend().host_functions().path == ("v2" if expected >= 13020 else "v1")


def test_fail_is_not_possible_on_a_cuda_gate(cuda_stream: Any) -> None:
    with hold(cuda_stream) as gate, pytest.raises(NotImplementedError, match="CUDA"):
        gate.fail()


# -- events and their pool -----------------------------------------------------------


async def test_ten_thousand_fences_on_eight_streams_reuse_pooled_events(
    cuda_device: CudaDevice, emulator: Emulator
) -> None:
    from cuda.bindings import driver

    streams = [cuda_device.new_stream() for _ in range(8)]
    backend = cuda_backend()

    async def round_of_fences() -> None:
        for _ in range(10):  # 10 batches of 1,000: 10,000 fences
            fences = [asyncfence.record(streams[i % 8]) for i in range(1000)]
            async with anyio.create_task_group() as tg:
                for fence in fences[-8:]:
                    tg.start_soon(fence.wait)
            assert all(fence.done() for fence in fences)
            del fences
            # A few loop turns: the rest of each wake, which runs once the
            # woken tasks have, returns their fences' events to the pool.
            await let_loop_run()

    # Events neither pooled for fences nor held by one (the lab's raw events,
    # say, which calibrating busy work uses): the same before and after.
    # Collect first: a finalizer run between the reads would skew them.
    gc.collect()
    others = emulator.live_events() - backend.pooled_events() - _events_in_use()
    try:
        await round_of_fences()
        gc.collect()
        steady = emulator.live_events()
        created = emulator.events_created()
        assert steady == backend.pooled_events() + _events_in_use() + others
        (stats,) = [s for s in asyncfence.backend_statistics() if s.backend == "cuda"]
        assert stats.pooled_markers == backend.pooled_events()
        await round_of_fences()
        gc.collect()
        assert emulator.events_created() == created  # steady state: no cuEventCreate
        assert emulator.live_events() == steady
        assert backend.pooled_events() <= steady
    finally:
        for stream in streams:
            driver.cuStreamDestroy(stream)


def _events_in_use() -> int:

    from asyncfence._core import FenceCore

    gc.collect()
    return sum(
        1
        for obj in gc.get_objects()
        # type(), not isinstance(): the latter reads __class__, which some of
        # torch's objects answer with a deprecation warning.
        if type(obj) is FenceCore and obj.backend.name == "cuda" and not obj.marker_released
    )


def test_events_are_created_without_timing(cuda_stream: Any, emulator: Emulator) -> None:
    from cuda.bindings import driver

    fence = asyncfence.record(cuda_stream)
    event = fence._core._marker.event
    assert emulator.event_flags(int(event)) == driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    fence.wait_sync(timeout=30)


# -- enqueue_wait ------------------------------------------------------------------


async def assert_second_waits_for_first(first: Any, second: Any) -> None:
    """A fence on held ``first``, waited for by ``second``: ``second`` is held too."""
    from cuda.bindings import driver

    try:
        with hold(first) as gate:
            fence = asyncfence.record(first)
            fence.enqueue_wait(second)
            later = asyncfence.record(second)
            with anyio.move_on_after(0.02):  # a few poller ticks, or a parked wait
                await later
            assert not later.done()
            gate.release()
            await later
        assert fence.done()
    finally:
        driver.cuStreamDestroy(first)
        driver.cuStreamDestroy(second)


async def test_enqueue_wait_holds_another_stream(cuda_device: CudaDevice) -> None:
    await assert_second_waits_for_first(cuda_device.new_stream(), cuda_device.new_stream())


@pytest.mark.usefixtures("two_cuda_devices")
async def test_enqueue_wait_across_devices(cuda_device: CudaDevice) -> None:
    from asyncfence.testing import CudaDevice

    first = cuda_device.new_stream()
    second = CudaDevice(1).new_stream()
    cuda_device.make_current()
    await assert_second_waits_for_first(first, second)


def test_enqueue_wait_refuses_an_opencl_queue(cuda_stream: Any, queue: Any) -> None:
    fence = asyncfence.record(cuda_stream)
    with pytest.raises(TypeError, match="CUDA stream"):
        fence.enqueue_wait(queue)


# -- faults ------------------------------------------------------------------------


async def test_a_sticky_fault_reaches_every_waiter_of_its_context(
    cuda_device: CudaDevice, emulator: Emulator
) -> None:
    from cuda.bindings import driver

    from asyncfence.testing import CudaDevice

    streams = [cuda_device.new_stream() for _ in range(3)]
    other_device = CudaDevice(1)
    bystander_stream = other_device.new_stream()
    cuda_device.make_current()
    errors: list[DeviceError] = []
    gates = [hold(stream) for stream in streams]
    bystander_gate = hold(bystander_stream)
    try:
        for gate in gates:
            gate.__enter__()
        bystander_held = bystander_gate.__enter__()
        fences = [asyncfence.record(stream) for stream in streams for _ in range(4)]
        bystander = asyncfence.record(bystander_stream)

        async def waiter(fence: asyncfence.Fence) -> None:
            try:
                await fence
            except DeviceError as error:
                errors.append(error)

        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(waiter, fence)
                tg.start_soon(waiter, fence)
            tg.start_soon(bystander.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 25)
            emulator.inject_fault(int(cuda_device.context), 700)
            await until(lambda: len(errors) == 24)
            assert not bystander.done()  # another context is untouched
            bystander_held.release()
        assert {(e.code, e.name) for e in errors} == {(700, "CUDA_ERROR_ILLEGAL_ADDRESS")}
        assert "illegal memory access" in str(errors[0])
        for fence in fences:
            with pytest.raises(DeviceError):
                fence.done()
        assert bystander.done()
    finally:
        emulator.clear_fault(int(cuda_device.context))
        for gate in gates:
            gate.__exit__(None, None, None)
        bystander_gate.__exit__(None, None, None)
        for stream in [*streams, bystander_stream]:
            driver.cuStreamDestroy(stream)


async def test_a_fault_in_the_middle_of_a_stream(
    cuda_device: CudaDevice, cuda_stream: Any, emulator: Emulator
) -> None:
    try:
        before = asyncfence.record(cuda_stream)
        await before
        with hold(cuda_stream) as gate:  # the fault must not strike before the record
            emulator.launch_fault(int(cuda_stream), 719)
            after = asyncfence.record(cuda_stream)
            gate.release()
        with pytest.raises(DeviceError) as caught:
            await after
        assert caught.value.name == "CUDA_ERROR_LAUNCH_FAILED"
        assert before.done()  # settled before the fault: stays done
        with pytest.raises(DeviceError):
            after.wait_sync(timeout=30)
    finally:
        emulator.clear_fault(int(cuda_device.context))


# -- CUDA graph capture (the emulator's model of it) ----------------------------------

GRAPH_ADVICE = ("cuStreamEndCapture", "cuGraphLaunch", "docs/graphs.md")


def begin_capture(stream: Any, mode: str = "GLOBAL") -> None:
    from cuda.bindings import driver

    chosen = getattr(driver.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{mode}")
    assert driver.cuStreamBeginCapture(stream, chosen)[0] == 0


def end_capture(stream: Any) -> tuple[int, Any]:
    """End the capture begun on ``stream``: the CUresult code, and the graph (or None)."""
    from cuda.bindings import driver

    err, graph = driver.cuStreamEndCapture(stream)
    return int(err), graph if err == 0 else None


def capture_status(stream: Any) -> int:
    from cuda.bindings import driver

    err, status = driver.cuStreamIsCapturing(stream)
    assert err == 0
    return int(status)


def destroy_graph(graph: Any) -> None:
    from cuda.bindings import driver

    assert driver.cuGraphDestroy(graph)[0] == 0


def relaxed_query(event: Any) -> int:
    """``cuEventQuery`` in relaxed capture mode, which no capture refuses."""
    from cuda.bindings import driver

    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = driver.cuThreadExchangeStreamCaptureMode(relaxed)[1]
    try:
        return int(driver.cuEventQuery(event)[0])
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


@pytest.fixture
def blocking_stream(cuda_device: CudaDevice) -> Iterator[Any]:
    """A blocking stream (flags 0): the legacy default stream synchronizes with it."""
    from cuda.bindings import driver

    stream = driver.cuStreamCreate(0)[1]
    yield stream
    driver.cuStreamDestroy(stream)  # also ends a capture a failed test left open


@pytest.mark.usefixtures("emulated_driver")
def test_the_emulator_captures_instead_of_running(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    """What the backend's refusal rests on: captured work and events never run."""
    from cuda.bindings import driver

    side = cuda_device.new_stream()
    event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    host = PinnedBuffer(64)
    try:
        begin_capture(cuda_stream)
        assert driver.cuMemsetD8Async(host.address, 7, 64, cuda_stream)[0] == 0
        assert driver.cuEventRecord(event, cuda_stream)[0] == 0
        assert relaxed_query(event) == 907  # CUDA_ERROR_CAPTURED_EVENT
        # A stream that waits for a captured event is pulled into the capture...
        assert driver.cuStreamWaitEvent(side, event, 0)[0] == 0
        assert capture_status(side) == 1  # ACTIVE
        # ...and the capture fails unless it is joined back.
        assert end_capture(cuda_stream) == (904, None)  # STREAM_CAPTURE_UNJOINED
        assert capture_status(side) == capture_status(cuda_stream) == 0
        assert driver.cuStreamSynchronize(cuda_stream)[0] == 0
        assert bytes(host.view()) == bytes(64)  # the captured memset never ran
        assert relaxed_query(event) == 907  # until it is recorded again, outside
    finally:
        host.free()
        driver.cuEventDestroy(event)
        driver.cuStreamDestroy(side)


@pytest.mark.usefixtures("emulated_driver")
def test_the_emulator_replays_a_joined_capture(cuda_device: CudaDevice, cuda_stream: Any) -> None:
    from cuda.bindings import driver

    side = cuda_device.new_stream()
    fork, join = (
        driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1] for _ in range(2)
    )
    host = PinnedBuffer(64)
    try:
        begin_capture(cuda_stream)
        assert driver.cuEventRecord(fork, cuda_stream)[0] == 0
        assert driver.cuStreamWaitEvent(side, fork, 0)[0] == 0
        assert driver.cuMemsetD8Async(host.address, 5, 64, side)[0] == 0
        assert driver.cuEventRecord(join, side)[0] == 0
        assert driver.cuStreamWaitEvent(cuda_stream, join, 0)[0] == 0
        err, graph = end_capture(cuda_stream)
        assert err == 0
        assert bytes(host.view()) == bytes(64)
        err, executable = driver.cuGraphInstantiate(graph, 0)
        assert err == 0
        assert driver.cuGraphLaunch(executable, cuda_stream)[0] == 0
        assert driver.cuStreamSynchronize(cuda_stream)[0] == 0
        assert bytes(host.view()) == bytes([5] * 64)
        assert driver.cuGraphExecDestroy(executable)[0] == 0
        destroy_graph(graph)
    finally:
        host.free()
        for event in (fork, join):
            driver.cuEventDestroy(event)
        driver.cuStreamDestroy(side)


@pytest.mark.usefixtures("emulated_driver")
def test_the_emulator_guards_the_legacy_stream_and_unsafe_calls(
    cuda_device: CudaDevice, blocking_stream: Any
) -> None:
    from cuda.bindings import driver

    event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    try:
        begin_capture(blocking_stream)
        # Asking is harmless: STREAM_CAPTURE_IMPLICIT, and the capture stays valid.
        assert driver.cuStreamIsCapturing(driver.CUstream(1))[0] == 906  # the legacy stream
        assert end_capture(blocking_stream)[0] == 0
        begin_capture(blocking_stream)
        # Using the legacy stream invalidates the capture.
        assert driver.cuEventRecord(event, driver.CUstream(1))[0] == 906
        assert end_capture(blocking_stream) == (901, None)  # STREAM_CAPTURE_INVALIDATED
        begin_capture(blocking_stream)
        # In global mode, a query during a capture is refused and invalidates it.
        assert driver.cuEventQuery(event)[0] == 900  # STREAM_CAPTURE_UNSUPPORTED
        assert end_capture(blocking_stream) == (901, None)
    finally:
        driver.cuEventDestroy(event)


def assert_refused_for_capture(caught: pytest.ExceptionInfo[FenceError], reason: str) -> None:
    assert not isinstance(caught.value, DeviceError)  # not a failure of the work
    message = str(caught.value)
    assert reason in message
    for advice in GRAPH_ADVICE:
        assert advice in message


def test_a_capturing_stream_refuses_a_fence(cuda_stream: Any, emulator: Emulator) -> None:
    backend = cuda_backend()
    asyncfence.record(cuda_stream).wait_sync(timeout=30)  # an event in the pool
    pooled = backend.pooled_events()
    created = emulator.events_created()
    begin_capture(cuda_stream)
    with pytest.raises(FenceError) as caught:
        asyncfence.record(cuda_stream)
    assert_refused_for_capture(caught, "cannot record a fence on a stream that is capturing")
    assert backend.pooled_events() == pooled  # no event taken, none lost
    assert emulator.events_created() == created
    err, graph = end_capture(cuda_stream)
    assert err == 0  # the capture is untouched: nothing joined, nothing invalidated
    destroy_graph(graph)


@pytest.mark.parametrize("handle", [0, 1])
def test_the_legacy_stream_refuses_a_fence_while_a_blocking_stream_captures(
    blocking_stream: Any, cuda_stream: Any, handle: int
) -> None:
    begin_capture(blocking_stream)
    if handle == 0 and per_thread_default_stream():
        # Handle 0 is this thread's per-thread default stream in this mode:
        # it does not synchronize with the capture, and takes fences.
        asyncfence.record(handle).wait_sync(timeout=30)
    else:
        with pytest.raises(FenceError) as caught:
            asyncfence.record(handle)
        assert_refused_for_capture(caught, "legacy default stream")
    # Streams that do not synchronize with the capture still take fences.
    asyncfence.record(cuda_stream).wait_sync(timeout=30)
    asyncfence.record(2).wait_sync(timeout=30)  # the per-thread default stream
    err, graph = end_capture(blocking_stream)
    assert err == 0  # not invalidated: asyncfence asked, it did not use the legacy stream
    destroy_graph(graph)
    asyncfence.record(handle).wait_sync(timeout=30)


async def test_after_the_capture_fences_record_and_follow_the_graph(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    """The documented pattern: the fence goes on the launch stream, after cuGraphLaunch."""
    from cuda.bindings import driver

    host = PinnedBuffer(64)
    try:
        begin_capture(cuda_stream)
        assert driver.cuMemsetD8Async(host.address, 9, 64, cuda_stream)[0] == 0
        err, graph = end_capture(cuda_stream)
        assert err == 0
        await asyncfence.record(cuda_stream)  # recording works again at once
        executable = driver.cuGraphInstantiate(graph, 0)[1]
        with hold(cuda_stream) as gate:
            assert driver.cuGraphLaunch(executable, cuda_stream)[0] == 0
            fence = asyncfence.record(cuda_stream)
            await let_loop_run()
            assert not fence.done()
            assert bytes(host.view()) == bytes(64)
            gate.release()
            await fence
        assert bytes(host.view()) == bytes([9] * 64)  # the graph's work, done
        driver.cuGraphExecDestroy(executable)
        destroy_graph(graph)
    finally:
        host.free()


def test_enqueue_wait_refuses_a_capturing_stream(cuda_device: CudaDevice, cuda_stream: Any) -> None:
    from cuda.bindings import driver

    capturing = cuda_device.new_stream()
    try:
        fence = asyncfence.record(cuda_stream)
        begin_capture(capturing)
        with pytest.raises(FenceError) as caught:
            fence.enqueue_wait(capturing)
        assert_refused_for_capture(caught, "cannot make a fence wait on a stream that is capturing")
        err, graph = end_capture(capturing)
        assert err == 0
        destroy_graph(graph)
        fence.enqueue_wait(capturing)  # after the capture: fine
    finally:
        driver.cuStreamDestroy(capturing)


@pytest.mark.parametrize("where", ["this thread", "another thread"])
async def test_waiting_during_a_capture_leaves_it_valid(
    cuda_device: CudaDevice, cuda_stream: Any, where: str
) -> None:
    """Polls and parked waits query events: in relaxed mode, never refused by a capture.

    In the default (global) capture mode a plain query, on the capturing
    thread or any other, would be refused and invalidate the capture.
    """
    from cuda.bindings import driver

    capturing = cuda_device.new_stream()
    started, finish = threading.Event(), threading.Event()
    result: dict[str, int] = {}

    def capture_elsewhere() -> None:
        cuda_device.make_current()
        begin_capture(capturing)
        started.set()
        finish.wait(30)
        err, graph = end_capture(capturing)
        result["end"] = err
        if graph is not None:
            destroy_graph(graph)

    thread = threading.Thread(target=capture_elsewhere)
    try:
        with hold(cuda_stream) as gate:
            fence = asyncfence.record(cuda_stream)
            if where == "this thread":
                begin_capture(capturing)
            else:
                thread.start()
                await anyio.to_thread.run_sync(started.wait, 30)
            async with anyio.create_task_group() as tg:
                tg.start_soon(fence.wait)
                await until(lambda: asyncfence.current_statistics().waiters == 1)
                await let_loop_run()  # polls, or a parked wait's signal and rechecks
                assert not fence.done()
                gate.release()
            if where == "this thread":
                err, graph = end_capture(capturing)
                result["end"] = err
                destroy_graph(graph)
            else:
                finish.set()
                await anyio.to_thread.run_sync(thread.join, 30)
        assert result == {"end": 0}
    finally:
        finish.set()
        driver.cuStreamDestroy(capturing)


async def test_the_drop_queue_never_defers_into_a_capture(cuda_stream: Any) -> None:
    freed: list[object] = []
    kept = object()
    async with DropQueue() as dq:
        begin_capture(cuda_stream)
        with pytest.raises(FenceError, match="capturing a CUDA graph"):
            dq.defer(asyncfence.record(cuda_stream), kept, free=freed.append)
        assert dq.statistics().pending_items == 0  # nothing waits on a captured event
        err, graph = end_capture(cuda_stream)
        assert err == 0
        destroy_graph(graph)
        dq.defer(asyncfence.record(cuda_stream), kept, free=freed.append)
        await dq.drain(timeout=30)
    assert freed == [kept]


async def test_a_staging_pool_never_defers_into_a_capture(cuda_stream: Any) -> None:
    pool = StagingPool(lambda: bytearray(16), 2)
    buffer = await pool.acquire()
    begin_capture(cuda_stream)
    with pytest.raises(FenceError, match="capturing a CUDA graph"):
        pool.release_after(asyncfence.record(cuda_stream), buffer)
    assert pool.statistics().returning == 0
    assert pool.available == 1  # the buffer stays with its taker
    err, graph = end_capture(cuda_stream)
    assert err == 0
    destroy_graph(graph)
    pool.release_after(asyncfence.record(cuda_stream), buffer)
    await until(lambda: pool.available == 2)
    await pool.aclose()


# -- contexts: default streams from any thread, per-thread streams, frees ------------


class _TorchDevice:
    def __init__(self, index: int) -> None:
        self.type = "cuda"
        self.index = index


class FakeTorchStream:
    """Looks like ``torch.cuda.current_stream()``: handle 0, and its device."""

    def __init__(self, handle: int, device: int) -> None:
        self.cuda_stream = handle
        self.device = _TorchDevice(device)


class FakeCupyStream:
    """Looks like a ``cupy.cuda.Stream``."""

    def __init__(self, handle: int, device: int) -> None:
        self.ptr = handle
        self.device_id = device


class _CoreDevice:
    def __init__(self, device_id: int) -> None:
        self.device_id = device_id


class FakeCoreStream:
    """Looks like a cuda.core ``Stream``."""

    def __init__(self, handle: int, device: int) -> None:
        self._handle = handle
        self.device = _CoreDevice(device)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


FakeTorchStream.__module__ = "torch.cuda.streams"
FakeCupyStream.__module__ = "cupy.cuda.stream"
FakeCoreStream.__module__ = "cuda.core._stream"

FAKE_STREAMS = [FakeTorchStream, FakeCupyStream, FakeCoreStream]


def in_fresh_thread(function: Callable[[], T]) -> T:
    """Run ``function`` on a new thread, which has no current context; return its result."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value


def primary_context(ordinal: int) -> int:
    from asyncfence.testing import CudaDevice

    return int(CudaDevice(ordinal).context)


@pytest.mark.parametrize("kind", FAKE_STREAMS, ids=lambda kind: kind.__module__)
@pytest.mark.parametrize("ordinal", [0, 1])
def test_a_default_stream_that_names_its_device_records_from_any_thread(
    cuda_device: CudaDevice, kind: type, ordinal: int, request: pytest.FixtureRequest
) -> None:
    from cuda.bindings import driver

    from asyncfence.testing import CudaDevice

    if ordinal:
        request.getfixturevalue("two_cuda_devices")

    device = CudaDevice(ordinal)
    device.make_current()
    try:
        with hold(1) as gate:  # that device's legacy default stream, held
            stream = kind(1, ordinal)

            def record() -> tuple[asyncfence.Fence, int, int]:
                before = current_context(driver)
                fence = asyncfence.record(stream)
                return fence, before, current_context(driver)

            fence, before, after = in_fresh_thread(record)
            assert before == after == 0  # pushed for the record, popped after
            assert fence._core._marker.context == primary_context(ordinal)
            assert not fence.done()  # on that device's default stream, behind the gate
            gate.release()
            fence.wait_sync(timeout=30)
    finally:
        cuda_device.make_current()


@pytest.mark.usefixtures("two_cuda_devices")
def test_a_default_stream_of_another_device_than_the_current_one(cuda_device: CudaDevice) -> None:
    fence = asyncfence.record(FakeTorchStream(0, 1))  # device 0 is current here
    assert fence._core._marker.context == primary_context(1)
    fence.wait_sync(timeout=30)
    target = asyncfence.record(FakeCupyStream(2, 1))
    fence.enqueue_wait(FakeTorchStream(0, 1))
    target.wait_sync(timeout=30)


@pytest.mark.usefixtures("emulated_driver")
def test_the_emulator_refuses_queued_work_without_a_current_context(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    """As cuda.h lists it: cuEventRecord, cuStreamWaitEvent and cuLaunchHostFunc
    need a current context, even on a stream that names its own."""
    from cuda.bindings import driver

    event = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    try:
        refused = in_fresh_thread(
            lambda: (
                driver.cuEventRecord(event, cuda_stream)[0],
                driver.cuStreamWaitEvent(cuda_stream, event, 0)[0],
            )
        )
        invalid = driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
        assert refused == (invalid, invalid)
        assert driver.cuEventRecord(event, cuda_stream)[0] == 0  # with one current: fine
    finally:
        driver.cuEventDestroy(event)


def test_a_stream_records_waits_and_parks_from_a_thread_without_a_context(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    """Every call that queues work makes the stream's context current first.

    On a fresh thread (no current context): a record, an enqueue_wait and a
    parked wait, whose signal is armed from that thread's own loop.
    """
    from cuda.bindings import driver

    other = cuda_device.new_stream()
    try:
        with hold(cuda_stream) as gate:

            def record_and_wait() -> tuple[asyncfence.Fence, asyncfence.Fence, int]:
                fence = asyncfence.record(cuda_stream)
                fence.enqueue_wait(other)
                return fence, asyncfence.record(other), current_context(driver)

            fence, behind, context_after = in_fresh_thread(record_and_wait)
            assert context_after == 0  # pushed for each call, popped after
            assert not fence.done()
            assert not behind.done()  # the other stream waits for the held one

            async def park_then_release() -> asyncfence.PollerStatistics:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(behind.wait, strategy="park"))
                    await until(lambda: asyncfence.current_statistics().parked == 1)
                    armed = asyncfence.current_statistics()
                    gate.release()
                return armed

            armed = in_fresh_thread(lambda: anyio.run(park_then_release))
            if shim() is not None:
                assert armed.armed == 1  # the signal was armed, not left to the re-check
            assert fence.done()
            assert behind.done()
    finally:
        driver.cuStreamDestroy(other)


def test_a_bare_default_handle_still_needs_a_current_context(cuda_device: CudaDevice) -> None:
    with pytest.raises(DeviceError, match="names its device") as caught:
        in_fresh_thread(lambda: asyncfence.record(0))
    assert caught.value.name == "CUDA_ERROR_INVALID_CONTEXT"


def test_enqueue_wait_on_a_default_stream_from_a_fresh_thread(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)
        in_fresh_thread(lambda: fence.enqueue_wait(FakeTorchStream(1, 0)))
        later = asyncfence.record(1)  # the legacy stream now waits for the fence
        assert not later.done()
        gate.release()
        later.wait_sync(timeout=30)


def test_per_thread_default_streams_are_one_queue_per_thread(cuda_device: CudaDevice) -> None:
    backend = cuda_backend()
    ready, finish = threading.Event(), threading.Event()
    theirs: dict[str, asyncfence.Fence] = {}

    def other_thread() -> None:
        cuda_device.make_current()
        with hold(2) as gate:  # this thread's per-thread default stream, held
            theirs["fence"] = asyncfence.record(2)
            ready.set()
            finish.wait(30)
            gate.release()

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert ready.wait(30)
        ours = asyncfence.record(2)
        assert ours._core.queue.key != theirs["fence"]._core.queue.key
        assert backend.stream_key(2) == 2  # the record lock's key may stay shared
        ours.wait_sync(timeout=30)  # another stream: not behind the held one
        assert not theirs["fence"].done()
    finally:
        finish.set()
        thread.join(30)
    theirs["fence"].wait_sync(timeout=30)


async def test_a_new_threads_default_stream_is_not_held_behind_an_exited_threads(
    cuda_device: CudaDevice,
) -> None:
    # Thread idents are reused once a thread exits: a new thread's per-thread
    # default stream must not share the queue of an exited thread's, whose
    # work may still be pending (an in-order sweep would stop at it).
    made: dict[str, Any] = {}

    def in_thread(name: str) -> None:
        if name == "new" and threading.get_ident() != made["exited ident"]:
            return  # not the ident this test is about: the next thread may get it
        cuda_device.make_current()
        made[f"{name} gate"] = StreamGate(2)  # this thread's per-thread default stream
        made[f"{name} fence"] = asyncfence.record(2)
        made[f"{name} ident"] = threading.get_ident()

    for name in ("exited", *["new"] * 50):
        thread = threading.Thread(target=in_thread, args=(name,))
        thread.start()
        thread.join(HANG_GUARD_S)
        if "new fence" in made:
            break
    if "new fence" not in made:
        pytest.skip("no new thread got the exited thread's ident in 50 tries")
    exited, new = made["exited fence"], made["new fence"]
    resumed = anyio.Event()

    async def wait_for_new() -> None:
        await new.wait()
        resumed.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(exited.wait)
            tg.start_soon(wait_for_new)
            await until(lambda: asyncfence.current_statistics().waiters == 2)
            made["new gate"].release()
            with anyio.fail_after(10):  # the exited thread's work is held throughout
                await resumed.wait()
            assert not exited.done()
            made["exited gate"].release()
    finally:
        made["exited gate"].release()
        made["new gate"].release()


@pytest.mark.parametrize("per_thread", ["1", None], ids=["per-thread", "legacy"])
def test_handle_0_in_per_thread_mode(
    driver_env: dict[str, str], strategy: str, per_thread: str | None
) -> None:
    """With CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1, handle 0 is per thread, as 2 is.

    A subprocess: the mode is read when the driver loads.
    """
    env = dict(driver_env)
    env.pop("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", None)
    if per_thread is not None:
        env["CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"] = per_thread
    code = textwrap.dedent(
        f"""
        import asyncio, json, threading
        import asyncfence
        from asyncfence.testing import CudaDevice
        from asyncfence.testing import StreamGate, hold

        asyncfence.configure(strategy={strategy!r})
        device = CudaDevice(0)
        device.make_current()
        ours = hold(0)  # handle 0 of this thread, held
        our_gate = ours.__enter__()
        held = asyncfence.record(0)
        same = asyncfence.record(2)
        other = {{}}

        def record_elsewhere():
            device.make_current()
            other["hold"] = hold(0)  # handle 0 of that thread, held too
            other["gate"] = other["hold"].__enter__()
            other["fence"] = asyncfence.record(0)

        thread = threading.Thread(target=record_elsewhere)
        thread.start()
        thread.join()

        async def main():
            waiters = [asyncio.ensure_future(f.wait()) for f in (held, other["fence"])]
            while asyncfence.current_statistics().waiters < 2:
                await asyncio.sleep(0.001)
            other["gate"].release()  # the other thread's stream runs on
            if {per_thread is not None!r}:  # its own stream: its fence completes
                finished, _ = await asyncio.wait({{waiters[1]}}, timeout=10)  # a hang guard
                independent = waiters[1] in finished
            else:  # one legacy stream, still behind our gate: surely not done
                independent = other["fence"].done()
            done = held.done()
            our_gate.release()
            await asyncio.gather(*waiters)
            await same
            return independent, done

        independent, held_done = asyncio.run(main())
        print(json.dumps({{
            "independent": independent,
            "held_done_early": held_done,
            "keys_differ": held._core.queue.key != other["fence"]._core.queue.key,
            "zero_is_two": held._core.queue.key == same._core.queue.key,
        }}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,  # a hang guard, not a timing assertion
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if per_thread:
        assert report == {
            "independent": True,
            "held_done_early": False,
            "keys_differ": True,
            "zero_is_two": True,
        }
    else:  # one legacy stream for every thread: the other thread's fence is behind the gate
        assert report == {
            "independent": False,
            "held_done_early": False,
            "keys_differ": False,
            "zero_is_two": False,
        }


@pytest.mark.parametrize("kind", [PinnedBuffer, DeviceBuffer])
def test_a_buffer_is_freed_from_a_thread_without_a_current_context(
    cuda_device: CudaDevice, emulator: Emulator, kind: type[PinnedBuffer | DeviceBuffer]
) -> None:
    from cuda.bindings import driver

    buffer = kind(256)
    control = kind(256)
    allocations = emulator.live_host_allocs()

    def free() -> tuple[int, int, int]:
        # As the real driver: a free with no current context is refused.
        if kind is PinnedBuffer:
            refused = int(driver.cuMemFreeHost(control.address)[0])
        else:
            refused = int(driver.cuMemFree(control.address)[0])
        buffer.free()
        return refused, current_context(driver), emulator.live_host_allocs()

    refused, context_after, allocations_after = in_fresh_thread(free)
    assert refused == 201  # CUDA_ERROR_INVALID_CONTEXT
    assert buffer.freed
    assert context_after == 0  # pushed for the free, popped after
    if kind is PinnedBuffer:
        assert allocations_after == allocations - 1
    control.free()


def test_a_drop_queue_on_a_thread_without_a_context_frees_buffers(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    from cuda.bindings import driver

    buffers: list[PinnedBuffer | DeviceBuffer] = [PinnedBuffer(64), DeviceBuffer(64)]
    fence = asyncfence.record(cuda_stream)

    async def main() -> int:
        async with DropQueue() as dq:
            for buffer in buffers:
                dq.defer(fence, buffer, free=type(buffer).free)
            await dq.drain(timeout=30)
            return current_context(driver)

    assert in_fresh_thread(lambda: asyncio.run(main())) == 0
    assert all(buffer.freed for buffer in buffers)


# -- bad input and fork ------------------------------------------------------------


class BadProtocol:
    def __init__(self, given: object) -> None:
        self.given = given

    def __cuda_stream__(self) -> object:
        return self.given


@pytest.mark.parametrize(
    ("given", "error", "message"),
    [
        (5, TypeError, r"must give a \(version, handle\) tuple"),
        ((0, 1, 2), TypeError, r"must give a \(version, handle\) tuple"),
        (("0", 7), TypeError, "protocol version must be an int"),
        ((1, 7), ValueError, "unsupported __cuda_stream__ protocol version 1"),
        (
            (0, "abc"),
            TypeError,
            r"handle must be an int, got str 'abc' from tests.test_cuda.BadProtocol.__cuda_",
        ),
        (
            (0, 3.9),
            TypeError,
            r"handle must be an int, got float 3.9 from tests.test_cuda.BadProtocol.__cuda_stream",
        ),
        (
            (0, True),
            TypeError,
            r"handle must be an int, got bool True from tests.test_cuda.BadProtocol.__cuda_",
        ),
        (
            (0, False),
            TypeError,
            r"handle must be an int, got bool False from tests.test_cuda.BadProtocol.__cuda",
        ),
        (
            (0, -1),
            ValueError,
            r"must be in \[0, 2\*\*64\), got -1 from tests.test_cuda.BadProtocol.__cuda_stream__",
        ),
    ],
)
def test_a_malformed_cuda_stream_protocol_is_a_clear_error(
    given: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        asyncfence.record(BadProtocol(given))


@pytest.mark.parametrize("nbytes", [2**64, 0, -1])
def test_buffer_sizes_out_of_range_are_refused_by_name(nbytes: int) -> None:
    for kind in (asyncfence.PinnedBuffer, asyncfence.DeviceBuffer):
        with pytest.raises(ValueError, match="nbytes must be in"):
            kind(nbytes)


def test_a_child_forked_during_driver_initialisation_gets_a_fence_error(
    driver_env: dict[str, str],
) -> None:
    import subprocess
    import sys

    code = """
import os, threading
from asyncfence import FenceError
from asyncfence._backends.cuda import _driver as _cuda
real = _cuda._initialise
inside, go = threading.Event(), threading.Event()
def slow(*args):
    inside.set()
    go.wait(30)
    return real(*args)
_cuda._initialise = slow
first = threading.Thread(target=_cuda.driver)
first.start()
assert inside.wait(30)  # the other thread is inside cuInit, holding the driver lock
pid = os.fork()
if pid == 0:
    try:
        _cuda.driver()
    except FenceError as error:
        os._exit(0 if "fork()" in str(error) else 2)
    os._exit(1)
_, status = os.waitpid(pid, 0)
go.set()
first.join(30)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    env = driver_env
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("raw", ["c_void_p", "int-like"])
def test_a_numba_stream_handle_in_either_form(raw: str) -> None:
    from asyncfence._backends.cuda._driver import cuda_stream_handle

    class CUstreamLike:
        def __int__(self) -> int:
            return 0x1234

    class NumbaStream:
        def __init__(self) -> None:
            self.handle = ctypes.c_void_p(0x1234) if raw == "c_void_p" else CUstreamLike()

    NumbaStream.__module__ = "numba.cuda.cudadrv.driver"
    assert cuda_stream_handle(NumbaStream()) == 0x1234


# -- races ---------------------------------------------------------------------


def test_wait_sync_follows_the_fence_not_its_recycled_event(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    other_stream = cuda_device.new_stream()
    try:
        with asyncfence.testing.hold(cuda_stream) as first_gate:
            fence = asyncfence.record(cuda_stream)
            assert fence._core._marker is not None
            event = int(fence._core._marker.event)
            paused, go = threading.Event(), threading.Event()
            returned: list[bool] = []

            # Between two looks at the fence: asleep on its signal (the shim),
            # or between queries (without it).
            if shim() is not None:
                where = pause_at(_blocking._sleep_on_signal, "watcher.poll(", paused, go)
            else:
                where = pause_at(_blocking._sleep_between_queries, "time.sleep(", paused, go)

            def wait_in_thread() -> None:
                sys.settrace(where)
                try:
                    fence.wait_sync(timeout=HANG_GUARD_S)
                    returned.append(True)
                finally:
                    sys.settrace(None)

            thread = threading.Thread(target=wait_in_thread)
            thread.start()
            assert paused.wait(HANG_GUARD_S)  # the waiting thread is between polls
            first_gate.release()
            fence.wait_sync(timeout=HANG_GUARD_S)  # settled here: the event is pooled
        with asyncfence.testing.hold(other_stream):
            reused = asyncfence.record(other_stream)  # the same event, held
            assert reused._core._marker is not None
            assert int(reused._core._marker.event) == event
            go.set()
            thread.join(HANG_GUARD_S)
            assert returned == [True]
            assert not reused.done()
        reused.wait_sync(timeout=HANG_GUARD_S)
    finally:
        cuda_device.close_stream(other_stream)


# -- the completion signal -----------------------------------------------------


async def test_one_signal_per_cuda_stream_not_per_fence(
    cuda_stream: Any, emulator: Emulator
) -> None:
    v1_before, v2_before = emulator.host_funcs_launched()
    fences = []
    with hold(cuda_stream) as gate:
        fences = [asyncfence.record(cuda_stream) for _ in range(20)]
        async with anyio.create_task_group() as tg:
            for parked, fence in enumerate(fences, start=1):  # parked in record order
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda n=parked: asyncfence.current_statistics().parked == n)
            gate.release()
    assert all(fence.done() for fence in fences)
    v1_after, v2_after = emulator.host_funcs_launched()
    # One signal, for the oldest fence of the stream: the sweep it triggers
    # finds the other 19, which completed behind it. (Which entry point took
    # it, and that it got the native function itself: tests/test_wake.py.)
    assert (v1_after - v1_before) + (v2_after - v2_before) == 1
    await until(lambda: emulator.pending_host_funcs() == 0)


async def test_cuda_signal_never_holds_the_users_stream(cuda_device: CudaDevice) -> None:
    from cuda.bindings import driver

    # The signal runs on a side stream; the user's stream runs on even while a
    # parked fence's host function has not run yet.
    first, second = cuda_device.new_stream(), cuda_device.new_stream()
    try:
        with hold(first) as gate:
            parked = asyncfence.record(first)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(parked.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                other = asyncfence.record(second)
                await other.wait(strategy="park")  # another stream's signal is not delayed
                gate.release()
    finally:
        driver.cuStreamDestroy(first)
        driver.cuStreamDestroy(second)


def test_a_driver_without_host_functions_falls_back_to_polling(cuda_mode: str) -> None:
    if cuda_mode != "emulated":
        pytest.skip("pretends to be an older emulated driver")
    from .cuda_emulator import build

    env = {
        **os.environ,
        "ASYNCFENCE_CUDA_DRIVER": "none",
        "LD_LIBRARY_PATH": f"{build().parent}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "ASYNCFENCE_EMULATED_HIDE": "cuLaunchHostFunc",  # a driver without host functions
    }
    code = textwrap.dedent(
        """
        import asyncio
        import asyncfence
        from asyncfence.testing import hold, open_default_device

        device = open_default_device("cuda")
        stream = device.new_stream()

        async def main():
            with hold(stream) as gate:
                fence = asyncfence.record(stream)
                waiter = asyncio.ensure_future(fence.wait(strategy="park"))
                while asyncfence.current_statistics().parked < 1:
                    await asyncio.sleep(0.001)
                stats = asyncfence.current_statistics()
                paths = {b.backend: b.signal_path for b in asyncfence.backend_statistics()}
                print("signal", paths["cuda"], "armed", stats.armed)
                gate.release()
                await asyncio.wait_for(waiter, 30)
            print("done", fence.done())

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "signal none armed 0" in result.stdout  # no host function: it is re-checked
    assert "done True" in result.stdout


def _driver_version() -> int:
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    assert err == driver.CUresult.CUDA_SUCCESS
    return int(version)


def cuda_signal_path() -> str | None:
    """How completion signals reach the CUDA driver, as the backend's statistics say."""
    paths = {stats.backend: stats.signal_path for stats in asyncfence.backend_statistics()}
    return paths["cuda"]


@pytest.mark.usefixtures("only_signals_wake")
async def test_the_cuda_driver_gets_the_native_function_itself(
    cuda_stream: Any, emulator: Emulator, wake_path: str
) -> None:
    if wake_path != "native":
        pytest.skip("without the shim there is no native function: parked waits are re-checked")
    v1_before, v2_before = emulator.host_funcs_launched()
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            gate.release()
            with anyio.fail_after(10):  # poll_cap 1 s, re-check 30 s: only the signal is fast
                await fence.wait(strategy="park")
    v1_after, v2_after = emulator.host_funcs_launched()
    newer_driver = _driver_version() >= 13020
    expected = "v2" if newer_driver else "v1"
    assert cuda_signal_path() == expected
    assert (v1_after - v1_before, v2_after - v2_before) == ((0, 1) if newer_driver else (1, 0))
    native = shim()
    assert native is not None
    assert emulator.last_host_fn() == native.fire  # not a trampoline


# -- a context reset -------------------------------------------------------------------


@pytest.mark.usefixtures("two_cuda_devices")  # device 1: the other tests keep nothing there
async def test_after_a_context_reset_no_destroyed_event_or_side_stream_is_reused(
    cuda_device: CudaDevice,
) -> None:
    """cuDevicePrimaryCtxReset (numba's cuda.close()) destroys the context's events
    and streams; the context after it may have the same address, never the same id."""
    from cuda.bindings import driver

    from asyncfence.testing import CudaDevice

    device = CudaDevice(1)
    backend = cuda_backend()
    device.make_current()
    try:
        stream = device.new_stream()
        with hold(stream) as gate:  # parked: a side stream made, armed, then pooled
            fence = asyncfence.record(stream)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                gate.release()
        for _ in range(3):  # events back in the context's pool
            asyncfence.record(stream).wait_sync(timeout=30)
        del fence
        gc.collect()
        before = backend.statistics()
        assert before.pooled_markers >= 1
        assert before.side_streams >= 1
        (err,) = driver.cuDevicePrimaryCtxReset(driver.CUdevice(1))
        assert err == driver.CUresult.CUDA_SUCCESS
        device.make_current()
        stream = device.new_stream()  # the old one went with the reset
        with hold(stream) as gate:
            fence = asyncfence.record(stream)  # not on a destroyed pooled event
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                if shim() is not None:  # armed on a new side stream, not a destroyed one
                    assert asyncfence.current_statistics().armed == 1
                gate.release()
        assert fence.done()
        driver.cuStreamDestroy(stream)
    finally:
        cuda_device.make_current()


# -- nothing blocks a running loop ------------------------------------------------


_FIRST_RECORD_UNDER_BLOCKBUSTER = """
import asyncio, sys
from blockbuster import blockbuster_ctx
import asyncfence

class Stream:  # names its device, as PyTorch's streams do: the legacy stream of device 0
    class device:
        index = 0
    def __cuda_stream__(self):
        return (0, 1)
Stream.__module__ = "torch.cuda.streams"
stream = Stream()
gate = None
if sys.argv[1] != "cold":
    asyncfence.warm_up(stream)  # and nothing else loads the driver before the loop
if sys.argv[1] == "warmed, parked":
    from asyncfence.testing import CudaDevice, StreamGate
    CudaDevice(0).make_current()
    gate = StreamGate(1)  # the fence parks behind it

async def main():
    with blockbuster_ctx("asyncfence"):
        fence = asyncfence.record(stream)
        waiter = asyncio.ensure_future(fence.wait(strategy="park"))
        while gate is not None and asyncfence.current_statistics().parked < 1:
            await asyncio.sleep(0.001)
        if gate is not None:
            gate.release()
        await waiter
        print(asyncfence.current_statistics().signals)

asyncio.run(main())
"""


@pytest.mark.parametrize("start", ["cold", "warmed", "warmed, parked"])
def test_after_warm_up_the_first_record_and_park_make_no_blocking_call(
    driver_env: dict[str, str], start: str
) -> None:
    pytest.importorskip("blockbuster")
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_RECORD_UNDER_BLOCKBUSTER, start],
        env=driver_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if start == "cold":  # what warm_up is for: a cold first record loads the driver
        assert result.returncode != 0
        assert "BlockingError" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    if start == "warmed, parked" and shim() is not None:
        assert result.stdout.split() == ["1"]  # parked, and woken by its signal


# -- the emulated driver's interprocess events ------------------------------------------

_IPC_CHILD = """
import ctypes, sys
from cuda.bindings import driver as drv

drv.cuInit(0)
_, device = drv.cuDeviceGet(0)
_, context = drv.cuDevicePrimaryCtxRetain(device)
drv.cuCtxSetCurrent(context)
handle = drv.CUipcEventHandle()
ctypes.memmove(handle.getPtr(), bytes.fromhex(sys.argv[1]), 64)
err, event = drv.cuIpcOpenEventHandle(handle)
print(int(err), flush=True)
if err == 0:
    for _ in sys.stdin:  # one query per line
        print(int(drv.cuEventQuery(event)[0]), flush=True)
    drv.cuEventDestroy(event)
"""


def _ipc_event(driver: Any) -> Any:
    flags = (
        driver.CUevent_flags.CU_EVENT_INTERPROCESS | driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    )
    err, event = driver.cuEventCreate(flags)
    assert err == driver.CUresult.CUDA_SUCCESS
    return event


def _handle_hex(driver: Any, event: Any) -> str:
    import ctypes

    err, handle = driver.cuIpcGetEventHandle(event)
    assert err == driver.CUresult.CUDA_SUCCESS
    return ctypes.string_at(handle.getPtr(), 64).hex()


def _open_in_another_process(handle_hex: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _IPC_CHILD, handle_hex],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_an_interprocess_event_completes_in_the_process_that_opened_it(
    cuda_stream: Any, driver_env: dict[str, str]
) -> None:
    from cuda.bindings import driver

    event = _ipc_event(driver)
    try:
        with hold(cuda_stream) as gate:
            assert driver.cuEventRecord(event, cuda_stream)[0] == driver.CUresult.CUDA_SUCCESS
            child = _open_in_another_process(_handle_hex(driver, event), driver_env)
            assert child.stdin is not None
            assert child.stdout is not None
            assert child.stdout.readline() == "0\n"  # opened
            child.stdin.write("query\n")
            child.stdin.flush()
            assert child.stdout.readline() == f"{int(driver.CUresult.CUDA_ERROR_NOT_READY)}\n"
            gate.release()
        assert driver.cuEventSynchronize(event)[0] == driver.CUresult.CUDA_SUCCESS
        child.stdin.write("query\n")
        child.stdin.close()
        assert child.stdout.readline() == "0\n"  # done there too
        child.stdout.close()
        assert child.wait(30) == 0
    finally:
        driver.cuEventDestroy(event)


@pytest.mark.usefixtures("emulated_driver")
def test_a_destroyed_interprocess_event_cannot_be_opened(
    cuda_device: CudaDevice, driver_env: dict[str, str]
) -> None:
    # Emulator only: a real driver documents a destroyed event's handle as undefined.
    from cuda.bindings import driver

    event = _ipc_event(driver)
    handle_hex = _handle_hex(driver, event)
    driver.cuEventDestroy(event)
    child = _open_in_another_process(handle_hex, driver_env)
    out, _ = child.communicate(timeout=30)
    assert out == f"{int(driver.CUresult.CUDA_ERROR_MAP_FAILED)}\n"


@pytest.mark.usefixtures("emulated_driver")
def test_the_emulator_checks_interprocess_events_and_handles(cuda_device: CudaDevice) -> None:
    import ctypes

    from cuda.bindings import driver

    invalid = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    # An interprocess event keeps no timing.
    assert driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_INTERPROCESS)[0] == invalid
    plain = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    try:
        assert driver.cuIpcGetEventHandle(plain)[0] == invalid  # not interprocess
    finally:
        driver.cuEventDestroy(plain)
    event = _ipc_event(driver)
    try:
        handle = driver.cuIpcGetEventHandle(event)[1]
        # Not in the process that exported it.
        err, _ = driver.cuIpcOpenEventHandle(handle)
        assert err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT
    finally:
        driver.cuEventDestroy(event)
    garbage = driver.CUipcEventHandle()
    ctypes.memmove(garbage.getPtr(), b"\x01" * 64, 64)
    assert driver.cuIpcOpenEventHandle(garbage)[0] == invalid


# -- from_event: a CUevent the user's code recorded -------------------------------------


async def released_only_by(gate: StreamGate, fence: Any) -> None:
    """``fence`` stays pending while ``gate`` holds its stream, and completes once released."""
    await let_loop_run()
    assert not fence.done()
    gate.release()
    with anyio.fail_after(HANG_GUARD_S):
        await fence
    assert fence.done()


def _raw_event() -> Any:
    from cuda.bindings import driver as drv

    err, event = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    assert err == drv.CUresult.CUDA_SUCCESS
    return event


def _record_raw(event: Any, stream: Any) -> None:
    from cuda.bindings import driver as drv

    (err,) = drv.cuEventRecord(event, stream)
    assert err == drv.CUresult.CUDA_SUCCESS


async def test_an_adopted_cuevent_is_awaited_once_its_work_is_done(cuda_stream: Any) -> None:
    event = _raw_event()
    with hold(cuda_stream) as gate:
        _record_raw(event, cuda_stream)
        fence = asyncfence.from_event(event)
        await let_loop_run()
        assert not fence.done()
        with pytest.raises(TimeoutError):
            fence.wait_sync(timeout=0.01)
        gate.release()
        with anyio.fail_after(HANG_GUARD_S):
            await fence
    assert fence.done()


async def test_an_adopted_cuevent_follows_its_record_at_the_call(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    # As cuStreamWaitEvent: the record at the time of the call, whatever the
    # user records on the event afterwards.
    other = cuda_device.new_stream()
    event = _raw_event()
    with hold(other) as later:
        with hold(cuda_stream) as first:
            _record_raw(event, cuda_stream)
            fence = asyncfence.from_event(event)
            _record_raw(event, other)  # recorded again, behind a gate still held
            first.release()
            with anyio.fail_after(HANG_GUARD_S):
                await fence
        assert fence.done()
        later.release()


async def test_a_cuevent_never_recorded_is_done(cuda_stream: Any) -> None:
    fence = asyncfence.from_event(_raw_event())
    with anyio.fail_after(HANG_GUARD_S):
        await fence
    assert fence.done()


async def test_another_stream_waits_on_the_device_for_an_adopted_cuevent(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    event = _raw_event()
    other = cuda_device.new_stream()
    with hold(cuda_stream) as gate:
        _record_raw(event, cuda_stream)
        asyncfence.from_event(event).enqueue_wait(other)
        after = asyncfence.record(other)
        await released_only_by(gate, after)


async def test_an_adopted_cuevent_fails_with_the_work_before_it(
    cuda_device: CudaDevice, cuda_stream: Any, emulator: Emulator
) -> None:
    event = _raw_event()
    try:
        with hold(cuda_stream) as gate:
            emulator.launch_fault(int(cuda_stream), 719)
            _record_raw(event, cuda_stream)
            fence = asyncfence.from_event(event)
            gate.release()
        with pytest.raises(DeviceError) as caught:
            await fence
        assert caught.value.name == "CUDA_ERROR_LAUNCH_FAILED"
    finally:
        emulator.clear_fault(int(cuda_device.context))


async def test_an_event_recorded_in_a_capture_is_refused_and_the_capture_kept(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    # A wait for it from a stream outside the capture would join that stream
    # to the capture (a fork), not wait: refused before any wait is queued.
    event = _raw_event()
    begin_capture(cuda_stream)
    try:
        _record_raw(event, cuda_stream)
        with pytest.raises(FenceError, match="recorded inside a CUDA graph capture"):
            asyncfence.from_event(event)
    finally:
        err, graph = end_capture(cuda_stream)
    assert err == 0  # the capture is whole: no stream of ours joined it
    destroy_graph(graph)
    # Recorded again outside the capture, it is an event like any other.
    with hold(cuda_stream) as gate:
        _record_raw(event, cuda_stream)
        fence = asyncfence.from_event(event)
        await released_only_by(gate, fence)


def _core_stream(cuda_device: CudaDevice) -> Any:
    core = pytest.importorskip("cuda.core")
    device = core.Device(cuda_device.ordinal)
    device.set_current()
    return device.create_stream()


async def test_a_cuda_core_event_is_adopted(cuda_device: CudaDevice) -> None:
    import weakref

    stream = _core_stream(cuda_device)
    with hold(stream) as gate:
        event = stream.record()
        fence = asyncfence.from_event(event)
        kept = weakref.ref(event)
        del event
        gc.collect()
        assert kept() is not None  # the fence keeps it until it settles
        await released_only_by(gate, fence)
    assert fence.done()
    stream.close()


def test_a_closed_cuda_core_event_is_refused(cuda_device: CudaDevice) -> None:
    stream = _core_stream(cuda_device)
    event = stream.record()
    event.close()
    with pytest.raises(TypeError, match="is closed"):
        asyncfence.from_event(event)
    stream.close()


def _torch_with_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with a CUDA GPU (its CUDA events and streams)")
    return torch


@pytest.mark.parametrize("kind", ["torch.cuda.Event", "torch.Event"])
async def test_a_torch_event_is_adopted(cuda_device: CudaDevice, kind: str) -> None:
    torch = _torch_with_cuda()
    stream = torch.cuda.Stream()
    event = torch.cuda.Event() if kind == "torch.cuda.Event" else torch.Event(device="cuda")
    with hold(stream) as gate:
        event.record(stream)
        fence = asyncfence.from_event(event)
        await released_only_by(gate, fence)


async def test_a_torch_event_never_recorded_is_done(cuda_device: CudaDevice) -> None:
    torch = _torch_with_cuda()
    fence = asyncfence.from_event(torch.cuda.Event())  # PyTorch creates it at its first record
    with anyio.fail_after(HANG_GUARD_S):
        await fence


async def test_a_cupy_event_is_adopted(cuda_device: CudaDevice) -> None:
    cupy = pytest.importorskip("cupy")
    stream = cupy.cuda.Stream(non_blocking=True)
    event = cupy.cuda.Event(disable_timing=True)
    with hold(stream) as gate:
        event.record(stream)
        fence = asyncfence.from_event(event)
        await released_only_by(gate, fence)


async def test_a_numba_event_is_adopted(cuda_device: CudaDevice) -> None:
    numba_cuda = pytest.importorskip("numba.cuda")
    if not numba_cuda.is_available():
        pytest.skip("needs a real GPU: numba-cuda finds no CUDA device")
    stream = numba_cuda.stream()
    event = numba_cuda.event(timing=False)
    with hold(stream) as gate:
        event.record(stream=stream)
        fence = asyncfence.from_event(event)
        await released_only_by(gate, fence)


def test_a_torch_event_off_cuda_is_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"torch\.Event on cpu, not a CUDA event"):
        asyncfence.from_event(torch.Event(device="cpu"))


# -- torch.Stream, PyTorch's device-generic stream, on CUDA ---------------------------


def _generic_torch_stream(stream: Any, ordinal: int) -> Any:
    """``stream`` as the ``torch.Stream`` that ``torch.cuda.ExternalStream`` gives."""
    torch = pytest.importorskip("torch")
    return torch.Stream(stream_id=int(stream), device_index=ordinal, device_type=1)  # CUDA


async def test_a_generic_torch_stream_on_cuda_is_recorded_on(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    generic = _generic_torch_stream(cuda_stream, cuda_device.ordinal)
    assert generic.device.type == "cuda"
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(generic)
        await released_only_by(gate, fence)


async def test_a_fence_waits_on_a_generic_torch_stream(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    other = cuda_device.new_stream()
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)
        fence.enqueue_wait(_generic_torch_stream(other, cuda_device.ordinal))
        after = asyncfence.record(other)
        await released_only_by(gate, after)


async def test_generic_torch_streams_go_to_the_backend_of_their_device(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    # One type, two backends: the choice is never cached by the type.
    torch = pytest.importorskip("torch")
    on_cpu = torch.Stream(device="cpu")
    on_cuda = _generic_torch_stream(cuda_stream, cuda_device.ordinal)
    for stream, backend in [(on_cpu, "torch-cpu"), (on_cuda, "cuda"), (on_cpu, "torch-cpu")]:
        assert backend_for(stream).name == backend
        await asyncfence.record(stream)


def test_the_default_stream_of_a_generic_torch_stream(cuda_device: CudaDevice) -> None:
    torch = pytest.importorskip("torch")
    default = torch.Stream(stream_id=0, device_index=cuda_device.ordinal, device_type=1)
    fence = asyncfence.record(default)
    fence.wait_sync(timeout=HANG_GUARD_S)
    assert fence.done()


def test_a_pooled_generic_torch_stream_needs_pytorchs_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.backends.cuda.is_built():
        pytest.skip("needs PyTorch without CUDA: a CUDA build resolves its own pooled streams")
    pooled = torch.Stream(stream_id=0x13, device_index=0, device_type=1)  # odd: PyTorch's pool
    with pytest.raises(TypeError, match="built without CUDA"):
        asyncfence.record(pooled)


@pytest.mark.parametrize("which", ["default", "pooled"])
async def test_torch_accelerator_current_stream_is_recorded_on(
    cuda_device: CudaDevice, which: str
) -> None:
    # On CUDA PyTorch, torch.accelerator.current_stream() is a torch.Stream:
    # id 0 on the default stream, an id of PyTorch's pools under a stream of
    # its own. (CPU PyTorch has no accelerator: it raises there.)
    torch = _torch_with_cuda()
    pooled = torch.cuda.Stream()
    chosen = pooled if which == "pooled" else torch.cuda.default_stream()
    with torch.cuda.stream(chosen):
        current = torch.accelerator.current_stream()
    assert type(current) is torch.Stream
    with hold(chosen) as gate:
        fence = asyncfence.record(current)
        await released_only_by(gate, fence)
