"""Await device work from asyncio: queue work on a few streams, await their fences.

Runs on the default device (PoCL's OpenCL on the CPU when no GPU is present):

    python examples/asyncio_fences.py
"""

from __future__ import annotations

import asyncio
import time

import asyncfence
from asyncfence.testing import open_default_device


async def main() -> None:
    device = open_default_device()
    streams = [device.new_stream() for _ in range(3)]
    start = time.perf_counter()
    for index, stream in enumerate(streams):
        device.launch_busy(stream, 0.01 * (index + 1))  # 10, 20 and 30 ms of work
    fences = [asyncfence.record(stream) for stream in streams]

    async def report(index: int, fence: asyncfence.Fence) -> None:
        await fence
        print(f"stream {index}: done after {(time.perf_counter() - start) * 1e3:.0f} ms")

    # The loop stays free while the device works: each fence resumes its own task.
    await asyncio.gather(*(report(i, fence) for i, fence in enumerate(fences)))


if __name__ == "__main__":
    asyncio.run(main())
