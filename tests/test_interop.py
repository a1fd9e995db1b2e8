"""Streams from the CUDA libraries users have: PyTorch, CuPy, numba-cuda, cuda.core.

Each test skips where its library is absent, or where the emulated driver is
in use (those libraries need a real GPU); ``scripts/gpu-check.sh`` runs them on
one.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import asyncfence
from asyncfence.testing import hold

from .conftest import until


@pytest.fixture
def real_gpu(cuda_mode: str) -> None:
    if cuda_mode != "real":
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
