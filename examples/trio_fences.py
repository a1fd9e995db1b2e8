"""The same with trio, and a timeout: waits run natively on trio, no threads.

python examples/trio_fences.py
"""

from __future__ import annotations

import trio

import asyncfence
from asyncfence.testing import hold, open_default_device


async def main() -> None:
    device = open_default_device()
    stream = device.new_stream()
    with hold(stream) as gate:  # the host holds the stream: the fence cannot complete
        fence = asyncfence.record(stream)
        try:
            await fence.wait(timeout=0.05)
        except TimeoutError:
            print("timed out while the stream was held; the fence is still valid")
        gate.release()
    await fence
    print("done once released:", fence.done())


if __name__ == "__main__":
    trio.run(main)
