"""The CUDA backend: against the emulated driver in CI, the real one on a GPU.

Each run's header says which driver it used. Tests that need the emulator's
hooks (faults, live-object counts) skip on a real driver.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError
from asyncfence._backend import backend_for
from asyncfence._cuda import CudaBackend
from asyncfence.testing import hold

from .conftest import let_loop_run, until

if TYPE_CHECKING:
    from asyncfence._devices import CudaDevice

    from .cuda_emulator import Emulator


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


def test_a_destroyed_stream_is_a_device_error(cuda_device: CudaDevice) -> None:
    from cuda.bindings import driver

    stream = cuda_device.new_stream()
    handle = int(stream)
    driver.cuStreamDestroy(stream)
    with pytest.raises(DeviceError) as caught:
        asyncfence.record(handle)
    assert caught.value.backend == "cuda"
    assert caught.value.name == "CUDA_ERROR_INVALID_HANDLE"


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

    try:
        await round_of_fences()
        steady = emulator.live_events()
        created = emulator.events_created()
        assert steady == backend.pooled_events() + _events_in_use()
        await round_of_fences()
        assert emulator.events_created() == created  # steady state: no cuEventCreate
        assert emulator.live_events() == steady
        assert backend.pooled_events() <= steady
    finally:
        for stream in streams:
            driver.cuStreamDestroy(stream)


def _events_in_use() -> int:
    import gc

    from asyncfence import Fence

    gc.collect()
    return sum(
        1
        for obj in gc.get_objects()
        if isinstance(obj, Fence) and obj._backend.name == "cuda" and obj._marker is not None
    )


def test_events_are_created_without_timing(cuda_stream: Any, emulator: Emulator) -> None:
    from cuda.bindings import driver

    fence = asyncfence.record(cuda_stream)
    event = fence._marker.event  # type: ignore[attr-defined]
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


async def test_enqueue_wait_across_devices(cuda_device: CudaDevice, emulator: Emulator) -> None:
    from asyncfence._devices import CudaDevice

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

    from asyncfence._devices import CudaDevice

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
