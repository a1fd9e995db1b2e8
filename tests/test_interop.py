"""Streams from the CUDA libraries users have: PyTorch, CuPy, numba-cuda, cuda.core.

Each test skips where its library is absent, or where the emulated driver is
in use (those libraries need a real GPU); ``scripts/gpu-check.sh`` runs them on
one.
"""

from __future__ import annotations

import contextlib
import ctypes
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence.testing import hold

from .conftest import let_loop_run, until

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncfence.testing import CudaDevice


@pytest.fixture
def real_gpu(cuda_mode: str, driver_is_emulated: bool) -> None:
    # Not the emulated driver, even with its hooks hidden: the library talks
    # to the driver beyond what is emulated.
    if cuda_mode != "real" or driver_is_emulated:
        pytest.skip("needs a real GPU: the library talks to the driver beyond what is emulated")


async def held_then_released(stream: Any) -> None:
    """A fence on a held stream stays pending until the gate opens, then completes."""
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters >= 1)
            assert not fence.done()
            gate.release()
    assert fence.done()


async def test_torch_stream(real_gpu: None) -> None:
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    await held_then_released(stream)
    with torch.cuda.stream(stream):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        total = x.sum()
    await asyncfence.record(stream)
    assert float(total) == float(sum(range(1 << 20)))


async def test_cupy_stream(real_gpu: None) -> None:
    cupy = pytest.importorskip("cupy")
    stream = cupy.cuda.Stream(non_blocking=True)
    await held_then_released(stream)
    with stream:
        x = cupy.arange(1 << 20, dtype=cupy.float64)
        total = x.sum()
    await asyncfence.record(stream)
    assert float(total) == float(sum(range(1 << 20)))


async def test_numba_cuda_stream(real_gpu: None) -> None:
    numba_cuda = pytest.importorskip("numba.cuda")
    stream = numba_cuda.stream()
    await held_then_released(stream)


async def test_cuda_core_stream(real_gpu: None) -> None:
    core = pytest.importorskip("cuda.core")
    device = core.Device(0)
    device.set_current()
    await held_then_released(device.create_stream())


async def test_a_torch_fence_gates_a_cupy_stream(real_gpu: None) -> None:
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    producer = torch.cuda.Stream()
    consumer = cupy.cuda.Stream(non_blocking=True)
    with hold(producer) as gate:
        fence = asyncfence.record(producer)
        fence.enqueue_wait(consumer)
        later = asyncfence.record(consumer)
        with anyio.move_on_after(0.02):
            await later
        assert not later.done()
        gate.release()
        await later


# -- raw handles: the fallbacks that __cuda_stream__ objects never reach ---------------


def numba_raw_handle(stream: Any) -> int:
    """A numba-cuda stream's raw handle: a ``CUstream``, or a ``c_void_p`` in older numba."""
    handle = stream.handle
    if isinstance(handle, ctypes.c_void_p):
        return handle.value or 0  # None is the default stream
    return int(handle)


def library_stream(library: str) -> tuple[Any, int]:
    """A new non-default stream of ``library``, and its raw handle as an int."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        torch_stream = torch.cuda.Stream()
        return torch_stream, int(torch_stream.cuda_stream)
    if library == "cupy":
        cupy = pytest.importorskip("cupy")
        cupy_stream = cupy.cuda.Stream(non_blocking=True)
        return cupy_stream, int(cupy_stream.ptr)
    if library == "numba":
        numba_cuda = pytest.importorskip("numba.cuda")
        numba_stream = numba_cuda.stream()
        return numba_stream, numba_raw_handle(numba_stream)
    core = pytest.importorskip("cuda.core")
    device = core.Device(0)
    device.set_current()
    core_stream = device.create_stream()
    return core_stream, int(core_stream.handle)


@pytest.mark.parametrize("library", ["torch", "cupy", "numba", "cuda.core"])
async def test_a_raw_handle_is_the_same_stream_as_its_object(real_gpu: None, library: str) -> None:
    stream, raw = library_stream(library)
    assert raw not in (0, 1, 2)
    assert isinstance(raw, int)
    await held_then_released(raw)
    # Held through the object, recorded through the handle: one stream.
    with hold(stream) as gate:
        fence = asyncfence.record(raw)
        await let_loop_run()
        assert not fence.done()
        gate.release()
        await fence
    await held_then_released(stream)


# -- each library's default streams --------------------------------------------------------

# (library, which default stream, the raw handle it must have)
DEFAULT_STREAMS = [
    ("torch", "current_stream", 0),
    ("torch", "default_stream", 0),
    ("cupy", "null", 0),
    ("cupy", "ptds", 2),
    ("numba", "default_stream", 0),
    ("numba", "legacy_default_stream", 1),
    ("numba", "per_thread_default_stream", 2),
]


def default_stream(library: str, which: str) -> tuple[Any, int]:
    """One of ``library``'s default-stream objects, and its raw handle."""
    if library == "torch":
        torch = pytest.importorskip("torch")
        torch_stream = getattr(torch.cuda, which)()
        return torch_stream, int(torch_stream.cuda_stream)
    if library == "cupy":
        cupy = pytest.importorskip("cupy")
        cupy_stream = getattr(cupy.cuda.Stream, which)
        return cupy_stream, int(cupy_stream.ptr)
    numba_cuda = pytest.importorskip("numba.cuda")
    numba_stream = getattr(numba_cuda, which)()
    return numba_stream, numba_raw_handle(numba_stream)


@pytest.mark.parametrize(
    ("library", "which", "handle"),
    [pytest.param(*entry, id=f"{entry[0]}-{entry[1]}") for entry in DEFAULT_STREAMS],
)
async def test_a_default_stream_of_each_library(
    real_gpu: None, cuda_device: CudaDevice, library: str, which: str, handle: int
) -> None:
    # cuda_device: the primary context (the one these libraries use) is current
    # on this thread, as the default-stream handles need. While the legacy
    # default stream is held, nothing here may synchronize the device (a free,
    # a blocking copy): it would wait for the gate that only this test opens.
    stream, raw = default_stream(library, which)
    assert raw == handle
    await held_then_released(stream)
    await held_then_released(raw)


async def test_the_cuda_core_default_stream(real_gpu: None, cuda_device: CudaDevice) -> None:
    core = pytest.importorskip("cuda.core")
    device = core.Device(0)
    device.set_current()
    stream = device.default_stream
    assert int(stream.handle) in (0, 1, 2)
    await held_then_released(stream)
    await held_then_released(int(stream.handle))


# -- a record from a worker thread ---------------------------------------------------------


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
async def test_a_torch_record_from_a_worker_thread(
    real_gpu: None, cuda_device: CudaDevice, side_stream: bool
) -> None:
    torch = pytest.importorskip("torch")
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    await asyncfence.record(torch.cuda.current_stream())  # x exists, for any stream

    def in_worker() -> tuple[asyncfence.Fence, Any, int]:
        # torch's current stream is per thread: the worker's own (the default
        # stream, whose handle needs the context that torch's launch made
        # current on this thread), or one it sets.
        scope = torch.cuda.stream(torch.cuda.Stream()) if side_stream else contextlib.nullcontext()
        with scope:
            y = x * 2 + 1
            current = torch.cuda.current_stream()
            return asyncfence.record(current), y, int(current.cuda_stream)

    fence, y, handle = await anyio.to_thread.run_sync(in_worker)
    assert (handle != 0) == side_stream
    await fence
    assert fence.done()
    expected = torch.arange(1 << 20, dtype=torch.float32) * 2 + 1
    assert torch.equal(y.cpu(), expected)


# -- two parked fences on one stream -----------------------------------------------------------


async def test_two_parked_fences_on_one_torch_stream(real_gpu: None) -> None:
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.zeros(1 << 20, device="cuda", dtype=torch.float32)
    with hold(stream) as gate:
        with torch.cuda.stream(stream):  # in place: nothing is allocated while held
            x.add_(1)
            first = asyncfence.record(stream)
            x.mul_(3)  # more work, behind the first fence
            second = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(first.wait, strategy="park"))
            tg.start_soon(partial(second.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 2)
            assert not first.done()
            assert not second.done()
            paths = {stats.backend: stats.signal_path for stats in asyncfence.backend_statistics()}
            assert paths["cuda"] in ("v1", "v2")
            gate.release()
    assert first.done()
    assert second.done()
    assert torch.equal(x.cpu(), torch.full((1 << 20,), 3.0))


# -- a device-to-host copy whose pinned buffer goes back through a DropQueue -----------------


def freed_after(fence_of: Callable[[], asyncfence.Fence], freed: list[tuple[Any, bool]]) -> Any:
    """A ``free`` that notes the buffer and whether its fence was done by then."""

    def free(buffer: Any) -> None:
        freed.append((buffer, fence_of().done()))

    return free


async def test_a_torch_copy_into_pinned_memory_frees_it_after_its_fence(real_gpu: None) -> None:
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        source = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    pinned = torch.empty(1 << 20, dtype=torch.float32, pin_memory=True)
    assert pinned.is_pinned()  # into pageable memory the copy would block while held
    freed: list[tuple[Any, bool]] = []
    fences: list[asyncfence.Fence] = []
    async with asyncfence.DropQueue() as drops:
        with hold(stream) as gate:
            with torch.cuda.stream(stream):
                pinned.copy_(source, non_blocking=True)
            fences.append(asyncfence.record(stream))
            drops.defer(fences[0], pinned, free=freed_after(lambda: fences[0], freed))
            await let_loop_run()
            assert freed == []
            assert drops.statistics().pending_items == 1
            gate.release()
            await drops.drain()
    assert len(freed) == 1
    assert freed[0][0] is pinned
    assert freed[0][1], "freed before its fence completed"
    assert torch.equal(pinned, torch.arange(1 << 20, dtype=torch.float32))


async def test_a_torch_to_cpu_non_blocking_lands_in_pinned_memory(real_gpu: None) -> None:
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    freed: list[tuple[Any, bool]] = []
    fences: list[asyncfence.Fence] = []
    async with asyncfence.DropQueue() as drops:
        with torch.cuda.stream(stream):
            source = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 3
            result = source.to("cpu", non_blocking=True)
        # Not held: were the result pageable, the copy would be synchronous.
        assert result.is_pinned()
        fences.append(asyncfence.record(stream))
        drops.defer(fences[0], result, free=freed_after(lambda: fences[0], freed))
        await drops.drain()
    assert len(freed) == 1
    assert freed[0][0] is result
    assert freed[0][1], "freed before its fence completed"
    assert torch.equal(result, torch.arange(1 << 20, dtype=torch.float32) * 3)


async def test_a_cupy_get_into_pinned_memory_frees_it_after_its_fence(real_gpu: None) -> None:
    cupy = pytest.importorskip("cupy")
    cupyx = pytest.importorskip("cupyx")
    import numpy as np

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        source = cupy.arange(1 << 20, dtype=cupy.float32)
    pinned = cupyx.empty_pinned((1 << 20,), dtype=np.float32)
    freed: list[tuple[Any, bool]] = []
    fences: list[asyncfence.Fence] = []
    async with asyncfence.DropQueue() as drops:
        with hold(stream) as gate:
            # blocking=False: queued on the stream, not waited for (CuPy >= 13).
            source.get(stream=stream, out=pinned, blocking=False)
            fences.append(asyncfence.record(stream))
            drops.defer(fences[0], pinned, free=freed_after(lambda: fences[0], freed))
            await let_loop_run()
            assert freed == []
            gate.release()
            await drops.drain()
    assert len(freed) == 1
    assert freed[0][0] is pinned
    assert freed[0][1], "freed before its fence completed"
    assert np.array_equal(pinned, np.arange(1 << 20, dtype=np.float32))
