"""The producing process of the cross-process scenario (``cross_process.py``).

Run as ``python -m benchmarks.bench.cross_process_producer BACKEND NOTIFY_FD``.
It obeys one command a line on stdin, read by its asyncio loop: ``METHOD
DELAY_S`` holds its queue behind a gate, records a fence behind it, and
prints (as the hex of a pickle, one line each) the fence's token for the
``import`` method, or ``None`` for the others, whose waits a thread of its
own makes (the runtime's blocking sync on its own event, then one byte written to ``NOTIFY_FD``: the
message after a blocking sync). ``DELAY_S`` later it stamps
``time.perf_counter()`` (the system's monotonic clock, which both processes
read), releases the gate, and prints the stamp. End of stdin ends it.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio

import asyncfence
from asyncfence.testing import StreamGate, open_default_device

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from asyncfence.testing import Device


def _say(value: Any) -> None:
    sys.stdout.write(pickle.dumps(value).hex() + "\n")
    sys.stdout.flush()


def _message_after_sync(device: Device, event: Any, notify_fd: int) -> None:
    device.raw_block(event)  # the runtime's own blocking sync (clWaitForEvents)
    os.write(notify_fd, b"x")


async def _lines() -> AsyncIterator[str]:
    pending = b""
    while True:
        await anyio.wait_readable(sys.stdin.fileno())
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode()


async def _produce(backend: str, notify_fd: int) -> None:
    device = open_default_device(backend)
    queue = device.new_stream()
    async for line in _lines():
        method, delay_s = line.split()
        gate = StreamGate(queue)
        if method == "import":
            _say(asyncfence.record(queue).export())
        else:
            event = device.raw_record(queue)
            threading.Thread(target=_message_after_sync, args=(device, event, notify_fd)).start()
            _say(None)
        await anyio.sleep(float(delay_s))
        stamp = time.perf_counter()
        gate.release()
        _say(stamp)


if __name__ == "__main__":
    anyio.run(_produce, sys.argv[1], int(sys.argv[2]))
