"""One poller per event loop: every wait on that loop goes through it.

Written once here; :mod:`asyncfence._loops` drives it on asyncio and on trio.
It runs only on its loop's thread, except :class:`~asyncfence._watcher.Mailbox`,
through which other threads hand it settled fences.

Per strategy:

* ``poll``: the fence is checked on every tick: at once while the spin budget
  lasts, then after sleeps that double up to the poll cap.
* ``auto``: checked on every tick while the spin budget lasts, then parked.
* ``park``: parked at once, never polled.

A parked fence is the watcher's to watch; its completion arrives through the
mailbox. The poller stops ticking whenever nothing is left to poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ._config import Strategy, current_config
from ._fence import FAILED, PENDING
from ._fenceset import FenceSet
from ._watcher import Mailbox, current_watcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._fence import Fence

__all__ = ["Poller", "PollerStatistics", "Waiter"]

# First sleep once the spin budget is spent; sleeps double up to the cap.
_FIRST_SLEEP_S = 50e-6
# Fences parked per tick at most, yielding to the loop between batches.
_PARK_BATCH = 128


class Waiter(Protocol):
    """One suspended wait, as its event loop resumes it."""

    def wake(self, error: BaseException | None) -> None:
        """Resume the wait, raising ``error`` in it if given. Never raises."""
        ...


@dataclass(frozen=True, slots=True)
class PollerStatistics:
    """A snapshot of one event loop's waits.

    Attributes:
        pending_fences: Fences that at least one task on this loop awaits.
        waiters: Tasks waiting on them.
        queues: Streams or queues of the fences being polled.
        parked: Fences handed to the watcher rather than polled.
        ticks: Checks made since the poller was created.
        queries: Device queries its ticks made.
        running: Whether the poller is scheduled to tick again.
    """

    pending_fences: int = 0
    waiters: int = 0
    queues: int = 0
    parked: int = 0
    ticks: int = 0
    queries: int = 0
    running: bool = False


class Poller:
    """The waits of one event loop. Subclasses schedule :meth:`tick` on it."""

    def __init__(self) -> None:
        self._waiters: dict[Fence, dict[Waiter, Strategy]] = {}
        self._waiter_count = 0
        # Fences with at least one "poll" waiter: polled for as long as they wait.
        self._eager: dict[Fence, int] = {}
        # Polled fences only "auto" waits want: parked once the spin budget is spent.
        self._auto_only: set[Fence] = set()
        self._polled = FenceSet()
        self._parked: set[Fence] = set()
        self._unpark_soon: set[Fence] = set()
        self._mailbox = Mailbox(self._call_soon_threadsafe, self.deliver)
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

    def _call_soon_threadsafe(self, callback: Callable[[], None]) -> object:
        """Run ``callback`` on the loop soon; callable from any thread."""
        raise NotImplementedError

    def _call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon, after what is already scheduled (loop thread).

        On a loop that is gone, run it now instead: never raise, never drop it.
        """
        raise NotImplementedError

    # -- waits -------------------------------------------------------------------

    def add(self, fence: Fence, waiter: Waiter, strategy: Strategy) -> None:
        """Register ``waiter`` to be woken once ``fence`` settles."""
        self._waiters.setdefault(fence, {})[waiter] = strategy
        self._waiter_count += 1
        if strategy == "park":
            self._park(fence)
            return
        if strategy == "poll":
            self._eager[fence] = self._eager.get(fence, 0) + 1
            self._auto_only.discard(fence)
        elif fence not in self._eager:
            self._auto_only.add(fence)
        self._polled.add(fence)
        # A new wait buys a fresh spin budget: short work is seen at once.
        self._spin_until = time.perf_counter() + current_config().spin_budget
        self._next_sleep = _FIRST_SLEEP_S
        self._ensure_ticking()

    def discard(self, fence: Fence, waiter: Waiter) -> None:
        """Forget ``waiter`` (cancelled or timed out); a no-op if already woken."""
        waiters = self._waiters.get(fence)
        if waiters is None:
            return
        strategy = waiters.pop(waiter, None)
        if strategy is None:
            return
        self._waiter_count -= 1
        if strategy == "poll":
            self._eager[fence] -= 1
            if not self._eager[fence]:
                del self._eager[fence]
                if "auto" in waiters.values():
                    self._auto_only.add(fence)
                else:  # only "park" waits are left, and they are parked
                    self._polled.discard(fence)
        if not waiters:
            self._forget(fence)

    def _forget(self, fence: Fence) -> None:
        """``fence`` has no waiters left on this loop."""
        self._waiters.pop(fence, None)
        self._eager.pop(fence, None)
        self._auto_only.discard(fence)
        self._polled.discard(fence)
        if fence in self._parked:
            self._parked.discard(fence)
            # Batched, and after the woken tasks have run: off the wake path.
            first = not self._unpark_soon
            self._unpark_soon.add(fence)
            if first:
                self._call_soon(self._flush_unparks)

    def _flush_unparks(self) -> None:
        watcher = current_watcher()
        for fence in self._unpark_soon:
            watcher.unpark(fence, self._mailbox)
        self._unpark_soon.clear()

    def _park(self, fence: Fence) -> None:
        if fence in self._parked:
            return
        self._parked.add(fence)
        if fence in self._unpark_soon:  # still parked with the watcher, signal armed
            self._unpark_soon.discard(fence)
            return
        current_watcher().park(fence, self._mailbox)
        # Armed first, checked second: a completion in between is never lost.
        # Through the mailbox, never synchronously: the waiter may not be
        # suspended yet.
        try:
            settled = fence._poll() != PENDING
        except Exception:  # deliver() will hand it to the waiters
            settled = True
        if settled:
            self._mailbox.post([fence])

    def tick(self) -> float | None:
        """Check the polled fences once and wake the waiters of those settled.

        Returns:
            Seconds until the next tick (0 to yield and check again at once),
            or ``None`` when nothing is left to poll and the poller should stop.
        """
        self._ticks += 1
        self._queries += self._polled.sweep(self._wake_all)
        if not self._polled:
            return None
        if time.perf_counter() < self._spin_until:
            return 0.0
        # The spin budget is spent: what only "auto" waits want is parked, a
        # batch a tick, so that parking thousands never stalls the loop.
        for _ in range(min(len(self._auto_only), _PARK_BATCH)):
            fence = self._auto_only.pop()
            self._polled.discard(fence)
            self._park(fence)
        if self._auto_only:
            return 0.0
        if not self._polled:
            return None
        cap = current_config().poll_cap
        delay = min(self._next_sleep, cap)
        self._next_sleep = min(delay * 2, cap)
        return delay

    def deliver(self, fences: list[Fence]) -> None:
        """Wake the waiters of those ``fences`` that have settled (loop thread)."""
        for fence in fences:
            if fence not in self._waiters:
                continue  # woken already, or every wait was cancelled: harmless
            try:
                if fence._poll() == PENDING:
                    continue
            except Exception as unexpected:  # a backend bug must reach the waiters
                self._wake_all(fence, unexpected)
            else:
                self._wake_all(fence, None)

    def _wake_all(self, fence: Fence, unexpected: Exception | None) -> None:
        waiters = self._waiters.get(fence)
        if waiters:
            # Woken first: their tasks are scheduled ahead of the bookkeeping.
            self._waiter_count -= len(waiters)
            failed = fence._state == FAILED
            for waiter in waiters:
                waiter.wake(unexpected or (fence._error() if failed else None))
        self._forget(fence)

    def statistics(self) -> PollerStatistics:
        """Return a snapshot of this loop's waits and counters."""
        return PollerStatistics(
            pending_fences=len(self._waiters),
            waiters=self._waiter_count,
            queues=self._polled.queue_count,
            parked=len(self._parked),
            ticks=self._ticks,
            queries=self._queries,
            running=self._is_running(),
        )
