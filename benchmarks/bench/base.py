"""What every part of the benchmark shares: its settings, its results, and timing helpers."""

from __future__ import annotations

import asyncio
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, final

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Sequence

    from asyncfence.testing import StreamGate

__all__ = [
    "AUTO",
    "CONTENDER_ORDER",
    "DEVICE_FINISH",
    "IMPORT_AWAITED",
    "IMPORT_IDLE",
    "LATE_AFTER_S",
    "LOCAL_WAITER",
    "NUMBA",
    "PARK",
    "POLL",
    "RUNTIME_BLOCKING",
    "SLEEP_0",
    "SLEEP_1MS",
    "TO_THREAD",
    "WAIT_SYNC",
    "BenchConfig",
    "Releaser",
    "Results",
    "bounded",
    "default_executor_workers",
    "gather",
    "latency",
    "on_trio",
    "ordered",
    "run_in_thread",
    "thread_pool_size",
]

AUTO = "asyncfence auto"
PARK = "asyncfence park"
POLL = "asyncfence poll"
TO_THREAD = "to_thread"
SLEEP_1MS = "sleep(1ms) loop"
SLEEP_0 = "sleep(0) loop"
NUMBA = "numba async_done"
#: Not a way to wait: when the device itself finished, by its own stamps.
DEVICE_FINISH = "device finished"
# Across processes: asyncfence's import, and the usual workarounds.
IMPORT = "asyncfence import"
MESSAGE_AFTER_SYNC = "message after sync"
POLLED_10MS = "polled, 10 ms"
# A failure across processes (``relay.py``): the producer's own wait, and the
# import while the producer is idle or awaits the fence too.
# A synchronous wait (``blocking.py``): asyncfence's, and the runtime's own.
WAIT_SYNC = "wait_sync"
RUNTIME_BLOCKING = "runtime's blocking wait"
LOCAL_WAITER = "local waiter"
IMPORT_IDLE = "import, producer idle"
IMPORT_AWAITED = "import, producer awaits"

#: A wake later than this is "late" beside a CPU-bound thread: more than two
#: of CPython's 5 ms GIL switch intervals.
LATE_AFTER_S = 0.011

#: The order every table lists its rows in: the contenders, then the device's own.
CONTENDER_ORDER = (
    AUTO,
    PARK,
    POLL,
    TO_THREAD,
    SLEEP_1MS,
    SLEEP_0,
    NUMBA,
    IMPORT,
    MESSAGE_AFTER_SYNC,
    POLLED_10MS,
    DEVICE_FINISH,
)

_Value = TypeVar("_Value")


def ordered(figures: dict[str, _Value]) -> dict[str, _Value]:
    """``figures`` with its contender keys in :data:`CONTENDER_ORDER` (others after, as given)."""
    rank = {name: index for index, name in enumerate(CONTENDER_ORDER)}
    return dict(sorted(figures.items(), key=lambda item: rank.get(item[0], len(rank))))


def default_executor_workers() -> int:
    """The size of asyncio's default executor, which ``to_thread`` runs on."""
    return min(32, (os.cpu_count() or 1) + 4)


def on_trio() -> bool:
    """Whether the running loop is trio's (the benchmark runs on asyncio, uvloop and trio)."""
    trio = sys.modules.get("trio")  # never imported to find out
    return trio is not None and bool(trio.lowlevel.in_trio_task())


def thread_pool_size(loop_name: str) -> int:
    """How many threads ``to_thread`` can use at once on ``loop_name``.

    asyncio's default executor has min(32, cores + 4); trio's
    ``to_thread.run_sync`` is bounded by its default limiter, 40 tokens.
    """
    if loop_name == "trio":
        return 40  # trio.to_thread.current_default_thread_limiter()'s total_tokens
    return default_executor_workers()


async def run_in_thread(function: Callable[[], object]) -> None:
    """Run ``function`` in a worker thread, as users of this loop write it.

    ``asyncio.to_thread`` on asyncio and uvloop; on trio, ``trio.to_thread.run_sync``
    with ``abandon_on_cancel`` so that a timed-out trial does not wait for its
    thread (asyncio's ``to_thread`` abandons it too).
    """
    if on_trio():
        import trio

        await trio.to_thread.run_sync(function, abandon_on_cancel=True)
    else:
        await asyncio.to_thread(function)


async def gather(*waits: Awaitable[_Value]) -> list[_Value]:
    """Await every one of ``waits`` concurrently, in a task group; their results in order."""
    slots: dict[int, _Value] = {}

    async def store(index: int, wait: Awaitable[_Value]) -> None:
        slots[index] = await wait

    async with anyio.create_task_group() as group:
        for index, wait in enumerate(waits):
            group.start_soon(store, index, wait)
    return [slots[index] for index in range(len(waits))]


@dataclass(frozen=True)
class BenchConfig:
    """How long to run each scenario: trial counts, windows, sizes and timeouts.

    Attributes:
        quick: The smoke run (``--quick``): every scenario, tiny counts.
        wake_trials: Trials per contender of the one-waiter wake scenarios.
        fresh_trials: Trials per contender with a fresh queue per wait.
        many_queues: Waiters (one queue each) released in random order.
        many_rounds: Rounds per contender of that scenario.
        many_timeout_s: The bound on each wait there: 64 tasks polling may
            starve the releasing thread of the GIL (busy polling on every
            loop, and trio's 1 ms polling), and their waits then run to it.
        saturated_trials: Trials per contender on the saturated loop.
        saturated_tasks: Tasks in the ring that keeps the loop busy.
        saturated_timeout_s: The bound on each trial on the saturated loop.
        cpu_thread_trials: Trials per contender beside a CPU-bound thread.
        cross_process_trials: Trials per way of resuming across processes.
        wait_sync_trials: Trials per blocking wait of its wake latency.
        wait_sync_cpu_trials: Waits of a second per blocking wait, for CPU.
        relay_failure_trials: Trials of a failure crossing, per way the
            producer treats its fence.
        relay_flood_connections: Connections in each flood of the relay.
        out_of_order_trials: Trials per contender of out-of-order parking.
        parked_queues: Held queues with one parked wait each, for threads and RSS.
        parked_cpu_window_s: How long 64 parked waits are watched for CPU.
        parked_cpu_trials: Trials per contender of that.
        cpu_trials: Trials per contender of CPU while waiting on long work.
        cpu_work_s: How long that work runs.
        throughput_window_s: Length of each throughput measurement.
        throughput_rounds: Measurements per contender and task count.
        scale_sizes: Pending fences in the scale scenario.
        scale_window_s: How long the loop lag is probed at each size.
        streams: Streams (and tasks) for throughput's many-task case and scale.
        drop_objects: Objects deferred in the drop-queue scenario.
        one_by_one_fences: Parked fences completing one by one, on an in-order
            and on an out-of-order queue.
        scaling_sizes: Held queues, one parked fence each, in the scaling scenario.
        scaling_released: Gates released one by one per round there.
        scaling_gap_s: Seconds between those releases.
        scaling_rounds: Rounds of releases per size.
        trial_timeout_s: The bound on any single wait elsewhere.
        probe_timeout_s: The bound on each contender's probe at setup.
    """

    quick: bool = False
    wake_trials: int = 200
    fresh_trials: int = 100
    many_queues: int = 64
    many_rounds: int = 20
    many_timeout_s: float = 1.0
    saturated_trials: int = 20
    saturated_tasks: int = 8
    saturated_timeout_s: float = 0.5
    cpu_thread_trials: int = 100
    cross_process_trials: int = 100
    wait_sync_trials: int = 100
    wait_sync_cpu_trials: int = 2
    relay_failure_trials: int = 30
    relay_flood_connections: int = 1000
    out_of_order_trials: int = 30
    parked_queues: int = 1000
    parked_cpu_window_s: float = 0.5
    parked_cpu_trials: int = 2
    cpu_trials: int = 5
    cpu_work_s: float = 0.2
    throughput_window_s: float = 0.5
    throughput_rounds: int = 5
    scale_sizes: tuple[int, ...] = (10, 1000, 10000)
    scale_window_s: float = 0.5
    streams: int = 64
    drop_objects: int = 100_000
    one_by_one_fences: int = 500
    scaling_sizes: tuple[int, ...] = (1024, 4096, 16384)
    scaling_released: int = 64
    scaling_gap_s: float = 0.002
    scaling_rounds: int = 3
    trial_timeout_s: float = 5.0
    probe_timeout_s: float = 5.0

    @classmethod
    def smoke(cls) -> BenchConfig:
        """A run of a few seconds, to check the benchmark itself works."""
        return cls(
            quick=True,
            wake_trials=12,
            fresh_trials=6,
            many_rounds=1,
            saturated_trials=3,
            saturated_timeout_s=0.2,
            cpu_thread_trials=6,
            cross_process_trials=6,
            wait_sync_trials=6,
            wait_sync_cpu_trials=1,
            relay_failure_trials=3,
            relay_flood_connections=100,
            out_of_order_trials=3,
            parked_queues=100,
            parked_cpu_window_s=0.05,
            parked_cpu_trials=1,
            cpu_trials=1,
            cpu_work_s=0.05,
            throughput_window_s=0.1,
            throughput_rounds=1,
            scale_sizes=(10, 1000),
            scale_window_s=0.1,
            streams=16,
            drop_objects=10_000,
            one_by_one_fences=50,
            scaling_sizes=(64, 256),
            scaling_released=16,
            scaling_rounds=1,
        )


@dataclass
class Results:
    """Everything measured so far, keyed by scenario, then by contender.

    Attributes:
        meta: Device, versions, settings, contenders and those left out.
        latency: Wake latencies in seconds; ``math.inf`` for a trial that
            timed out.
        cpu: CPU seconds of the Python threads per wall second.
        throughput: Round trips per second, per number of tasks.
        scale: Loop lag (and poller tick cost) per number of pending fences.
        footprint: Threads and memory with many waits parked.
        drop: The drop-queue figures, per queue.
        signal_hold: How long each completion signal held its stream, in seconds.
        one_by_one: Per queue kind, parked fences completing one by one: how
            many, the wall time and the loop thread's CPU time in seconds,
            and the device queries and signals per fence.
        parked_scaling: Per number of held queues (one parked fence each),
            the wake latencies and loop lag while some are released.
        per_wait: Python heap per parked wait with a timeout, in bytes: a
            fence's, the plain-future floor's, and the fence's share.
        relay: Per flood of the relay, the exporting loop's lag and the
            owner's import beside it.
        completed: Scenario keys in the order they finished.
    """

    meta: dict[str, Any]
    latency: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    throughput: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    scale: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    footprint: dict[str, dict[str, float | None]] = field(default_factory=dict)
    drop: dict[str, dict[str, float]] = field(default_factory=dict)
    signal_hold: dict[str, list[float]] = field(default_factory=dict)
    one_by_one: dict[str, dict[str, float]] = field(default_factory=dict)
    parked_scaling: dict[int, dict[str, float]] = field(default_factory=dict)
    per_wait: dict[str, float] = field(default_factory=dict)
    relay: dict[str, dict[str, float | None]] = field(default_factory=dict)
    completed: list[str] = field(default_factory=list)


@final
class Releaser:
    """A thread that releases gates after delays, stamping the instant of each release.

    Gates stay referenced until their release call has returned (PoCL 3.0 can
    crash when a gate is dropped while its release runs). Use it as a context
    manager: leaving waits for every job queued so far.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[list[tuple[float, StreamGate]], list[float]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="bench releaser", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            steps, stamps = job
            for delay, gate in steps:
                if delay > 0:
                    time.sleep(delay)
                stamps.append(time.perf_counter())
                gate.release()

    def release_after(self, delay: float, gate: StreamGate) -> list[float]:
        """Release ``gate`` ``delay`` seconds from now; the list gets the instant of release."""
        return self.release_in_turn([(delay, gate)])

    def release_in_turn(self, steps: Iterable[tuple[float, StreamGate]]) -> list[float]:
        """Release each gate after its delay, one after the other; stamps in the same order."""
        stamps: list[float] = []
        self._jobs.put((list(steps), stamps))
        return stamps

    def close(self) -> None:
        """Finish the jobs queued so far, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()

    def __enter__(self) -> Releaser:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def bounded(wait: Awaitable[None], limit_s: float) -> float:
    """Await ``wait``; the instant it resumed, or ``math.inf`` if ``limit_s`` passed first.

    The instant is taken in the waiting task itself, as it resumes, so the
    timeout's machinery adds nothing to it.
    """
    with anyio.move_on_after(limit_s):
        await wait
        return time.perf_counter()
    return math.inf


def latency(resumed: float, stamps: Sequence[float], index: int = 0) -> float:
    """From the stamped release to ``resumed``; ``math.inf`` for a timeout or a missing stamp."""
    if not math.isfinite(resumed) or len(stamps) <= index:
        return math.inf
    return resumed - stamps[index]
