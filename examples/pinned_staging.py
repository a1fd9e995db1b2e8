"""An async host-to-device pipeline through a staging pool.

A producer fills staging buffers and queues the copies that upload them; a
consumer awaits each batch's fence and checks what arrived. Each staging buffer
goes back to the pool only once the device has passed the fence of the copy
that read it: the producer can never overwrite data still being uploaded, and
never waits longer than that.

On CUDA the staging buffers are pinned host memory (``PinnedBuffer``); on
OpenCL (PoCL when there is no GPU) ordinary host arrays. There, pyopencl's
event for each copy between host and device goes into a drop queue with the
copy's fence: such an event, garbage-collected, waits for its copy with the
GIL held, so dropping it at once would make every copy synchronous (and the
pool would never have a buffer in flight). Run it with:

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

    def upload(self, staging: np.ndarray) -> tuple[Any, Any]:
        """Queue the copy of ``staging`` to a new device buffer.

        Returns:
            The device buffer, and pyopencl's event for the copy: keep it until
            a fence recorded after the copy completes.
        """
        target = self.cl.Buffer(self.context, self.cl.mem_flags.READ_WRITE, size=BATCH_BYTES)
        transfer = self.cl.enqueue_copy(self.stream, target, staging, is_blocking=False)
        return target, transfer

    def download(self, source: Any) -> tuple[np.ndarray, Any]:
        """Queue the copy of ``source`` to a new host array.

        Returns:
            The host array, and pyopencl's event for the copy: keep it until a
            fence recorded after the copy completes.
        """
        result = np.empty(BATCH_BYTES, dtype=np.uint8)
        transfer = self.cl.enqueue_copy(self.stream, result, source, is_blocking=False)
        return result, transfer


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

    def upload(self, staging: asyncfence.PinnedBuffer) -> tuple[asyncfence.DeviceBuffer, None]:
        """Queue the copy of ``staging`` to a new device buffer; nothing else to keep."""
        target = asyncfence.DeviceBuffer(BATCH_BYTES)
        self.driver.cuMemcpyHtoDAsync(target.address, staging.address, BATCH_BYTES, self.stream)
        return target, None

    def download(self, source: asyncfence.DeviceBuffer) -> tuple[np.ndarray, None]:
        """Queue the copy of ``source`` to new pinned memory; nothing else to keep."""
        result = asyncfence.PinnedBuffer(BATCH_BYTES)
        self.driver.cuMemcpyDtoHAsync(result.address, source.address, BATCH_BYTES, self.stream)
        return np.frombuffer(result.view(), dtype=np.uint8), None


class Pipeline:
    """A producer uploading ``batches`` batches through a staging pool, a consumer checking them.

    Args:
        uploads: ``OpenCLUploads`` or ``CudaUploads``.
        batches: How many batches.
    """

    def __init__(self, uploads: Any, batches: int = BATCHES) -> None:
        self.uploads = uploads
        self.batches = batches
        self.pool: StagingPool[Any] = uploads.staging_pool()
        # Whatever a copy needs alive until its fence: pyopencl's events.
        self.transfers = asyncfence.DropQueue()
        #: How many times the producer found no staging buffer free.
        self.producer_waited = 0
        #: Batches that arrived intact.
        self.verified = 0

    async def run(self) -> None:
        """Run the producer and the consumer to the end, then close the pool."""
        queue: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()
        try:
            await asyncio.gather(self.produce(queue), self.consume(queue))
        finally:
            await self.pool.aclose()
            await self.transfers.aclose()

    async def produce(self, queue: asyncio.Queue[tuple[int, Any] | None]) -> None:
        """Fill staging buffers and queue their uploads."""
        for batch in range(self.batches):
            if not self.pool.available:
                self.producer_waited += 1
            staging = await self.pool.acquire()  # only a buffer no copy still reads
            self.uploads.fill(staging, batch % 256)
            target, transfer = self.uploads.upload(staging)
            fence = asyncfence.record(self.uploads.stream)
            self.pool.release_after(fence, staging)
            if transfer is not None:
                self.transfers.defer(fence, transfer)
            await queue.put((batch, target))
        await queue.put(None)

    async def consume(self, queue: asyncio.Queue[tuple[int, Any] | None]) -> None:
        """Download each batch, await its fence, and check what arrived."""
        while (entry := await queue.get()) is not None:
            batch, target = entry
            result, transfer = self.uploads.download(target)
            fence = asyncfence.record(self.uploads.stream)
            if transfer is not None:
                self.transfers.defer(fence, transfer)
            await fence  # the loop stays free meanwhile
            assert (result == batch % 256).all(), f"batch {batch} arrived corrupted"
            self.verified += 1


async def main() -> None:
    device = open_default_device()
    uploads: Any = CudaUploads(device) if device.backend == "cuda" else OpenCLUploads(device)
    pipeline = Pipeline(uploads)
    start = time.perf_counter()
    await pipeline.run()
    elapsed = time.perf_counter() - start
    print(
        f"{device.backend} on {device.name}: {pipeline.verified} batches of "
        f"{BATCH_BYTES >> 20} MiB through {STAGING_BUFFERS} staging buffers in "
        f"{elapsed * 1e3:.0f} ms, all verified; "
        f"the producer waited for a free buffer {pipeline.producer_waited} times"
    )


if __name__ == "__main__":
    asyncio.run(main())
