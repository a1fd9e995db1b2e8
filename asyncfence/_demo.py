"""``python -m asyncfence demo``: record fences on the default device and await them."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING

from ._exceptions import DeviceError
from ._fence import record
from ._poller import current_statistics
from .testing import hold, open_default_device

if TYPE_CHECKING:
    from .testing import Device


def plural(count: int, word: str, plural_form: str | None = None) -> str:
    """``"1 task"``, ``"2 tasks"``, ``"1,000 tasks"``."""
    form = word if count == 1 else (plural_form or f"{word}s")
    return f"{count:,} {form}"


async def _heartbeat(beats: list[float]) -> None:
    """Tick every millisecond: proof that the loop is free while fences are awaited."""
    while True:
        beats.append(time.perf_counter())
        await asyncio.sleep(0.001)


def _micros(since: float) -> str:
    return f"{(time.perf_counter() - since) * 1e6:.0f} µs"


async def _failure(device: Device) -> bool:
    """Step 3; whether every waiter got the error."""
    stream = device.new_stream()
    with hold(stream) as gate:
        fence = record(stream)
        waiters = [asyncio.create_task(fence.wait()) for _ in range(3)]
        await asyncio.sleep(0.005)
        try:
            gate.fail()
        except NotImplementedError as cannot:  # CUDA: the host cannot fail a stream
            gate.release()
            await asyncio.gather(*waiters)
            print(f"3. (skipped: {cannot})")
            return True
        results = await asyncio.gather(*waiters, return_exceptions=True)
    errors = [result for result in results if isinstance(result, DeviceError)]
    seen = f"code {errors[0].code}, {errors[0].name}" if errors else "none"
    print(
        f"3. failed the queue: {len(errors)} of {plural(len(waiters), 'waiter')} "
        f"got DeviceError ({seen})"
    )
    return len(errors) == len(waiters)


async def demo(backend: str | None = None) -> int:
    """Run the demo on the default device (or ``backend``'s); returns the exit status."""
    device = open_default_device(backend)
    print(f"asyncfence demo on {device.backend}: {device.name}")
    beats: list[float] = []
    heartbeat = asyncio.create_task(_heartbeat(beats))
    try:
        # 1. A held queue: the fence stays pending until the host lets the queue go.
        stream = device.new_stream()
        with hold(stream) as gate:
            fence = record(stream)
            waiter = asyncio.create_task(fence.wait())
            await asyncio.sleep(0.02)
            state = "done" if fence.done() else "pending"
            print(f"1. held queue: after 20 ms the fence is {state}, waiter done: {waiter.done()}")
            released = time.perf_counter()
            gate.release()
            await waiter
            print(f"   released the queue: the waiter resumed {_micros(released)} later")

        # 2. Work on several queues, awaited together while the loop stays free.
        streams = [device.new_stream() for _ in range(4)]
        beats.clear()
        start = time.perf_counter()  # before the launch: the work's whole time
        for stream in streams:
            device.launch_busy(stream, 0.025)
        fences = [record(stream) for stream in streams]
        await asyncio.gather(*(fence.wait() for fence in fences))
        elapsed_ms = (time.perf_counter() - start) * 1e3
        worst_gap_ms = max((b - a for a, b in itertools.pairwise(beats)), default=0.0) * 1e3
        print(
            f"2. 25 ms of work on each of {len(streams)} queues, "
            f"{plural(len(fences), 'fence')} awaited together: done {elapsed_ms:.0f} ms after "
            f"the launch; meanwhile a 1 ms heartbeat on the loop ran "
            f"{plural(len(beats), 'time')}, its longest gap {worst_gap_ms:.1f} ms"
        )

        # 3. A failure on the device reaches every waiter as DeviceError.
        failed_everywhere = await _failure(device)

        stats = current_statistics()
        state = "running" if stats.running else "idle"
        queries = plural(stats.queries, "device query", "device queries")
        how = (
            "wake through the native path"
            if stats.wake_path == "native"
            else "are re-checked on the loop (the native wake shim is not built)"
        )
        print(f"poller: {plural(stats.ticks, 'tick')}, {queries}, now {state}; parked waits {how}")
        return 0 if failed_everywhere else 1
    finally:
        heartbeat.cancel()
