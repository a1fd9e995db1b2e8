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


class _LagProbe:
    """A task asking for 1 ms sleeps: how much later than asked each one ends."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            while True:
                asked = time.perf_counter()
                await anyio.sleep(0.001)
                self.lags.append(time.perf_counter() - asked - 0.001)

    def figures(self) -> tuple[float, float, int]:
        lags = sorted(self.lags) or [0.0]
        return lags[min(len(lags) - 1, int(0.99 * len(lags)))], lags[-1], len(self.lags)


async def _await_failure(fence: asyncfence.Fence, woken: list[float]) -> None:
    try:
        await fence
    except asyncfence.DeviceError:
        woken.append(time.perf_counter())
        time.sleep(0.02)  # noqa: ASYNC251 (a busy task, holding the loop: what is measured)


async def _produce(backend: str, notify_fd: int) -> None:
    device = open_default_device(backend)
    queue = device.new_stream()
    probe: _LagProbe | None = None
    async with anyio.create_task_group() as tg:
        async for line in _lines():
            method, *argument = line.split()
            if method == "lag-start":
                probe = _LagProbe()
                tg.start_soon(probe.run)
                _say(None)
                continue
            if method == "lag-stop":
                assert probe is not None
                probe.scope.cancel()
                _say(probe.figures())
                continue
            delay_s = float(argument[0])
            gate = StreamGate(queue)
            if method in ("import", "fail-idle", "fail-await"):
                fence = asyncfence.record(queue)
                _say(fence.export())
            else:
                event = device.raw_record(queue)
                thread = threading.Thread(
                    target=_message_after_sync, args=(device, event, notify_fd)
                )
                thread.start()
                _say(None)
            woken: list[float] = []
            async with anyio.create_task_group() as waiters:
                if method == "fail-await":
                    waiters.start_soon(_await_failure, fence, woken)
                await anyio.sleep(delay_s)
                stamp = time.perf_counter()
                if method.startswith("fail"):
                    gate.fail()
                else:
                    gate.release()
            if method.startswith("fail"):
                _say((stamp, woken[0] if woken else None))
            else:
                _say(stamp)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(_produce, sys.argv[1], int(sys.argv[2]))
