"""The scenarios of cost and load: CPU, threads and memory, round trips, scale."""

from __future__ import annotations

import contextlib
import functools
import math
import random
import threading
import time
import tracemalloc
from typing import TYPE_CHECKING, Any

import anyio

import asyncfence
from asyncfence.testing import OpenCLDevice, StreamGate

from ..measure import loop_lag, os_thread_count, percentile, python_threads_cpu, rss_bytes
from .base import PARK, Releaser, gather, on_trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Iterator

    from anyio.abc import TaskGroup

    from .targets import Contender, Context

__all__ = [
    "FENCE_PER_WAIT",
    "FLOOR_PER_WAIT",
    "cpu_while_parked",
    "cpu_while_waiting",
    "parked_at_scale",
    "parked_one_by_one",
    "parked_queues",
    "scale",
    "throughput",
]

# How long waits are given to reach their parked state before measuring.
_SETTLE_S = 0.05
# Waits parked on held queues for CPU while parked.
_PARKED_FOR_CPU = 64
# The loop-lag probe of parked_at_scale sleeps this long at a time.
_PROBE_INTERVAL_S = 0.001
# The bound on releasing many parked waits at once.
_RELEASE_ALL_TIMEOUT_S = 120.0


async def _wait(contender: Contender, token: Any) -> None:
    await contender.wait(token)


@contextlib.asynccontextmanager
async def _parked(
    contender: Contender, streams: list[Any], count: int | None = None
) -> AsyncIterator[None]:
    """``count`` waits (default: one per stream) on held streams, in turn, for the block.

    Leaving the block releases every gate and waits for every wait, bounded:
    a stuck one fails the scenario with TimeoutError.
    """
    gates = [StreamGate(stream) for stream in streams]
    count = len(streams) if count is None else count
    tokens = [contender.record(streams[i % len(streams)]) for i in range(count)]
    async with anyio.create_task_group() as waits:
        for token in tokens:
            waits.start_soon(_wait, contender, token)
        try:
            yield
        finally:
            for gate in gates:
                gate.release()
            waits.cancel_scope.deadline = anyio.current_time() + _RELEASE_ALL_TIMEOUT_S
    if waits.cancel_scope.cancelled_caught:
        raise TimeoutError(f"{contender.name}: parked waits still running after release")
    for token in tokens:
        contender.done(token)


async def cpu_while_waiting(ctx: Context) -> None:
    """CPU of the Python threads per wall second while awaiting one long piece of work."""
    target, config = ctx.target, ctx.config
    samples = ctx.results.cpu.setdefault("cpu_while_waiting", {})
    stream = target.new_stream()
    rng = random.Random(8)
    for trial in range(config.cpu_trials):
        ctx.progress(trial / config.cpu_trials)
        for contender in rng.sample(ctx.entrants, len(ctx.entrants)):
            target.device.launch_busy(stream, config.cpu_work_s)
            token = contender.record(stream)
            cpu, wall = python_threads_cpu(), time.perf_counter()
            await contender.wait(token)
            wall = time.perf_counter() - wall
            cpu = python_threads_cpu() - cpu
            contender.done(token)
            samples.setdefault(contender.name, []).append(cpu / wall)


async def cpu_while_parked(ctx: Context) -> None:
    """CPU of the Python threads per wall second while 64 waits sit on held queues."""
    target, config = ctx.target, ctx.config
    samples = ctx.results.cpu.setdefault("cpu_while_parked", {})
    streams = [target.new_stream() for _ in range(_PARKED_FOR_CPU)]
    rng = random.Random(9)
    for trial in range(config.parked_cpu_trials):
        ctx.progress(trial / config.parked_cpu_trials)
        for contender in rng.sample(ctx.entrants, len(ctx.entrants)):
            async with _parked(contender, streams):
                await anyio.sleep(_SETTLE_S)
                cpu, wall = python_threads_cpu(), time.perf_counter()
                await anyio.sleep(config.parked_cpu_window_s)
                wall = time.perf_counter() - wall
                cpu = python_threads_cpu() - cpu
            samples.setdefault(contender.name, []).append(cpu / wall)


def _megabytes(after: int | None, before: int | None) -> float | None:
    return None if after is None or before is None else (after - before) / 1e6


async def parked_queues(ctx: Context) -> None:
    """Threads and memory it takes to keep one wait parked on each of 1,000 held queues.

    Per contender, once: the gates and tokens are made first, then the counts
    taken, then the waits started and given time to park, then the counts
    taken again, after one unmeasured warm-up round (under tracemalloc too,
    whose tables grow on first use). ``to_thread`` starts from a fresh
    default executor, so its thread count is the threads it needed. RSS is
    the whole process's, and the allocator keeps memory an earlier contender
    freed, which can hide a later one's; the Python heap figure (tracemalloc,
    over the waits alone) does not depend on the order, but leaves out
    native memory.
    """
    target, config = ctx.target, ctx.config
    footprint = ctx.results.footprint
    streams = [target.new_stream() for _ in range(config.parked_queues)]
    # One unmeasured round first: the allocator's growth, and the first park's
    # one-off costs, would otherwise count against whichever contender is first.
    settle = _SETTLE_S + config.parked_queues * 20e-6
    # Under tracemalloc, like the measured rounds: its own tables grow on
    # first use and would otherwise count in the first contender's RSS.
    tracemalloc.start()
    try:
        async with _parked(ctx.entrants[0], streams):
            await anyio.sleep(settle)
    finally:
        tracemalloc.stop()
    for contender in ctx.entrants:
        ctx.fresh_default_executor()
        threads, os_threads, rss = threading.active_count(), os_thread_count(), rss_bytes()
        tracemalloc.start()
        try:
            async with _parked(contender, streams):
                await anyio.sleep(settle)
                traced = tracemalloc.get_traced_memory()[0]
                tracemalloc.stop()
                os_after = os_thread_count()
                footprint[contender.name] = {
                    "queues": float(config.parked_queues),
                    "python_threads_delta": float(threading.active_count() - threads),
                    "os_threads_delta": (
                        None
                        if os_after is None or os_threads is None
                        else float(os_after - os_threads)
                    ),
                    "rss_delta_mb": _megabytes(rss_bytes(), rss),
                    "python_heap_mb": traced / 1e6,
                }
        finally:
            tracemalloc.stop()  # a no-op once stopped
    if any(c.name == PARK for c in ctx.entrants):
        ctx.results.per_wait.update(await _heap_per_wait(streams, settle))


#: The rows of the heap-per-wait figures: a parked fence, and the floor.
FENCE_PER_WAIT = "asyncfence park: record, task, wait(timeout=120)"
FLOOR_PER_WAIT = "plain future: task, await inside a 120 s timeout"


async def _heap_per_wait(streams: list[Any], settle: float) -> dict[str, float]:
    """Python heap per wait, with a timeout: a parked fence beside a task awaiting a plain future.

    Both under tracemalloc over the same number of waits; the fence's row
    counts its record too (the fence, its core and its marker), the floor
    the future. On trio the floor is a ``trio.Event`` awaited inside
    ``trio.fail_after``, on asyncio a bare future inside ``asyncio.timeout``.
    """
    count = len(streams)
    figures: dict[str, float] = {}
    for name in (FLOOR_PER_WAIT, FENCE_PER_WAIT):
        gates = [StreamGate(stream) for stream in streams] if name == FENCE_PER_WAIT else []
        wake, waits = _plain_waits(count) if name == FLOOR_PER_WAIT else (None, [])
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            async with anyio.create_task_group() as tg:
                if name == FENCE_PER_WAIT:
                    fences = [asyncfence.record(stream) for stream in streams]
                    for fence in fences:
                        tg.start_soon(functools.partial(fence.wait, 120, strategy="park"))
                else:
                    for wait in waits:
                        tg.start_soon(wait)
                await anyio.sleep(settle)
                figures[name] = (tracemalloc.get_traced_memory()[0] - before) / count
                tracemalloc.stop()
                for gate in gates:
                    gate.release()
                if wake is not None:
                    wake()
        finally:
            tracemalloc.stop()
            for gate in gates:
                gate.release()
    figures["the fence's share"] = figures[FENCE_PER_WAIT] - figures[FLOOR_PER_WAIT]
    return figures


def _plain_waits(
    count: int,
) -> tuple[Callable[[], None], list[Callable[[], Coroutine[Any, Any, None]]]]:
    """``count`` waits on plain futures, each inside a 120 s timeout, and what wakes them all."""
    if on_trio():
        import trio

        events = [trio.Event() for _ in range(count)]

        async def trio_wait(event: trio.Event) -> None:
            with trio.fail_after(120):
                await event.wait()

        def set_all() -> None:
            for event in events:
                event.set()

        return set_all, [functools.partial(trio_wait, event) for event in events]
    import asyncio

    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(count)]

    async def future_wait(future: asyncio.Future[None]) -> None:
        async with asyncio.timeout(120):
            await future

    def resolve_all() -> None:
        for future in futures:
            future.set_result(None)

    return resolve_all, [functools.partial(future_wait, future) for future in futures]


async def throughput(ctx: Context) -> None:
    """Record-and-await round trips per second on short work, with 1 task and with many."""
    target, config = ctx.target, ctx.config
    rates = ctx.results.throughput
    streams = [target.new_stream() for _ in range(config.streams)]
    rng = random.Random(10)
    for half, tasks in enumerate((1, config.streams)):
        for round_ in range(config.throughput_rounds):
            ctx.progress(
                (half * config.throughput_rounds + round_) / (2 * config.throughput_rounds)
            )
            for contender in rng.sample(ctx.entrants, len(ctx.entrants)):
                deadline = time.perf_counter() + config.throughput_window_s
                counts = [0] * tasks

                async def loop(
                    index: int,
                    contender: Contender = contender,
                    deadline: float = deadline,
                    counts: list[int] = counts,
                ) -> None:
                    stream = streams[index]
                    while time.perf_counter() < deadline:
                        target.short_work(stream)
                        token = contender.record(stream)
                        await contender.wait(token)
                        contender.done(token)
                        counts[index] += 1

                start = time.perf_counter()
                await gather(*(loop(i) for i in range(tasks)))
                rate = sum(counts) / (time.perf_counter() - start)
                rates.setdefault(contender.name, {}).setdefault(tasks, []).append(rate)


@contextlib.contextmanager
def _timed_ticks(figures: dict[str, float]) -> Iterator[None]:
    """The running loop's poller ticks over the block, from its statistics."""
    before = asyncfence.current_statistics()
    yield
    after = asyncfence.current_statistics()
    ticks = after.ticks - before.ticks
    if ticks:
        figures["ticks"] = float(ticks)
        figures["tick_mean_s"] = (after.tick_seconds - before.tick_seconds) / ticks


async def scale(ctx: Context) -> None:
    """10, 1,000 and 10,000 pending fences over held streams: the loop's lag, the tick cost."""
    target, config = ctx.target, ctx.config
    streams = [target.new_stream() for _ in range(config.streams)]
    for step, size in enumerate(config.scale_sizes):
        for contender in ctx.entrants:
            ctx.progress(step / len(config.scale_sizes))
            ticks: dict[str, float] = {}
            async with _parked(contender, streams, size):
                await anyio.sleep(0.01)  # every waiter is parked in its wait
                with _timed_ticks(ticks) if contender.is_asyncfence else contextlib.nullcontext():
                    lags = await loop_lag(time.perf_counter() + config.scale_window_s)
            figures = {"lag_p99_s": percentile(lags, 0.99), "lag_p50_s": percentile(lags, 0.5)}
            figures.update(ticks)
            ctx.results.scale.setdefault(contender.name, {})[size] = figures


async def _start_parked(
    tg: TaskGroup, wait: Callable[[int], Coroutine[Any, Any, None]], count: int
) -> None:
    """Start ``wait(0)`` to ``wait(count - 1)`` in ``tg``; return once all are parked."""
    for index in range(count):
        tg.start_soon(wait, index)
    while asyncfence.current_statistics().parked < count:  # noqa: ASYNC110
        await anyio.sleep(0.001)


async def parked_one_by_one(ctx: Context) -> None:
    """Parked fences completing one by one, on an in-order and an out-of-order queue.

    ``asyncfence park`` only, on OpenCL: each fence behind a gate of its own,
    every wait parked, then the gates released one at a time, each wait
    awaited before the next release. The wall time includes the device's own:
    PoCL's out-of-order queues track every earlier command as a dependency of
    each marker, which costs it time that grows with the square of the
    fences; the runtime alone (the same gates and markers, released the same
    way, each marker waited for with the runtime's blocking wait on a thread)
    is timed beside it on a queue of its own. The loop thread's CPU time is
    what waiting cost on the loop (the releases run on a thread of their
    own), calls into the runtime included; the device queries and signals per
    fence are asyncfence's own work.
    """
    target, config = ctx.target, ctx.config
    park = next((c for c in ctx.entrants if c.name == PARK), None)
    device = target.device
    if park is None or not isinstance(device, OpenCLDevice):
        return  # OpenCL's out-of-order queues only: the report has no such table
    count = config.one_by_one_fences
    for kind, in_order in (("in-order", True), ("out-of-order", False)):
        stream = device.new_stream(in_order=in_order)
        try:
            alone_s = await anyio.to_thread.run_sync(_one_by_one_alone, device, stream, count)
        finally:
            device.close_stream(stream)
        stream = device.new_stream(in_order=in_order)
        try:
            figures = await _one_by_one(park, stream, count)
        finally:
            device.close_stream(stream)
        ctx.results.one_by_one[kind] = {**figures, "runtime_alone_wall_s": alone_s}
        ctx.progress(0.5 if in_order else 1.0)


def _one_by_one_alone(device: OpenCLDevice, stream: Any, count: int) -> float:
    """The runtime alone, the same way: markers behind gates released one at a time, no fence.

    On a thread: each marker waited for with the runtime's own blocking wait
    before the next release. The wall time is the runtime's, which the
    fences' row cannot go below.
    """
    gates, markers = [], []
    for _ in range(count):
        gates.append(StreamGate(stream))
        markers.append(device.raw_record(stream))
    started = time.perf_counter()
    try:
        for gate, marker in zip(gates, markers, strict=True):
            gate.release()
            device.raw_block(marker)
    finally:
        for gate in gates:
            gate.release()
    return time.perf_counter() - started


async def _one_by_one(park: Contender, stream: Any, count: int) -> dict[str, float]:
    """Time ``count`` parked waits woken one by one; a thread releases each gate in turn.

    The releases run on a thread of their own: PoCL does part of its
    dependency work inside the release call, which is the device's cost,
    not the waiting's, and would otherwise land on the loop thread.
    """
    gates, tokens = [], []
    for _ in range(count):
        gates.append(StreamGate(stream))  # holds the fence recorded next
        tokens.append(park.record(stream))
    resumed = [threading.Event() for _ in range(count)]

    async def wait(index: int) -> None:
        await park.wait(tokens[index])
        resumed[index].set()

    def release_one_by_one() -> None:
        for gate, event in zip(gates, resumed, strict=True):
            gate.release()
            if not event.wait(_RELEASE_ALL_TIMEOUT_S):
                return  # the loop side times out and says so

    releaser = threading.Thread(target=release_one_by_one, name="bench one-by-one releaser")
    try:
        with anyio.fail_after(2 * _RELEASE_ALL_TIMEOUT_S + count * 0.2):
            async with anyio.create_task_group() as tg:
                await _start_parked(tg, wait, count)
                before = asyncfence.current_statistics()
                started, cpu_started = time.perf_counter(), time.thread_time()
                releaser.start()
            # Leaving the group waited for every wait: nothing else ran here.
            wall, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
            after = asyncfence.current_statistics()
    finally:
        for gate in gates:
            gate.release()
        if releaser.is_alive():
            releaser.join()
    for token in tokens:
        park.done(token)
    return {
        "fences": float(count),
        "wall_s": wall,
        "loop_cpu_s": cpu,
        # asyncfence's own work: what it asked the device, and the signals
        # that woke it. Equal per fence on both queues when a wake costs what
        # fired; the loop's CPU time also holds what each call costs inside
        # the runtime.
        "queries_per_fence": (after.queries - before.queries) / count,
        "signals_per_fence": (after.signals - before.signals) / count,
    }


async def parked_at_scale(ctx: Context) -> None:
    """One parked fence on each of 1,024, 4,096 and 16,384 held queues, a few released 2 ms apart.

    ``asyncfence park`` only: what grows with the parked fences. Per size,
    every wait parks, then a releaser thread releases ``scaling_released``
    gates one by one, ``scaling_gap_s`` apart, stamping each, for
    ``scaling_rounds`` rounds (each round's waits awaited before the next).
    The releases start as soon as every wait is parked, so the first
    re-checks of all of them fall inside the window. A wake's latency runs
    from its gate's stamp to its task's resumption; the loop's lag is how
    much later than asked a probe task that sleeps a millisecond at a time
    resumes, over the whole window. Beside each size, PoCL alone: the same
    queues, gates and markers (the device's own events) with no fence and no
    wait, the same gates released the same way, the same probe.
    """
    target, config = ctx.target, ctx.config
    park = next((c for c in ctx.entrants if c.name == PARK), None)
    if park is None:
        return
    for step, size in enumerate(config.scaling_sizes):
        ctx.progress(step / len(config.scaling_sizes))
        streams = [target.device.new_stream() for _ in range(size)]
        try:
            figures = await _parked_at_scale(park, streams, config)
            figures.update(await _runtime_alone(ctx.target, streams, config))
            ctx.results.parked_scaling[size] = figures
        finally:
            for stream in streams:
                target.device.close_stream(stream)


class _SleepLag:
    """How much later than asked a task that sleeps a millisecond at a time resumes.

    A stall of the loop shows whether it falls in the sleep or in a turn.
    """

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._probing = True
        self._stopped = anyio.Event()

    async def run(self) -> None:
        while self._probing:
            sent = time.perf_counter()
            await anyio.sleep(_PROBE_INTERVAL_S)
            self.lags.append(max(time.perf_counter() - sent - _PROBE_INTERVAL_S, 0.0))
        self._stopped.set()

    async def stop(self) -> None:
        """Stop probing, once the sleep under way has ended."""
        self._probing = False
        await self._stopped.wait()


async def _runtime_alone(target: Any, streams: list[Any], config: Any) -> dict[str, float]:
    """The loop's lag with the same gates and releases, and no fence: the runtime's own share."""
    gates = [StreamGate(stream) for stream in streams]
    markers = [target.raw_record(stream) for stream in streams]
    rng = random.Random(12)
    chosen = rng.sample(
        range(len(streams)), min(len(streams), config.scaling_released * config.scaling_rounds)
    )
    probe = _SleepLag()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(probe.run)
            with Releaser() as releaser:
                for start in range(0, len(chosen), config.scaling_released):
                    batch = chosen[start : start + config.scaling_released]
                    stamps = releaser.release_in_turn(
                        (config.scaling_gap_s, gates[index]) for index in batch
                    )
                    while len(stamps) < len(batch):  # noqa: ASYNC110 (the loop stays free)
                        await anyio.sleep(0.001)
            await probe.stop()
    finally:
        for gate in gates:
            gate.release()
    for marker in markers:
        target.raw_done(marker)
    return {
        "alone_lag_p99_s": percentile(probe.lags, 0.99),
        "alone_lag_max_s": max(probe.lags, default=math.nan),
    }


async def _parked_at_scale(park: Contender, streams: list[Any], config: Any) -> dict[str, float]:
    size = len(streams)
    rng = random.Random(12)
    gates = [StreamGate(stream) for stream in streams]
    tokens = [park.record(stream) for stream in streams]
    resumed = [math.nan] * size
    chosen = rng.sample(range(size), min(size, config.scaling_released * config.scaling_rounds))
    wakes: list[float] = []
    probe = _SleepLag()

    async def wait(index: int) -> None:
        await park.wait(tokens[index])
        resumed[index] = time.perf_counter()

    try:
        with anyio.fail_after(_RELEASE_ALL_TIMEOUT_S + size * 1e-3):
            async with anyio.create_task_group() as tg:
                await _start_parked(tg, wait, size)
                before = asyncfence.current_statistics()
                tg.start_soon(probe.run)
                with Releaser() as releaser:
                    for start in range(0, len(chosen), config.scaling_released):
                        batch = chosen[start : start + config.scaling_released]
                        stamps = releaser.release_in_turn(
                            (config.scaling_gap_s, gates[index]) for index in batch
                        )
                        while any(math.isnan(resumed[index]) for index in batch):  # noqa: ASYNC110
                            await anyio.sleep(0.001)
                        wakes += [
                            resumed[i] - stamp for i, stamp in zip(batch, stamps, strict=True)
                        ]
                await probe.stop()  # before the rest is released, all at once
                after = asyncfence.current_statistics()
                for gate in gates:
                    gate.release()
    finally:
        for gate in gates:
            gate.release()  # no-ops once released
    for token in tokens:
        park.done(token)
    return {
        "queues": float(size),
        "wakes": float(len(wakes)),
        "wake_p50_s": percentile(wakes, 0.5),
        "wake_p99_s": percentile(wakes, 0.99),
        "lag_p99_s": percentile(probe.lags, 0.99),
        "lag_max_s": max(probe.lags, default=math.nan),
        "rechecks": float(after.rechecks - before.rechecks),
        "queries_per_wake": (after.queries - before.queries) / max(len(wakes), 1),
    }
