"""The :class:`~asyncfence._loops._driver.LoopDriver` of trio (imported only in a trio run)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Final

from ._driver import guarded, retry_delay

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import trio

    from ._driver import Waiter

__all__ = ["TrioDriver", "driver_of_run"]

_logger = logging.getLogger("asyncfence.loops")

# What every wait calls of trio's and outcome's, bound as the first driver is
# made (this module is imported without trio): an import statement on each
# call runs the import machinery.
_lowlevel: Any = None
_value: Any = None
_error: Any = None


def _bind() -> None:
    global _lowlevel, _value, _error
    import outcome
    import trio

    _lowlevel, _value, _error = trio.lowlevel, outcome.Value, outcome.Error


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
                    delay = retry_delay()
                if delay is not None:
                    self.ensure(delay)
                if self._due <= trio.current_time():
                    await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._running = False
            self._scope = None


class _TaskWaiter:
    """A suspended task, and its own abort function: no bound method per wait."""

    __slots__ = ("task",)

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task: trio.lowlevel.Task | None = task

    def __call__(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        """Trio's abort function: the task is cancelled, so no wake may reschedule it.

        The wait unregisters the waiter as it unwinds.
        """
        self.task = None
        abort: trio.lowlevel.Abort = _lowlevel.Abort.SUCCEEDED
        return abort

    def wake(self, error: BaseException | None) -> None:
        task, self.task = self.task, None
        if task is None:
            return  # one reschedule per wait, whatever happens
        _lowlevel.reschedule(task, _value(True) if error is None else _error(error))


async def _suspend_for(waiter: _TaskWaiter, seconds: float) -> bool:
    import trio

    with trio.move_on_after(seconds):
        woken: bool = await trio.lowlevel.wait_task_rescheduled(waiter)
        return woken
    return False


class TrioDriver:
    """A trio run's primitives (see :class:`~asyncfence._loops._driver.LoopDriver`).

    Thread-safety: as the protocol says.
    """

    __slots__ = ("__weakref__", "_token", "poller", "relay")

    def __init__(self) -> None:
        _bind()
        self._token = _lowlevel.current_trio_token()
        self.poller: object = None
        self.relay: object = None

    # -- for the wait ------------------------------------------------------------

    def new_waiter(self) -> _TaskWaiter:
        return _TaskWaiter(_lowlevel.current_task())

    async def checkpoint(self) -> None:
        import trio

        await trio.lowlevel.checkpoint()

    def suspend(self, waiter: Waiter, seconds: float) -> Awaitable[bool]:
        assert isinstance(waiter, _TaskWaiter)
        if seconds == math.inf:  # trio's own coroutine, as it is: no frame of ours
            # Awaited by the caller, at once.
            woken: Awaitable[bool] = _lowlevel.wait_task_rescheduled(waiter)
            return woken
        return _suspend_for(waiter, seconds)

    untimed_wait: Final = None  # trio suspends a task only from a coroutine of its own

    # -- for the poller ----------------------------------------------------------

    def call_soon(self, callback: Callable[[], None]) -> None:
        run = guarded(callback, "a poller callback")
        try:
            self._token.run_sync_soon(run)
        except RuntimeError:  # RunFinishedError: the run is over
            run()

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        self._token.run_sync_soon(guarded(callback, "a poller callback"))

    def chain(self, step: Callable[[], float | None]) -> _TrioChain:
        return _TrioChain(step, "asyncfence poller")

    def spawn_system_task(self, run: Callable[[], Awaitable[None]], name: str) -> bool:
        import trio

        try:
            trio.lowlevel.spawn_system_task(run, name=name)
        except RuntimeError:  # the run is shutting down
            return False
        return True

    async def wait_readable(self, fd: int) -> None:
        import trio

        await trio.lowlevel.wait_readable(fd)

    def watch_readable(self, fd: int, on_readable: Callable[[], bool]) -> bool:
        import trio

        async def read_forever() -> None:
            while True:
                await trio.lowlevel.wait_readable(fd)
                while on_readable():
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


_run_driver: trio.lowlevel.RunVar[TrioDriver] | None = None


def driver_of_run(*, create: bool) -> TrioDriver | None:
    """The running trio run's driver; made on first use where ``create``, else ``None``."""
    global _run_driver
    if _run_driver is None:
        import trio

        _run_driver = trio.lowlevel.RunVar("asyncfence.driver")
    try:
        return _run_driver.get()
    except LookupError:
        if not create:
            return None
        driver = TrioDriver()
        _run_driver.set(driver)
        return driver
