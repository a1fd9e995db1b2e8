"""Await, in one process, device work that another process queued.

A producer process fills batches on its device and copies each into memory
both processes share; for each batch it records a fence, exports it
(``fence.export()``) and sends the token down a pipe. The consumer, an
asyncio server, imports each token (``asyncfence.import_fence``) and awaits
it on its own loop: no thread, no polling. It reads a batch only once the
producer's copy into the shared memory is done, and checks it. Run it with:

    python examples/cross_process.py

It runs on OpenCL: the default device where there is no GPU (PoCL, on the
CPU). The producer is started with ``spawn``, never ``fork``: a device
runtime does not survive a fork.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import numpy as np

import asyncfence
from asyncfence.testing import OpenCLDevice, open_default_device

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

BATCHES = 6
BATCH_BYTES = 1 << 16
WORK_S = 0.02  # device work before each copy, so the consumer does wait


async def produce(pipe: Connection, shared_name: str) -> None:
    """Fill each batch on the device and copy it into the shared memory; send its token."""
    import pyopencl as cl

    device = open_default_device("opencl")
    assert isinstance(device, OpenCLDevice)
    queue = device.new_stream()
    shared = shared_memory.SharedMemory(shared_name)
    batches = np.ndarray((BATCHES, BATCH_BYTES), dtype=np.uint8, buffer=shared.buf)
    # pyopencl's events for non-blocking copies must outlive the copies: the
    # drop queue keeps each, with its device buffer, until its fence completes.
    async with asyncfence.DropQueue() as keep_alive:
        for index in range(BATCHES):
            source = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, size=BATCH_BYTES)
            device.launch_busy(queue, WORK_S)
            filled = cl.enqueue_fill_buffer(
                queue, source, np.full(1, index + 1, np.uint8), 0, BATCH_BYTES
            )
            copied = cl.enqueue_copy(queue, batches[index], source, is_blocking=False)
            fence = asyncfence.record(queue)
            keep_alive.defer(fence, (source, filled, copied))
            pipe.send(fence.export())
        # This loop answers the consumer's imports: keep it running until the
        # consumer has them all.
        await wait_readable(pipe)
        assert pipe.recv() == "done"
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
        await asyncfence.import_fence(token)  # resumes once the copy into shared memory is done
        batch = batches[index]
        assert (batch == index + 1).all(), f"batch {index} read before its copy completed"
        print(f"batch {index}: {batch.nbytes:,} bytes of {index + 1}, read after its fence")

    async with asyncio.TaskGroup() as group:
        for index in range(BATCHES):
            await wait_readable(pipe)
            group.create_task(consume(index, pipe.recv()))
    pipe.send("done")


def run_producer(pipe: Connection, shared_name: str) -> None:
    asyncio.run(produce(pipe, shared_name))


def main() -> None:
    shared = shared_memory.SharedMemory(create=True, size=BATCHES * BATCH_BYTES)
    try:
        batches = np.ndarray((BATCHES, BATCH_BYTES), dtype=np.uint8, buffer=shared.buf)
        batches[:] = 0
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        producer = multiprocessing.get_context("spawn").Process(
            target=run_producer, args=(theirs, shared.name)
        )
        producer.start()
        theirs.close()  # so that the producer's exit, however it ends, ends our reads
        asyncio.run(serve(ours, batches))
        producer.join()
        print(f"{BATCHES} batches from process {producer.pid}, producer exit {producer.exitcode}")
        del batches
    finally:
        shared.close()
        shared.unlink()


if __name__ == "__main__":
    main()
