"""Fences grouped by stream, swept so that only what can have completed is queried.

A loop's poller keeps two: its polled fences and its parked ones. Not
thread-safe: its owner's thread only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._core import PENDING

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Hashable

    from ._core import FenceCore

__all__ = ["FenceSet"]

# An in-order queue's heap is rebuilt once stale entries outnumber live ones
# by this many, so fences that left the set are never held for long.
_COMPACT_SLACK = 16


@dataclass(slots=True)
class _Queue:
    in_order: bool
    # In-order queues: a heap by record order. Entries of fences no longer in
    # the set are dropped when they reach the top, or by compaction.
    heap: list[tuple[int, FenceCore]] = field(default_factory=list)
    # Out-of-order queues: every member, as an ordered set.
    unordered: dict[FenceCore, None] = field(default_factory=dict)
    members: int = 0


def _query(fence: FenceCore) -> tuple[bool, Exception | None]:
    """Whether ``fence`` has settled, and what its query raised unexpectedly."""
    try:
        return fence.poll() != PENDING, None
    except Exception as unexpected:  # a backend bug must reach the waiters
        return True, unexpected


class FenceSet:
    """A set of fences that knows which of them a sweep need query.

    On an in-order queue fences complete in record order, so a sweep queries
    the oldest member and stops at the first one pending: one query per queue
    when nothing completes, however many fences wait. On an out-of-order queue
    it queries every member.
    """

    def __init__(self) -> None:
        self._members: set[FenceCore] = set()
        self._queues: dict[Hashable, _Queue] = {}

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, fence: object) -> bool:
        return fence in self._members

    @property
    def queue_count(self) -> int:
        """How many streams the members are on."""
        return len(self._queues)

    def has_queue(self, key: Hashable) -> bool:
        """Whether any member is on the queue with ``key``."""
        return key in self._queues

    def add(self, fence: FenceCore) -> bool:
        """Add ``fence``; returns whether it was new."""
        if fence in self._members:
            return False
        self._members.add(fence)
        info = fence.queue
        queue = self._queues.get(info.key)
        if queue is None:
            queue = self._queues[info.key] = _Queue(info.in_order)
        queue.members += 1
        if queue.in_order:
            heapq.heappush(queue.heap, (fence.seq, fence))
        else:
            queue.unordered[fence] = None
        return True

    def discard(self, fence: FenceCore) -> None:
        """Remove ``fence`` if present."""
        if fence not in self._members:
            return
        self._members.discard(fence)
        key = fence.queue.key
        queue = self._queues[key]
        queue.members -= 1
        if not queue.members:
            del self._queues[key]  # and with it every stale heap entry
        elif not queue.in_order:
            del queue.unordered[fence]
        elif len(queue.heap) > 2 * queue.members + _COMPACT_SLACK:
            queue.heap = [entry for entry in queue.heap if entry[1] in self._members]
            heapq.heapify(queue.heap)

    def clear(self) -> None:
        """Remove every fence."""
        self._members.clear()
        self._queues.clear()

    def head(self, fence: FenceCore) -> FenceCore | None:
        """The oldest member on ``fence``'s in-order queue; ``None`` out of order."""
        queue = self._queues.get(fence.queue.key)
        if queue is None or not queue.in_order:
            return None
        return self._oldest(queue)

    def _oldest(self, queue: _Queue) -> FenceCore | None:
        heap = queue.heap
        while heap and heap[0][1] not in self._members:  # drop stale entries
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def needs_own_signal(self, fence: FenceCore) -> bool:
        """Whether nothing but its own signal would tell when ``fence`` completes.

        On an in-order queue only the oldest member does: when it completes, a
        sweep finds the others behind it. Out of order, every member does.
        """
        if fence not in self._members:
            return False
        head = self.head(fence)
        return head is None or head is fence

    def heads(self, keys: Collection[Hashable] | None = None) -> list[FenceCore]:
        """The members that need their own signal (see :meth:`needs_own_signal`).

        Args:
            keys: Only on these queues; every queue by default.
        """
        found: list[FenceCore] = []
        for queue in self._selected(keys):
            if not queue.in_order:
                found.extend(queue.unordered)
            elif (oldest := self._oldest(queue)) is not None:
                found.append(oldest)
        return found

    def _selected(self, keys: Collection[Hashable] | None) -> list[_Queue]:
        if keys is None:
            return list(self._queues.values())
        return [queue for key in keys if (queue := self._queues.get(key)) is not None]

    def sweep(
        self,
        settled: Callable[[FenceCore, Exception | None], None],
        keys: Collection[Hashable] | None = None,
    ) -> int:
        """Query what can have completed; remove and report each settled fence.

        ``settled(fence, None)`` is called for a fence done or failed, and
        ``settled(fence, error)`` if querying it raised something unexpected.
        Each is removed before it is reported.

        Args:
            settled: Told of each settled fence.
            keys: Only the queues with these keys; every queue by default.

        Returns:
            The number of device queries made.
        """
        queries = 0
        found: list[tuple[FenceCore, Exception | None]] = []
        for queue in self._selected(keys):
            if queue.in_order:
                while (fence := self._oldest(queue)) is not None:
                    queries += fence.state == PENDING
                    done, unexpected = _query(fence)
                    if not done:
                        break
                    self.discard(fence)
                    found.append((fence, unexpected))
            else:
                for fence in list(queue.unordered):
                    queries += fence.state == PENDING
                    done, unexpected = _query(fence)
                    if done:
                        self.discard(fence)
                        found.append((fence, unexpected))
        # Reported once the set is consistent: a report may add or remove members.
        for fence, unexpected in found:
            settled(fence, unexpected)
        return queries
