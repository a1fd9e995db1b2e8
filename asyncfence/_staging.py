"""A pool of staging buffers, each handed out again only once the device is done with it."""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, final

from ._drop_queue import DropQueue
from ._exceptions import ClosedResourceError
from ._sync import Changes
from ._validation import check_callable, check_int

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import TracebackType

    from typing_extensions import Self

    from ._backends import PinnedBuffer
    from ._fence import Fence

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

__all__ = ["StagingPool", "StagingPoolStatistics"]

_logger = logging.getLogger("asyncfence.staging")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StagingPoolStatistics:
    """A snapshot of a :class:`StagingPool`.

    Attributes:
        buffers: How many buffers the pool was made with.
        available: Ready to hand out now.
        returning: Handed to :meth:`~StagingPool.release_after`, waiting for
            their fences.
        taken: Held by their takers (acquired, not yet handed back).
        lost: Retired because the work that read them failed.
        closed: Whether :meth:`~StagingPool.aclose` was called.
    """

    buffers: int
    available: int
    returning: int
    taken: int
    lost: int
    closed: bool


@final
class StagingPool(Generic[T]):
    """A fixed set of staging buffers, each handed out again only once reusable.

    The pattern of an async host-to-device pipeline: :meth:`acquire` a buffer,
    fill it, queue the copy that reads it, record a fence, then
    :meth:`release_after` that fence. The buffer returns to the pool only when
    the device has passed the fence, so the next producer can never overwrite
    data a copy is still reading. A buffer whose fence failed is not reused.
    ``async with`` closes the pool on exit (:meth:`aclose`).

    Cancellation: a cancelled :meth:`acquire` takes no buffer.

    Thread-safety: :meth:`release_after` and :meth:`statistics` may be called
    from any thread; the rest belongs to the pool's event loop (the loop of
    the first :meth:`acquire` where the pool was made outside a loop).

    Args:
        make: Makes one buffer; called ``count`` times up front.
        count: How many buffers.
        dispose: Called with each buffer by :meth:`aclose` (``PinnedBuffer.free``,
            say); by default the pool just lets go of them.

    Raises:
        TypeError: ``make`` or ``dispose`` is not callable, or ``count`` not an int.
        ValueError: ``count`` is less than 1.
    """

    def __init__(
        self,
        make: Callable[[], T],
        count: int,
        *,
        dispose: Callable[[T], object] | None = None,
    ) -> None:
        check_callable("make", make)
        check_callable("dispose", dispose, optional=True)
        self._count = check_int("count", count, minimum=1)
        self._dispose = dispose
        self._free: deque[T] = deque()
        try:
            for _ in range(count):
                self._free.append(make())
        except BaseException:
            # None of them leaks; make()'s error is the one the caller sees.
            for error in self._dispose_each(list(self._free)):
                _logger.error("dispose raised for a staging buffer", exc_info=error)
            raise
        self._returns = DropQueue(on_fault=self._lose)
        self._lost: list[T] = []
        self._changes = Changes()
        self._closed = False

    @classmethod
    def pinned(cls, nbytes: int, count: int) -> StagingPool[PinnedBuffer]:
        """A pool of ``count`` pinned host buffers of ``nbytes`` each, freed on close."""
        from ._backends import PinnedBuffer

        return StagingPool(lambda: PinnedBuffer(nbytes), count, dispose=PinnedBuffer.free)

    @property
    def available(self) -> int:
        """Buffers ready to hand out now."""
        return len(self._free)

    def statistics(self) -> StagingPoolStatistics:
        """Return a snapshot of the pool. Thread-safe."""
        available, lost = len(self._free), len(self._lost)
        returning = self._returns.statistics().pending_items
        return StagingPoolStatistics(
            buffers=self._count,
            available=available,
            returning=returning,
            taken=max(0, self._count - available - returning - lost),
            lost=lost,
            closed=self._closed,
        )

    async def acquire(self) -> T:
        """Take a buffer, waiting until one is reusable. Always a checkpoint.

        Raises:
            ClosedResourceError: The pool is closed.
            RuntimeError: Every buffer was lost to device faults.
        """
        # Binds the returns to this loop, if the pool was made outside one:
        # buffers handed back from other threads then reach it.
        self._returns.bind()

        def ready() -> bool:
            return bool(self._free) or self._closed or len(self._lost) == self._count

        await self._changes.wait_until(ready)
        if self._closed:
            raise ClosedResourceError("the StagingPool is closed")
        if not self._free:
            raise RuntimeError("every staging buffer was lost to a device fault")
        return self._free.popleft()

    def release_after(self, fence_or_fences: Fence | Iterable[Fence], buffer: T) -> None:
        """Return ``buffer`` to the pool once the fences given have completed.

        After :meth:`aclose`, the buffer is disposed of once they have
        completed instead, so none taken before the close leaks.

        Thread-safety: safe from any thread.
        """
        self._returns.defer(fence_or_fences, buffer, free=self._give_back)

    def _give_back(self, buffer: T) -> None:
        if self._closed:  # came back after the close: nobody will take it
            if self._dispose is not None:
                self._dispose(buffer)  # what it raises, the DropQueue reports
            return
        self._free.append(buffer)
        self._changes.notify()

    def _dispose_each(self, buffers: list[T]) -> list[Exception]:
        """Dispose of every one of ``buffers``; return what ``dispose`` raised."""
        errors: list[Exception] = []
        if self._dispose is not None:
            for buffer in buffers:
                try:
                    self._dispose(buffer)
                except Exception as error:  # the rest are still disposed of
                    errors.append(error)
        return errors

    def _dispose_free(self) -> list[Exception]:
        buffers, self._free = list(self._free), deque()
        return self._dispose_each(buffers)

    def _lose(self, buffer: T, error: BaseException) -> None:
        _logger.warning("a staging buffer is retired: the work that read it failed (%s)", error)
        self._lost.append(buffer)
        self._changes.notify()

    async def aclose(self) -> None:
        """Wait for every buffer out on the device to come back, then dispose of all.

        From the start of the call, :meth:`acquire` raises (waiting ones too).
        A buffer still held by its taker is disposed of once it is handed to
        :meth:`release_after` and its fences complete. Buffers lost to faults
        are kept, never disposed: the device may still touch them.

        Cancellation: the pool stays closed, the buffers in it are disposed of
        all the same (what ``dispose`` raises then is logged), and those not
        yet back are disposed of as they come back.

        Raises:
            ExceptionGroup: ``dispose`` raised for some buffers; the others
                were disposed of all the same.
        """
        self._closed = True
        self._changes.notify()
        errors: list[Exception] = []
        try:
            await self._returns.drain()
        except ExceptionGroup as group:  # disposing of buffers that came back meanwhile
            errors.extend(group.exceptions)
        except BaseException:
            for error in self._dispose_free():
                _logger.error("dispose raised for a staging buffer", exc_info=error)
            raise
        errors.extend(self._dispose_free())
        if errors:
            raise ExceptionGroup("dispose raised for some staging buffers", errors)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        stats = self.statistics()
        return (
            f"<asyncfence.StagingPool {stats.available} of {stats.buffers} available, "
            f"{stats.returning} returning, {stats.lost} lost>"
        )
