"""The benchmark's drop-queue scenarios, beside a lazy free-at-next-allocation pool.

The lazy pool is what PyTorch's and CuPy's pinned-memory pools do: deferred
frees sit in one FIFO of ``(event, object)`` and are processed only when the
program next allocates, stopping at the first event not yet done. Here the
program allocates once a millisecond.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from asyncfence import DropQueue, record
from asyncfence.testing import StreamGate

from ..measure import percentile
from .base import Releaser

if TYPE_CHECKING:
    from collections.abc import Callable

    from .base import BenchConfig
    from .targets import Context, Target

__all__ = ["DROP_QUEUE", "LAZY_POOL", "drop_queue"]

DROP_QUEUE = "asyncfence DropQueue"
LAZY_POOL = "lazy pool (free at next alloc)"

_ALLOCATION_INTERVAL_S = 0.001
# A gate is released this long after its object is deferred: a random phase
# against the lazy pool's allocations (a fixed delay would lock onto them).
_RELEASE_DELAYS_S = (0.0005, 0.003)


class LazyPool:
    """Frees at the next allocation, in FIFO order, stopping at the first event not done."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._fifo: deque[tuple[Any, Any, Callable[[Any], object]]] = deque()

    def defer(self, stream: Any, obj: Any, free: Callable[[Any], object]) -> None:
        self._fifo.append((self._target.raw_record(stream), obj, free))

    def allocate(self) -> None:
        """What the pool does on each allocation: release the completed prefix."""
        while self._fifo and self._target.raw_query(self._fifo[0][0]):
            event, obj, free = self._fifo.popleft()
            free(obj)
            self._target.raw_done(event)

    def __len__(self) -> int:
        return len(self._fifo)


async def _allocate_periodically(pool: LazyPool) -> None:
    """What a program that allocates once a millisecond does to the pool, until cancelled."""
    while True:
        pool.allocate()
        await anyio.sleep(_ALLOCATION_INTERVAL_S)


async def _release_latency(target: Target, config: BenchConfig, lazy: bool) -> list[float]:
    """From the release of a gate to the free of the object behind it."""
    stream = target.new_stream()
    pool = LazyPool(target)
    rng = random.Random(11)
    latencies: list[float] = []
    with Releaser() as releaser:
        async with anyio.create_task_group() as allocator, DropQueue() as queue:
            if lazy:
                allocator.start_soon(_allocate_periodically, pool)
            for _ in range(max(5, config.wake_trials // 4)):
                freed = anyio.Event()
                freed_at: list[float] = []

                def free(
                    _obj: object, freed: anyio.Event = freed, at: list[float] = freed_at
                ) -> None:
                    at.append(time.perf_counter())
                    freed.set()

                gate = StreamGate(stream)
                if lazy:
                    pool.defer(stream, object(), free)
                else:
                    queue.defer(record(stream), object(), free=free)
                stamp = releaser.release_after(rng.uniform(*_RELEASE_DELAYS_S), gate)
                with anyio.fail_after(30):
                    await freed.wait()
                latencies.append(freed_at[0] - stamp[0])  # stamped before the release
            allocator.cancel_scope.cancel()
    return latencies


async def _until(done: Callable[[], int], target: int) -> float:
    """Seconds until ``done()`` reached ``target``; gives up after 0.5 s without progress."""
    start = last_progress = time.perf_counter()
    seen = done()
    while seen < target and time.perf_counter() - last_progress < 0.5:
        await anyio.sleep(0.0005)
        if done() != seen:
            seen, last_progress = done(), time.perf_counter()
    return (last_progress if seen < target else time.perf_counter()) - start


async def _bytes_per_pending_object(target: Target, lazy: bool) -> float:
    """Memory the structures take per pending object (tracemalloc, 5,000 objects)."""
    stream = target.new_stream()
    gate = StreamGate(stream)
    pool = LazyPool(target)
    async with DropQueue() as queue:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(5000):
            if lazy:
                pool.defer(stream, None, lambda _obj: None)
            else:
                queue.defer(record(stream), None)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()  # the queue takes them in and starts watching
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        gate.release()
    pool.allocate()
    return used / 5000


async def _many_objects(target: Target, config: BenchConfig, lazy: bool) -> dict[str, float]:
    """Objects across 16 streams; one stream stuck, the others done; then all done."""
    count = config.drop_objects
    streams = [target.new_stream() for _ in range(16)]
    gates = [StreamGate(stream) for stream in streams]
    freed = 0

    def free(_obj: object) -> None:
        nonlocal freed
        freed += 1

    pool = LazyPool(target)
    figures: dict[str, float] = {}
    others = count - count // 16
    async with anyio.create_task_group() as allocator:
        if lazy:
            allocator.start_soon(_allocate_periodically, pool)
        async with DropQueue() as queue:
            start = time.perf_counter()
            for index in range(count):
                stream = streams[index % 16]  # interleaved, as work on many streams is
                if lazy:
                    pool.defer(stream, object(), free)
                else:
                    queue.defer(record(stream), object(), free=free)
            figures["defer_us"] = (time.perf_counter() - start) / count * 1e6
            for gate in gates[1:]:  # every stream but the first completes
                gate.release()
            waited = await _until(lambda: freed, others)
            figures["released_with_one_stream_stuck"] = freed
            figures["release_others_ms"] = waited * 1e3
            gates[0].release()
            figures["release_rest_ms"] = await _until(lambda: freed, count) * 1e3
        allocator.cancel_scope.cancel()
    return figures


async def drop_queue(ctx: Context) -> None:
    """Every drop-queue figure, for asyncfence's queue and for the lazy pool."""
    target, config = ctx.target, ctx.config
    for name, lazy in ((DROP_QUEUE, False), (LAZY_POOL, True)):
        latencies = await _release_latency(target, config, lazy)
        figures = await _many_objects(target, config, lazy)
        figures["objects"] = float(config.drop_objects)
        figures["bytes_per_pending_object"] = await _bytes_per_pending_object(target, lazy)
        figures["release_latency_p50_us"] = percentile(latencies, 0.5) * 1e6
        figures["release_latency_p99_us"] = percentile(latencies, 0.99) * 1e6
        ctx.results.drop[name] = figures
