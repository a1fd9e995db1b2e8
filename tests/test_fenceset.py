"""The fence set's own bookkeeping: streams of one member and of many.

Its members here are minimal stand-ins with what the set reads of a fence (a
stream key, record order, a query), so each test decides exactly which have
completed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pytest

from asyncfence._core import DONE, PENDING
from asyncfence._fenceset import FenceSet

if TYPE_CHECKING:
    from asyncfence._core import FenceCore

_order = itertools.count()


@dataclass(frozen=True)
class _Queue:
    key: str


@dataclass(eq=False)
class _Fence:
    queue: _Queue
    state: int = PENDING
    order: int = field(default_factory=lambda: next(_order))

    def __lt__(self, other: _Fence) -> bool:
        return self.order < other.order

    def poll(self) -> int:
        return self.state


def _fences(key: str, count: int) -> list[FenceCore]:
    queue = _Queue(key)
    return [cast("FenceCore", _Fence(queue)) for _ in range(count)]


def _complete(*fences: FenceCore) -> None:
    for fence in fences:
        cast("Any", fence).state = DONE


def _sweep(fences: FenceSet, keys: list[str] | None = None) -> list[FenceCore]:
    settled: list[FenceCore] = []
    fences.sweep(lambda fence, unexpected: settled.append(fence), keys)
    return settled


def test_a_streams_only_member_is_its_oldest_and_leaves_no_stream_behind() -> None:
    fences = FenceSet()
    (only,) = _fences("a", 1)
    assert fences.add(only)
    assert not fences.add(only)
    assert (len(fences), fences.queue_count, fences.oldest("a")) == (1, 1, only)
    assert fences.needs_own_signal(only)
    fences.discard(only)
    assert (len(fences), fences.queue_count, fences.oldest("a")) == (0, 0, None)
    assert not fences.has_queue("a")


@pytest.mark.parametrize("added_in_order", [True, False])
def test_a_second_member_keeps_record_order(added_in_order: bool) -> None:
    fences = FenceSet()
    older, newer = _fences("a", 2)
    for fence in (older, newer) if added_in_order else (newer, older):
        fences.add(fence)
    assert fences.oldest("a") is older
    assert fences.heads() == [older]
    assert not fences.needs_own_signal(newer)
    fences.discard(older)
    assert fences.oldest("a") is newer
    fences.discard(newer)
    assert fences.queue_count == 0


@pytest.mark.parametrize("members", [1, 2, 5])
def test_a_sweep_stops_at_the_first_pending_member(members: int) -> None:
    fences = FenceSet()
    stream = _fences("a", members)
    other = _fences("b", 1)
    for fence in [*stream, *other]:
        fences.add(fence)
    assert _sweep(fences) == []
    _complete(*stream[: members - 1])  # all but the newest
    assert _sweep(fences) == stream[: members - 1]
    assert fences.oldest("a") is stream[-1]
    _complete(stream[-1], *other)
    assert _sweep(fences, ["a"]) == [stream[-1]]
    assert (fences.queue_count, fences.oldest("b")) == (1, other[0])
    assert _sweep(fences) == other
    assert (len(fences), fences.queue_count) == (0, 0)


def test_a_stream_emptied_and_refilled_starts_over() -> None:
    fences = FenceSet()
    first, second, third = _fences("a", 3)
    fences.add(first)
    fences.add(second)
    fences.discard(first)
    fences.discard(second)
    fences.add(third)
    assert (fences.oldest("a"), fences.heads(["a", "missing"])) == (third, [third])
