"""Await device work from asyncio: queue work on a few streams, await their fences.

Runs on the default device (PoCL's OpenCL on the CPU when no GPU is present):

    python examples/asyncio_fences.py

It prints how long each stream took, as measured in this run. The streams run
at once: on PoCL they share the CPU's cores, so each takes longer than its
work alone would.
"""

from __future__ import annotations

import asyncio
import time

import asyncfence
from asyncfence.testing import open_default_device


async def main() -> None:
    device = open_default_device()
    # The first launch_busy times the device to learn how much work lasts how
    # long; do it now, so that the timing below does not include it.
    device.chunks_for(0.01)
    streams = [device.new_stream() for _ in range(3)]
    work_ms = [10 * (index + 1) for index in range(len(streams))]  # 10, 20 and 30 ms
    start = time.perf_counter()
    for stream, ms in zip(streams, work_ms, strict=True):
        device.launch_busy(stream, ms / 1e3)
    fences = [asyncfence.record(stream) for stream in streams]

    async def report(index: int, fence: asyncfence.Fence) -> None:
        await fence
        elapsed_ms = (time.perf_counter() - start) * 1e3
        print(f"stream {index}: {work_ms[index]} ms of work, done after {elapsed_ms:.0f} ms")

    # The loop stays free while the device works: each fence resumes its own task.
    await asyncio.gather(*(report(i, fence) for i, fence in enumerate(fences)))


if __name__ == "__main__":
    asyncio.run(main())
