"""The poller (``asyncfence._poller``): polling, parking, and failures.

Polling queries only what can have completed; parked fences wake by their own
completion signals (or, without the native shim, by re-checks on the loop),
with no thread either way; and nothing the poller does can kill a loop's
waits, or keep a dead loop alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import itertools
import logging
import random
import threading
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError, _parking, _poller
from asyncfence._core import FenceCore
from asyncfence._native import NativeMailbox, unavailable_reason
from asyncfence._poller import current_poller
from asyncfence.testing import StreamGate, hold

from .conftest import let_loop_run, poller_ticks, until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    import pyopencl as cl

    from asyncfence.testing import CudaDevice, Device, OpenCLDevice

    from .cuda_emulator import Emulator


@pytest.mark.logs_wait_errors
async def test_a_fence_that_cannot_be_parked_is_polled_and_every_wait_works(
    device: OpenCLDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Once "auto" waits outlast their spin they are parked. Should parking
    # raise (a backend bug), they are polled instead: every one resumes, and
    # the loop's later waits work.
    def broken_park(self: Any, fence: FenceCore) -> None:
        raise RuntimeError("a bug in parking")

    queues = [device.new_stream() for _ in range(24)]
    with contextlib.ExitStack() as stack, caplog.at_level(logging.ERROR, "asyncfence.poller"):
        stack.enter_context(monkeypatch.context()).setattr(_parking.Parking, "park", broken_park)
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queue) for queue in queues]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="auto"))
            tg.start_soon(partial(fences[0].wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().waiters == 25)
            await until(lambda: "polling it instead" in caplog.text)
            assert asyncfence.current_statistics().parked == 0
            for gate in gates:
                gate.release()
    assert all(fence.done() for fence in fences)
    later = asyncfence.record(queues[0])
    with anyio.fail_after(10):
        await later.wait(strategy="park")  # the poller still works: a done fence resumes
    with hold(queues[1]) as gate:  # and with parking mended, waits park again
        parked = asyncfence.record(queues[1])
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(parked.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            gate.release()


@pytest.mark.logs_wait_errors
async def test_a_tick_that_raises_is_retried_not_lost(
    queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_tick = _poller.Poller._tick_at
    failures: list[float] = []

    def failing_once(self: _poller.Poller, now: float) -> float | None:
        if not failures:
            failures.append(now)
            raise RuntimeError("a bug in a tick")
        return real_tick(self, now)

    monkeypatch.setattr(_poller.Poller, "_tick_at", failing_once)
    with hold(queue) as gate, caplog.at_level(logging.ERROR, "asyncfence.loops"):
        fence = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="poll"))
            await until(lambda: bool(failures))
            gate.release()
    assert fence.done()
    assert "a poller step raised; retrying it" in caplog.text


async def test_a_wait_whose_registration_fails_leaves_nothing_registered(
    queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_add(self: _poller.Poller, fence: Any, waiter: Any, strategy: str) -> None:
        self._waiters.setdefault(fence, _poller._Waits(waiter, "park"))  # registered halfway
        self._waiter_count += 1
        raise RuntimeError("registration failed midway")

    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with monkeypatch.context() as patched:
            patched.setattr(_poller.Poller, "add", broken_add)
            with pytest.raises(RuntimeError, match="midway"):
                await fence.wait(strategy="park")
        stats = asyncfence.current_statistics()
        assert (stats.waiters, stats.pending_fences) == (0, 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))  # a healthy wait
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            gate.release()
    assert fence.done()


@pytest.mark.parametrize("strategy", ["poll", "park"])
async def test_fences_that_timed_out_are_not_kept_behind_an_older_one(
    queue: cl.CommandQueue, strategy: Literal["poll", "park"]
) -> None:
    with hold(queue) as gate:
        oldest = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(oldest.wait, strategy=strategy))  # stays awaited throughout
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            refs = []
            for _ in range(500):
                fence = asyncfence.record(queue)
                refs.append(weakref.ref(fence))
                with pytest.raises(TimeoutError):
                    await fence.wait(timeout=1e-4, strategy=strategy)
                del fence
            gc.collect()
            alive = sum(ref() is not None for ref in refs)
            assert alive < 50  # a bounded few, never all 500
            gate.release()


@pytest.mark.parametrize("factory", ["asyncio", "uvloop"])
def test_a_loop_closed_while_tasks_wait_is_collected(queue: cl.CommandQueue, factory: str) -> None:
    if factory == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        new_loop = uvloop.new_event_loop
    else:
        new_loop = asyncio.new_event_loop
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    with hold(queue):
        fence = asyncfence.record(queue)
        for index in range(50):
            loop = new_loop()
            strategy = ("park", "poll", "auto")[index % 3]
            task = loop.create_task(fence.wait(strategy=strategy))  # type: ignore[arg-type]
            loop.run_until_complete(asyncio.sleep(0.001))
            assert not task.done()
            task._log_destroy_pending = False  # on purpose
            loop.close()  # with its task still waiting
            loops.append(weakref.ref(loop))
            del loop, task
        gc.collect()
        assert sum(ref() is not None for ref in loops) == 0


@pytest.mark.usefixtures("no_thread_from_asyncfence")
async def test_two_hundred_timed_out_waits_leave_no_threads_behind(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(200)]
    threads_before = {thread.ident for thread in threading.enumerate()}
    with contextlib.ExitStack() as stack:
        for queue in queues:
            stack.enter_context(hold(queue))
        fences = [asyncfence.record(queue) for queue in queues]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(_time_out, fence))
    new = [
        thread.name
        for thread in threading.enumerate()
        if thread.ident not in threads_before and "asyncfence" in thread.name
    ]
    assert new == []


async def _time_out(fence: asyncfence.Fence) -> None:
    with pytest.raises(TimeoutError):
        await fence.wait(timeout=0.01, strategy="park")


# -- polling -------------------------------------------------------------------


@pytest.fixture
def poll_by_default() -> Iterator[None]:
    """Poll, whatever the default strategy."""
    previous = asyncfence.configure().strategy
    asyncfence.configure(strategy="poll")
    yield
    asyncfence.configure(strategy=previous)


@pytest.mark.usefixtures("poll_by_default")
async def test_poller_checks_one_fence_per_in_order_queue_per_tick(
    device: OpenCLDevice,
) -> None:
    queues = [device.new_stream() for _ in range(3)]
    gates = [hold(q) for q in queues]
    handles = [gate.__enter__() for gate in gates]
    try:
        fences = [asyncfence.record(q) for q in queues for _ in range(50)]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == len(fences))
            before = asyncfence.current_statistics()
            await poller_ticks(5)
            after = asyncfence.current_statistics()
            assert after.pending_fences == 150
            assert after.queues == 3
            assert after.queries - before.queries == 3 * (after.ticks - before.ticks)
            for handle in handles:
                handle.release()
    finally:
        for gate in gates:
            gate.__exit__(None, None, None)
    assert all(fence.done() for fence in fences)


def test_fences_on_an_out_of_order_queue_complete_in_record_order(
    unordered_queue: cl.CommandQueue,
) -> None:
    # What lets the poller check one fence per out-of-order queue: a marker
    # waits for every command enqueued before it, earlier markers included.
    first_gate = StreamGate(unordered_queue)
    first = asyncfence.record(unordered_queue)
    second_gate = StreamGate(unordered_queue)
    second = asyncfence.record(unordered_queue)
    second_gate.release()
    with pytest.raises(TimeoutError):
        second.wait_sync(timeout=0.05)  # a bounded look, not a timing assertion
    assert not first.done()
    first_gate.release()
    second.wait_sync(timeout=30)
    assert first.done()


@pytest.mark.usefixtures("poll_by_default")
async def test_poller_checks_one_fence_per_out_of_order_queue_too(
    unordered_queue: cl.CommandQueue,
) -> None:
    with hold(unordered_queue) as gate:
        fences = [asyncfence.record(unordered_queue) for _ in range(5)]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 5)
            before = asyncfence.current_statistics()
            await poller_ticks(5)
            after = asyncfence.current_statistics()
            assert after.queries - before.queries == after.ticks - before.ticks
            gate.release()
    assert all(fence.done() for fence in fences)


@pytest.mark.usefixtures("only_signals_wake")
async def test_parked_fences_on_an_out_of_order_queue_wake_one_by_one_in_linear_work(
    unordered_queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each completes on its own, and each wake costs what fired: the fences
    # queried over the whole run grow with the fences, not with their square
    # (a wake that swept the whole queue would make about 20,000 queries).
    count = 200
    gates, fences = [], []
    for _ in range(count):
        gates.append(StreamGate(unordered_queue))  # holds the fence recorded next
        fences.append(asyncfence.record(unordered_queue))
    polls = 0
    real_poll = FenceCore.poll

    def counted_poll(self: FenceCore, *, keep_marker: bool = False) -> int:
        nonlocal polls
        polls += 1
        return real_poll(self, keep_marker=keep_marker)

    woken: list[object] = []
    try:
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(parked_wait_noted, fence, fence, woken)
            await until(lambda: asyncfence.current_statistics().parked == count)
            monkeypatch.setattr(FenceCore, "poll", counted_poll)
            with anyio.fail_after(30):  # the re-check is 30 s away, poll_cap 1 s
                for index, gate in enumerate(gates):
                    gate.release()
                    await until(lambda index=index: len(woken) > index)
                    assert woken[index] is fences[index]
    finally:
        for gate in gates:
            gate.release()
    assert asyncfence.current_statistics().parked == 0
    assert polls <= 10 * count


@pytest.mark.usefixtures("poll_by_default")
async def test_fences_awaited_out_of_record_order(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fences = [asyncfence.record(queue) for _ in range(10)]
        async with anyio.create_task_group() as tg:
            for fence in reversed(fences):
                tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 10)
            gate.release()
    assert all(fence.done() for fence in fences)


@pytest.mark.usefixtures("poll_by_default")
async def test_idle_poller_does_no_work(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().running)
            gate.release()
    await until(lambda: not asyncfence.current_statistics().running)
    idle = asyncfence.current_statistics()
    for _ in range(20):
        await anyio.sleep(0.001)
    assert asyncfence.current_statistics() == idle
    assert (idle.pending_fences, idle.waiters, idle.queues) == (0, 0, 0)


@pytest.mark.usefixtures("poll_by_default")
async def test_statistics_before_any_wait_are_zero() -> None:
    stats = asyncfence.current_statistics()
    assert stats == asyncfence.PollerStatistics()
    assert stats.wake_path is None  # decided when this loop first parks


@pytest.mark.usefixtures("poll_by_default")
async def test_mixed_strategies_on_one_fence(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        poll_scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_wait_in, poll_scope, fence, "poll")
            tg.start_soon(partial(fence.wait, strategy="park"))
            tg.start_soon(partial(fence.wait, strategy="auto"))
            await until(lambda: asyncfence.current_statistics().waiters == 3)
            assert asyncfence.current_statistics().parked == 1
            await let_loop_run()
            assert asyncfence.current_statistics().queues == 1  # polled for "poll"
            poll_scope.cancel()  # the poll waiter leaves: nothing needs polling any more
            await until(lambda: not asyncfence.current_statistics().running)
            assert asyncfence.current_statistics().queues == 0
            gate.release()
    assert fence.done()


async def _wait_in(scope: anyio.CancelScope, fence: asyncfence.Fence, strategy: str) -> None:
    with scope:
        await fence.wait(strategy=strategy)  # type: ignore[arg-type]


# -- parking -------------------------------------------------------------------


@pytest.fixture
def quick_recheck() -> Iterator[None]:
    """Re-check parked fences every 10 ms, so fault tests finish quickly."""
    previous = asyncfence.configure().recheck_interval
    asyncfence.configure(recheck_interval=0.01)
    yield
    asyncfence.configure(recheck_interval=previous)


@pytest.fixture(params=["opencl", "cuda"])
def stream(request: pytest.FixtureRequest, device: OpenCLDevice) -> Iterator[Any]:
    """A stream on each backend: a PoCL queue, and a CUDA stream."""
    if request.param == "opencl":
        queue = device.new_stream()
        yield queue
        queue.finish()
        return
    cuda_device: CudaDevice = request.getfixturevalue("cuda_device")
    from cuda.bindings import driver

    cuda_stream = cuda_device.new_stream()
    yield cuda_stream
    driver.cuStreamDestroy(cuda_stream)


@pytest.fixture
def new_same_kind_stream(
    request: pytest.FixtureRequest, stream: Any, device: OpenCLDevice
) -> Iterator[Callable[[], Any]]:
    """Makes more streams of ``stream``'s backend; released afterwards."""
    backend = request.node.callspec.params["stream"]
    maker: Device = device if backend == "opencl" else request.getfixturevalue("cuda_device")
    made: list[Any] = []

    def make() -> Any:
        made.append(maker.new_stream())
        return made[-1]

    yield make
    for each in made:
        maker.close_stream(each)


@pytest.mark.usefixtures("no_thread_from_asyncfence")
async def test_park_leaves_the_loop_idle_while_the_work_runs(stream: Any, wake_path: str) -> None:
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            before = asyncfence.current_statistics()
            await let_loop_run()
            after = asyncfence.current_statistics()
            assert after.ticks == before.ticks == 0  # not one poll
            assert not after.running
            assert after.wake_path == wake_path
            if wake_path == "native":  # the loop's own mailbox: nothing to do until the signal
                assert after.armed == 1
                assert after.rechecks == before.rechecks
            else:  # no shim: re-checked on the loop, by its timer
                assert after.armed == 0
                assert after.rechecks > before.rechecks
            assert not fence.done()
            gate.release()
    assert fence.done()
    stats = asyncfence.current_statistics()
    assert (stats.waiters, stats.parked) == (0, 0)


async def test_auto_spins_then_parks(stream: Any) -> None:
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="auto"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            assert asyncfence.current_statistics().ticks >= 1  # it spun first
            await until(lambda: not asyncfence.current_statistics().running)
            ticks = asyncfence.current_statistics().ticks
            await let_loop_run()
            assert asyncfence.current_statistics().ticks == ticks  # parked: no polling
            gate.release()
    assert fence.done()


async def test_auto_sees_work_done_within_the_spin_budget(queue: Any) -> None:
    fence = asyncfence.record(queue)  # an idle queue: done almost at once
    await fence.wait(strategy="auto")
    assert fence.done()
    assert asyncfence.current_statistics().parked == 0


@contextlib.asynccontextmanager
async def parked_on_held(
    queues: list[Any], per_queue: int = 1
) -> AsyncIterator[tuple[list[StreamGate], list[asyncfence.Fence]]]:
    """``per_queue`` parked waits on each of ``queues``, held; the gates and the fences.

    The waits run in a task group: leaving the block waits for them, so
    release every gate inside it.
    """
    with contextlib.ExitStack() as stack:
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queue) for queue in queues for _ in range(per_queue)]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == len(fences))
            yield gates, fences


async def test_many_parked_waiters_on_many_streams(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(8)]
    async with parked_on_held(queues, per_queue=10) as (gates, fences):
        for gate in reversed(gates):
            gate.release()
    assert all(fence.done() for fence in fences)


class LoopClock:
    """The poller's clock, stopped at ``now`` until the test lets it run."""

    def __init__(self) -> None:
        self.now = 0.0
        self._offset: float | None = None

    def __call__(self) -> float:
        return self.now if self._offset is None else time.monotonic() + self._offset

    def run_free(self) -> None:
        """From here on, time passes as it does: what the test left due runs on its own."""
        self._offset = self.now - time.monotonic()


@pytest.fixture
def loop_clock(monkeypatch: pytest.MonkeyPatch) -> LoopClock:
    """The poller's clock, moved by the test."""
    clock = LoopClock()
    monkeypatch.setattr(_parking, "_recheck_clock", clock)
    return clock


def current_parking() -> _parking.Parking:
    parking = current_poller()._parking
    assert isinstance(parking, _parking.Parking)
    return parking


@pytest.mark.usefixtures("only_signals_wake")
async def test_each_stream_backs_off_alone_and_starts_over_when_it_settles(
    device: OpenCLDevice, wake_path: str, loop_clock: LoopClock
) -> None:
    if wake_path != "native":
        pytest.skip("without the shim, parked fences are re-checked up to every poll_cap")
    interval = asyncfence.configure().recheck_interval
    first_queue, second_queue = device.new_stream(), device.new_stream()
    with hold(first_queue) as first_gate, hold(second_queue):
        first = asyncfence.record(first_queue)
        with hold(first_queue):  # a second fence on the first stream, held after the first
            behind = asyncfence.record(first_queue)
            second = asyncfence.record(second_queue)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(first.wait, strategy="park"))
                tg.start_soon(partial(behind.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 2)
                parking = current_parking()
                # The steps are called directly: what each returns is the next delay.
                assert parking._recheck_step() == interval  # nothing due yet
                assert asyncfence.current_statistics().rechecks == 0
                delays: list[float] = []
                for _ in range(5):
                    loop_clock.now += delays[-1] if delays else interval
                    delay = parking._recheck_step()
                    assert delay is not None
                    delays.append(delay)
                assert delays == [
                    2 * interval,
                    4 * interval,
                    8 * interval,
                    8 * interval,
                    8 * interval,
                ]
                assert asyncfence.current_statistics().rechecks == 5

                # A new stream is due within the interval; the backed-off one keeps its own.
                tg.start_soon(partial(second.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 3)
                assert parking._recheck_delay() == interval
                loop_clock.now += interval
                queries = asyncfence.current_statistics().queries
                assert parking._recheck_step() == 2 * interval
                assert asyncfence.current_statistics().queries == queries + 1  # that stream only

                # The first stream's head settles, its signal not taken yet: its next
                # re-check finds it, wakes its waiter, and starts over at the interval.
                first_gate.release()
                first.wait_sync()  # on the loop's thread: its signal cannot be taken meanwhile
                loop_clock.now += 7 * interval  # the first stream is due: 8 intervals since
                parking._recheck_step()
                assert parking._schedule.next_due() == loop_clock.now + interval
                await until(lambda: asyncfence.current_statistics().waiters == 2)
                tg.cancel_scope.cancel()
    assert first.done()


@pytest.mark.usefixtures("quick_recheck")
async def test_once_nothing_is_parked_the_rechecks_forget_every_stream(
    device: OpenCLDevice, wake_path: str, loop_clock: LoopClock
) -> None:
    # The sequence that once left a stream looking scheduled with no re-check
    # to run it: the second stream's fence is woken by its signal, the first
    # stream's fails (no signal) and is found by the re-check, which then
    # stops; a new park on the second stream must start the re-checks again.
    if wake_path != "native":
        pytest.skip("the second stream's fence must be woken by its signal")
    interval = asyncfence.configure().recheck_interval
    first_queue, second_queue = device.new_stream(), device.new_stream()
    failures: list[DeviceError] = []

    async def wait(fence: asyncfence.Fence) -> None:
        try:
            await fence.wait(strategy="park")
        except DeviceError as error:
            failures.append(error)

    with hold(first_queue) as first_gate, hold(second_queue) as second_gate:
        first, second = asyncfence.record(first_queue), asyncfence.record(second_queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, first)
            await until(lambda: asyncfence.current_statistics().parked == 1)
            loop_clock.now += interval / 2  # the second stream falls due later
            tg.start_soon(wait, second)
            await until(lambda: asyncfence.current_statistics().parked == 2)
            second_gate.release()
            await until(lambda: asyncfence.current_statistics().parked == 1)
            first_gate.fail()
            # The first stream is due, the second not: the re-check's own next
            # step finds the failure, and with that nothing is parked.
            loop_clock.now += interval * 0.6
        assert len(failures) == 1
        parking = current_parking()
        await until(lambda: not parking._recheck.running)
        assert len(parking._schedule) == 0
        loop_clock.run_free()
        with hold(second_queue) as gate:
            third = asyncfence.record(second_queue)
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait, third)
                await until(lambda: asyncfence.current_statistics().parked == 1)
                assert parking._recheck.running
                gate.fail()  # no signal: only a re-check finds it
        assert len(failures) == 2


@pytest.mark.usefixtures("only_signals_wake")
async def test_a_recheck_step_takes_a_bounded_slice_of_the_due_streams(
    device: OpenCLDevice, wake_path: str, loop_clock: LoopClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    if wake_path != "native":
        pytest.skip("without the shim, parked fences are re-checked up to every poll_cap")
    monkeypatch.setattr(_parking, "_RECHECK_SLICE", 2)
    monkeypatch.setattr(_parking, "RECHECK_RATE", 1000)  # a full slice, then 2 ms
    interval = asyncfence.configure().recheck_interval
    queues = [device.new_stream() for _ in range(5)]
    async with parked_on_held(queues) as (gates, _):
        parking = current_parking()
        loop_clock.now += interval
        slices: list[tuple[int, object]] = []
        for advance in (0.0, 0.0, 0.002, 0.002):
            loop_clock.now += advance
            queries = asyncfence.current_statistics().queries
            delay = parking._recheck_step()
            slices.append((asyncfence.current_statistics().queries - queries, delay))
        # Two streams a step, at most a slice per 2 ms (called early, a step
        # takes none), then the last one; then the first two, backed off.
        assert slices == [
            (2, pytest.approx(0.002)),
            (0, pytest.approx(0.002)),
            (2, pytest.approx(0.002)),
            (1, pytest.approx(2 * interval - 0.004)),
        ]
        for gate in gates:
            gate.release()


@pytest.mark.usefixtures("quick_recheck")
async def test_a_failed_opencl_event_reaches_parked_waiters(queue: Any) -> None:
    errors: list[DeviceError] = []
    with hold(queue) as gate:
        fence = asyncfence.record(queue)

        async def waiter(strategy: str) -> None:
            try:
                await fence.wait(strategy=strategy)  # type: ignore[arg-type]
            except DeviceError as error:
                errors.append(error)

        async with anyio.create_task_group() as tg:
            for strategy in ("park", "auto", "park"):
                tg.start_soon(waiter, strategy)
            await until(lambda: asyncfence.current_statistics().parked == 1)
            await until(lambda: asyncfence.current_statistics().waiters == 3)
            gate.fail()  # PoCL sends no callback for a failure: the re-check finds it
    assert len(errors) == 3


@pytest.mark.usefixtures("quick_recheck")
async def test_a_cuda_fault_reaches_parked_waiters(
    cuda_device: CudaDevice, cuda_stream: Any, emulator: Emulator
) -> None:
    try:
        with hold(cuda_stream):
            fence = asyncfence.record(cuda_stream)
            async with anyio.create_task_group() as tg:

                async def waiter() -> None:
                    with pytest.raises(DeviceError) as caught:
                        await fence.wait(strategy="park")
                    assert caught.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"

                tg.start_soon(waiter)
                tg.start_soon(waiter)
                await until(lambda: asyncfence.current_statistics().parked == 1)
                # Host functions never run after a fault: only the re-check can see it.
                emulator.inject_fault(int(cuda_device.context), 700)
    finally:
        emulator.clear_fault(int(cuda_device.context))


@pytest.mark.usefixtures("only_signals_wake")  # only a signal can wake it in time
async def test_when_the_oldest_leaves_the_next_one_is_signalled(stream: Any) -> None:
    with hold(stream) as gate:
        oldest, behind = asyncfence.record(stream), asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            oldest_scope = anyio.CancelScope()
            tg.start_soon(partial(_wait_in, oldest_scope, oldest, "park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            tg.start_soon(partial(behind.wait, strategy="park"))  # parked behind it: unarmed
            await until(lambda: asyncfence.current_statistics().parked == 2)
            oldest_scope.cancel()
            await until(lambda: asyncfence.current_statistics().parked == 1)
            gate.release()
            with anyio.fail_after(10):  # the re-check is 30 s away: this is the signal
                await behind.wait(strategy="park")
    assert behind.done()


@pytest.mark.usefixtures("only_signals_wake")
async def test_a_fence_settled_elsewhere_as_it_is_armed_still_wakes_its_waiters(
    stream: Any, monkeypatch: pytest.MonkeyPatch, wake_path: str
) -> None:
    # When the oldest parked fence leaves, the next one is armed. Should it
    # have been settled elsewhere just then (another thread's done(), another
    # loop), no signal will ever come for it: it must be swept all the same.
    if wake_path != "native":
        pytest.skip("without the shim no signal is armed: every parked fence is re-checked")
    real_arm = FenceCore.arm
    with hold(stream) as gate:
        oldest, behind = asyncfence.record(stream), asyncfence.record(stream)

        def settled_first(self: FenceCore, mailbox: Any, token: int) -> str:
            if self is behind._core:
                gate.release()
                while not behind.done():  # settled here, by "another thread"
                    pass
            return real_arm(self, mailbox, token)

        async with anyio.create_task_group() as tg:
            oldest_scope = anyio.CancelScope()
            tg.start_soon(partial(_wait_in, oldest_scope, oldest, "park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            tg.start_soon(partial(behind.wait, strategy="park"))  # parked behind it: unarmed
            await until(lambda: asyncfence.current_statistics().parked == 2)
            monkeypatch.setattr(FenceCore, "arm", settled_first)
            with anyio.fail_after(10):  # the re-check is 30 s away
                oldest_scope.cancel()
                await until(lambda: asyncfence.current_statistics().waiters == 0)
    assert behind.done()


async def test_cancellation_racing_completion(queue: Any) -> None:
    for _ in range(50):
        gate_cm = hold(queue)
        gate = gate_cm.__enter__()
        fence = asyncfence.record(queue)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                threading.Thread(target=gate.release).start()
                scope.cancel()
        gate_cm.__exit__(None, None, None)
        await fence.wait(strategy="park")  # the late signal hurt nothing
        stats = asyncfence.current_statistics()
        assert (stats.waiters, stats.parked, stats.pending_fences) == (0, 0, 0)


async def test_a_signal_after_the_waiter_left_is_harmless(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with anyio.move_on_after(0.02):
            await fence.wait(strategy="park")
        assert asyncfence.current_statistics().parked == 0
        gate.release()
    await let_loop_run()
    await fence.wait(strategy="park")


# -- parked waits woken by their own signals -----------------------------------


def asyncfence_threads(*, besides: set[int | None]) -> set[str]:
    """The names of asyncfence's threads started since ``besides`` was taken."""
    return {
        thread.name
        for thread in threading.enumerate()
        if "asyncfence" in thread.name and thread.ident not in besides
    }


@pytest.mark.usefixtures("only_signals_wake", "no_thread_from_asyncfence")
async def test_a_parked_wait_needs_no_thread(stream: Any, wake_path: str) -> None:
    threads_before = {thread.ident for thread in threading.enumerate()}
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            # (anyio runs trio tests in guest mode, whose I/O waits use a
            # "Trio thread" of trio's own: so names, not a thread count.)
            assert asyncfence_threads(besides=threads_before) == set()
            signals = asyncfence.current_statistics().signals
            gate.release()
    assert fence.done()
    if wake_path == "native":
        assert asyncfence.current_statistics().signals == signals + 1
        assert asyncfence.current_statistics().rechecks == 0


async def parked_wait_noted(fence: asyncfence.Fence, name: object, notes: list[Any]) -> None:
    """Wait for ``fence`` with the "park" strategy, then note ``name``."""
    await fence.wait(strategy="park")
    notes.append(name)


@pytest.mark.usefixtures("only_signals_wake")
async def test_an_opencl_fence_failing_while_its_signal_is_armed_wakes_with_the_failure(
    device: OpenCLDevice, wake_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An OpenCL marker lives while referenced, so its arm holds no pin on it:
    # another thread may settle the fence and release the marker meanwhile,
    # and the signal must still come.
    if wake_path != "native":
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    queue = device.new_stream()
    gate = StreamGate(queue)
    fence = asyncfence.record(queue)
    backend_type = type(fence._core.backend)
    arm = backend_type.arm
    released_during_arm: list[bool] = []

    def arm_once_failed_elsewhere(self: Any, marker: Any, *rest: Any) -> bool:
        gate.fail()
        # Settled here, on the loop's thread, inside the arm: under the GIL,
        # what another thread's wait_sync() would do meanwhile.
        with pytest.raises(DeviceError):
            fence.wait_sync(timeout=10)
        released_during_arm.append(fence._core.marker_released)
        return arm(self, marker, *rest)

    monkeypatch.setattr(backend_type, "arm", arm_once_failed_elsewhere)
    with anyio.fail_after(10), pytest.raises(DeviceError):  # the re-check is 30 s away
        await fence.wait(strategy="park")
    assert released_during_arm == [True]
    stats = asyncfence.current_statistics()
    assert (stats.signals, stats.rechecks, stats.parked) == (1, 0, 0)


@pytest.mark.usefixtures("only_signals_wake")
async def test_an_older_fence_parked_after_a_newer_one_wakes_by_its_own_signal(
    stream: Any,
) -> None:
    with hold(stream) as gate:
        older = asyncfence.record(stream)
        with hold(stream) as later_gate:
            newer = asyncfence.record(stream)
            woken: list[str] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(parked_wait_noted, newer, "newer", woken)
                await until(lambda: asyncfence.current_statistics().parked == 1)
                tg.start_soon(parked_wait_noted, older, "older", woken)
                await until(lambda: asyncfence.current_statistics().parked == 2)
                gate.release()  # the older completes; the newer is still held
                with anyio.fail_after(10):  # the re-check is 30 s away
                    await until(lambda: woken == ["older"])
                later_gate.release()
    assert woken == ["older", "newer"]


@pytest.mark.usefixtures("only_signals_wake")
async def test_a_signal_that_comes_before_its_fence_completes_arms_it_again(
    queue: cl.CommandQueue,
) -> None:
    from asyncfence._native import shim

    native = shim()
    if native is None:
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().armed == 1)
            parking = current_poller()._parking
            assert isinstance(parking, _parking.Parking)
            live_slots = native.live_slots()
            signals = asyncfence.current_statistics().signals
            # A signal with the fence's token while the fence is still held,
            # as from a runtime that calls back before its status reads so.
            assert parking._mailbox is not None
            slot = parking._mailbox.new_slot(fence._core.seq)
            ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.fire)(slot)
            await until(lambda: asyncfence.current_statistics().signals == signals + 1)
            await until(lambda: not parking._fired and not parking._rest_pending)
            assert not fence.done()
            # Armed again: a new slot beside the first, which the runtime holds still.
            assert parking._has_signal(fence._core)
            assert native.live_slots() == live_slots + 1
            gate.release()  # its new signal wakes it: the re-check is 30 s away
            with anyio.fail_after(10):
                await until(fence.done)
    assert asyncfence.current_statistics().parked == 0


def noted_calls(
    monkeypatch: pytest.MonkeyPatch,
    wake_path: str,
    owner: type,
    name: str,
    note: str,
    events: list[str] | None = None,
) -> list[str]:
    """``events`` (or a new list), given ``note`` each time the native wake calls ``owner.name``."""
    if wake_path != "native":
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    if events is None:
        events = []
    original = getattr(owner, name)

    def noted(*args: Any) -> Any:
        events.append(note)
        return original(*args)

    monkeypatch.setattr(owner, name, noted)
    return events


@pytest.fixture
def rests_of_wakes(wake_path: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that gets "rest" each time the rest of a native wake runs."""
    return noted_calls(monkeypatch, wake_path, _parking.Parking, "_finish_wake", "rest")


@pytest.mark.usefixtures("only_signals_wake")
async def test_a_woken_task_runs_before_the_rest_of_its_wake(
    stream: Any, rests_of_wakes: list[str]
) -> None:
    # The wake does only what the woken task needs. The rest (the fences
    # behind on the queue, the bookkeeping, releasing the marker, arming the
    # next signals) runs once the woken task has, and none of it is lost.
    events = rests_of_wakes
    with hold(stream) as gate:
        first = asyncfence.record(stream)
        second = asyncfence.record(stream)  # parked behind it: no signal of its own
        async with anyio.create_task_group() as tg:
            tg.start_soon(parked_wait_noted, first, "first", events)
            await until(lambda: asyncfence.current_statistics().parked == 1)
            tg.start_soon(parked_wait_noted, second, "second", events)
            await until(lambda: asyncfence.current_statistics().parked == 2)
            assert asyncfence.current_statistics().armed == 1
            gate.release()
            with anyio.fail_after(10):  # the re-check is 30 s away
                await until(lambda: "second" in events)
                await until(lambda: first._core.marker_released)  # released by the rest
    assert events[:2] == ["first", "rest"]
    # The second was woken by that rest's sweep, or by its own signal, armed by it.
    assert events.index("second") > 1
    assert second._core.marker_released
    stats = asyncfence.current_statistics()
    assert (stats.waiters, stats.parked, stats.armed) == (0, 0, 0)


@pytest.mark.usefixtures("only_signals_wake")
async def test_a_fence_parked_by_a_task_just_woken_gets_its_signal_at_once(
    stream: Any, rests_of_wakes: list[str]
) -> None:
    # A task in a loop of record-and-await parks its next fence before the
    # rest of its last wake ran: the fence that woke it must not stand in
    # front of the new one, which would then wait for the rest to be armed.
    armed_at_once: list[bool] = []
    with hold(stream) as gate:
        first = asyncfence.record(stream)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def wake_then_park() -> None:
                    await first.wait(strategy="park")
                    assert not rests_of_wakes  # the rest of this wake has not run yet
                    parking = current_poller()._parking
                    assert isinstance(parking, _parking.Parking)
                    with hold(stream) as second_gate:
                        second = asyncfence.record(stream)._core
                        parking.park(second)
                        armed_at_once.append(parking._has_signal(second))
                        parking.unpark(second)
                        second_gate.release()

                tg.start_soon(wake_then_park)
                await until(lambda: asyncfence.current_statistics().armed == 1)
                gate.release()
    assert armed_at_once == [True]


@pytest.fixture
def takes_noted(wake_path: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that gets "take" each time a native wake asks the shim for its signals."""
    events = noted_calls(monkeypatch, wake_path, NativeMailbox, "take", "take")
    return noted_calls(monkeypatch, wake_path, NativeMailbox, "take_undrained", "take", events)


@pytest.mark.parametrize("armed", [1, 2], ids=["one-signal-armed", "two-signals-armed"])
@pytest.mark.usefixtures("only_signals_wake")
async def test_a_wake_asks_the_shim_first_only_with_more_than_one_signal_armed(
    stream: Any, device: OpenCLDevice, armed: int, takes_noted: list[str]
) -> None:
    # With one signal armed, the fd being readable says which fired: the
    # woken task runs before the shim is asked (its take comes with the rest).
    events = takes_noted
    other = device.new_stream()
    with hold(stream) as gate, hold(other) as other_gate:
        fence = asyncfence.record(stream)
        bystander = asyncfence.record(other)
        async with anyio.create_task_group() as tg:
            tg.start_soon(parked_wait_noted, fence, "woken", events)
            if armed == 2:
                tg.start_soon(parked_wait_noted, bystander, "bystander", events)
            await until(lambda: asyncfence.current_statistics().armed == armed)
            events.clear()
            gate.release()
            with anyio.fail_after(10):  # the re-check is 30 s away
                await until(lambda: "woken" in events)
                await until(lambda: fence._core.marker_released)  # released by the rest
            assert events[:2] == (["woken", "take"] if armed == 1 else ["take", "woken"])
            other_gate.release()
    assert asyncfence.current_statistics().parked == 0


@pytest.mark.parametrize("armed", [1, 2], ids=["one-signal-armed", "two-signals-armed"])
@pytest.mark.usefixtures("only_signals_wake")
@pytest.mark.logs_wait_errors
async def test_a_reader_that_raises_leaves_the_loop_and_its_waits_working(
    stream: Any,
    device: OpenCLDevice,
    armed: int,
    wake_path: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One signal armed: the rest of the wake raises. Two: the wake itself.
    if wake_path != "native":
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    calls = 0

    def failing_once(take: Any) -> Any:
        def take_failing_once(self: NativeMailbox) -> list[int]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in the wake path")
            return take(self)  # type: ignore[no-any-return]

        return take_failing_once

    other = device.new_stream()
    with caplog.at_level(logging.ERROR, "asyncfence.loops"), hold(stream) as gate:
        fence = asyncfence.record(stream)
        with hold(other) as other_gate:
            bystander = asyncfence.record(other)
            # Its fd stays readable, so the reader runs again: the re-check is 30 s away.
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(fence.wait, strategy="park"))
                    if armed == 2:
                        tg.start_soon(partial(bystander.wait, strategy="park"))
                    await until(lambda: asyncfence.current_statistics().armed == armed)
                    for name in ("take", "take_undrained"):  # whichever comes first
                        monkeypatch.setattr(
                            NativeMailbox, name, failing_once(getattr(NativeMailbox, name))
                        )
                    gate.release()
                    await until(fence.done)
                    other_gate.release()
                await until(lambda: calls >= 2)
    assert "the native mailbox's reader raised" in caplog.text
    later = asyncfence.record(stream)
    await later.wait(strategy="park")
    stats = asyncfence.current_statistics()
    assert (stats.waiters, stats.parked) == (0, 0)


@pytest.mark.usefixtures("only_signals_wake")
async def test_64_waiters_on_64_queues_completing_in_random_order(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(64)]
    async with parked_on_held(queues) as (gates, fences):
        order = list(range(64))
        random.Random(1).shuffle(order)
        with anyio.fail_after(10):
            for index in order:
                gates[index].release()
                await until(lambda index=index: fences[index].done())
    assert asyncfence.current_statistics().parked == 0


@pytest.mark.parametrize("shim", ["native", "no shim"])
@pytest.mark.usefixtures("no_thread_from_asyncfence")
async def test_a_thousand_parked_waits_start_no_thread(
    device: OpenCLDevice, shim: str, wake_path: str, request: pytest.FixtureRequest
) -> None:
    if shim == "native" and wake_path != "native":
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    if shim == "no shim":
        request.getfixturevalue("without_shim")
    queues = [device.new_stream() for _ in range(1000)]
    threads_before = {thread.ident for thread in threading.enumerate()}
    async with parked_on_held(queues) as (gates, fences):
        assert asyncfence.current_statistics().wake_path == (
            "native" if shim == "native" else "polling"
        )
        # None of asyncfence's; at most trio's guest-mode I/O thread, of trio's own.
        new = [thread for thread in threading.enumerate() if thread.ident not in threads_before]
        assert len(new) <= 1
        assert asyncfence_threads(besides=threads_before) == set()
        for gate in gates:
            gate.release()
    assert all(fence.done() for fence in fences)


# -- without the native shim --------------------------------------------------------


@pytest.mark.usefixtures("without_shim")
async def test_without_the_shim_a_round_of_rechecks_takes_a_slice_of_streams_a_turn(
    device: OpenCLDevice, loop_clock: LoopClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Thousands of unsignalled streams must never be queried in one turn: a
    # round takes a slice a step, the next slice at once (delay 0), and only
    # then sleeps.
    monkeypatch.setattr(_parking, "_UNSIGNALLED_SLICE", 4)
    queried: list[int] = []
    real_progress = _parking.Parking._progress

    def noted(self: _parking.Parking, keys: Any) -> Any:
        keys = list(keys)
        queried.append(len(keys))
        return real_progress(self, keys)

    monkeypatch.setattr(_parking.Parking, "_progress", noted)
    queues = [device.new_stream() for _ in range(10)]
    gates = [StreamGate(queue) for queue in queues]
    fences = [asyncfence.record(queue) for queue in queues]
    try:
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 10)
            parking = current_poller()._parking
            assert isinstance(parking, _parking.Parking)
            queried.clear()
            delays: list[float | None] = []
            loop_clock.now += parking._recheck_delay()
            for _ in range(3):
                delays.append(parking._recheck_step())
                loop_clock.now += delays[-1] or 0.0
            assert queried == [4, 4, 2]  # one round, a slice a step
            assert delays[:2] == [0.0, 0.0]  # the rest of the round: next turn
            assert delays[2] is not None
            assert delays[2] > 0  # the round is over: a sleep before the next
            loop_clock.run_free()
            for gate in gates:
                gate.release()
    finally:
        for gate in gates:
            gate.release()
    assert all(fence.done() for fence in fences)


@pytest.mark.usefixtures("without_shim", "no_thread_from_asyncfence")
async def test_without_the_shim_parked_waits_are_rechecked_backing_off_to_poll_cap(
    device: OpenCLDevice, loop_clock: LoopClock
) -> None:
    asyncfence.configure(poll_cap=0.004)
    first_queue, second_queue = device.new_stream(), device.new_stream()
    with hold(first_queue) as first_gate, hold(second_queue) as second_gate:
        first, second = asyncfence.record(first_queue), asyncfence.record(second_queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(first.wait, strategy="park"))
            tg.start_soon(partial(second.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 2)
            parking = current_poller()._parking
            assert isinstance(parking, _parking.Parking)
            assert parking.wake_path == "polling"
            assert asyncfence.current_statistics().armed == 0
            # The steps are called directly, each when due: what each returns
            # is the next delay.
            delays: list[float | None] = [parking._recheck_delay()]
            for _ in range(8):
                loop_clock.now += delays[-1] or 0.0
                delays.append(parking._recheck_step())
            assert delays[0] == pytest.approx(50e-6)
            for earlier, later in itertools.pairwise(delays):
                assert earlier is not None
                assert later == pytest.approx(min(2 * earlier, 0.004))
            assert delays[-1] == pytest.approx(0.004)
            first_gate.release()
            first.wait_sync()
            loop_clock.now += 0.004
            assert parking._recheck_step() == pytest.approx(50e-6)  # it found one settled
            loop_clock.run_free()
            second_gate.release()
    assert first.done()
    assert second.done()


def test_a_missing_shim_is_said_once_as_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_parking, "shim", lambda: None)
    monkeypatch.setattr(_parking, "unavailable_reason", lambda: "the shim was not built")
    monkeypatch.setattr(_parking, "unavailable_for_good", lambda: True)
    monkeypatch.setattr(_parking, "_shim_warned", False)
    with caplog.at_level(logging.WARNING, "asyncfence.poller"):
        assert _parking.new_mailbox() is None  # a first loop parks
        assert _parking.new_mailbox() is None  # and a second
    warnings = [r.getMessage() for r in caplog.records if r.name == "asyncfence.poller"]
    assert len(warnings) == 1
    assert "the native wake shim is not in use: the shim was not built" in warnings[0]
    assert "install a C compiler" in warnings[0]


# -- a wake decided by what fired -------------------------------------------------------


@pytest.mark.usefixtures("only_signals_wake")
async def test_an_orphaned_signal_and_a_settle_elsewhere_lose_no_wake(
    stream: Any,
    new_same_kind_stream: Any,
    wake_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sequence that once left a waiter suspended for good:
    # 1. a parked fence's wait is abandoned and the fence dropped while its
    #    signal is still armed (once, its token was forgotten and its slot
    #    orphaned; now the token holds the fence until the signal fires);
    # 2. with one other fence's signal armed, the orphan fires: the wake
    #    guesses that fence fired, finds it pending, and leaves the rest;
    # 3. before the rest runs, that fence settles by a poll that is no sweep,
    #    and another task parks a fence;
    # 4. the woken-and-parked bookkeeping must not drop the settled fence
    #    whose waiter was never woken.
    if wake_path != "native":
        pytest.skip("without the shim no signal is armed")
    orphan_stream, other_stream = new_same_kind_stream(), new_same_kind_stream()
    orphan_gate, fence_gate, other_gate = (
        StreamGate(orphan_stream),
        StreamGate(stream),
        StreamGate(other_stream),
    )
    try:
        orphan = asyncfence.record(orphan_stream)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(orphan.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().armed == 1)
                scope.cancel()
        orphan_core = weakref.ref(orphan._core)
        del orphan
        gc.collect()
        assert orphan_core() is not None  # its armed signal's token holds it
        fence, other = asyncfence.record(stream), asyncfence.record(other_stream)
        parking = current_poller()._parking
        assert isinstance(parking, _parking.Parking)
        real_finish = _parking.Parking._finish_wake
        interposed: list[str] = []

        def finish_after_a_settle_and_a_park(self: _parking.Parking) -> None:
            if not interposed:
                interposed.append("settled and parked")
                fence_gate.release()
                fence.wait_sync(timeout=30)  # settled by a poll that is no sweep
                self.park(other._core)  # another task parks meanwhile
            real_finish(self)

        monkeypatch.setattr(_parking.Parking, "_finish_wake", finish_after_a_settle_and_a_park)
        woken = anyio.Event()

        async def wait_for_fence() -> None:
            await fence.wait(strategy="park")
            woken.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_fence)
            await until(lambda: asyncfence.current_statistics().armed == 1)  # the fence's alone
            orphan_gate.release()  # the orphaned slot fires: the fd turns readable
            with anyio.fail_after(10):  # the re-check is 30 s away
                await woken.wait()
        assert interposed == ["settled and parked"]
        parking.unpark(other._core)
        gc.collect()
        assert orphan_core() is None  # let go once its signal fired
    finally:
        for gate in (orphan_gate, fence_gate, other_gate):
            gate.release()


# -- the ages of the oldest pending and parked fences, for health checks ----------------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock of the fences' ages, set by the test: ``clock[0]`` seconds (the loop's is real)."""
    now = [1000.0]
    monkeypatch.setattr(_poller, "_clock", lambda: now[0])
    return now


async def test_statistics_age_the_oldest_pending_and_parked_fences(
    device: OpenCLDevice, clock: list[float]
) -> None:
    first, second = device.new_stream(), device.new_stream()
    with hold(first) as first_gate, hold(second) as second_gate:
        polled, parked = asyncfence.record(first), asyncfence.record(second)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(polled.wait, strategy="poll"))
            await until(lambda: asyncfence.current_statistics().pending_fences == 1)
            stats = asyncfence.current_statistics()
            assert (stats.oldest_pending_age, stats.oldest_parked_age) == (0.0, None)
            clock[0] += 5
            tg.start_soon(partial(parked.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            clock[0] += 2
            stats = asyncfence.current_statistics()
            assert (stats.oldest_pending_age, stats.oldest_parked_age) == (7.0, 2.0)
            assert stats.stuck_fences is None  # not asked
            assert asyncfence.current_statistics(stuck_after=6).stuck_fences == 1
            assert asyncfence.current_statistics(stuck_after=1.5).stuck_fences == 2
            assert asyncfence.current_statistics(stuck_after=7).stuck_fences == 0  # more than
            first_gate.release()
            await until(lambda: asyncfence.current_statistics().pending_fences == 1)
            stats = asyncfence.current_statistics(stuck_after=0)
            assert (stats.oldest_pending_age, stats.oldest_parked_age) == (2.0, 2.0)
            assert stats.stuck_fences == 1
            second_gate.release()
    stats = asyncfence.current_statistics(stuck_after=0)
    assert (stats.oldest_pending_age, stats.oldest_parked_age, stats.stuck_fences) == (
        None,
        None,
        0,
    )
    first.finish()
    second.finish()


async def test_a_fence_is_aged_from_its_first_wait_and_anew_once_its_waits_left(
    queue: cl.CommandQueue, clock: list[float]
) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            clock[0] += 10
            tg.start_soon(fence.wait)  # a second wait on it: the fence keeps its age
            await until(lambda: asyncfence.current_statistics().waiters == 2)
            assert asyncfence.current_statistics().oldest_pending_age == 10.0
            tg.cancel_scope.cancel()
        assert asyncfence.current_statistics().oldest_pending_age is None
        clock[0] += 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait)  # awaited again: aged from now
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            clock[0] += 3
            assert asyncfence.current_statistics().oldest_pending_age == 3.0
            gate.release()
    assert fence.done()


async def test_a_drop_queues_wait_on_a_held_fence_counts_as_pending(
    queue: cl.CommandQueue, clock: list[float]
) -> None:
    drops = asyncfence.DropQueue()
    with hold(queue) as gate:
        drops.defer(asyncfence.record(queue), object())
        await until(lambda: asyncfence.current_statistics().pending_fences == 1)
        clock[0] += 4
        assert asyncfence.current_statistics(stuck_after=3).stuck_fences == 1
        gate.release()
        await drops.aclose()
    assert drops.statistics().released == 1
    assert asyncfence.current_statistics(stuck_after=3).stuck_fences == 0


@pytest.mark.parametrize(
    ("bound", "error"),
    [
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("5", TypeError),
        (True, TypeError),
    ],
)
async def test_stuck_after_must_be_a_finite_number_of_seconds(
    bound: object, error: type[Exception]
) -> None:
    fresh = asyncfence.current_statistics(stuck_after=0)  # no poller on this loop yet
    assert (fresh.stuck_fences, fresh.oldest_pending_age, fresh.oldest_parked_age) == (
        0,
        None,
        None,
    )
    with pytest.raises(error, match="stuck_after"):
        asyncfence.current_statistics(stuck_after=bound)  # type: ignore[arg-type]
