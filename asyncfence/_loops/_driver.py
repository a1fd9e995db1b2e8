"""The one protocol every event loop library implements for asyncfence: :class:`LoopDriver`.

A driver gives the wait (:mod:`asyncfence._fence`) a way to suspend the
calling task, and the loop's poller (:mod:`asyncfence._poller`) what it needs
of the loop: call soon, from the loop thread or any other, a self-rescheduling
chain, and a file descriptor to watch. It knows nothing of devices or fences.
Each loop library has one driver class, in a module of its own; one driver
per loop, made on first use, lives as long as the loop (or the trio run).

Every callback a driver runs for the poller goes through :func:`guarded`
(the mailbox's reader guards itself): nothing the poller does can raise into
the loop (an asyncio exception handler, trio's ``TrioInternalError``), and a
chain step that fails is retried rather than lost.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from .._config import current_config

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Generator

__all__ = ["Chain", "LoopDriver", "WaitRegistry", "Waiter", "guarded", "retry_delay"]

_logger = logging.getLogger("asyncfence.loops")


class Waiter(Protocol):
    """One suspended wait, as its event loop resumes it."""

    def wake(self, error: BaseException | None) -> None:
        """Resume the wait, raising ``error`` in it if given. Never raises."""
        ...


class WaitRegistry(Protocol):
    """Where a wait registers its waiter: the loop's poller, as a driver sees it.

    Thread-safety: the loop's thread only.
    """

    def add(self, fence: Any, waiter: Any, strategy: Any) -> None:
        """Wake ``waiter`` once ``fence`` settles. Never raises."""
        ...

    def discard(self, fence: Any, waiter: Any) -> None:
        """Forget ``waiter``, cancelled or abandoned; a no-op once woken."""
        ...


class Chain(Protocol):
    """A callback that reschedules itself on the loop: the poller's ticks and re-checks.

    The driver calls ``step()``; it returns the seconds until the next call (0:
    as soon as the loop has run what is ready), or ``None`` to stop.
    """

    @property
    def running(self) -> bool:
        """Whether a call of ``step`` is scheduled."""
        ...

    def ensure(self, delay: float) -> None:
        """Have ``step`` called within ``delay`` seconds (sooner if already due)."""
        ...


class LoopDriver(Protocol):
    """What asyncfence needs of one event loop.

    Thread-safety: :meth:`call_soon_threadsafe` and :meth:`is_closed` may be
    called from any thread; the rest belongs to the loop's thread.
    """

    #: The loop's poller, kept here for the loop's life; ``None`` until made.
    poller: object
    #: The loop's relay of exported fences (:mod:`asyncfence._interprocess`); ``None`` until made.
    relay: object

    # -- for the wait ------------------------------------------------------------

    def new_waiter(self) -> Waiter:
        """A waiter for the calling task."""
        ...

    async def checkpoint(self) -> None:
        """Yield to the loop, honouring cancellation."""
        ...

    def suspend(self, waiter: Waiter, seconds: float) -> Awaitable[bool]:
        """What to await until ``waiter`` is woken (True) or ``seconds`` pass (False).

        Cancelled, it raises the loop's cancellation; a wake that comes after
        that, or after the timeout, is a no-op. The caller unregisters the
        waiter however the wait ends unwoken. Without a timeout it should
        cost no frame of its own (asyncio's is the waiter's future).
        """
        ...

    @property
    def untimed_wait(
        self,
    ) -> Callable[[WaitRegistry, object, str], Generator[Any, None, None]] | None:
        """``untimed_wait(registry, fence, strategy)``: ``await fence`` with no coroutine frame.

        For a pending fence awaited without a timeout: an iterator that
        registers its waiter with ``registry`` when first advanced, suspends
        the task until the waiter is woken (returning, or raising the error
        it was woken with), and discards the waiter if the wait is cancelled
        or closed first. ``None`` where the loop cannot suspend a task
        without a coroutine of its own (trio): the caller's coroutine waits.
        """
        ...

    # -- for the poller ----------------------------------------------------------

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon (loop thread); on a loop that is gone, now."""
        ...

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon, from any thread.

        Raises:
            RuntimeError: The loop is closed, or its run finished.
        """
        ...

    def chain(self, step: Callable[[], float | None]) -> Chain:
        """A chain that calls ``step`` on the loop (see :class:`Chain`)."""
        ...

    # -- for the relay -----------------------------------------------------------

    def spawn_system_task(self, run: Callable[[], Awaitable[None]], name: str) -> bool:
        """Run ``run()`` as a task of the loop's own, for as long as the loop runs.

        ``run`` must catch what it raises, but the loop's cancellation: a
        system task that raises ends a trio run. It is cancelled when the
        loop or run shuts down.

        Returns:
            False if the loop is shutting down and runs no new task.
        """
        ...

    async def wait_readable(self, fd: int) -> None:
        """Wait until ``fd`` is readable (or closed by its peer). A checkpoint.

        One task at a time may wait on one fd. Cancellation: it stops
        watching ``fd`` and propagates.
        """
        ...

    def watch_readable(self, fd: int, on_readable: Callable[[], bool]) -> bool:
        """Call ``on_readable`` on the loop whenever ``fd`` is readable, for the loop's life.

        When it returns True it left ``fd`` readable on purpose, to be called
        again once the tasks it woke have run: the driver makes sure that the
        repeat call comes after them. It never raises (it guards itself: the
        wake path saves the wrapper's frame), so the driver calls it as it is.

        Returns:
            False if this loop cannot watch file descriptors.
        """
        ...

    def is_closed(self) -> bool:
        """Whether the loop is known to be gone (closed)."""
        ...


def guarded(callback: Callable[[], None], what: str) -> Callable[[], None]:
    """``callback``, made safe to run as a loop callback: it never raises an Exception."""

    def run() -> None:
        try:
            callback()
        except Exception:
            _logger.exception("asyncfence: %s raised; the loop goes on", what)

    return run


def retry_delay() -> float:
    """How long a chain whose step raised waits before it tries again."""
    return current_config().poll_cap
