"""A PyTorch pipeline that awaits the GPU without blocking the event loop.

Each batch goes host -> device -> host on two streams: an upload stream copies
a pinned staging tensor to the GPU (``non_blocking=True``), a compute stream
waits for that copy on the GPU (``Fence.enqueue_wait``), computes, and copies
the result back into pinned memory. The consumer awaits the batch's fence,
``record(torch.cuda.current_stream())`` taken right after that copy, and only
then reads the result; the event loop serves other tasks meanwhile (a
heartbeat counts its ticks).

A ``DropQueue`` keeps what the GPU still reads alive until the fence of the
work that reads it completes: the staging tensor (then back into the pool for
the next batch, never overwritten while a copy reads it) and the uploaded
tensor, which the compute stream reads although the upload stream allocated it
(no ``record_stream`` needed). ``max_items`` bounds the batches in flight.

Needs PyTorch with a CUDA GPU; elsewhere it says so and exits with status 0:

    python examples/torch_pipeline.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import asyncfence

ELEMENTS = 1 << 20  # float32: 4 MiB a batch
BATCHES = 32
STAGING_BUFFERS = 4


def load_torch() -> tuple[Any, str]:
    """PyTorch where a CUDA GPU is usable, else ``None`` and why not."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed"
    if not torch.cuda.is_available():
        return None, "PyTorch finds no CUDA GPU"
    return torch, ""


async def heartbeat(stop: asyncio.Event, ticks: list[int]) -> None:
    """Tick every millisecond: proof that the loop is never blocked for long."""
    while not stop.is_set():
        ticks[0] += 1
        await asyncio.sleep(0.001)


async def pipeline(torch: Any) -> None:
    """Run the batches through; check each result once its fence completed."""
    upload, compute = torch.cuda.Stream(), torch.cuda.Stream()
    pool = [
        torch.empty(ELEMENTS, dtype=torch.float32, pin_memory=True) for _ in range(STAGING_BUFFERS)
    ]
    results: asyncio.Queue[tuple[int, asyncfence.Fence, Any] | None] = asyncio.Queue()
    drops = asyncfence.DropQueue(max_items=STAGING_BUFFERS)
    waited_for_room = 0

    def recycle(kept: tuple[Any, Any]) -> None:
        staging, _uploaded = kept  # the uploaded tensor goes with the reference
        pool.append(staging)

    async def produce() -> None:
        nonlocal waited_for_room
        for batch in range(BATCHES):
            if not pool:
                waited_for_room += 1
            await drops.wait_for_room()  # fewer than STAGING_BUFFERS batches in flight
            staging = pool.pop()  # no copy reads it any more: its fence completed
            torch.arange(ELEMENTS, dtype=torch.float32, out=staging).add_(batch)
            with torch.cuda.stream(upload):
                uploaded = staging.to("cuda", non_blocking=True)
                copied_in = asyncfence.record(torch.cuda.current_stream())
            copied_in.enqueue_wait(compute)  # on the GPU: the host does not wait
            with torch.cuda.stream(compute):
                doubled = uploaded * 2 + 1
                result = torch.empty(ELEMENTS, dtype=torch.float32, pin_memory=True)
                result.copy_(doubled, non_blocking=True)  # pinned: truly asynchronous
                done = asyncfence.record(torch.cuda.current_stream())
            # Until `done`, the GPU still reads `staging` and `uploaded`.
            drops.defer(done, (staging, uploaded), free=recycle)
            await results.put((batch, done, result))
        await results.put(None)

    async def consume() -> int:
        verified = 0
        expected = torch.arange(ELEMENTS, dtype=torch.float32)
        while (entry := await results.get()) is not None:
            batch, done, result = entry
            await done  # the loop runs on; reading `result` before this reads garbage
            if not torch.equal(result, (expected + batch) * 2 + 1):
                raise AssertionError(f"batch {batch} came back wrong")
            verified += 1
        return verified

    stop, ticks = asyncio.Event(), [0]
    beat = asyncio.create_task(heartbeat(stop, ticks))
    start = time.perf_counter()
    _, verified = await asyncio.gather(produce(), consume())
    await drops.aclose()  # every deferred tensor released, after its fence
    elapsed = time.perf_counter() - start
    stop.set()
    await beat
    released = drops.statistics().released
    print(
        f"torch on {torch.cuda.get_device_name()}: {verified} batches of "
        f"{ELEMENTS * 4 >> 20} MiB up, computed and down in {elapsed * 1e3:.0f} ms, "
        f"all verified; {released} batches' tensors released by the DropQueue after "
        f"their fences, {STAGING_BUFFERS} staging buffers reused "
        f"(the producer waited for one {waited_for_room} times); "
        f"the loop ticked {ticks[0]} times meanwhile"
    )


def main() -> int:
    """Run the pipeline where PyTorch has a GPU; say why not elsewhere."""
    torch, missing = load_torch()
    if torch is None:
        print(f"torch_pipeline: needs a CUDA GPU with PyTorch ({missing}); nothing to do")
        return 0
    asyncio.run(pipeline(torch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
