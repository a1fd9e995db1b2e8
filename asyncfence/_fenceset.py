"""Fences grouped by stream, swept so that only what can have completed is queried.

Shared by the loop's poller and the watcher thread. Not thread-safe: each
owner guards its own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._fence import PENDING

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterator

    from ._fence import Fence

__all__ = ["FenceSet"]


@dataclass(slots=True)
class _Queue:
    in_order: bool
    # In-order queues: a heap by record order. Entries of fences no longer in
    # the set are dropped lazily, when they reach the top.
    heap: list[tuple[int, Fence]] = field(default_factory=list)
    # Out-of-order queues: every member, as an ordered set.
    unordered: dict[Fence, None] = field(default_factory=dict)


class FenceSet:
    """A set of fences that knows which of them a sweep need query.

    On an in-order queue fences complete in record order, so a sweep queries
    the oldest member and stops at the first one pending: one query per queue
    when nothing completes, however many fences wait. On an out-of-order queue
    it queries every member.
    """

    def __init__(self) -> None:
        self._members: set[Fence] = set()
        self._members_per_queue: dict[Hashable, int] = {}
        self._in_heap: set[Fence] = set()
        self._queues: dict[Hashable, _Queue] = {}

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, fence: object) -> bool:
        return fence in self._members

    def __iter__(self) -> Iterator[Fence]:
        return iter(list(self._members))

    @property
    def queue_count(self) -> int:
        """How many streams the members are on."""
        return len(self._members_per_queue)

    def on_queue_of(self, fence: Fence) -> int:
        """How many members share ``fence``'s queue (``fence`` included, if a member)."""
        return self._members_per_queue.get(fence._queue.key, 0)

    def add(self, fence: Fence) -> bool:
        """Add ``fence``; returns whether it was new."""
        if fence in self._members:
            return False
        self._members.add(fence)
        info = fence._queue
        self._members_per_queue[info.key] = self._members_per_queue.get(info.key, 0) + 1
        queue = self._queues.get(info.key)
        if queue is None:
            queue = self._queues[info.key] = _Queue(info.in_order)
        if not queue.in_order:
            queue.unordered[fence] = None
        elif fence not in self._in_heap:
            self._in_heap.add(fence)
            heapq.heappush(queue.heap, (fence._seq, fence))
        return True

    def discard(self, fence: Fence) -> None:
        """Remove ``fence`` if present."""
        if fence not in self._members:
            return
        self._remove_member(fence)
        if not self._members:
            self.clear()  # drop stale heap entries: they keep fences alive
            return
        queue = self._queues.get(fence._queue.key)
        if queue is not None and not queue.in_order:
            queue.unordered.pop(fence, None)
            if not queue.unordered:
                del self._queues[fence._queue.key]

    def _remove_member(self, fence: Fence) -> None:
        self._members.discard(fence)
        key = fence._queue.key
        remaining = self._members_per_queue[key] - 1
        if remaining:
            self._members_per_queue[key] = remaining
        else:
            del self._members_per_queue[key]

    def clear(self) -> None:
        """Remove every fence."""
        self._members.clear()
        self._members_per_queue.clear()
        self._in_heap.clear()
        self._queues.clear()

    def head(self, fence: Fence) -> Fence | None:
        """The oldest member on ``fence``'s in-order queue; ``None`` out of order."""
        queue = self._queues.get(fence._queue.key)
        if queue is None or not queue.in_order:
            return None
        return self._oldest(queue)

    def _oldest(self, queue: _Queue) -> Fence | None:
        heap = queue.heap
        while heap and heap[0][1] not in self._members:  # drop stale entries
            self._in_heap.discard(heapq.heappop(heap)[1])
        return heap[0][1] if heap else None

    def needs_own_signal(self, fence: Fence) -> bool:
        """Whether nothing but its own signal would tell when ``fence`` completes.

        On an in-order queue only the oldest member does: when it completes, a
        sweep finds the others behind it. Out of order, every member does.
        """
        if fence not in self._members:
            return False
        head = self.head(fence)
        return head is None or head is fence

    def heads(self) -> list[Fence]:
        """The members that need their own signal (see :meth:`needs_own_signal`)."""
        found: list[Fence] = []
        for queue in self._queues.values():
            if not queue.in_order:
                found.extend(queue.unordered)
            elif (oldest := self._oldest(queue)) is not None:
                found.append(oldest)
        return found

    def sweep(self, settled: Callable[[Fence, Exception | None], None]) -> int:
        """Query what can have completed; remove and report each settled fence.

        ``settled(fence, None)`` is called for a fence done or failed, and
        ``settled(fence, error)`` if querying it raised something unexpected.

        Returns:
            The number of device queries made.
        """
        queries = 0
        for key, queue in list(self._queues.items()):
            if queue.in_order:
                heap = queue.heap
                while heap:
                    fence = heap[0][1]
                    if fence in self._members:
                        queries += fence._state == PENDING
                        outcome = self._query(fence)
                        if outcome is PENDING:
                            break
                    heapq.heappop(heap)
                    self._in_heap.discard(fence)
                    if fence in self._members:
                        self._remove_member(fence)
                        settled(fence, outcome)  # type: ignore[arg-type]
                empty = not heap
            else:
                for fence in list(queue.unordered):
                    queries += fence._state == PENDING
                    outcome = self._query(fence)
                    if outcome is not PENDING:
                        del queue.unordered[fence]
                        self._remove_member(fence)
                        settled(fence, outcome)  # type: ignore[arg-type]
                empty = not queue.unordered
            if empty:
                del self._queues[key]
        return queries

    @staticmethod
    def _query(fence: Fence) -> Exception | int | None:
        """``PENDING``, ``None`` (settled), or an unexpected error from the backend."""
        try:
            return PENDING if fence._poll() == PENDING else None
        except Exception as unexpected:  # a backend bug must reach the waiters
            return unexpected
