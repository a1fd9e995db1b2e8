"""The re-check schedule of parked streams, on its own (the poller's use: test_poller.py)."""

from __future__ import annotations

from asyncfence._recheck import BACKOFF_LIMIT, RecheckSchedule


def test_a_stream_is_due_an_interval_after_it_parks_and_backs_off_alone() -> None:
    schedule = RecheckSchedule()
    schedule.parked("a", now=0.0, interval=1.0)
    schedule.parked("b", now=0.5, interval=1.0)
    assert schedule.next_due() == 1.0
    assert schedule.take_due(0.9, limit=10) == []
    assert schedule.take_due(1.0, limit=10) == ["a"]
    schedule.checked("a", settled=False, now=1.0, interval=1.0)  # due in 2 intervals now
    assert schedule.take_due(1.5, limit=10) == ["b"]
    schedule.checked("b", settled=True, now=1.5, interval=1.0)  # something settled: 1 again
    assert schedule.next_due() == 2.5
    assert schedule.take_due(3.0, limit=10) == ["b", "a"]


def test_the_back_off_stops_at_its_limit_and_a_new_park_starts_it_over() -> None:
    schedule = RecheckSchedule()
    schedule.parked("a", now=0.0, interval=1.0)
    now, gaps = 1.0, []
    for _ in range(6):
        assert schedule.take_due(now, limit=1) == ["a"]
        schedule.checked("a", settled=False, now=now, interval=1.0)
        due = schedule.next_due()
        assert due is not None
        gaps.append(due - now)
        now = due
    assert gaps == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert BACKOFF_LIMIT == 8
    schedule.parked("a", now=now - 7.0, interval=1.0)  # a new wait: prompt again
    assert schedule.next_due() == now - 6.0


def test_take_due_stops_at_its_limit_in_due_order() -> None:
    schedule = RecheckSchedule()
    for index, key in enumerate("edcba"):
        schedule.parked(key, now=float(index), interval=1.0)
    assert schedule.take_due(10.0, limit=2) == ["e", "d"]
    assert schedule.take_due(10.0, limit=2) == ["c", "b"]
    assert schedule.take_due(10.0, limit=2) == ["a"]
    assert len(schedule) == 0  # each taken stream waits to be checked or forgotten
    assert schedule.next_due() is None


def test_forgotten_streams_are_never_due_and_the_heap_stays_bounded() -> None:
    schedule = RecheckSchedule()
    for round_ in range(50):
        for key in range(100):
            schedule.parked(key, now=float(round_), interval=1.0)
            schedule.checked(key, settled=True, now=float(round_), interval=1.0)
        for key in range(0, 100, 2):
            schedule.forget(key)
        for key in range(0, 100, 2):
            schedule.parked(key, now=float(round_), interval=1.0)
    assert len(schedule) == 100
    assert len(schedule._heap) <= 2 * len(schedule) + 64  # stale entries compacted
    schedule.forget(7)
    assert 7 not in schedule.take_due(1e9, limit=1000)


def test_a_park_due_later_than_the_scheduled_check_keeps_it_and_starts_the_back_off_over() -> None:
    schedule = RecheckSchedule()
    schedule.parked("a", now=0.0, interval=1.0)
    for now in (1.0, 3.0):  # nothing settled twice: next due at 7, four intervals on
        assert schedule.take_due(now, limit=1) == ["a"]
        schedule.checked("a", settled=False, now=now, interval=1.0)
    assert schedule.next_due() == 7.0
    assert schedule.parked("a", now=6.5, interval=1.0) is False  # due at 7 already
    assert schedule.next_due() == 7.0
    assert schedule.take_due(7.0, limit=1) == ["a"]
    schedule.checked("a", settled=False, now=7.0, interval=1.0)
    assert schedule.next_due() == 9.0  # twice the interval again, not eight times
