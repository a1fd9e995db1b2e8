"""The :class:`~asyncfence._loops._driver.LoopDriver` of asyncio (uvloop included)."""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Final

from ._driver import guarded, retry_delay

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._driver import Waiter, WaitRegistry

__all__ = ["DRIVER_ATTRIBUTE", "AsyncioDriver", "driver_of"]

_logger = logging.getLogger("asyncfence.loops")

# Where a loop keeps its driver (and so its poller): on the loop itself, so
# that a loop closed with waits pending is collected with its poller (a
# registry keyed by the loop would be kept alive by the waiters' futures,
# which refer to the loop).
DRIVER_ATTRIBUTE: Final = "_asyncfence_driver"


class _AsyncioChain:
    """A step that reschedules itself with ``call_soon`` / ``call_at``."""

    __slots__ = ("_due", "_handle", "_loop", "_soon", "_step")

    def __init__(
        self, loop: weakref.ref[asyncio.AbstractEventLoop], step: Callable[[], float | None]
    ) -> None:
        self._loop = loop
        self._step = step
        self._handle: asyncio.Handle | None = None
        self._soon = False
        self._due = math.inf

    @property
    def running(self) -> bool:
        return self._handle is not None

    def ensure(self, delay: float) -> None:
        handle = self._handle
        if handle is not None and self._soon:
            return  # nothing is sooner
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        if delay <= 0:
            if handle is not None:
                handle.cancel()
            self._handle, self._soon = loop.call_soon(self._run), True
            return
        due = loop.time() + delay
        if handle is not None and self._due <= due:
            return
        if handle is not None:
            handle.cancel()
        self._handle, self._soon, self._due = loop.call_at(due, self._run), False, due

    def _run(self) -> None:
        self._handle, self._due = None, math.inf
        try:
            delay = self._step()
        except Exception:  # never lost: the loop's later waits must still work
            _logger.exception("asyncfence: a poller step raised; retrying it")
            delay = retry_delay()
        if delay is not None:
            self.ensure(delay)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a reader callback must never raise
        future.set_result(None)


def _expire(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


class _FutureWaiter(asyncio.Future[bool]):
    """The waiting task's future, woken by the poller: a future and no wrapper around it."""

    __slots__ = ()

    def wake(self, error: BaseException | None) -> None:
        if self.done():  # cancelled or timed out meanwhile
            return
        if error is None:
            self.set_result(True)
        else:
            self.set_exception(error)


class _UntimedWait(Generator[Any, None, None]):
    """``await fence`` without a timeout: ``Fence.wait``'s usual case, with no frame.

    A parked task holds this (four slots) and its future, where a coroutine
    would hold a frame of some 300 bytes: in a server with a hundred
    thousand waits in flight, a third of what each costs beyond its task.
    The task sees what asyncio's ``Future.__await__`` gives it: the future,
    yielded once, then its outcome.

    Cancellation: the task's cancellation (or ``close()``) discards the
    waiter and propagates; no device work is cancelled.

    Thread-safety: the loop's thread only.
    """

    __slots__ = ("_fence", "_registry", "_strategy", "_waiter")

    def __init__(
        self, registry: WaitRegistry, fence: object, strategy: str, waiter: _FutureWaiter
    ) -> None:
        self._registry = registry
        self._fence = fence
        self._strategy: str | None = strategy  # None once registered
        self._waiter = waiter

    def __next__(self) -> Any:
        waiter = self._waiter
        strategy = self._strategy
        if strategy is not None:  # the first step: register, then suspend on the future
            self._strategy = None
            self._registry.add(self._fence, waiter, strategy)
            waiter._asyncio_future_blocking = True
            return waiter
        if not waiter.done():  # advanced by hand, not by a task
            self._abandon()
            raise RuntimeError("await wasn't used with future")  # as asyncio's own says
        try:
            waiter.result()  # raises the error it was woken with
        except BaseException:
            self._registry.discard(self._fence, waiter)  # a no-op once woken
            raise
        raise StopIteration

    def send(self, value: None) -> Any:
        return self.__next__()

    def throw(self, typ: Any, value: Any = None, traceback: Any = None) -> Any:
        # The task's cancellation, or an exception thrown into the awaiting
        # coroutine: the waiter is forgotten, then the exception goes on.
        self._abandon()
        if value is None:
            value = typ() if isinstance(typ, type) else typ
        if traceback is not None:
            value = value.with_traceback(traceback)
        raise value

    def close(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if self._strategy is None:  # registered
            self._registry.discard(self._fence, self._waiter)
        self._strategy = None


class AsyncioDriver:
    """An asyncio loop's primitives (see :class:`~asyncfence._loops._driver.LoopDriver`).

    Thread-safety: as the protocol says.
    """

    __slots__ = ("__weakref__", "_loop", "_system_tasks", "poller", "relay")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: the loop holds this driver, not the reverse.
        self._loop = weakref.ref(loop)
        self.poller: object = None
        self.relay: object = None
        # Held here: asyncio keeps only weak references to its tasks.
        self._system_tasks: set[asyncio.Task[None]] = set()

    # -- for the wait ------------------------------------------------------------

    def new_waiter(self) -> _FutureWaiter:
        loop = self._loop()
        assert loop is not None
        return _FutureWaiter(loop=loop)

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def suspend(self, waiter: Waiter, seconds: float) -> Awaitable[bool]:
        assert isinstance(waiter, _FutureWaiter)
        # A cancellation cancels the future and unwinds through the caller,
        # which unregisters the waiter; a wake that comes late finds the
        # future done.
        if seconds == math.inf:
            return waiter  # the future, awaited as it is: no frame of its own
        return self._suspend_for(waiter, seconds)

    async def _suspend_for(self, future: asyncio.Future[bool], seconds: float) -> bool:
        loop = self._loop()
        assert loop is not None
        timer = loop.call_later(seconds, _expire, future)
        try:
            return await future
        finally:
            timer.cancel()

    def untimed_wait(self, registry: WaitRegistry, fence: object, strategy: str) -> _UntimedWait:
        return _UntimedWait(registry, fence, strategy, self.new_waiter())

    # -- for the poller ----------------------------------------------------------

    def call_soon(self, callback: Callable[[], None]) -> None:
        run = guarded(callback, "a poller callback")
        loop = self._loop()
        if loop is None or loop.is_closed():
            run()  # a task abandoned on a closed loop, being closed: clean up now
            return
        loop.call_soon(run)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop is gone")
        loop.call_soon_threadsafe(guarded(callback, "a poller callback"))

    def chain(self, step: Callable[[], float | None]) -> _AsyncioChain:
        return _AsyncioChain(self._loop, step)

    def spawn_system_task(self, run: Callable[[], Awaitable[None]], name: str) -> bool:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False

        async def system_task() -> None:
            await run()

        task = loop.create_task(system_task(), name=name)
        self._system_tasks.add(task)
        task.add_done_callback(self._system_tasks.discard)
        return True

    async def wait_readable(self, fd: int) -> None:
        loop = self._loop()
        assert loop is not None
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _resolve, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)

    def watch_readable(self, fd: int, on_readable: Callable[[], bool]) -> bool:
        loop = self._loop()
        if loop is None:
            return False
        try:
            # A True return left fd readable: the selector reports it again on
            # the next turn, and its callback queues behind the ready ones (the
            # woken tasks), since the ready queue is first in, first out.
            loop.add_reader(fd, on_readable)
        except NotImplementedError:  # a proactor loop (Windows)
            return False
        return True

    def is_closed(self) -> bool:
        loop = self._loop()
        return loop is None or loop.is_closed()


_unattributable: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioDriver] = (
    weakref.WeakKeyDictionary()
)


def driver_of(loop: asyncio.AbstractEventLoop, *, create: bool) -> AsyncioDriver | None:
    """``loop``'s driver; made on first use where ``create``, else ``None`` until then."""
    driver: AsyncioDriver | None = getattr(loop, DRIVER_ATTRIBUTE, None)
    if driver is not None:
        return driver
    driver = _unattributable.get(loop)
    if driver is None and create:
        driver = AsyncioDriver(loop)
        try:
            setattr(loop, DRIVER_ATTRIBUTE, driver)
        except AttributeError:  # a loop without __dict__: a weak registry instead
            _unattributable[loop] = driver
    return driver
