"""Fences grouped by stream, swept so that only what can have completed is queried.

A fence marks everything queued before it, so the device passes the fences of
one stream in the order they were recorded (on an out-of-order OpenCL queue
too: a marker waits for every command enqueued before it, earlier markers
included). A sweep therefore queries each stream's oldest member and stops at
the first one pending: one query per stream when nothing completes, however
many fences wait.

A loop's poller keeps two: its polled fences and its parked ones. Not
thread-safe: its owner's thread only.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from ._core import PENDING

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Hashable

    from ._core import FenceCore

__all__ = ["FenceSet"]

# A stream's heap is rebuilt once stale entries outnumber live ones by this
# many, so fences that left the set are never held for long.
_COMPACT_SLACK = 16


class _Stream:
    """A stream's members, once it has had two: a heap by record order, and how many are live.

    Entries of fences no longer in the set are dropped when they reach the
    top, or by compaction. Until its second member, a stream's entry is the
    fence itself: one fence per stream is the common case (a task waiting
    for its own work), and the heap and this object would be a tenth of a
    parked wait's memory.
    """

    __slots__ = ("heap", "members")

    def __init__(self, first: FenceCore) -> None:
        self.heap: list[FenceCore] = [first]  # ordered by FenceCore.__lt__: record order
        self.members = 1


def _query(fence: FenceCore) -> tuple[bool, Exception | None]:
    """Whether ``fence`` has settled, and what its query raised unexpectedly."""
    try:
        return fence.poll() != PENDING, None
    except Exception as unexpected:  # a backend bug must reach the waiters
        return True, unexpected


class FenceSet:
    """A set of fences that knows which of them a sweep need query.

    Attributes:
        members: The fences in the set; read it, never change it (for a
            membership test without the call that ``in`` on the set makes).
    """

    __slots__ = ("_streams", "members")

    def __init__(self) -> None:
        self.members: set[FenceCore] = set()
        self._streams: dict[Hashable, FenceCore | _Stream] = {}

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, fence: object) -> bool:
        return fence in self.members

    @property
    def queue_count(self) -> int:
        """How many streams the members are on."""
        return len(self._streams)

    def has_queue(self, key: Hashable) -> bool:
        """Whether any member is on the stream with ``key``."""
        return key in self._streams

    def add(self, fence: FenceCore) -> bool:
        """Add ``fence``; returns whether it was new."""
        if fence in self.members:
            return False
        self.members.add(fence)
        key = fence.queue.key
        entry = self._streams.get(key)
        if entry is None:
            self._streams[key] = fence
            return True
        if not isinstance(entry, _Stream):  # its second member
            entry = self._streams[key] = _Stream(entry)
        entry.members += 1
        heapq.heappush(entry.heap, fence)
        return True

    def discard(self, fence: FenceCore) -> None:
        """Remove ``fence`` if present."""
        if fence not in self.members:
            return
        self.members.discard(fence)
        key = fence.queue.key
        stream = self._streams[key]
        if not isinstance(stream, _Stream):  # it was the only member
            del self._streams[key]
            return
        stream.members -= 1
        if not stream.members:
            del self._streams[key]  # and with it every stale heap entry
        elif len(stream.heap) > 2 * stream.members + _COMPACT_SLACK:
            stream.heap = [entry for entry in stream.heap if entry in self.members]
            heapq.heapify(stream.heap)

    def clear(self) -> None:
        """Remove every fence."""
        self.members.clear()
        self._streams.clear()

    def _oldest(self, entry: FenceCore | _Stream) -> FenceCore | None:
        if not isinstance(entry, _Stream):
            # Left the set if a sweep just removed it (the stream is gone then).
            return entry if entry in self.members else None
        heap = entry.heap
        while heap and heap[0] not in self.members:  # drop stale entries
            heapq.heappop(heap)
        return heap[0] if heap else None

    def needs_own_signal(self, fence: FenceCore) -> bool:
        """Whether nothing but its own signal would tell when ``fence`` completes.

        Only the oldest member of its stream does: when it completes, a sweep
        finds the others that completed behind it.
        """
        entry = self._streams.get(fence.queue.key)
        if entry is fence:
            return True  # its stream's only member
        if entry is None or not isinstance(entry, _Stream) or fence not in self.members:
            return False
        return self._oldest(entry) is fence

    def oldest(self, key: Hashable) -> FenceCore | None:
        """The oldest member on the stream with ``key``; ``None`` if it has none."""
        entry = self._streams.get(key)
        if entry is None or not isinstance(entry, _Stream):
            return entry  # a stream's only member (a member while its entry is there)
        return self._oldest(entry)

    def heads(self, keys: Collection[Hashable] | None = None) -> list[FenceCore]:
        """The oldest member of each stream (of ``keys``' streams, if given)."""
        return [
            oldest
            for stream in self._selected(keys)
            if (oldest := self._oldest(stream)) is not None
        ]

    def _selected(self, keys: Collection[Hashable] | None) -> list[FenceCore | _Stream]:
        if keys is None:
            return list(self._streams.values())
        return [stream for key in keys if (stream := self._streams.get(key)) is not None]

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
            keys: Only the streams with these keys; every stream by default.

        Returns:
            The number of device queries made.
        """
        queries = 0
        found: list[tuple[FenceCore, Exception | None]] = []
        for stream in self._selected(keys):
            while (fence := self._oldest(stream)) is not None:
                queries += fence.state == PENDING
                done, unexpected = _query(fence)
                if not done:
                    break
                self.discard(fence)
                found.append((fence, unexpected))
        # Reported once the set is consistent: a report may add or remove members.
        for fence, unexpected in found:
            settled(fence, unexpected)
        return queries
