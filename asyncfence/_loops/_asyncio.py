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


def _thrown(typ: Any, value: Any, traceback: Any) -> BaseException:
    """What a generator's ``throw(typ, value, traceback)`` raises, the legacy forms included.

    A ``StopIteration`` is turned into a ``RuntimeError``, as a generator
    does (PEP 479): it would end the await as though the fence were done.
    """
    if isinstance(typ, BaseException):
        error = typ
    elif isinstance(typ, type) and issubclass(typ, BaseException):
        if isinstance(value, typ):
            error = value
        elif value is None:
            error = typ()
        else:
            error = typ(*value) if isinstance(value, tuple) else typ(value)
    else:
        raise TypeError(
            f"exceptions must be classes or instances deriving from BaseException, "
            f"not {type(typ).__name__}"
        )
    if traceback is not None:
        error = error.with_traceback(traceback)
    if isinstance(error, StopIteration):
        stop = error
        error = RuntimeError("StopIteration was thrown into an await of a fence")
        error.__cause__ = stop
    return error


class _UntimedWait(Generator[Any, None, None]):
    """``await fence`` without a timeout: ``Fence.wait``'s usual case, with no frame.

    A parked task holds this (four slots) and its future, where a coroutine
    would hold a frame of some 300 bytes: 1,328 bytes of Python heap per
    parked wait with its task, against 1,621 (a task awaiting a plain future:
    1,089; see docs/performance.md).
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
        # A task resumes here only after a wake without error: it delivers the
        # future's exception, the fence's failure, through throw(). By hand:
        try:
            waiter.result()
        except BaseException:
            self._registry.discard(self._fence, waiter)  # a no-op once woken
            del self, waiter  # the traceback keeps this frame: no cycle through the future
            raise
        raise StopIteration

    def send(self, value: None) -> Any:
        return self.__next__()

    def throw(self, typ: Any, value: Any = None, traceback: Any = None) -> Any:
        # How the task delivers the fence's failure (the future's exception)
        # and its own cancellation, and whatever else is thrown into the
        # awaiting coroutine: the waiter is forgotten (a no-op once woken),
        # then the exception goes on.
        self._abandon()
        error = _thrown(typ, value, traceback)
        try:
            raise error  # the fence's failure, the task's cancellation, or what was thrown in
        finally:
            # The traceback keeps this frame: a local naming the exception,
            # or the waiter holding it, would be a cycle that keeps the
            # awaiting coroutine's locals until the garbage collector runs.
            del self, typ, value, traceback, error

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
            del future  # the failure's traceback keeps this frame: no cycle through it

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
