"""A PyTorch pipeline that awaits the device without blocking the event loop.

Each batch goes host -> device -> host on two streams: an upload stream copies
a staging tensor to the device (``non_blocking=True``), a compute stream
waits for that copy on the device (``Fence.enqueue_wait``), computes, and
copies the result back to the host. The consumer awaits the batch's fence,
``record(streams.current_stream())`` taken right after that copy, and only
then reads the result; the event loop serves other tasks meanwhile (a
heartbeat counts its ticks).

A ``DropQueue`` keeps what the device still reads alive until the fence of
the work that reads it completes: the staging tensor (then back into the pool
for the next batch, never overwritten while a copy reads it) and the uploaded
tensor, which the compute stream reads although the upload stream allocated it
(no ``record_stream`` needed). ``max_items`` bounds the batches in flight.

The code is device-agnostic, as PyTorch's own ``torch.get_device_module``
makes it: on a CUDA GPU the streams are ``torch.cuda.Stream`` and the staging
tensors are pinned, so the copies are truly asynchronous; on CPU-only PyTorch
they are ``torch.cpu.Stream``, the work runs when it is queued, every fence
is done when recorded (awaiting it is still a checkpoint) and the tensors are
ordinary ones (there is no pinned memory without an accelerator). The same
code therefore runs in CI and on a laptop.

    python examples/torch_pipeline.py

Where PyTorch is not installed it says so and exits with status 0; a PyTorch
that is installed but fails to import fails, with its error.
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


def load_torch() -> Any:
    """PyTorch, or ``None`` if it is not installed.

    Only a missing ``torch`` package counts as "not installed": a PyTorch that
    is there but broken (a missing shared library, a dependency of its own
    missing) raises, so that the error is seen.
    """
    try:
        import torch
    except ModuleNotFoundError as missing:
        if missing.name != "torch":
            raise
        return None
    return torch


def pick_device(torch: Any) -> Any:
    """The first CUDA GPU where PyTorch sees one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


async def heartbeat(stop: asyncio.Event, ticks: list[int]) -> None:
    """Tick every millisecond: proof that the loop is never blocked for long."""
    while not stop.is_set():
        ticks[0] += 1
        await asyncio.sleep(0.001)


async def pipeline(torch: Any, device: Any) -> str:
    """Run the batches through; check each result once its fence completed.

    Returns:
        What it did, in one line.
    """
    streams = torch.get_device_module(device)  # torch.cuda or torch.cpu: the same calls
    pinned = device.type == "cuda"  # page-locked staging: asynchronous copies
    upload, compute = streams.Stream(), streams.Stream()
    pool = [
        torch.empty(ELEMENTS, dtype=torch.float32, pin_memory=pinned)
        for _ in range(STAGING_BUFFERS)
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
            with streams.stream(upload):
                uploaded = staging.to(device, non_blocking=True)
                copied_in = asyncfence.record(streams.current_stream())
            copied_in.enqueue_wait(compute)  # on the device: the host does not wait
            with streams.stream(compute):
                doubled = uploaded * 2 + 1
                result = torch.empty(ELEMENTS, dtype=torch.float32, pin_memory=pinned)
                result.copy_(doubled, non_blocking=True)  # pinned: truly asynchronous
                done = asyncfence.record(streams.current_stream())
            # Until `done`, the device still reads `staging` and `uploaded`.
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
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (CUDA, pinned staging)"
    else:
        where = "the CPU (no CUDA: every fence done when recorded)"
    return (
        f"torch {torch.__version__} on {where}: {verified} batches of "
        f"{ELEMENTS * 4 >> 20} MiB up, computed and down in {elapsed * 1e3:.0f} ms, "
        f"all verified; {released} batches' tensors released by the DropQueue after "
        f"their fences, {STAGING_BUFFERS} staging buffers reused "
        f"(the producer waited for one {waited_for_room} times); "
        f"the loop ticked {ticks[0]} times meanwhile"
    )


def main() -> int:
    """Run the pipeline on a CUDA GPU, else on the CPU; say so where PyTorch is missing."""
    torch = load_torch()
    if torch is None:
        print("torch_pipeline: needs PyTorch (not installed); nothing to do")
        return 0
    print(asyncio.run(pipeline(torch, pick_device(torch))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
