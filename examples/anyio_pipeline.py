"""A producer and a consumer on the device, with backpressure through the drop queue.

The producer stages each batch in a host buffer and queues device work that
reads it; the buffer is deferred to a DropQueue with a budget of four. When
four buffers are still in use by the device, ``wait_for_room`` holds the
producer back until one is released. The consumer awaits each batch's fence.
Written for anyio, it runs unchanged on asyncio and on trio:

    python examples/anyio_pipeline.py [asyncio|trio]
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import anyio

import asyncfence
from asyncfence.testing import open_default_device

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream

BATCHES = 20
BUDGET = 4


async def main(backend: str) -> None:
    device = open_default_device()
    device.chunks_for(0.002)  # the first launch_busy calibrates: do it before the timing
    stream = device.new_stream()
    send, receive = anyio.create_memory_object_stream[tuple[int, asyncfence.Fence]](BATCHES)
    held_back = 0

    async def produce(dq: asyncfence.DropQueue) -> None:
        nonlocal held_back
        async with send:
            for batch in range(BATCHES):
                if dq.statistics().pending_items >= BUDGET:
                    held_back += 1
                await dq.wait_for_room()  # backpressure: at most BUDGET buffers in flight
                staging = bytearray(1 << 20)  # filled by the host...
                device.launch_busy(stream, 0.002)  # ...and read by the device
                fence = asyncfence.record(stream)
                dq.defer(fence, staging)  # kept alive until the device is done with it
                await send.send((batch, fence))

    async def consume(receive: MemoryObjectReceiveStream[tuple[int, asyncfence.Fence]]) -> int:
        done = 0
        async with receive:
            async for _batch, fence in receive:
                await fence
                done += 1
        return done

    start = time.perf_counter()
    async with asyncfence.DropQueue(max_items=BUDGET) as dq, anyio.create_task_group() as tg:
        tg.start_soon(produce, dq)
        consumed = await consume(receive)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    print(
        f"{backend}: {consumed} batches through a budget of {BUDGET} buffers "
        f"in {elapsed_ms:.0f} ms; "
        f"the producer was held back {held_back} times; "
        f"{dq.statistics().released} buffers released"
    )


if __name__ == "__main__":
    chosen = sys.argv[1] if len(sys.argv) > 1 else "asyncio"
    anyio.run(main, chosen, backend=chosen)
