"""When a loop's parked streams are re-checked: each stream on its own schedule.

The re-check is the safety net under the completion signals (a device fault
sends none), so it must reach every parked stream within a bound, without
costing what is parked on every turn. Each stream is due ``interval`` after
a fence first parks on it; a re-check that finds nothing settled doubles
that stream's interval, up to :data:`BACKOFF_LIMIT` times; one that finds
something settled, or a new park on the stream, brings it back to
``interval``. A step takes the due streams a bounded slice at a time, so one
step never holds the loop for long, and a stream signalled as it should be
costs one query per backed-off interval, whatever else is parked.

Not thread-safe: its loop's thread only.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Hashable

__all__ = ["BACKOFF_LIMIT", "RecheckSchedule"]

#: While re-checks of a stream find nothing new, its interval doubles up to
#: this many times the configured ``recheck_interval``.
BACKOFF_LIMIT = 8
# The heap is rebuilt once stale entries outnumber live ones by this many.
_COMPACT_SLACK = 64


class RecheckSchedule:
    """Per-stream due times for the re-checks of parked fences."""

    __slots__ = ("_backoff", "_due", "_heap", "_order")

    def __init__(self) -> None:
        # (due, order, key); an entry is live while it matches _due[key].
        self._heap: list[tuple[float, int, Hashable]] = []
        self._due: dict[Hashable, float] = {}
        self._backoff: dict[Hashable, int] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        """How many streams have a re-check scheduled."""
        return len(self._due)

    def parked(self, key: Hashable, now: float, interval: float) -> bool:
        """A fence parked on stream ``key``: it is re-checked within ``interval``.

        Returns:
            Whether that made its re-check sooner (else one was due by then).
        """
        self._backoff[key] = 1
        due = now + interval
        if self._due.get(key, due + 1.0) <= due:
            return False
        self._schedule(key, due)
        return True

    def checked(self, key: Hashable, settled: bool, now: float, interval: float) -> None:
        """Stream ``key`` was re-checked: when next, by whether anything had settled."""
        backoff = 1 if settled else min(2 * self._backoff.get(key, 1), BACKOFF_LIMIT)
        self._backoff[key] = backoff
        self._schedule(key, now + interval * backoff)

    def forget(self, key: Hashable) -> None:
        """Nothing is parked on stream ``key`` any more."""
        self._due.pop(key, None)
        self._backoff.pop(key, None)

    def take_due(self, now: float, limit: int) -> list[Hashable]:
        """Up to ``limit`` streams due by ``now``, earliest first.

        Each must then be :meth:`checked` or :meth:`forget`-ten.
        """
        heap = self._heap
        taken: list[Hashable] = []
        while heap and len(taken) < limit and heap[0][0] <= now:
            due, _, key = heapq.heappop(heap)
            if self._due.get(key) == due:
                del self._due[key]  # until checked() schedules it again
                taken.append(key)
        return taken

    def next_due(self) -> float | None:
        """When the earliest re-check is due; ``None`` with none scheduled."""
        heap = self._heap
        while heap and self._due.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)  # stale
        return heap[0][0] if heap else None

    def _schedule(self, key: Hashable, due: float) -> None:
        self._due[key] = due
        heapq.heappush(self._heap, (due, next(self._order), key))
        if len(self._heap) > 2 * len(self._due) + _COMPACT_SLACK:
            self._heap = [entry for entry in self._heap if self._due.get(entry[2]) == entry[0]]
            heapq.heapify(self._heap)
