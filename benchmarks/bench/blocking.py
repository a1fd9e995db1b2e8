"""A synchronous wait: ``Fence.wait_sync()`` beside the runtime's own blocking wait.

The scenario an engine's step loop lives in: a thread blocks until the
device passes a point. Per trial, a thread of its own blocks in one of:

* ``wait_sync``: asyncfence's, sleeping on the completion signal (the shim);
* ``runtime's blocking wait``: the runtime's own (``clWaitForEvents`` on
  OpenCL, ``cuEventSynchronize`` on CUDA) on a raw event at the same point.

The loop releases the gate 0.5 to 3 ms in, stamping the instant; the latency
is from that stamp to the thread's return. Then each waits once for a gate
held a whole second, and the thread's own CPU time over that second is its
row in the CPU table (CPU s per wall s).
"""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING

import anyio

import asyncfence
from asyncfence.testing import StreamGate

from .base import RUNTIME_BLOCKING, WAIT_SYNC

if TYPE_CHECKING:
    from collections.abc import Callable

    from .targets import Context

__all__ = ["blocking_waits"]

_DELAYS_S = (0.0005, 0.003)
_HELD_S = 1.0


async def blocking_waits(ctx: Context) -> None:
    """Each blocking wait's wake latency, and its thread's CPU while blocked a second."""
    target, config = ctx.target, ctx.config
    samples = ctx.results.latency.setdefault("wait_sync", {})
    cpu = ctx.results.cpu.setdefault("wait_sync_cpu", {})
    stream = target.new_stream()
    rng = random.Random(5)
    for trial in range(config.wait_sync_trials + 1):  # the first is untimed
        ctx.progress(trial / (config.wait_sync_trials + 1) / 2)
        for name in rng.sample((WAIT_SYNC, RUNTIME_BLOCKING), 2):
            resumed, _ = await _one_wait(target, stream, name, rng.uniform(*_DELAYS_S))
            if trial:
                samples.setdefault(name, []).append(resumed)
    for trial in range(config.wait_sync_cpu_trials):
        ctx.progress(0.5 + trial / config.wait_sync_cpu_trials / 2)
        for name in (WAIT_SYNC, RUNTIME_BLOCKING):
            _, cpu_s = await _one_wait(target, stream, name, _HELD_S)
            cpu.setdefault(name, []).append(cpu_s / _HELD_S)


async def _one_wait(
    target: object, stream: object, name: str, delay_s: float
) -> tuple[float, float]:
    """Block a thread in ``name``'s wait; release ``delay_s`` in: (latency, the thread's CPU s)."""
    gate = StreamGate(stream)
    wait: Callable[[], None]
    if name == WAIT_SYNC:
        fence = asyncfence.record(stream)

        def wait() -> None:
            fence.wait_sync(timeout=30)
    else:
        event = target.raw_record(stream)  # type: ignore[attr-defined]

        def wait() -> None:
            target.device.raw_block(event)  # type: ignore[attr-defined]

    outcome: list[float] = []

    def blocked() -> None:
        started = time.thread_time()
        wait()
        outcome[:] = [time.perf_counter(), time.thread_time() - started]

    thread = threading.Thread(target=blocked, name="blocking wait")
    thread.start()
    try:
        await anyio.sleep(delay_s)
        stamp = time.perf_counter()
        gate.release()
        while thread.is_alive():  # noqa: ASYNC110 (the loop stays free: the thread is measured)
            await anyio.sleep(0.001)
    finally:
        gate.release()  # a no-op once released
        thread.join()
    if name != WAIT_SYNC:
        target.raw_done(event)  # type: ignore[attr-defined]
    resumed, cpu_s = outcome
    return resumed - stamp, cpu_s
