"""The device as the baselines use it, the contenders, and the probe that admits them.

A :class:`Target` gives the baselines raw events (OpenCL markers, CUDA events)
on the device's streams. A :class:`Contender` is one way to wait: what it
records on a stream and how it awaits that. Every contender is probed once at
setup (:func:`probe_contenders`); one that cannot run is left out, with the
reason, instead of crashing the run.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import asyncfence

from .base import (
    AUTO,
    NUMBA,
    PARK,
    POLL,
    SLEEP_0,
    SLEEP_1MS,
    TO_THREAD,
    BenchConfig,
    Results,
    default_executor_workers,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from asyncfence._devices import Device

__all__ = [
    "Contender",
    "Context",
    "CudaTarget",
    "OpenCLTarget",
    "Target",
    "contenders",
    "make_target",
    "probe_contenders",
]


class Target:
    """Raw events on one device, for the baselines, plus streams and work."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._streams: list[Any] = []

    def new_stream(self) -> Any:
        """A stream that :meth:`close` releases."""
        stream = self.device.new_stream()
        self._streams.append(stream)
        return stream

    def raw_record(self, stream: Any) -> Any:
        """Record a raw event at the current end of ``stream``."""
        raise NotImplementedError

    def raw_query(self, event: Any) -> bool:
        """Whether ``event`` is complete; raises if it failed."""
        raise NotImplementedError

    def raw_block(self, event: Any) -> None:
        """Block the calling thread until ``event`` completes (GIL released)."""
        raise NotImplementedError

    def raw_done(self, event: Any) -> None:
        """The baseline finished with ``event``."""

    def short_work(self, stream: Any) -> None:
        """Queue one piece of short work (a 1 MiB copy or memset)."""
        self.device.launch_chunks(stream, 1)

    def close(self) -> None:
        """Release the streams this target made."""
        for stream in self._streams:
            self.device.close_stream(stream)
        self._streams.clear()


class OpenCLTarget(Target):
    """Markers, their status, and ``Event.wait()``."""

    def raw_record(self, stream: Any) -> Any:
        """Enqueue a marker and flush."""
        import pyopencl as cl

        marker = cl.enqueue_marker(stream)
        stream.flush()
        return marker

    def raw_query(self, event: Any) -> bool:
        """The marker's ``command_execution_status`` is complete."""
        status: int = event.command_execution_status
        if status < 0:
            raise RuntimeError(f"OpenCL event failed with status {status}")
        return status == 0

    def raw_block(self, event: Any) -> None:
        """``Event.wait()``."""
        event.wait()


class CudaTarget(Target):
    """Pooled timing-disabled events, ``cuEventQuery`` and ``cuEventSynchronize``.

    Attributes:
        drv: ``cuda.bindings.driver``, initialised.
    """

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        from asyncfence._cuda import check, driver

        self.drv = driver()
        self._check = check
        self._pool: list[Any] = []

    def check(self, result: tuple[Any, ...], what: str) -> Any:
        """The value of a cuda.bindings call's result; raises on an error code."""
        return self._check(result, what)

    def raw_record(self, stream: Any) -> Any:
        """``cuEventRecord`` of a pooled event."""
        drv = self.drv
        if self._pool:
            event = self._pool.pop()
        else:
            flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
            event = self.check(drv.cuEventCreate(flags), "cuEventCreate")
        self.check(drv.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def raw_query(self, event: Any) -> bool:
        """``cuEventQuery``."""
        (err,) = self.drv.cuEventQuery(event)
        if err == self.drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuEventQuery failed: {err}")
        return True

    def raw_block(self, event: Any) -> None:
        """``cuEventSynchronize``."""
        self.drv.cuEventSynchronize(event)

    def raw_done(self, event: Any) -> None:
        """Back to the pool."""
        self._pool.append(event)

    def close(self) -> None:
        """Destroy the streams and the pooled events."""
        super().close()
        for event in self._pool:
            self.drv.cuEventDestroy(event)
        self._pool.clear()


def make_target(device: Device) -> Target:
    """The target for ``device``'s backend."""
    if device.backend == "cuda":
        return CudaTarget(device)
    return OpenCLTarget(device)


@dataclass(frozen=True)
class Contender:
    """A way to wait: what it records on a stream, and how it awaits that.

    Attributes:
        name: As the tables show it.
        record: Records a token at the current end of a stream.
        wait: Awaits a token.
        done: Called once a token is no longer needed (not after a timeout).
        is_asyncfence: One of asyncfence's strategies.
    """

    name: str
    record: Callable[[Any], Any]
    wait: Callable[[Any], Awaitable[None]]
    done: Callable[[Any], None] = lambda token: None
    is_asyncfence: bool = False


def contenders(target: Target) -> list[Contender]:
    """Asyncfence's strategies, then the baselines users write today, in table order."""

    def strategy(name: Literal["auto", "park", "poll"]) -> Callable[[Any], Awaitable[None]]:
        async def fence_wait(fence: asyncfence.Fence) -> None:
            await fence.wait(strategy=name)

        return fence_wait

    async def to_thread(event: Any) -> None:
        await asyncio.to_thread(target.raw_block, event)

    # The loops users write by hand; the very thing the linter warns about.
    async def sleep_loop(event: Any) -> None:
        while not target.raw_query(event):  # noqa: ASYNC110
            await asyncio.sleep(0.001)

    async def busy_loop(event: Any) -> None:
        while not target.raw_query(event):  # noqa: ASYNC110
            await asyncio.sleep(0)

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
        Contender(SLEEP_1MS, target.raw_record, sleep_loop, target.raw_done),
        Contender(SLEEP_0, target.raw_record, busy_loop, target.raw_done),
    ]
    numba = _numba_contender(target)
    if numba is not None:
        found.append(numba)
    return found


def _numba_contender(target: Target) -> Contender | None:
    if not isinstance(target, CudaTarget):
        return None
    try:
        from numba import cuda as numba_cuda
    except ImportError:
        return None

    async def async_done(stream: Any) -> None:
        await stream.async_done()

    return Contender(NUMBA, lambda stream: numba_cuda.external_stream(int(stream)), async_done)


async def probe_contenders(
    target: Target, entrants: list[Contender], timeout: float, *, quiet: bool = False
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
            await asyncio.wait_for(contender.wait(token), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            left_out[contender.name] = f"its probe did not finish within {timeout:g} s"
        except Exception as error:
            left_out[contender.name] = f"{type(error).__name__}: {error}"
        else:
            contender.done(token)
            admitted.append(contender)
            continue
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
    """

    target: Target
    entrants: list[Contender]
    config: BenchConfig
    results: Results
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)

    def fresh_default_executor(self) -> None:
        """Give the running loop a new default executor, of the default size.

        ``to_thread`` starts its threads again from none: the thread count a
        scenario then sees is the threads it needed.
        """
        old = self._executor
        self._executor = ThreadPoolExecutor(
            max_workers=default_executor_workers(), thread_name_prefix="asyncio"
        )
        asyncio.get_running_loop().set_default_executor(self._executor)
        if old is not None:
            old.shutdown(wait=True)
