"""``python -m asyncfence soak --minutes N``: a long run that checks nothing creeps.

Tasks record and await fences on many streams without pause, with every
strategy, timeouts and cancellations mixed in, while staging buffers go through
a drop queue. Every interval it reports fences awaited, the event loop's lag
(the delay of a ``call_soon`` probe, p99), traced memory and threads. At the
end it checks that memory and lag stayed flat: the exit status says whether.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import tracemalloc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from asyncfence import DropQueue, current_statistics, record
from asyncfence.testing import open_default_device

from .measure import percentile, plural

if TYPE_CHECKING:
    from asyncfence import PollerStatistics

__all__ = ["run_soak"]

_STRATEGIES: tuple[Literal["auto", "poll", "park"], ...] = ("auto", "poll", "park")
_TASKS = 64
_STREAMS = 16
# After warm-up, traced memory may not grow by more than this over the run.
_MEMORY_SLACK_BYTES = 2 << 20


@dataclass
class _Interval:
    at_s: float
    awaited: int
    timeouts: int
    cancellations: int
    lag_p99_ms: float
    memory_bytes: int
    threads: int


async def _soak(seconds: float, interval_s: float) -> tuple[list[_Interval], PollerStatistics]:
    device = open_default_device()
    streams = [device.new_stream() for _ in range(_STREAMS)]
    rng = random.Random(0)
    counts = {"awaited": 0, "timeouts": 0, "cancellations": 0}
    deadline = time.perf_counter() + seconds
    lags: list[float] = []
    intervals: list[_Interval] = []

    async def worker(index: int, queue: DropQueue) -> None:
        stream = streams[index % _STREAMS]
        while time.perf_counter() < deadline:
            device.launch_chunks(stream, rng.randint(1, 8))
            fence = record(stream)
            queue.defer(fence, bytearray(4096))
            strategy = rng.choice(_STRATEGIES)
            plan = rng.random()
            try:
                # `await fence` (the default strategy, no coroutine of
                # asyncfence's on asyncio) and `fence.wait(...)`, both.
                if plan < 0.025:
                    await asyncio.wait_for(fence.wait(strategy=strategy), rng.uniform(0, 5e-4))
                elif plan < 0.05:
                    await asyncio.wait_for(fence, rng.uniform(0, 5e-4))
                elif plan < 0.1:
                    await fence.wait(timeout=rng.uniform(0, 5e-4), strategy=strategy)
                elif plan < 0.4:
                    await fence
                else:
                    await fence.wait(strategy=strategy)
                counts["awaited"] += 1
            except (asyncio.TimeoutError, TimeoutError):
                counts["timeouts" if plan >= 0.05 else "cancellations"] += 1

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            done = loop.create_future()
            loop.call_soon(done.set_result, None)
            await done
            lags.append(time.perf_counter() - sent)
            await asyncio.sleep(0.01)

    async def report() -> None:
        start = time.perf_counter()
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(interval_s, max(0.0, deadline - time.perf_counter())))
            sample, lags[:] = list(lags), []
            intervals.append(
                _Interval(
                    at_s=time.perf_counter() - start,
                    awaited=counts["awaited"],
                    timeouts=counts["timeouts"],
                    cancellations=counts["cancellations"],
                    lag_p99_ms=percentile(sample, 0.99) * 1e3,
                    memory_bytes=tracemalloc.get_traced_memory()[0],
                    threads=threading.active_count(),
                )
            )
            row = intervals[-1]
            print(
                f"{row.at_s:7.1f} s  {row.awaited:>10,} awaited  "
                f"{plural(row.timeouts, 'timeout'):>14}  {row.cancellations:>6,} cancelled  "
                f"lag p99 {row.lag_p99_ms:7.2f} ms  "
                f"memory {row.memory_bytes / 1e6:7.2f} MB  threads {row.threads}",
                flush=True,
            )

    async with DropQueue(max_items=4 * _TASKS) as queue:
        await asyncio.gather(*(worker(index, queue) for index in range(_TASKS)), probe(), report())
    statistics = current_statistics()
    for stream in streams:
        device.close_stream(stream)
    return intervals, statistics


def run_soak(minutes: float) -> int:
    """Soak for ``minutes``; returns 0 if memory and lag stayed flat, else 1."""
    seconds = max(1.0, minutes * 60)
    interval_s = max(0.5, min(30.0, seconds / 10))
    tracemalloc.start()
    try:
        intervals, statistics = asyncio.run(_soak(seconds, interval_s))
    finally:
        tracemalloc.stop()
    if len(intervals) < 3:
        print("too short to judge: run for longer")
        return 1
    warm, last = intervals[1], intervals[-1]
    growth = last.memory_bytes - warm.memory_bytes
    worst_lag = max(row.lag_p99_ms for row in intervals[1:])
    flat = growth < _MEMORY_SLACK_BYTES and last.threads <= warm.threads + _STREAMS
    print(
        f"{plural(last.awaited, 'fence')} awaited, {plural(last.timeouts, 'timeout')}, "
        f"{plural(last.cancellations, 'cancellation')}; memory {growth / 1e6:+.2f} MB "
        f"after warm-up, worst lag p99 {worst_lag:.2f} ms, "
        f"{plural(statistics.signals, 'completion signal')} through the "
        f"{statistics.wake_path} wake path: " + ("flat" if flat else "NOT flat")
    )
    return 0 if flat else 1
