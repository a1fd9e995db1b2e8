"""The device as the baselines use it, the contenders, and the probe that admits them.

A :class:`Target` gives the baselines raw events (OpenCL markers, CUDA events)
on the device's streams. A :class:`Contender` is one way to wait: what it
records on a stream and how it awaits that. Every contender is probed once at
setup (:func:`probe_contenders`); one that cannot run is left out, with the
reason, instead of crashing the run.
"""

from __future__ import annotations

import asyncio
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio

import asyncfence

from .base import (
    AUTO,
    DEVICE_FINISH,
    NUMBA,
    PARK,
    POLL,
    SLEEP_0,
    SLEEP_1MS,
    TO_THREAD,
    BenchConfig,
    Results,
    bounded,
    default_executor_workers,
    on_trio,
    run_in_thread,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from asyncfence.testing import Device

__all__ = [
    "Contender",
    "Context",
    "Target",
    "contenders",
    "device_finish_row",
    "make_target",
    "probe_contenders",
]


class Target:
    """A device's streams and raw events (OpenCL markers, CUDA events), for the baselines.

    The raw events are the device's own (:meth:`asyncfence.testing.Device.raw_record`
    and the rest): each backend's lab provides them.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._streams: list[Any] = []
        #: Whether the device stamps when it finishes each raw event (see
        #: :func:`device_finish_row`); asked before any stream exists.
        self.stamped = device.stamp_streams()

    def new_stream(self) -> Any:
        """A stream that :meth:`close` releases."""
        stream = self.device.new_stream()
        self._streams.append(stream)
        return stream

    def raw_record(self, stream: Any) -> Any:
        """Record a raw event at the current end of ``stream``."""
        return self.device.raw_record(stream)

    def raw_query(self, event: Any) -> bool:
        """Whether ``event`` is complete; raises if it failed."""
        return self.device.raw_query(event)

    def raw_block(self, event: Any) -> None:
        """Block the calling thread until ``event`` completes (GIL released)."""
        self.device.raw_block(event)

    def raw_done(self, event: Any) -> None:
        """The baseline finished with ``event``."""
        self.device.raw_done(event)

    def raw_finished_at(self, event: Any) -> float | None:
        """When the device finished ``event``, on :func:`time.perf_counter`'s clock, if known."""
        return self.device.raw_finished_at(event)

    def short_work(self, stream: Any) -> None:
        """Queue one piece of short work (a 1 MiB copy or memset)."""
        self.device.launch_chunks(stream, 1)

    def close(self) -> None:
        """Release the streams this target made, and the raw events."""
        for stream in self._streams:
            self.device.close_stream(stream)
        self._streams.clear()
        self.device.close()


def make_target(device: Device) -> Target:
    """The target for ``device``."""
    return Target(device)


@dataclass(frozen=True)
class Contender:
    """A way to wait: what it records on a stream, and how it awaits that.

    Attributes:
        name: As the tables show it.
        record: Records a token at the current end of a stream.
        wait: Awaits a token.
        done: Called once a token is no longer needed (not after a timeout).
        is_asyncfence: One of asyncfence's strategies.
        finished_at: Only for the device's own row (:func:`device_finish_row`):
            when the device finished a token, which its latency runs to
            instead of the wait's resumption.
    """

    name: str
    record: Callable[[Any], Any]
    wait: Callable[[Any], Awaitable[None]]
    done: Callable[[Any], None] = lambda token: None
    is_asyncfence: bool = False
    finished_at: Callable[[Any], float | None] | None = None

    def latency_end(self, token: Any, resumed: float) -> float:
        """Where a trial's latency runs to, given the instant its wait resumed.

        That instant itself for a way to wait; the device's own stamp for
        the device's row (``math.inf`` for a timeout, or a stamp missing).
        """
        if self.finished_at is None or not math.isfinite(resumed):
            return resumed
        finished = self.finished_at(token)
        return math.inf if finished is None else finished


def contenders(target: Target) -> list[Contender]:
    """Asyncfence's strategies, then the baselines users write today, in table order."""

    def strategy(name: Literal["auto", "park", "poll"]) -> Callable[[Any], Awaitable[None]]:
        async def fence_wait(fence: asyncfence.Fence) -> None:
            await fence.wait(strategy=name)

        return fence_wait

    async def to_thread(event: Any) -> None:
        await run_in_thread(lambda: target.raw_block(event))

    async def busy_loop(event: Any) -> None:
        while not target.raw_query(event):  # noqa: ASYNC110
            await anyio.sleep(0)  # noqa: ASYNC115 (what users write)

    strategies: tuple[tuple[str, Literal["auto", "park", "poll"]], ...] = (
        (AUTO, "auto"),
        (PARK, "park"),
        (POLL, "poll"),
    )
    found = [
        Contender(name, asyncfence.record, strategy(value), is_asyncfence=True)
        for name, value in strategies
    ]
    found += [
        Contender(TO_THREAD, target.raw_record, to_thread, target.raw_done),
        Contender(SLEEP_1MS, target.raw_record, _sleep_loop(target), target.raw_done),
        Contender(SLEEP_0, target.raw_record, busy_loop, target.raw_done),
    ]
    numba = _numba_contender(target)
    if numba is not None:
        found.append(numba)
    return found


def _sleep_loop(target: Target) -> Callable[[Any], Awaitable[None]]:
    # The loop users write by hand; the very thing the linter warns about.
    async def sleep_loop(event: Any) -> None:
        while not target.raw_query(event):  # noqa: ASYNC110
            await anyio.sleep(0.001)

    return sleep_loop


def device_finish_row(target: Target) -> Contender | None:
    """The device's own row: when it finished each raw event, by its own stamps.

    No wait can resume before the device has finished, so this row is the
    floor under the floor: what is left above it is the cost of learning of
    the finish and resuming the task. It waits like the ``sleep(1ms)`` loop
    (no thread, little CPU), but its latency runs to the device's stamp.
    ``None`` where the device has no stamps on a host clock: CUDA events
    time only relative to one another.
    """
    if not target.stamped:
        return None
    return Contender(
        DEVICE_FINISH,
        target.raw_record,
        _sleep_loop(target),
        target.raw_done,
        finished_at=target.raw_finished_at,
    )


def _numba_contender(target: Target) -> Contender | None:
    if target.device.backend != "cuda" or on_trio():  # async_done is asyncio's
        return None
    try:
        from numba import cuda as numba_cuda
    except ImportError:
        return None

    async def async_done(stream: Any) -> None:
        await stream.async_done()

    return Contender(NUMBA, lambda stream: numba_cuda.external_stream(int(stream)), async_done)


async def probe_contenders(
    target: Target, entrants: list[Contender], limit_s: float, *, quiet: bool = False
) -> tuple[list[Contender], dict[str, str]]:
    """Record and await one trivial token per contender; leave out those that fail.

    numba-cuda 0.28's ``Stream.async_done`` raises AttributeError on a
    cuda.bindings stream, for instance: better a row fewer than a run lost.

    Returns:
        The contenders that passed, in order, and ``{name: reason}`` for the others.
    """
    stream = target.new_stream()
    admitted: list[Contender] = []
    left_out: dict[str, str] = {}
    for contender in entrants:
        try:
            token = contender.record(stream)
            resumed = await bounded(contender.wait(token), limit_s)
            ended = contender.latency_end(token, resumed)
        except Exception as error:
            left_out[contender.name] = f"{type(error).__name__}: {error}"
        else:
            if math.isfinite(resumed):
                contender.done(token)
            if math.isfinite(ended):
                admitted.append(contender)
                continue
            left_out[contender.name] = (
                "the device gave no stamp of its finish"
                if math.isfinite(resumed)
                else f"its probe did not finish within {limit_s:g} s"
            )
        if not quiet:
            print(f"left out {contender.name}: {left_out[contender.name]}", file=sys.stderr)
    return admitted, left_out


@dataclass
class Context:
    """What a scenario runs against, and where it writes what it measured.

    Attributes:
        target: The device, with raw events for the baselines.
        entrants: The contenders admitted by the probe, in table order.
        config: Trial counts and sizes.
        results: Where the scenario writes its samples.
        device_row: The device's own row (:func:`device_finish_row`), if it
            has one: the latency scenarios time it with the entrants.
        progress: Takes how much of the scenario under way is done (0 to 1):
            its progress bar. Called between trials, never inside a timed one.
    """

    target: Target
    entrants: list[Contender]
    config: BenchConfig
    results: Results
    device_row: Contender | None = None
    progress: Callable[[float], None] = field(default=lambda done: None, repr=False)
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)

    @property
    def timed(self) -> list[Contender]:
        """What a latency scenario times: the entrants, and the device's row."""
        return self.entrants + ([] if self.device_row is None else [self.device_row])

    def fresh_default_executor(self) -> None:
        """Give the running asyncio loop a new default executor, of the default size.

        ``to_thread`` starts its threads again from none: the thread count a
        scenario then sees is the threads it needed. Trio has no executor to
        replace: its idle worker threads are kept for 10 s and then exit.
        """
        if on_trio():
            return
        old = self._executor
        self._executor = ThreadPoolExecutor(
            max_workers=default_executor_workers(), thread_name_prefix="asyncio"
        )
        asyncio.get_running_loop().set_default_executor(self._executor)
        if old is not None:
            old.shutdown(wait=True)
