"""Await, in one process, device work that another process queued.

A producer process fills batches on its device, into memory both processes
share; for each batch it records a fence, exports it (``fence.export()``)
and sends the token down a pipe. The consumer, an asyncio server, imports
each token (``asyncfence.import_fence``) and awaits it on its own loop: no
thread, no polling. It reads a batch only once the producer's device has
written it, and checks it. Run it with:

    python examples/cross_process.py [opencl|cuda]

By default it runs on the default device (PoCL's OpenCL on the CPU where
there is no GPU). On OpenCL the producer fills a device buffer and copies it
into the shared memory; on CUDA its device writes the shared memory itself
(registered with ``cuMemHostRegister`` and mapped for the device), and the
consumer's own device waits on the producer's interprocess event. The
producer is started with ``spawn``, never ``fork``: a device runtime does not
survive a fork.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import numpy as np

import asyncfence
from asyncfence.testing import CudaDevice, OpenCLDevice, open_default_device

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

BATCHES = 6
BATCH_BYTES = 1 << 16
WORK_S = 0.02  # device work before each batch, so the consumer does wait


class OpenCLFill:
    """Fills a device buffer per batch and copies it into the shared memory."""

    def __init__(self, device: OpenCLDevice, batches: np.ndarray) -> None:
        import pyopencl as cl

        self.cl, self.device, self.batches = cl, device, batches
        self.stream = device.new_stream()

    def fill(self, index: int) -> Any:
        """Queue batch ``index``'s work; what must stay alive until its fence."""
        cl = self.cl
        source = cl.Buffer(self.device.context, cl.mem_flags.READ_WRITE, size=BATCH_BYTES)
        self.device.launch_busy(self.stream, WORK_S)
        value = np.full(1, index + 1, np.uint8)
        filled = cl.enqueue_fill_buffer(self.stream, source, value, 0, BATCH_BYTES)
        copied = cl.enqueue_copy(self.stream, self.batches[index], source, is_blocking=False)
        # pyopencl's events for non-blocking copies must outlive the copies.
        return source, filled, copied

    def close(self) -> None:
        """Nothing to undo."""


class CudaFill:
    """Has the device write each batch straight into the shared memory."""

    def __init__(self, device: CudaDevice, batches: np.ndarray) -> None:
        from cuda.bindings import driver

        self.driver, self.device = driver, device
        device.make_current()
        self.stream = device.new_stream()
        self.address = batches.ctypes.data
        # Pinned for every context, and mapped: the device may write it.
        flags = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
        (err,) = driver.cuMemHostRegister(self.address, batches.nbytes, flags)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemHostRegister failed: {err!r}")
        err, self.device_address = driver.cuMemHostGetDevicePointer(self.address, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed: {err!r}")

    def fill(self, index: int) -> None:
        """Queue batch ``index``'s work; nothing need stay alive for it."""
        self.device.launch_busy(self.stream, WORK_S)
        address = int(self.device_address) + index * BATCH_BYTES
        self.driver.cuMemsetD8Async(address, index + 1, BATCH_BYTES, self.stream)

    def close(self) -> None:
        self.driver.cuMemHostUnregister(self.address)


async def produce(pipe: Connection, shared_name: str, backend: str) -> None:
    """Fill each batch on the device, into the shared memory; send its token."""
    device = open_default_device(backend)
    shared = shared_memory.SharedMemory(shared_name)
    batches = np.ndarray((BATCHES, BATCH_BYTES), dtype=np.uint8, buffer=shared.buf)
    filler: CudaFill | OpenCLFill
    if isinstance(device, CudaDevice):
        filler = CudaFill(device, batches)
    else:
        assert isinstance(device, OpenCLDevice)
        filler = OpenCLFill(device, batches)
    try:
        # The drop queue keeps what a batch's work needs until its fence completes.
        async with asyncfence.DropQueue() as keep_alive:
            for index in range(BATCHES):
                needed = filler.fill(index)
                fence = asyncfence.record(filler.stream)
                if needed is not None:
                    keep_alive.defer(fence, needed)
                pipe.send(fence.export())
            # This loop answers the consumer's imports: keep it running until
            # the consumer has them all.
            await wait_readable(pipe)
            assert pipe.recv() == "done"
    finally:
        filler.close()
        del batches
        shared.close()


async def wait_readable(pipe: Connection) -> None:
    """Until ``pipe`` has something to read; the loop stays free."""
    readable = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(pipe.fileno(), readable.set)
    try:
        await readable.wait()
    finally:
        loop.remove_reader(pipe.fileno())


async def serve(pipe: Connection, batches: np.ndarray) -> None:
    """Await each batch the producer announces, then check it."""

    async def consume(index: int, token: asyncfence.FenceToken) -> None:
        await asyncfence.import_fence(token)  # once the batch is written, never before
        batch = batches[index]
        assert (batch == index + 1).all(), f"batch {index} read before it was written"
        print(f"batch {index}: {batch.nbytes:,} bytes of {index + 1}, read after its fence")

    async with asyncio.TaskGroup() as group:
        for index in range(BATCHES):
            await wait_readable(pipe)
            group.create_task(consume(index, pipe.recv()))
    pipe.send("done")


def run_producer(pipe: Connection, shared_name: str, backend: str) -> None:
    asyncio.run(produce(pipe, shared_name, backend))


def main() -> None:
    device = open_default_device(sys.argv[1] if len(sys.argv) > 1 else None)
    if isinstance(device, CudaDevice):
        # The imports open the producer's events on this device: load the
        # driver now, off the loop (it blocks).
        device.make_current()
        asyncfence.warm_up(device.new_stream())
    shared = shared_memory.SharedMemory(create=True, size=BATCHES * BATCH_BYTES)
    try:
        batches = np.ndarray((BATCHES, BATCH_BYTES), dtype=np.uint8, buffer=shared.buf)
        batches[:] = 0
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        producer = multiprocessing.get_context("spawn").Process(
            target=run_producer, args=(theirs, shared.name, device.backend)
        )
        producer.start()
        theirs.close()  # so that the producer's exit, however it ends, ends our reads
        asyncio.run(serve(ours, batches))
        producer.join()
        print(
            f"{BATCHES} batches from process {producer.pid} on {device.backend}, "
            f"producer exit {producer.exitcode}"
        )
        del batches
    finally:
        shared.close()
        shared.unlink()


if __name__ == "__main__":
    main()
