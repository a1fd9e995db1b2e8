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
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from collections.abc import Hashable

__all__ = ["BACKOFF_LIMIT", "RecheckSchedule"]

#: While re-checks of a stream find nothing new, its interval doubles up to
#: this many times the configured ``recheck_interval``.
BACKOFF_LIMIT = 8
# The heap is rebuilt once stale entries outnumber live ones by this many.
_COMPACT_SLACK = 64

_Entry: TypeAlias = "tuple[float, int, Hashable, int]"


class RecheckSchedule:
    """Per-stream due times for the re-checks of parked fences."""

    __slots__ = ("_entries", "_heap", "_order", "_taken")

    def __init__(self) -> None:
        # Entries are (due, order, key, backoff), the order breaking ties (keys
        # need not compare); a stream's backoff rides in its entry, not in a
        # map of its own. An entry is live while it is _entries[key].
        self._heap: list[_Entry] = []
        self._entries: dict[Hashable, _Entry] = {}
        # The backoffs of the streams take_due() handed out, until each is
        # checked() or forgotten.
        self._taken: dict[Hashable, int] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        """How many streams have a re-check scheduled."""
        return len(self._entries)

    def parked(self, key: Hashable, now: float, interval: float) -> bool:
        """A fence parked on stream ``key``: it is re-checked within ``interval``.

        Returns:
            Whether that made its re-check sooner (else one was due by then).
        """
        due = now + interval
        entry = self._entries.get(key)
        if entry is None or due < entry[0]:
            self._taken.pop(key, None)
            self._schedule(key, due, 1)
            return True
        if entry[3] != 1:  # due by then already, but its backoff starts over
            self._schedule(key, entry[0], 1)
        return False

    def checked(self, key: Hashable, settled: bool, now: float, interval: float) -> None:
        """Stream ``key`` was re-checked: when next, by whether anything had settled."""
        backoff = self._taken.pop(key, 1)
        backoff = 1 if settled else min(2 * backoff, BACKOFF_LIMIT)
        self._schedule(key, now + interval * backoff, backoff)

    def forget(self, key: Hashable) -> None:
        """Nothing is parked on stream ``key`` any more."""
        self._entries.pop(key, None)
        self._taken.pop(key, None)

    def take_due(self, now: float, limit: int) -> list[Hashable]:
        """Up to ``limit`` streams due by ``now``, earliest first.

        Each must then be :meth:`checked` or :meth:`forget`-ten.
        """
        heap = self._heap
        entries = self._entries
        taken: list[Hashable] = []
        while heap and len(taken) < limit and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            key = entry[2]
            if entries.get(key) is entry:
                del entries[key]  # until checked() schedules it again
                self._taken[key] = entry[3]
                taken.append(key)
        return taken

    def next_due(self) -> float | None:
        """When the earliest re-check is due; ``None`` with none scheduled."""
        heap = self._heap
        while heap and self._entries.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)  # stale
        return heap[0][0] if heap else None

    def _schedule(self, key: Hashable, due: float, backoff: int) -> None:
        entry = self._entries[key] = (due, next(self._order), key, backoff)
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entries) + _COMPACT_SLACK:
            entries = self._entries
            self._heap = [entry for entry in self._heap if entries.get(entry[2]) is entry]
            heapq.heapify(self._heap)
