"""The event loops: one small driver per loop library, and the wait, written once.

A driver gives the poller (:mod:`asyncfence._poller`) what it needs of its
loop (call soon, from the loop thread or any other, a self-rescheduling
chain, a file descriptor to watch) and gives :func:`wait_for_fence` a way to
suspend the calling task and a checkpoint. Drivers exist for asyncio (uvloop
included) and trio; anyio runs on one of them. Each loop gets one poller, made
on first use, that lives as long as the loop (or the trio run) does.

Every callback a driver runs for the poller is guarded: nothing the poller
does can raise into the loop (an asyncio exception handler, trio's
``TrioInternalError``), and a step that fails is retried rather than lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import weakref
from typing import TYPE_CHECKING, Any, Final, Protocol

from ._config import current_config
from ._fence import DONE, FAILED, PENDING
from ._poller import Poller, PollerStatistics

if TYPE_CHECKING:
    from collections.abc import Callable

    import trio

    from ._config import Strategy
    from ._fence import Fence
    from ._poller import Waiter

__all__ = ["current_poller", "current_statistics", "in_trio", "wait_for_fence"]

_logger = logging.getLogger("asyncfence.loops")

# Where an asyncio loop keeps its driver and poller: on the loop itself, so
# that a loop closed with waits pending is collected with its poller (a
# registry keyed by the loop would be kept alive by the waiters' futures,
# which refer to the loop).
_DRIVER_ATTRIBUTE: Final = "_asyncfence_driver"


class _Suspender(Protocol):
    """How :func:`wait_for_fence` suspends a task on one loop library."""

    poller: Poller

    def new_waiter(self) -> Waiter:
        """A waiter for the calling task."""
        ...

    async def checkpoint(self) -> None:
        """Yield to the loop, honouring cancellation."""
        ...

    async def suspend(self, waiter: Waiter, seconds: float, abort: Callable[[], None]) -> bool:
        """Sleep until ``waiter`` is woken (True) or ``seconds`` pass (False).

        ``abort()`` unregisters the waiter, for a loop that must be told at
        once that a cancelled task will not be woken (trio's abort function).
        The caller unregisters it too, however the wait ends unwoken.
        """
        ...


async def wait_for_fence(fence: Fence, seconds: float, strategy: Strategy) -> None:
    """Wait for ``fence`` on whichever loop runs the calling task.

    Always a checkpoint; always unregisters, however the wait ends.

    Raises:
        TimeoutError: ``seconds`` passed first.
        DeviceError: The work before the fence failed.
        RuntimeError: No asyncio or trio loop runs the calling task.
    """
    loop = _current_suspender()
    if fence._poll() != PENDING or seconds == 0:
        await loop.checkpoint()  # a checkpoint, even when there is nothing to wait for
        _settled_outcome(fence, seconds)
        return
    poller = loop.poller
    waiter = loop.new_waiter()
    woken = False
    try:
        poller.add(fence, waiter, strategy)
        woken = await loop.suspend(waiter, seconds, lambda: poller.discard(fence, waiter))
    finally:
        if not woken:  # cancelled, timed out or failed: a wake unregisters its waiters
            poller.discard(fence, waiter)
    if not woken:
        _settled_outcome(fence, seconds)


def _settled_outcome(fence: Fence, seconds: float) -> None:
    """After a checkpoint or a timeout: return if done, raise its failure, or time out."""
    state = fence._poll()
    if state == DONE:
        return
    if state == FAILED:
        fence._raise_failure()
    raise TimeoutError(f"{fence!r} did not complete within {seconds} s")


def in_trio() -> bool:
    """Whether this runs in a trio task (trio is never imported to find out)."""
    trio = sys.modules.get("trio")
    return trio is not None and trio.lowlevel.in_trio_task()


def _current_suspender() -> _Suspender:
    if in_trio():
        return _trio_suspender()
    return _asyncio_suspender(_running_asyncio_loop())


def current_poller() -> Poller:
    """The running loop's poller, made on first use.

    Raises:
        RuntimeError: Called outside an asyncio or trio event loop.
    """
    return _current_suspender().poller


def current_statistics() -> PollerStatistics:
    """Return a snapshot of the running loop's waits.

    Raises:
        RuntimeError: Called outside an asyncio or trio event loop.
    """
    if in_trio():
        poller: Poller | None = _trio_poller(create=False)
    else:
        suspender = _existing_asyncio_suspender(_running_asyncio_loop())
        poller = None if suspender is None else suspender.poller
    return poller.statistics() if poller is not None else PollerStatistics()


def _guarded(callback: Callable[[], None], what: str) -> Callable[[], None]:
    """``callback``, made safe to run as a loop callback: it never raises an Exception."""

    def run() -> None:
        try:
            callback()
        except Exception:
            _logger.exception("asyncfence: %s raised; the loop goes on", what)

    return run


def _read_guarded(on_readable: Callable[[], bool]) -> bool:
    """``on_readable()``, made safe to run on the loop: False if it raised an Exception."""
    try:
        return on_readable()
    except Exception:
        _logger.exception("asyncfence: the native mailbox's reader raised; the loop goes on")
        return False


def _retry_delay() -> float:
    return current_config().poll_cap


# -- asyncio (uvloop included) -------------------------------------------------------------


def _running_asyncio_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "awaiting a fence needs a running asyncio or trio event loop; "
            "from synchronous code, call fence.wait_sync()"
        ) from None


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
            delay = _retry_delay()
        if delay is not None:
            self.ensure(delay)


class _FutureWaiter:
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[bool]) -> None:
        self.future = future

    def wake(self, error: BaseException | None) -> None:
        future = self.future
        if future.done():  # cancelled or timed out meanwhile
            return
        if error is None:
            future.set_result(True)
        else:
            future.set_exception(error)


def _expire(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


class _AsyncioDriver:
    """asyncio's primitives, for a poller and for :func:`wait_for_fence`."""

    __slots__ = ("__weakref__", "_loop", "poller")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: the loop holds this driver (through its poller), not the reverse.
        self._loop = weakref.ref(loop)
        self.poller = Poller(self)

    # For the poller.

    def call_soon(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            callback()  # a task abandoned on a closed loop, being closed: clean up now
            return
        loop.call_soon(_guarded(callback, "a poller callback"))

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop is gone")
        loop.call_soon_threadsafe(_guarded(callback, "a poller callback"))

    def chain(self, step: Callable[[], float | None]) -> _AsyncioChain:
        return _AsyncioChain(self._loop, step)

    def watch_readable(self, fd: int, on_readable: Callable[[], bool]) -> bool:
        loop = self._loop()
        if loop is None:
            return False
        try:
            # A True return left fd readable: the selector reports it again on
            # the next turn, and its callback queues behind the ready ones (the
            # woken tasks), since the ready queue is first in, first out.
            loop.add_reader(fd, _read_guarded, on_readable)
        except NotImplementedError:  # a proactor loop (Windows)
            return False
        return True

    def is_closed(self) -> bool:
        loop = self._loop()
        return loop is None or loop.is_closed()

    # For wait_for_fence.

    def new_waiter(self) -> _FutureWaiter:
        loop = self._loop()
        assert loop is not None
        return _FutureWaiter(loop.create_future())

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    async def suspend(self, waiter: Waiter, seconds: float, abort: Callable[[], None]) -> bool:
        assert isinstance(waiter, _FutureWaiter)
        timer = None
        if seconds != math.inf:
            loop = self._loop()
            assert loop is not None
            timer = loop.call_later(seconds, _expire, waiter.future)
        # No abort(): a cancellation unwinds through the caller, which
        # unregisters the waiter, and a wake that comes late finds its future
        # done.
        try:
            return await waiter.future
        finally:
            if timer is not None:
                timer.cancel()


_unattributable: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncioDriver] = (
    weakref.WeakKeyDictionary()
)


def _existing_asyncio_suspender(loop: asyncio.AbstractEventLoop) -> _AsyncioDriver | None:
    driver: _AsyncioDriver | None = getattr(loop, _DRIVER_ATTRIBUTE, None)
    return driver if driver is not None else _unattributable.get(loop)


def _asyncio_suspender(loop: asyncio.AbstractEventLoop) -> _AsyncioDriver:
    driver: _AsyncioDriver | None = getattr(loop, _DRIVER_ATTRIBUTE, None)
    if driver is not None:
        return driver
    driver = _unattributable.get(loop)
    if driver is None:
        driver = _AsyncioDriver(loop)
        try:
            setattr(loop, _DRIVER_ATTRIBUTE, driver)
        except AttributeError:  # a loop without __dict__: a weak registry instead
            _unattributable[loop] = driver
    return driver


# -- trio ------------------------------------------------------------------------------------


class _TrioChain:
    """A step run by a system task, which exits whenever the step says stop."""

    __slots__ = ("_due", "_name", "_running", "_scope", "_step")

    def __init__(self, step: Callable[[], float | None], name: str) -> None:
        self._step = step
        self._name = name
        self._running = False
        self._due = math.inf
        self._scope: trio.CancelScope | None = None

    @property
    def running(self) -> bool:
        return self._running

    def ensure(self, delay: float) -> None:
        import trio

        due = trio.current_time() + max(delay, 0.0)
        if due < self._due:
            self._due = due
            if self._scope is not None:
                self._scope.deadline = due  # cut the sleep short
        if not self._running:
            try:
                trio.lowlevel.spawn_system_task(self._run, name=self._name)
            except RuntimeError:
                # The run is shutting down (its system nursery is closed): no
                # task can wait any more, and raising here would crash it.
                self._due = math.inf
                return
            self._running = True

    async def _run(self) -> None:
        import trio

        try:
            while self._due != math.inf:
                if self._due > trio.current_time():
                    with trio.CancelScope(deadline=self._due) as self._scope:
                        await trio.sleep_forever()
                    self._scope = None
                    continue  # the deadline may have moved meanwhile
                self._due = math.inf
                try:
                    delay = self._step()
                except Exception:  # never into trio: a TrioInternalError ends the run
                    _logger.exception("asyncfence: a poller step raised; retrying it")
                    delay = _retry_delay()
                if delay is not None:
                    self.ensure(delay)
                if self._due <= trio.current_time():
                    await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._running = False
            self._scope = None


class _TaskWaiter:
    __slots__ = ("task",)

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task: trio.lowlevel.Task | None = task

    def wake(self, error: BaseException | None) -> None:
        import outcome
        import trio

        task, self.task = self.task, None
        if task is None:
            return  # one reschedule per wait, whatever happens
        result = outcome.Value(True) if error is None else outcome.Error(error)
        trio.lowlevel.reschedule(task, result)


class _TrioDriver:
    """trio's primitives, for a poller and for :func:`wait_for_fence`."""

    __slots__ = ("__weakref__", "_token", "poller")

    def __init__(self) -> None:
        import trio

        self._token = trio.lowlevel.current_trio_token()
        self.poller = Poller(self)

    # For the poller.

    def call_soon(self, callback: Callable[[], None]) -> None:
        try:
            self._token.run_sync_soon(_guarded(callback, "a poller callback"))
        except RuntimeError:  # RunFinishedError: the run is over
            callback()

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        self._token.run_sync_soon(_guarded(callback, "a poller callback"))

    def chain(self, step: Callable[[], float | None]) -> _TrioChain:
        return _TrioChain(step, "asyncfence poller")

    def watch_readable(self, fd: int, on_readable: Callable[[], bool]) -> bool:
        import trio

        async def read_forever() -> None:
            while True:
                await trio.lowlevel.wait_readable(fd)
                while _read_guarded(on_readable):
                    # Called again once the tasks it woke have run: trio may
                    # run a batch of tasks in either order, so two turns.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    await trio.lowlevel.cancel_shielded_checkpoint()

        try:
            trio.lowlevel.spawn_system_task(read_forever, name="asyncfence mailbox")
        except RuntimeError:  # the run is shutting down: nothing will wait any more
            return True
        return True

    def is_closed(self) -> bool:
        return False  # known only when a post is refused (RunFinishedError)

    # For wait_for_fence.

    def new_waiter(self) -> _TaskWaiter:
        import trio

        return _TaskWaiter(trio.lowlevel.current_task())

    async def checkpoint(self) -> None:
        import trio

        await trio.lowlevel.checkpoint()

    async def suspend(self, waiter: Waiter, seconds: float, abort: Callable[[], None]) -> bool:
        import trio

        def abort_wait(_raise_cancel: Any) -> trio.lowlevel.Abort:
            abort()
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.move_on_after(seconds):
            woken: bool = await trio.lowlevel.wait_task_rescheduled(abort_wait)
            return woken
        return False


_trio_runvar: trio.lowlevel.RunVar[_TrioDriver] | None = None


def _trio_driver(*, create: bool) -> _TrioDriver | None:
    global _trio_runvar
    import trio

    if _trio_runvar is None:
        _trio_runvar = trio.lowlevel.RunVar("asyncfence.poller")
    try:
        return _trio_runvar.get()
    except LookupError:
        if not create:
            return None
        driver = _TrioDriver()
        _trio_runvar.set(driver)
        return driver


def _trio_suspender() -> _TrioDriver:
    driver = _trio_driver(create=True)
    assert driver is not None
    return driver


def _trio_poller(*, create: bool) -> Poller | None:
    driver = _trio_driver(create=create)
    return None if driver is None else driver.poller
