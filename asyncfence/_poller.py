"""The ``poll`` strategy: one poller per event loop checks every awaited fence.

The poller is written once here; :mod:`asyncfence._loops` drives it on asyncio
and on trio. It runs only on its loop's thread.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ._config import current_config
from ._fence import FAILED, PENDING

if TYPE_CHECKING:
    from collections.abc import Hashable

    from ._fence import Fence

__all__ = ["Poller", "PollerStatistics", "Waiter"]

# First sleep once the spin budget is spent; sleeps double up to the cap.
_FIRST_SLEEP_S = 50e-6


class Waiter(Protocol):
    """One suspended wait, as its event loop resumes it."""

    def wake(self, error: BaseException | None) -> None:
        """Resume the wait, raising ``error`` in it if given. Never raises."""
        ...


@dataclass(frozen=True, slots=True)
class PollerStatistics:
    """A snapshot of one event loop's poller.

    Attributes:
        pending_fences: Fences that at least one task on this loop awaits.
        waiters: Tasks waiting on them.
        queues: Streams or queues those fences are on.
        ticks: Checks made since the poller was created.
        queries: Device queries made since the poller was created.
        running: Whether the poller is scheduled to tick again.
    """

    pending_fences: int = 0
    waiters: int = 0
    queues: int = 0
    ticks: int = 0
    queries: int = 0
    running: bool = False


@dataclass(slots=True)
class _Queue:
    in_order: bool
    # In-order queues: a heap by record order, of fences not yet known done
    # (possibly no longer awaited; those are dropped when they reach the top).
    heap: list[tuple[int, Fence]] = field(default_factory=list)
    in_heap: set[Fence] = field(default_factory=set)
    # Out-of-order queues: every awaited fence, as an ordered set.
    unordered: dict[Fence, None] = field(default_factory=dict)


class Poller:
    """Checks awaited fences, spinning briefly after each new wait, then backing off.

    On an in-order queue only the oldest awaited fence is queried, since fences
    there complete in order; on an out-of-order queue every one is. Subclasses
    schedule :meth:`tick` on their loop.
    """

    def __init__(self) -> None:
        self._waiters: dict[Fence, dict[Waiter, None]] = {}
        self._queues: dict[Hashable, _Queue] = {}
        self._waiter_count = 0
        self._spin_until = 0.0
        self._next_sleep = _FIRST_SLEEP_S
        self._ticks = 0
        self._queries = 0

    # -- for the loop drivers ---------------------------------------------------

    def _ensure_ticking(self) -> None:
        """Schedule a tick now if none is scheduled, or cut a sleep short."""
        raise NotImplementedError

    def _is_running(self) -> bool:
        raise NotImplementedError

    def add(self, fence: Fence, waiter: Waiter) -> None:
        """Register ``waiter`` to be woken once ``fence`` settles."""
        waiters = self._waiters.get(fence)
        if waiters is None:
            waiters = self._waiters[fence] = {}
            info = fence._queue
            queue = self._queues.get(info.key)
            if queue is None:
                queue = self._queues[info.key] = _Queue(info.in_order)
            if not queue.in_order:
                queue.unordered[fence] = None
            elif fence not in queue.in_heap:
                queue.in_heap.add(fence)
                heapq.heappush(queue.heap, (fence._seq, fence))
        waiters[waiter] = None
        self._waiter_count += 1
        # A new wait buys a fresh spin budget: short work is seen at once.
        self._spin_until = time.perf_counter() + current_config().spin_budget
        self._next_sleep = _FIRST_SLEEP_S
        self._ensure_ticking()

    def discard(self, fence: Fence, waiter: Waiter) -> None:
        """Forget ``waiter`` (cancelled or timed out); a no-op if already woken."""
        waiters = self._waiters.get(fence)
        if waiters is None or waiters.pop(waiter, False) is False:
            return
        self._waiter_count -= 1
        if not waiters:
            del self._waiters[fence]
            queue = self._queues.get(fence._queue.key)
            if queue is not None and not queue.in_order:
                queue.unordered.pop(fence, None)
            # In-order heap entries are dropped lazily when they reach the top.

    def tick(self) -> float | None:
        """Check the fences once and wake the waiters of those settled.

        Returns:
            Seconds until the next tick (0 to yield and check again at once),
            or ``None`` when nothing is awaited and the poller should stop.
        """
        self._ticks += 1
        for key, queue in list(self._queues.items()):
            if queue.in_order:
                self._check_in_order(queue)
            else:
                for fence in list(queue.unordered):
                    if self._check(fence):
                        del queue.unordered[fence]
            if not queue.heap and not queue.unordered:
                del self._queues[key]
        if not self._waiter_count:
            self._queues.clear()
            return None
        if time.perf_counter() < self._spin_until:
            return 0.0
        delay = self._next_sleep
        self._next_sleep = min(delay * 2, current_config().poll_cap)
        return min(delay, current_config().poll_cap)

    def _check_in_order(self, queue: _Queue) -> None:
        heap = queue.heap
        while heap:
            fence = heap[0][1]
            if fence in self._waiters and not self._check(fence):
                return  # the oldest awaited fence is pending: so are the rest
            heapq.heappop(heap)
            queue.in_heap.discard(fence)

    def _check(self, fence: Fence) -> bool:
        """Query ``fence``; if settled, wake its waiters. Returns whether settled."""
        if fence._state == PENDING:
            self._queries += 1
        try:
            if fence._poll() == PENDING:
                return False
        except Exception as unexpected:  # a backend bug must reach the waiters, not the loop
            self._wake_all(fence, unexpected)
        else:
            self._wake_all(fence, None)
        return True

    def _wake_all(self, fence: Fence, unexpected: Exception | None) -> None:
        waiters = self._waiters.pop(fence, None)
        if not waiters:
            return
        self._waiter_count -= len(waiters)
        failed = fence._state == FAILED
        for waiter in waiters:
            waiter.wake(unexpected or (fence._error() if failed else None))

    def statistics(self) -> PollerStatistics:
        """Return a snapshot of this poller's state and counters."""
        return PollerStatistics(
            pending_fences=len(self._waiters),
            waiters=self._waiter_count,
            queues=len(self._queues),
            ticks=self._ticks,
            queries=self._queries,
            running=self._is_running(),
        )
