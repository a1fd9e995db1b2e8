"""Waiting on asyncio and on trio: each loop's native suspension, one poller each.

No thread is spent on a wait. The poller is created on first use in a loop and
stops ticking whenever nothing on that loop is awaited.
"""

from __future__ import annotations

import asyncio
import math
import sys
import weakref
from typing import TYPE_CHECKING

from ._fence import DONE, FAILED, PENDING
from ._poller import Poller, PollerStatistics

if TYPE_CHECKING:
    from collections.abc import Callable

    import trio

    from ._config import Strategy
    from ._fence import Fence

__all__ = ["current_poller", "current_statistics", "wait_for_fence"]


def _in_trio() -> bool:
    trio = sys.modules.get("trio")
    return trio is not None and trio.lowlevel.in_trio_task()


async def wait_for_fence(fence: Fence, seconds: float, strategy: Strategy) -> None:
    """Wait for ``fence`` on whichever loop runs the calling task."""
    if _in_trio():
        await _wait_trio(fence, seconds, strategy)
    else:
        await _wait_asyncio(fence, seconds, strategy)


def current_poller() -> Poller:
    """The running loop's poller, made on first use.

    Raises:
        RuntimeError: Called outside an asyncio or trio event loop.
    """
    if _in_trio():
        poller = _current_trio_poller(create=True)
        assert poller is not None
        return poller
    return _asyncio_poller(_running_asyncio_loop())


def current_statistics() -> PollerStatistics:
    """Return a snapshot of the running loop's poller.

    Raises:
        RuntimeError: Called outside an asyncio or trio event loop.
    """
    if _in_trio():
        poller: Poller | None = _current_trio_poller(create=False)
    else:
        poller = _asyncio_pollers.get(_running_asyncio_loop())
    return poller.statistics() if poller is not None else PollerStatistics()


def _settled_outcome(fence: Fence, seconds: float) -> None:
    """After a checkpoint or a timeout: return if done, else raise."""
    state = fence._poll()
    if state == DONE:
        return
    if state == FAILED:
        fence._raise_failure()
    raise TimeoutError(f"{fence!r} did not complete within {seconds} s")


# -- asyncio -------------------------------------------------------------------


def _running_asyncio_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "awaiting a fence needs a running asyncio or trio event loop; "
            "from synchronous code, call fence.wait_sync()"
        ) from None


class _FutureWaiter:
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future

    def wake(self, error: BaseException | None) -> None:
        future = self.future
        if future.done():  # cancelled meanwhile
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


class _AsyncioPoller(Poller):
    """Ticks with ``call_soon`` while spinning and ``call_later`` while backing off."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        # Weak, so that the registry below never keeps a closed loop alive.
        self._loop = weakref.ref(loop)
        self._handle: asyncio.Handle | None = None
        self._sleeping = False

    def _is_running(self) -> bool:
        return self._handle is not None

    def _call_soon_threadsafe(self, callback: Callable[[], None]) -> object:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop is gone")
        return loop.call_soon_threadsafe(callback)

    def _call_soon(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            # A task abandoned on a closed loop, being closed: clean up now.
            callback()
            return
        loop.call_soon(callback)

    def _ensure_ticking(self) -> None:
        if self._handle is not None and not self._sleeping:
            return
        loop = self._loop()
        if loop is None:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._sleeping = False
        self._handle = loop.call_soon(self._run)

    def _run(self) -> None:
        delay = self.tick()
        loop = self._loop()
        if delay is None or loop is None:
            self._handle = None
        elif delay == 0:
            self._sleeping = False
            self._handle = loop.call_soon(self._run)
        else:
            self._sleeping = True
            self._handle = loop.call_later(delay, self._run)


_asyncio_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncioPoller] = (
    weakref.WeakKeyDictionary()
)


def _asyncio_poller(loop: asyncio.AbstractEventLoop) -> _AsyncioPoller:
    poller = _asyncio_pollers.get(loop)
    if poller is None:
        poller = _asyncio_pollers[loop] = _AsyncioPoller(loop)
    return poller


def _expire(poller: Poller, fence: Fence, waiter: _FutureWaiter, seconds: float) -> None:
    poller.discard(fence, waiter)
    if waiter.future.done():
        return
    try:
        _settled_outcome(fence, seconds)
    except BaseException as error:  # delivered to the waiting task, never to the loop
        waiter.future.set_exception(error)
    else:
        waiter.future.set_result(None)


async def _wait_asyncio(fence: Fence, seconds: float, strategy: Strategy) -> None:
    loop = _running_asyncio_loop()
    if fence._poll() != PENDING or seconds == 0:
        await asyncio.sleep(0)  # a checkpoint, even when there is nothing to wait for
        _settled_outcome(fence, seconds)
        return
    poller = _asyncio_poller(loop)
    waiter = _FutureWaiter(loop.create_future())
    timer = None
    try:
        # Inside: should add() fail halfway (a thread that cannot start, say),
        # the waiter is not left registered.
        poller.add(fence, waiter, strategy)
        if seconds != math.inf:
            timer = loop.call_later(seconds, _expire, poller, fence, waiter, seconds)
        await waiter.future
    finally:
        if timer is not None:
            timer.cancel()
        poller.discard(fence, waiter)


# -- trio ----------------------------------------------------------------------


class _TaskWaiter:
    __slots__ = ("task",)

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task

    def wake(self, error: BaseException | None) -> None:
        import outcome
        import trio

        result = outcome.Value(None) if error is None else outcome.Error(error)
        trio.lowlevel.reschedule(self.task, result)


class _TrioPoller(Poller):
    """Ticks in a system task, which exits whenever nothing is awaited."""

    def __init__(self) -> None:
        import trio

        super().__init__()
        self._token = trio.lowlevel.current_trio_token()
        self._running = False
        self._sleep_scope: trio.CancelScope | None = None

    def _is_running(self) -> bool:
        return self._running

    def _call_soon_threadsafe(self, callback: Callable[[], None]) -> object:
        self._token.run_sync_soon(callback)  # RunFinishedError once the run is over
        return None

    def _call_soon(self, callback: Callable[[], None]) -> None:
        try:
            self._call_soon_threadsafe(callback)
        except RuntimeError:  # RunFinishedError: the run is over
            callback()

    def _ensure_ticking(self) -> None:
        import trio

        if not self._running:
            try:
                trio.lowlevel.spawn_system_task(self._run, name="asyncfence poller")
            except RuntimeError:
                # The run is shutting down (its system nursery is closed): no
                # task can wait any more, and raising here would crash it.
                return
            self._running = True
        elif self._sleep_scope is not None:
            self._sleep_scope.cancel()

    async def _run(self) -> None:
        import trio

        while True:
            delay = self.tick()
            if delay is None:
                self._running = False
                return
            if delay == 0:
                await trio.lowlevel.cancel_shielded_checkpoint()
                continue
            with trio.CancelScope(deadline=trio.current_time() + delay) as self._sleep_scope:
                await trio.sleep_forever()
            self._sleep_scope = None


_trio_poller_runvar: trio.lowlevel.RunVar[_TrioPoller] | None = None


def _current_trio_poller(*, create: bool) -> _TrioPoller | None:
    """The running trio run's poller; made on first use when ``create``."""
    global _trio_poller_runvar
    import trio

    if _trio_poller_runvar is None:
        _trio_poller_runvar = trio.lowlevel.RunVar("asyncfence.poller")
    try:
        return _trio_poller_runvar.get()
    except LookupError:
        if not create:
            return None
        poller = _TrioPoller()
        _trio_poller_runvar.set(poller)
        return poller


async def _wait_trio(fence: Fence, seconds: float, strategy: Strategy) -> None:
    import trio

    if fence._poll() != PENDING or seconds == 0:
        await trio.lowlevel.checkpoint()
        _settled_outcome(fence, seconds)
        return
    poller = _current_trio_poller(create=True)
    assert poller is not None
    waiter = _TaskWaiter(trio.lowlevel.current_task())

    def abort(_raise_cancel: object) -> trio.lowlevel.Abort:
        poller.discard(fence, waiter)
        return trio.lowlevel.Abort.SUCCEEDED

    with trio.move_on_after(seconds):
        poller.add(fence, waiter, strategy)
        await trio.lowlevel.wait_task_rescheduled(abort)
        return
    _settled_outcome(fence, seconds)
