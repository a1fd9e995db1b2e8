"""An async host-to-device pipeline through a staging pool.

A producer fills staging buffers and queues the copies that upload them; a
consumer awaits each batch's fence and checks what arrived. Each staging buffer
goes back to the pool only once the device has passed the fence of the copy
that read it: the producer can never overwrite data still being uploaded, and
never waits longer than that.

On CUDA the staging buffers are pinned host memory (``PinnedBuffer``); on
OpenCL (PoCL when there is no GPU) ordinary host arrays. Run it with:

    python examples/pinned_staging.py
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from typing import Any

import numpy as np

import asyncfence
from asyncfence import StagingPool
from asyncfence.testing import open_default_device

BATCH_BYTES = 1 << 20
STAGING_BUFFERS = 4
BATCHES = 24


class OpenCLUploads:
    """Uploads through host arrays and ``enqueue_copy``."""

    def __init__(self, device: Any) -> None:
        import pyopencl as cl

        self.cl = cl
        self.context = device.context
        self.stream = device.new_stream()

    def staging_pool(self) -> StagingPool[np.ndarray]:
        return StagingPool(lambda: np.empty(BATCH_BYTES, dtype=np.uint8), STAGING_BUFFERS)

    def fill(self, staging: np.ndarray, value: int) -> None:
        staging.fill(value)

    def upload(self, staging: np.ndarray) -> Any:
        target = self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, size=BATCH_BYTES)
        self.cl.enqueue_copy(self.stream, target, staging, is_blocking=False)
        return target

    def download(self, source: Any) -> np.ndarray:
        result = np.empty(BATCH_BYTES, dtype=np.uint8)
        self.cl.enqueue_copy(self.stream, result, source, is_blocking=False)
        return result


class CudaUploads:
    """Uploads through pinned buffers and ``cuMemcpyHtoDAsync``."""

    def __init__(self, device: Any) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.stream = device.new_stream()

    def staging_pool(self) -> StagingPool[asyncfence.PinnedBuffer]:
        return StagingPool.pinned(BATCH_BYTES, STAGING_BUFFERS)

    def fill(self, staging: asyncfence.PinnedBuffer, value: int) -> None:
        ctypes.memset(staging.address, value, BATCH_BYTES)

    def upload(self, staging: asyncfence.PinnedBuffer) -> asyncfence.DeviceBuffer:
        target = asyncfence.DeviceBuffer(BATCH_BYTES)
        self.driver.cuMemcpyHtoDAsync(target.address, staging.address, BATCH_BYTES, self.stream)
        return target

    def download(self, source: asyncfence.DeviceBuffer) -> np.ndarray:
        result = asyncfence.PinnedBuffer(BATCH_BYTES)
        self.driver.cuMemcpyDtoHAsync(result.address, source.address, BATCH_BYTES, self.stream)
        return np.frombuffer(result.view(), dtype=np.uint8)


async def main() -> None:
    device = open_default_device()
    uploads: Any = CudaUploads(device) if device.backend == "cuda" else OpenCLUploads(device)
    pool = uploads.staging_pool()
    batches: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()
    producer_waited = 0

    async def produce() -> None:
        nonlocal producer_waited
        for batch in range(BATCHES):
            if not pool.available:
                producer_waited += 1
            staging = await pool.acquire()  # only a buffer no copy still reads
            uploads.fill(staging, batch % 256)
            target = uploads.upload(staging)
            pool.release_after(asyncfence.record(uploads.stream), staging)
            await batches.put((batch, target))
        await batches.put(None)

    async def consume() -> int:
        verified = 0
        while (entry := await batches.get()) is not None:
            batch, target = entry
            result = uploads.download(target)
            await asyncfence.record(uploads.stream)  # the loop stays free meanwhile
            assert (result == batch % 256).all(), f"batch {batch} arrived corrupted"
            verified += 1
        return verified

    start = time.perf_counter()
    _, verified = await asyncio.gather(produce(), consume())
    elapsed = time.perf_counter() - start
    await pool.aclose()
    print(
        f"{device.backend} on {device.name}: {verified} batches of {BATCH_BYTES >> 20} MiB "
        f"through {STAGING_BUFFERS} staging buffers in {elapsed * 1e3:.0f} ms, all verified; "
        f"the producer waited for a free buffer {producer_waited} times"
    )


if __name__ == "__main__":
    asyncio.run(main())
