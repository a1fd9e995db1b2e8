"""The async drop queue: keep buffers alive until the work that reads them is done."""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import anyio

from ._config import check_timeout, current_config
from ._core import FAILED, PENDING
from ._exceptions import ClosedResourceError, FenceError
from ._fence import cores_of
from ._poller import current_poller
from ._sync import Changes
from ._validation import check_callable, check_int

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self

    from ._core import FenceCore
    from ._fence import Fence
    from ._poller import Poller

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["DropQueue", "DropQueueStatistics", "FaultHandler"]

_logger = logging.getLogger("asyncfence.drop_queue")

#: Called with an object whose fences failed, and the failure, on the queue's loop.
FaultHandler = Callable[[Any, BaseException], None]


@dataclass(frozen=True, slots=True)
class DropQueueStatistics:
    """A snapshot of a :class:`DropQueue`.

    Attributes:
        pending_items: Objects deferred and not yet released.
        pending_bytes: Their ``nbytes``, summed.
        released: Objects released since the queue was made (their ``free``
            called, or the reference dropped).
        failed_frees: Of those, how many had a ``free`` that raised.
        faulted: Objects handed to ``on_fault`` (their fences failed, or the
            queue closed with ``cancel_pending=True``).
        oldest_pending_age: Seconds since the oldest pending object was
            deferred; 0 with nothing pending.
    """

    pending_items: int
    pending_bytes: int
    released: int
    failed_frees: int
    faulted: int
    oldest_pending_age: float


class _Item:
    """One deferred object, waiting for its fences."""

    __slots__ = (
        "deferred_at",
        "failure",
        "fences",
        "free",
        "nbytes",
        "obj",
        "remaining",
        "seq",
        "waiters",
    )

    def __init__(
        self,
        seq: int,
        obj: object,
        fences: list[FenceCore],
        free: Callable[[Any], object] | None,
        nbytes: int,
    ) -> None:
        self.seq = seq
        self.obj: object = obj
        self.fences = fences
        self.free = free
        self.nbytes = nbytes
        self.remaining = len(fences)
        self.failure: BaseException | None = None
        self.deferred_at = time.monotonic()
        # Registered with the poller, one per pending fence.
        self.waiters: list[tuple[FenceCore, _ItemWaiter]] = []


class _ItemWaiter:
    """Waits on one of an item's fences, in the loop's poller."""

    __slots__ = ("item", "queue")

    def __init__(self, queue: DropQueue, item: _Item) -> None:
        self.queue = queue
        self.item = item

    def wake(self, error: BaseException | None) -> None:
        self.queue._fence_settled(self.item, error)


def _limit(name: str, value: object) -> int | None:
    return None if value is None else check_int(name, value, minimum=1)


@final
class DropQueue:
    """Keeps objects alive until the fences of the work that reads them complete.

    ``defer(fence, buffer, free=release)`` hands the queue a buffer that device
    work still reads; the queue calls ``release(buffer)`` on its event loop as
    soon as the fence completes, never before, through the same waiting
    machinery as ``await fence``. A pending fence on one stream never holds
    back a release on another.

    The queue belongs to the event loop it is first used on (asyncio, uvloop
    or trio): made inside a running loop, to that loop; otherwise to the loop
    of the first ``await`` on it. Objects deferred before then wait for it.

    Failures:

    * A ``free`` that raises (anything: an ``Exception`` or not) is logged and
      counted; the other frees go on. :meth:`drain` and :meth:`aclose` raise
      the errors so far together as an ``ExceptionGroup``, except a
      ``KeyboardInterrupt`` or ``SystemExit``, which they raise as itself.
    * An object whose fences failed (a device fault) is not freed as if its
      work were done: it goes to ``on_fault(obj, error)``. The default handler
      logs a warning and keeps the object, for :attr:`faulted_objects`: memory a
      faulted device may still touch is never handed back for reuse.

    Cancellation: cancelling :meth:`wait_for_room`, :meth:`drain` or
    :meth:`aclose` cancels no device work and releases nothing early; deferred
    objects stay in the queue.

    Thread-safety: :meth:`defer` and :meth:`statistics` may be called from any
    thread. The rest belongs to the queue's loop.

    Args:
        max_bytes: The byte budget :meth:`wait_for_room` keeps producers within.
        max_items: The item budget :meth:`wait_for_room` keeps producers within.
        on_fault: Called on the queue's loop with each object whose fences
            failed, and the error; by default, log and keep it.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        max_items: int | None = None,
        on_fault: FaultHandler | None = None,
    ) -> None:
        check_callable("on_fault", on_fault, optional=True)
        self._max_bytes = _limit("max_bytes", max_bytes)
        self._max_items = _limit("max_items", max_items)
        self._on_fault = on_fault or self._keep_faulted
        self._lock = threading.Lock()
        self._sequence = itertools.count()
        # Every object not yet released, in the order deferred (oldest first).
        self._unfinished: dict[int, _Item] = {}
        self._inbox: list[_Item] = []
        self._inbox_scheduled = False
        self._pending_bytes = 0
        self._released = 0
        self._failed_frees = 0
        self._faulted_count = 0
        self._free_errors: list[BaseException] = []
        self._faulted: list[tuple[object, BaseException]] = []
        self._changes = Changes()
        self._closed = False
        self._poller: Poller | None = None
        with contextlib.suppress(RuntimeError):  # no running loop: bound on first use
            self._poller = current_poller()

    # -- any thread -------------------------------------------------------------

    def defer(
        self,
        fence_or_fences: Fence | Iterable[Fence],
        obj: object,
        *,
        free: Callable[[Any], object] | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Keep ``obj`` alive until every fence given has completed, then release it.

        Released means ``free(obj)`` is called on the queue's loop, or, without
        ``free``, the queue drops its reference. Never blocks and never refuses
        for lack of room: producers that want a budget await
        :meth:`wait_for_room` first.

        Thread-safety: safe to call from any thread, and from ``free`` itself.

        Args:
            fence_or_fences: A fence, or an iterable of fences (all must
                complete; none means release at once).
            obj: The object to keep alive.
            free: Called with ``obj`` once its fences completed.
            nbytes: Its size for the byte budget; by default ``obj.nbytes``
                where it has one, else 0.

        Raises:
            TypeError: A fence is not a Fence, ``free`` is not callable, or
                ``nbytes`` is not an int.
            ValueError: ``nbytes`` is negative.
            ClosedResourceError: The queue is closed.
        """
        fences = cores_of(fence_or_fences)
        check_callable("free", free, optional=True)
        if nbytes is None:
            size = getattr(obj, "nbytes", 0)
            nbytes = size if isinstance(size, int) and size >= 0 else 0
        else:
            check_int("nbytes", nbytes, minimum=0)
        if self._poller is None:
            with contextlib.suppress(RuntimeError):  # from a loop: that loop owns the queue
                self._bind()
        with self._lock:
            self._check_open()
            item = _Item(next(self._sequence), obj, fences, free, nbytes)
            self._unfinished[item.seq] = item
            self._pending_bytes += nbytes
            self._inbox.append(item)
            schedule = self._poller is not None and not self._inbox_scheduled
            if schedule:
                self._inbox_scheduled = True
            poller = self._poller
        if schedule:
            assert poller is not None
            try:
                poller.driver.call_soon_threadsafe(self._take_inbox)
            except RuntimeError:  # the loop is gone: the items stay pending, visibly
                _logger.error("the DropQueue's event loop is closed; %r stays pending", obj)

    def statistics(self) -> DropQueueStatistics:
        """Return a snapshot of the queue. Thread-safe."""
        with self._lock:
            oldest = next(iter(self._unfinished.values()), None)
            return DropQueueStatistics(
                pending_items=len(self._unfinished),
                pending_bytes=self._pending_bytes,
                released=self._released,
                failed_frees=self._failed_frees,
                faulted=self._faulted_count,
                oldest_pending_age=0.0 if oldest is None else time.monotonic() - oldest.deferred_at,
            )

    @property
    def faulted_objects(self) -> list[tuple[object, BaseException]]:
        """Objects the default ``on_fault`` kept, with the errors: a copy."""
        with self._lock:
            return list(self._faulted)

    # -- the queue's loop ---------------------------------------------------------

    def bind(self) -> None:
        """Make the running loop this queue's now, if it has none yet. Never blocks.

        A queue made outside a loop belongs to the first loop that uses it,
        and objects deferred from other threads before then wait for that.
        Call this from the loop (at its startup, say) to have them released
        as soon as their fences complete.

        Raises:
            RuntimeError: No asyncio or trio loop runs the calling task, or
                the queue belongs to another event loop.

        Thread-safety: the loop's thread.
        """
        self._bind()

    def _bind(self) -> Poller:
        poller = current_poller()
        with self._lock:
            if self._poller is None:
                self._poller = poller
                schedule = bool(self._inbox) and not self._inbox_scheduled
                self._inbox_scheduled |= schedule
            elif self._poller is not poller:
                raise RuntimeError("this DropQueue belongs to another event loop")
            else:
                schedule = False
        if schedule:
            poller.driver.call_soon(self._take_inbox)
        return poller

    def _take_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, []
            self._inbox_scheduled = False
            poller = self._poller
        assert poller is not None
        strategy = current_config().strategy
        for item in items:
            if not item.fences:
                self._finish(item)
                continue
            for fence in item.fences:
                try:
                    state = fence.poll()
                except Exception as unexpected:
                    self._fence_settled(item, unexpected)
                    continue
                if state == PENDING:
                    waiter = _ItemWaiter(self, item)
                    item.waiters.append((fence, waiter))
                    poller.add(fence, waiter, strategy)
                else:
                    self._fence_settled(item, fence.failure() if state == FAILED else None)

    def _fence_settled(self, item: _Item, error: BaseException | None) -> None:
        if error is not None and item.failure is None:
            item.failure = error
        item.remaining -= 1
        if item.remaining == 0:
            self._finish(item)

    def _finish(self, item: _Item) -> None:
        """Release ``item``, or hand it to ``on_fault``. Never raises.

        What ``free`` or ``on_fault`` raise stays with the queue: a
        ``KeyboardInterrupt`` or ``SystemExit`` is raised again by the next
        :meth:`drain` or :meth:`aclose`, as itself.
        """
        obj, free, failure = item.obj, item.free, item.failure
        item.obj = item.free = None
        item.fences = []
        item.waiters = []
        if failure is None:
            free_error: BaseException | None = None
            if free is not None:
                try:
                    free(obj)
                except BaseException as error:  # isolated, whatever it is
                    free_error = error
                    _logger.error("free(%r) failed; the queue goes on", obj, exc_info=error)
            self._retire(item, released=True, free_error=free_error)
        else:
            self._retire(item, released=False, free_error=None)
            self._hand_to_on_fault(obj, failure)
        del obj

    def _hand_to_on_fault(self, obj: object, error: BaseException) -> None:
        try:
            self._on_fault(obj, error)
        except BaseException as handler_error:  # isolated, whatever it is
            _logger.error("on_fault(%r) failed; the object is kept", obj, exc_info=handler_error)
            with self._lock:
                self._faulted.append((obj, error))
                if isinstance(handler_error, (KeyboardInterrupt, SystemExit)):
                    self._free_errors.append(handler_error)

    def _keep_faulted(self, obj: object, error: BaseException) -> None:
        _logger.warning("keeping %r: the work that reads it failed (%s)", obj, error)
        with self._lock:
            self._faulted.append((obj, error))

    def _retire(self, item: _Item, *, released: bool, free_error: BaseException | None) -> None:
        with self._lock:
            del self._unfinished[item.seq]
            self._pending_bytes -= item.nbytes
            if released:
                self._released += 1
            else:
                self._faulted_count += 1
            if free_error is not None:
                self._failed_frees += 1
                self._free_errors.append(free_error)
        self._changes.notify()

    def _raise_free_errors(self) -> None:
        """Raise what ``free`` raised since the last call (see :meth:`drain`)."""
        with self._lock:
            errors, self._free_errors = self._free_errors, []
        for error in errors:
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                with self._lock:  # the others are not lost: the next drain raises them
                    self._free_errors[:0] = [e for e in errors if e is not error]
                raise error
        if errors:
            raise BaseExceptionGroup("free() raised for objects the DropQueue released", errors)

    async def wait_for_room(self, nbytes: int = 0) -> None:
        """Wait until one more object of ``nbytes`` fits the queue's budget.

        Fits means fewer than ``max_items`` objects pending, and ``nbytes``
        more within ``max_bytes``; an object larger than ``max_bytes`` alone
        fits once nothing else is pending. Without budgets it returns at once
        (after a checkpoint).

        Cancellation: a cancelled wait leaves the queue as it was.

        Raises:
            TypeError: ``nbytes`` is not an int.
            ValueError: ``nbytes`` is negative.
            ClosedResourceError: The queue is closed (or closes while this waits).
            RuntimeError: The queue belongs to another event loop.
        """
        check_int("nbytes", nbytes, minimum=0)
        self._bind()

        def fits() -> bool:
            if self._closed:
                return True  # to raise at once
            pending = len(self._unfinished)
            if self._max_items is not None and pending >= self._max_items:
                return False
            if self._max_bytes is None or self._pending_bytes + nbytes <= self._max_bytes:
                return True
            return pending == 0

        await self._changes.wait_until(fits)
        self._check_open()

    async def drain(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (the API)
        """Wait until everything deferred before this call has been released.

        Objects handed to ``on_fault`` count as done. Objects deferred after
        the call began are not waited for.

        Cancellation: nothing is released early; the objects stay queued.

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.

        Raises:
            TimeoutError: The timeout expired first; the queue is unchanged.
            ExceptionGroup: ``free`` raised for some objects released since
                the last drain; the queue went on regardless. (A
                ``BaseExceptionGroup`` if one of them is not an ``Exception``.)
            KeyboardInterrupt: ``free`` or ``on_fault`` raised it (the same
                for ``SystemExit``); raised as itself, the other errors kept
                for the next drain.
            RuntimeError: The queue belongs to another event loop.
        """
        seconds = check_timeout(timeout)
        self._bind()
        with self._lock:
            target = next(self._sequence)  # every earlier object must be done

        def done() -> bool:
            with self._lock:  # defer() may insert from another thread
                oldest = next(iter(self._unfinished), None)
            return oldest is None or oldest > target

        if done():  # even with timeout=0, as Fence.wait on a done fence
            await anyio.lowlevel.checkpoint()
        else:
            with anyio.fail_after(None if seconds == float("inf") else seconds):
                await self._changes.wait_until(done)
        self._raise_free_errors()

    async def aclose(self, *, cancel_pending: bool = False) -> None:
        """Close the queue: drain it, or hand what is pending to ``on_fault``.

        Nothing is ever dropped silently. From the start of the call the queue
        is closed: :meth:`defer`, :meth:`wait_for_room` (waits under way
        included) and ``async with`` raise
        :class:`~asyncfence.ClosedResourceError` (anyio's), as adding work to
        a closed trio or anyio channel does. :meth:`drain`, :meth:`statistics`
        and closing again still work: closing twice is fine.

        Args:
            cancel_pending: Instead of waiting, hand each pending object to
                ``on_fault`` with a :class:`~asyncfence.FenceError` saying so.
                Its fences are no longer watched.

        The queue is closed however this returns, a raise included.

        Raises:
            ExceptionGroup: ``free`` raised for some released objects (see
                :meth:`drain`, which also says when ``KeyboardInterrupt`` and
                ``SystemExit`` are raised).
        """
        poller = self._bind()
        with self._lock:
            self._closed = True
        self._changes.notify()  # waits for room fail now
        if cancel_pending:
            await anyio.lowlevel.checkpoint()
            with self._lock:
                self._inbox.clear()
                pending = list(self._unfinished.values())
            for item in pending:
                for fence, waiter in item.waiters:
                    poller.discard(fence, waiter)
                item.failure = FenceError(
                    "the DropQueue closed with cancel_pending=True before this "
                    "object's fences completed"
                )
                self._finish(item)
        else:
            await self.drain()
        self._raise_free_errors()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedResourceError("this DropQueue is closed")

    async def __aenter__(self) -> Self:
        """Bind the queue to this loop; ``aclose()`` on the way out.

        Raises:
            ClosedResourceError: The queue is closed.
            RuntimeError: The queue belongs to another loop.
        """
        self._bind()
        await anyio.lowlevel.checkpoint()
        self._check_open()
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
            f"<asyncfence.DropQueue {stats.pending_items} pending, "
            f"{stats.pending_bytes} bytes, {stats.released} released>"
        )
