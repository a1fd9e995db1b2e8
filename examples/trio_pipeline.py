"""The pipeline of ``anyio_pipeline.py`` in trio's own idiom: a nursery and a channel.

The producer stages each batch in a host buffer and queues device work that
reads it; the buffer waits in a DropQueue, budget four, until the device is
done with it. ``wait_for_room`` holds the producer back while four are in use.

    python examples/trio_pipeline.py
"""

from __future__ import annotations

import time

import trio

import asyncfence
from asyncfence.testing import open_default_device

BATCHES = 20
BUDGET = 4


async def main() -> None:
    device = open_default_device()
    device.chunks_for(0.002)  # the first launch_busy calibrates: do it before the timing
    stream = device.new_stream()
    send, receive = trio.open_memory_channel[asyncfence.Fence](BATCHES)
    consumed = 0

    async def produce(dq: asyncfence.DropQueue) -> None:
        async with send:
            for _ in range(BATCHES):
                await dq.wait_for_room()
                staging = bytearray(1 << 20)
                device.launch_busy(stream, 0.002)
                fence = asyncfence.record(stream)
                dq.defer(fence, staging)
                await send.send(fence)

    async def consume() -> None:
        nonlocal consumed
        async with receive:
            async for fence in receive:
                await fence
                consumed += 1

    start = time.perf_counter()
    async with asyncfence.DropQueue(max_items=BUDGET) as dq, trio.open_nursery() as nursery:
        nursery.start_soon(produce, dq)
        nursery.start_soon(consume)
    print(
        f"trio: {consumed} batches through a budget of {BUDGET} buffers in "
        f"{(time.perf_counter() - start) * 1e3:.0f} ms; "
        f"{dq.statistics().released} buffers released, none pending"
    )


if __name__ == "__main__":
    trio.run(main)
