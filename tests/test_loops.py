"""The loop drivers (``asyncfence._loops``): closed loops, finished runs, one wait for all loops."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import pytest

import asyncfence
from asyncfence._loops import _asyncio, _trio
from asyncfence._poller import Poller
from asyncfence.testing import StreamGate, hold

from .conftest import HANG_GUARD_S, until

if sys.version_info < (3, 11):
    pass

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice


def test_a_wait_abandoned_on_a_closed_loop_unparks_when_closed(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    loop = asyncio.new_event_loop()
    task = loop.create_task(fence.wait(strategy="park"))
    loop.run_until_complete(until(lambda: asyncfence.current_statistics().parked == 1))
    loop.close()  # the task is still waiting
    task.get_coro().close()  # what its destruction does: runs its finally
    driver = _asyncio.driver_of(loop, create=False)
    assert driver is not None
    assert isinstance(driver.poller, Poller)
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)


def test_an_await_abandoned_on_a_closed_loop_unparks_when_closed(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)

    async def wait() -> None:
        await fence

    loop = asyncio.new_event_loop()
    previous = asyncfence.configure().strategy
    asyncfence.configure(strategy="park")
    try:
        task = loop.create_task(wait())
        loop.run_until_complete(until(lambda: asyncfence.current_statistics().parked == 1))
    finally:
        asyncfence.configure(strategy=previous)
    loop.close()
    task.get_coro().close()  # closes the await within it, as collecting the task does
    driver = _asyncio.driver_of(loop, create=False)
    assert driver is not None
    assert isinstance(driver.poller, Poller)
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)


def test_a_closed_loops_wait_collected_on_another_thread_unparks_without_raising(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    # A wait abandoned on a closed loop is finalized when the garbage collector
    # finds it, on whatever thread allocates then: its unpark runs there, and
    # must neither raise nor schedule anything on the closed loop.
    fence = asyncfence.record(queue)
    loop = asyncio.new_event_loop()
    task = loop.create_task(fence.wait(strategy="park"))
    loop.run_until_complete(until(lambda: asyncfence.current_statistics().parked == 1))
    loop.close()
    finished = threading.Event()
    raised: list[BaseException] = []

    def finalize() -> None:
        try:
            task.get_coro().close()
        except BaseException as error:
            raised.append(error)
        finished.set()

    thread = threading.Thread(target=finalize, daemon=True)
    thread.start()
    assert finished.wait(HANG_GUARD_S), "unparking a closed loop's wait hung"
    thread.join(HANG_GUARD_S)
    assert raised == []
    driver = _asyncio.driver_of(loop, create=False)
    assert driver is not None
    assert isinstance(driver.poller, Poller)
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)


def test_the_trio_poller_survives_a_run_that_is_shutting_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio

    async def main() -> None:
        driver = _trio.driver_of_run(create=True)
        assert driver is not None
        chain = driver.chain(lambda: None)

        def closed_nursery(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Nursery is closed to new arrivals")

        monkeypatch.setattr(trio.lowlevel, "spawn_system_task", closed_nursery)
        chain.ensure(0.0)  # must not raise into trio
        assert not chain.running

    trio.run(main)


@pytest.mark.parametrize("doomed_loop", ["asyncio", "uvloop"])
def test_a_closed_loop_leaves_the_waits_of_other_loops_working(
    device: OpenCLDevice, doomed_loop: str
) -> None:
    first, second = device.new_stream(), device.new_stream()
    with hold(first) as first_gate, hold(second) as second_gate:
        orphan = asyncfence.record(first)
        survivor = asyncfence.record(second)
        if doomed_loop == "uvloop":
            uvloop = pytest.importorskip("uvloop")
            doomed = uvloop.new_event_loop()
        else:
            doomed = asyncio.new_event_loop()
        orphan_task = doomed.create_task(orphan.wait(strategy="park"))
        doomed.run_until_complete(asyncio.sleep(0.01))  # the orphan is parked
        assert not orphan_task.done()
        doomed.close()  # with its task still waiting
        orphan_task._log_destroy_pending = False  # its loop is closed: by design

        async def main() -> None:
            waiter = asyncio.create_task(survivor.wait(strategy="park"))
            await asyncio.sleep(0.01)
            first_gate.release()  # its signal goes to a closed loop's mailbox: harmless
            await asyncio.sleep(0.05)
            second_gate.release()
            await asyncio.wait_for(waiter, 10)
            stats = asyncfence.current_statistics()
            assert (stats.parked, stats.waiters) == (0, 0)

        asyncio.run(main())
    assert survivor.done()


# -- `await fence` on asyncio: no coroutine frame of asyncfence's ------------------


def _run_on(loop_name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if loop_name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), HANG_GUARD_S))
    finally:
        loop.close()


def _waiters() -> int:
    return asyncfence.current_statistics().waiters


def _suspended_on(fence: asyncfence.Fence) -> Coroutine[Any, Any, None]:
    """A coroutine that awaits ``fence``, after its first step, as a task would take it."""

    async def wait() -> None:
        await fence

    suspended = wait()
    yielded = suspended.send(None)  # suspends on the waiter's future
    assert isinstance(yielded, asyncio.Future)
    assert _waiters() == 1
    return suspended


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_an_await_closed_while_suspended_unregisters_its_waiter(
    queue: cl.CommandQueue, gate: StreamGate, loop_name: str
) -> None:
    fence = asyncfence.record(queue)

    async def main() -> None:
        suspended = _suspended_on(fence)
        suspended.close()  # what collecting a suspended task does
        assert _waiters() == 0
        gate.release()
        await fence  # the fence itself is untouched

    _run_on(loop_name, main)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_an_exception_thrown_into_an_await_goes_on_and_unregisters(
    queue: cl.CommandQueue, gate: StreamGate, loop_name: str
) -> None:
    fence = asyncfence.record(queue)

    async def main() -> None:
        suspended = _suspended_on(fence)
        with pytest.raises(LookupError, match="thrown in"):
            suspended.throw(LookupError("thrown in"))
        assert _waiters() == 0
        assert not fence.done()
        gate.release()
        await fence

    _run_on(loop_name, main)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_an_await_advanced_twice_by_hand_says_so_and_unregisters(
    queue: cl.CommandQueue, gate: StreamGate, loop_name: str
) -> None:
    fence = asyncfence.record(queue)

    async def main() -> None:
        suspended = _suspended_on(fence)
        with pytest.raises(RuntimeError, match="await wasn't used with future"):
            suspended.send(None)  # not by a task: the future is not done
        assert _waiters() == 0

    _run_on(loop_name, main)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_task_cancelled_just_before_its_await_is_cancelled_there(
    queue: cl.CommandQueue, gate: StreamGate, loop_name: str
) -> None:
    fence = asyncfence.record(queue)
    reached: list[str] = []

    async def main() -> None:
        async def cancelled_then_awaits() -> None:
            current = asyncio.current_task()
            assert current is not None
            current.cancel()  # pending: delivered at the task's next suspension
            reached.append("before")
            await fence
            reached.append("after")

        task = asyncio.create_task(cancelled_then_awaits())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reached == ["before"]
        assert _waiters() == 0
        assert not fence.done()

    _run_on(loop_name, main)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_asyncio_wait_for_on_a_fence_times_out_then_waits_again(
    queue: cl.CommandQueue, gate: StreamGate, loop_name: str
) -> None:
    fence = asyncfence.record(queue)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(fence, 0.01)  # wraps the fence in a task of its own
        assert _waiters() == 0
        gate.release()
        await asyncio.wait_for(fence, HANG_GUARD_S)
        assert fence.done()

    _run_on(loop_name, main)


def _frees_its_locals_at_once(
    loop_name: str,
    wait: Callable[[], Awaitable[None]],
    end: Callable[[asyncio.Task[None]], object],
    raised: type[BaseException],
) -> bool:
    """Whether a task's locals are freed, with the collector off, once ``end`` ended its wait.

    A reference cycle through the traceback of what ended it would keep a
    request's buffers alive until the garbage collector happened to run.
    """

    class Buffer:
        pass

    buffers: list[weakref.ref[Buffer]] = []

    async def main() -> None:
        async def handler() -> None:
            buffer = Buffer()
            buffers.append(weakref.ref(buffer))
            await wait()

        task = asyncio.create_task(handler())
        await until(lambda: _waiters() == 1)
        end(task)
        with pytest.raises(raised):
            await task
        del task
        await asyncio.sleep(0)

    gc.disable()
    try:
        _run_on(loop_name, main)
        return buffers[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_cancelled_await_frees_the_awaiting_coroutines_locals_without_the_collector(
    queue: cl.CommandQueue, gate: StreamGate, loop_name: str
) -> None:
    fence = asyncfence.record(queue)

    async def wait() -> None:
        await fence

    assert _frees_its_locals_at_once(
        loop_name, wait, lambda task: task.cancel(), asyncio.CancelledError
    )


@pytest.mark.parametrize(
    ("thrown", "expected"),
    [
        ((LookupError("one"),), LookupError("one")),
        ((LookupError,), LookupError()),
        ((LookupError, "legacy"), LookupError("legacy")),
        ((LookupError, ("a", "b")), LookupError("a", "b")),
        ((StopIteration,), RuntimeError("StopIteration was thrown into an await of a fence")),
    ],
    ids=["instance", "class", "class-and-value", "class-and-arguments", "stop-iteration"],
)
def test_throw_into_an_await_raises_what_a_coroutine_would(
    queue: cl.CommandQueue, gate: StreamGate, thrown: tuple[Any, ...], expected: BaseException
) -> None:
    fence = asyncfence.record(queue)

    async def main() -> None:
        suspended = _suspended_on(fence)
        with pytest.raises(type(expected)) as raised:
            suspended.throw(*thrown)
        assert raised.value.args == expected.args
        assert _waiters() == 0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy throw() forms
        _run_on("asyncio", main)


@pytest.mark.parametrize("timeout", [None, HANG_GUARD_S])
def test_a_stop_iteration_thrown_into_a_wait_is_no_timeout(
    queue: cl.CommandQueue, gate: StreamGate, timeout: float | None
) -> None:
    # The future it awaits ends on the StopIteration as though it returned:
    # neither woken nor timed out, the wait must not say it timed out.
    fence = asyncfence.record(queue)

    async def main() -> None:
        suspended = fence.wait(timeout=timeout)
        assert isinstance(suspended.send(None), asyncio.Future)
        assert _waiters() == 1
        with pytest.raises(RuntimeError, match="StopIteration was thrown into an await"):
            suspended.throw(StopIteration())
        assert _waiters() == 0
        assert not fence.done()

    _run_on("asyncio", main)


def test_throw_of_what_is_no_exception_is_a_type_error(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)

    async def main() -> None:
        suspended = _suspended_on(fence)
        with pytest.raises(TypeError, match="deriving from BaseException"):
            suspended.throw(42)  # type: ignore[call-overload]
        assert _waiters() == 0

    _run_on("asyncio", main)


@pytest.mark.parametrize(
    "written", ["await fence", "await fence.wait()", "await fence.wait(timeout=30)"]
)
def test_a_failed_await_frees_the_awaiting_coroutines_locals_without_the_collector(
    queue: cl.CommandQueue, gate: StreamGate, written: str
) -> None:
    fence = asyncfence.record(queue)

    async def wait() -> None:
        if written == "await fence":
            await fence
        elif written == "await fence.wait()":
            await fence.wait()
        else:
            await fence.wait(timeout=HANG_GUARD_S)

    assert _frees_its_locals_at_once(
        "asyncio", wait, lambda _: gate.fail(-5), asyncfence.DeviceError
    )


async def test_waits_on_asyncio_go_on_while_another_thread_imports_trio(
    queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch, anyio_backend: tuple[str, Any]
) -> None:
    if anyio_backend[0] != "asyncio":
        pytest.skip("a trio run has trio imported whole")
    # What sys.modules holds while another thread runs trio's __init__: a
    # module with none of its attributes yet (trio.lowlevel is bound last).
    half_imported = types.ModuleType("trio")
    monkeypatch.setitem(sys.modules, "trio", half_imported)
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with pytest.raises(TimeoutError):
            await fence.wait(timeout=0)
        gate.release()
    await fence
    await fence.wait(timeout=HANG_GUARD_S, strategy="park")
    assert fence.done()
