"""The poller under failure: nothing it does can kill a loop's waits, or keep a dead loop alive."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import anyio
import pytest

import asyncfence
from asyncfence import _poller, _watcher
from asyncfence.testing import hold

from .conftest import until

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice


class _ThreadThatCannotStart(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def _without_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No new thread can start for the watcher (only for it: trio needs its own)."""
    import types

    monkeypatch.setattr(
        _watcher,
        "threading",
        types.SimpleNamespace(
            Thread=_ThreadThatCannotStart,
            Lock=threading.Lock,
            current_thread=threading.current_thread,
        ),
    )


@pytest.mark.usefixtures("thread_wake_path")
async def test_a_thread_that_cannot_start_leaves_every_wait_working(
    device: OpenCLDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Once "auto" waits outlast their spin they are parked, and parking on the
    # fallback needs the watcher thread. With no thread to be had, they are
    # polled instead: every one resumes, and the loop's later waits work.
    _watcher.current_watcher().stop(timeout=10)
    _without_threads(monkeypatch)
    queues = [device.new_stream() for _ in range(24)]
    with contextlib.ExitStack() as stack, caplog.at_level(logging.WARNING, "asyncfence.poller"):
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queue) for queue in queues]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="auto"))
            tg.start_soon(partial(fences[0].wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().waiters == 25)
            await until(lambda: not asyncfence.current_statistics().parked)
            for gate in gates:
                gate.release()
    assert all(fence.done() for fence in fences)
    assert "polling them instead" in caplog.text
    later = asyncfence.record(queues[0])
    with anyio.fail_after(10):
        await later.wait(strategy="park")  # the poller still works: a done fence resumes
    monkeypatch.undo()
    with hold(queues[1]) as gate:  # and with threads back, waits park again
        parked = asyncfence.record(queues[1])
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(parked.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            gate.release()


async def test_a_tick_that_raises_is_retried_not_lost(
    queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_tick = _poller.Poller._tick
    failures: list[float] = []

    def failing_once(self: _poller.Poller, now: float) -> float | None:
        if not failures:
            failures.append(now)
            raise RuntimeError("a bug in a tick")
        return real_tick(self, now)

    monkeypatch.setattr(_poller.Poller, "_tick", failing_once)
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
        self._waiters.setdefault(fence, {})[waiter] = "park"  # registered halfway
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


@pytest.mark.usefixtures("thread_wake_path")
async def test_an_unpark_that_raises_spares_the_rest_of_its_batch(
    device: OpenCLDevice, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    watcher = _watcher.current_watcher()
    real_unpark = watcher.unpark
    raised: list[object] = []

    def unpark(fence: Any, target: Any) -> None:
        if not raised:
            raised.append(fence)
            raise RuntimeError("unpark failed")
        real_unpark(fence, target)

    monkeypatch.setattr(watcher, "unpark", unpark)
    queues = [device.new_stream() for _ in range(5)]
    with contextlib.ExitStack() as stack, caplog.at_level(logging.ERROR, "asyncfence.poller"):
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queue) for queue in queues]
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                for fence in fences:
                    tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda: watcher.statistics().parked == 5)
                scope.cancel()  # five unparks, in one batch
        # The one that raised stays with the watcher; the other four left it.
        await until(lambda: watcher.statistics().parked == 1)
        assert "unparking" in caplog.text
        other = next(fence for fence in fences if fence is not raised[0])
        async with anyio.create_task_group() as tg:  # later batches still flush
            tg.start_soon(partial(other.wait, strategy="park"))
            await until(lambda: watcher.statistics().parked == 2)
            tg.cancel_scope.cancel()
        await until(lambda: watcher.statistics().parked == 1)
        for gate in gates:
            gate.release()


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


async def test_two_hundred_timed_out_waits_leave_no_threads_behind(
    device: OpenCLDevice, wake_path: str
) -> None:
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
    assert new == ([] if wake_path == "native" else new[:1])  # at most the fallback's watcher
    assert len(new) <= 1


async def _time_out(fence: asyncfence.Fence) -> None:
    with pytest.raises(TimeoutError):
        await fence.wait(timeout=0.01, strategy="park")
