"""One poller per event loop: every wait on that loop goes through it.

The poller composes its loop's driver (:mod:`asyncfence._loops`) and runs
only on the loop's thread; other threads reach it only through the driver's
``call_soon_threadsafe`` or the native mailbox. It watches fences two ways:

* **polled** fences are checked by a tick chain: at once while the spin
  budget lasts, then after sleeps that double up to ``poll_cap``;
* **parked** fences (:class:`~asyncfence._parking.Parking`) cost the loop nothing until their
  completion signal writes the loop's mailbox fd (the native shim). Without
  the shim they are re-checked on the loop instead, after sleeps that double
  up to ``poll_cap``. A loop timer re-checks each parked stream regardless,
  on its own schedule (:class:`~asyncfence._recheck.RecheckSchedule`), a
  bounded slice per loop turn: no signal comes for a device fault.

How each strategy uses them, and the wake path: ``docs/design.md``
("Waiting", "The wake path") and ``docs/waiting.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from ._config import check_seconds, current_config
from ._core import FAILED
from ._fenceset import FenceSet
from ._loops import current_driver, existing_driver
from ._parking import FIRST_SLEEP_S, Parking, WakePath, new_mailbox

if TYPE_CHECKING:
    from collections.abc import Collection

    from ._config import Strategy
    from ._core import FenceCore
    from ._loops import LoopDriver, Waiter

__all__ = [
    "Poller",
    "PollerStatistics",
    "Settles",
    "WakePath",
    "current_poller",
    "current_statistics",
    "poller_of",
]

_logger = logging.getLogger("asyncfence.poller")

# First sleep once the spin budget is spent; sleeps double up to poll_cap.
_FIRST_SLEEP_S = FIRST_SLEEP_S
# Fences parked per tick at most, yielding to the loop between batches.
_PARK_BATCH = 128

# The clock of the fences' ages, whatever the loop (asyncio's loop clock is
# this one; trio's is its own): a module attribute so that tests can set it.
_clock = time.monotonic


class Settles(Protocol):
    """What a wait waits on: a fence's core, or an imported fence, which its reader settles."""

    @property
    def state(self) -> int:
        """:data:`~asyncfence._core.PENDING`, ``DONE`` or ``FAILED``."""

    def failure(self) -> Exception:
        """A fresh copy of the failure of a ``FAILED`` one."""


@dataclass(frozen=True, slots=True)
class PollerStatistics:
    """A snapshot of one event loop's waits.

    Attributes:
        pending_fences: Fences that at least one task on this loop awaits.
        waiters: Tasks waiting on them.
        queues: Streams or queues of the fences being polled.
        parked: Fences parked rather than polled.
        ticks: Checks made since the poller was created.
        queries: Device queries made: by the ticks, and for parked fences
            by wakes and re-checks.
        tick_seconds: Time spent in those ticks, in seconds.
        running: Whether the poller is scheduled to tick again.
        wake_path: How parked waits on this loop are woken: ``"native"`` (the
            shim writes the loop's own mailbox fd; no thread involved) or
            ``"polling"`` (no shim: re-checked on the loop, up to every
            ``poll_cap``); ``None`` until a wait on this loop first parks,
            which decides it.
        armed: Parked fences whose completion signal is armed.
        signals: Completion signals received.
        rechecks: Periodic re-checks of the parked fences.
        oldest_pending_age: Seconds since a wait on this loop (a task's, or a
            drop queue's) first awaited the oldest of the pending fences;
            ``None`` with none pending. A fence stuck on the device (a hung
            kernel, a lost signal) shows here, growing, while everything
            else on the loop still answers.
        oldest_parked_age: The same, for the oldest of the parked fences;
            ``None`` with none parked.
        stuck_fences: Pending fences first awaited more than ``stuck_after``
            seconds ago, where :func:`current_statistics` was given
            ``stuck_after``; otherwise ``None``.

    Ages are measured on :func:`time.monotonic`'s clock (asyncio's loop
    clock; not trio's, which is its own), whatever loop runs.
    """

    pending_fences: int = 0
    waiters: int = 0
    queues: int = 0
    parked: int = 0
    ticks: int = 0
    queries: int = 0
    tick_seconds: float = 0.0
    running: bool = False
    wake_path: WakePath | None = None
    armed: int = 0
    signals: int = 0
    rechecks: int = 0
    oldest_pending_age: float | None = None
    oldest_parked_age: float | None = None
    stuck_fences: int | None = None


class _Waits:
    """The waits on one fence, each waiter's strategy, and when the first began.

    A fence's entry is made when it gains its first wait and dropped when it
    has none left, so a poller's entries are in the order of their ``since``
    (``time.monotonic()``): the oldest pending fence is the first, at no cost
    on the wake path. One wait, the usual case, is held inline: a dict per
    fence would cost a parked wait a fifth of its memory.
    """

    __slots__ = ("_more", "_strategy", "_waiter", "since")

    def __init__(self, waiter: Waiter, strategy: Strategy) -> None:
        self.since = _clock()
        self._waiter: Waiter | None = waiter
        self._strategy: Strategy = strategy
        self._more: dict[Waiter, Strategy] | None = None  # from the second wait on

    def __setitem__(self, waiter: Waiter, strategy: Strategy) -> None:
        more = self._more
        if more is not None:
            more[waiter] = strategy
        elif self._waiter is None or self._waiter is waiter:
            self._waiter, self._strategy = waiter, strategy
        else:
            self._more = {self._waiter: self._strategy, waiter: strategy}
            self._waiter = None

    def pop(self, waiter: Waiter) -> Strategy | None:
        """Forget ``waiter``; its strategy, or ``None`` if it was not here."""
        if self._more is not None:
            return self._more.pop(waiter, None)
        if self._waiter is not waiter:
            return None
        self._waiter = None
        return self._strategy

    def __len__(self) -> int:
        if self._more is not None:
            return len(self._more)
        return int(self._waiter is not None)

    def all(self) -> tuple[Waiter, ...]:
        """The waiters, in the order they came."""
        if self._more is not None:
            return tuple(self._more)
        return () if self._waiter is None else (self._waiter,)

    def wants(self, strategy: Strategy) -> bool:
        """Whether any of the waits asked for ``strategy``."""
        if self._more is not None:
            return strategy in self._more.values()
        return self._waiter is not None and self._strategy == strategy


class Poller:
    """The waits of one event loop, on the primitives its driver gives.

    Thread-safety: loop thread only.
    """

    def __init__(self, driver: LoopDriver) -> None:
        self.driver = driver
        # In the order of each fence's first wait (see _Waits).
        self._waiters: dict[Settles, _Waits] = {}
        #: The fences some wait on this loop waits for (``in`` it: :meth:`is_awaited`
        #: without its call); read it, never change it.
        self.awaited: Collection[Settles] = self._waiters.keys()
        self._waiter_count = 0
        # Fences with at least one "poll" waiter: polled for as long as they wait.
        self._eager: dict[FenceCore, int] = {}
        # Polled fences only "auto" waits want: parked once the spin budget is spent.
        self._auto_only: set[FenceCore] = set()
        self._polled = FenceSet()
        self._parking: Parking | None = None
        self._ticks_chain = driver.chain(self._tick)
        self._spin_until = 0.0
        self._next_sleep = _FIRST_SLEEP_S
        self._ticks = 0
        self._queries = 0
        self._tick_seconds = 0.0

    # -- waits -------------------------------------------------------------------

    def add(self, fence: FenceCore, waiter: Waiter, strategy: Strategy) -> None:
        """Register ``waiter`` to be woken once ``fence`` settles. Never raises.

        Where a fence cannot be parked, it is polled instead: the wait is
        slower, never lost.
        """
        waits = self._waiters.get(fence)
        if waits is None:
            waits = self._waiters[fence] = _Waits(waiter, strategy)
        else:
            waits[waiter] = strategy
        self._waiter_count += 1
        if strategy == "park":
            if self._park(fence):
                return
            strategy = "poll"  # polled instead, for as long as it waits
            waits[waiter] = strategy
        if strategy == "poll":
            self._eager[fence] = self._eager.get(fence, 0) + 1
            self._auto_only.discard(fence)
        elif fence not in self._eager:
            self._auto_only.add(fence)
        self._polled.add(fence)
        # A new wait buys a fresh spin budget: short work is seen at once.
        self._spin_until = time.perf_counter() + current_config().spin_budget
        self._next_sleep = _FIRST_SLEEP_S
        self._ticks_chain.ensure(0.0)

    def add_settled_elsewhere(self, fence: Settles, waiter: Waiter) -> None:
        """Register ``waiter`` on ``fence``, which something else settles, then wakes here.

        For an imported fence: its reader settles it from the exporter's
        answer and calls :meth:`wake`. Nothing polls or parks it; its waits
        count in the statistics (pending fences, their ages, stuck fences)
        like any. Never raises.
        """
        waits = self._waiters.get(fence)
        if waits is None:
            self._waiters[fence] = _Waits(waiter, "park")  # "park": nothing polls it
        else:
            waits[waiter] = "park"
        self._waiter_count += 1

    def discard(self, fence: Settles, waiter: Waiter) -> None:
        """Forget ``waiter`` (cancelled or timed out); a no-op if already woken."""
        waiters = self._waiters.get(fence)
        if waiters is None:
            return
        strategy = waiters.pop(waiter)
        if strategy is None:
            return
        self._waiter_count -= 1
        if strategy == "poll":  # a core's: what is settled elsewhere is never polled
            core = cast("FenceCore", fence)
            self._eager[core] -= 1
            if not self._eager[core]:
                del self._eager[core]
                if waiters.wants("auto"):
                    self._auto_only.add(core)
                else:  # only "park" waits are left, and they are parked
                    self._polled.discard(core)
        if not waiters:
            self._forget(fence)

    def is_awaited(self, fence: Settles) -> bool:
        """Whether any wait on this loop still waits for ``fence``."""
        return fence in self._waiters

    def wake(self, fence: Settles, unexpected: Exception | None = None) -> None:
        """Resume every wait on the settled ``fence``, and stop watching it.

        Every wake comes here: a parked fence's signal or re-check, a polled
        fence's tick, a fault, an imported fence's answer.

        Each waiter gets ``unexpected`` (what querying the fence raised, a
        backend bug), its own copy of the fence's failure, or nothing. A
        no-op for a fence no wait waits for (woken already, or abandoned).

        Raises:
            KeyboardInterrupt: A waiter's wake raised it (or ``SystemExit``),
                once every waiter has been woken; anything else a waiter
                raises is logged.
        """
        waiters = self._waiters.pop(fence, None)
        if waiters is None:
            return
        sole = waiters._waiter if waiters._more is None else None  # no call for the usual one
        woken = waiters.all() if sole is None else (sole,)
        self._waiter_count -= len(woken)
        self._forget(fence)
        failed = unexpected is None and fence.state == FAILED
        surfaced: BaseException | None = None
        for waiter in woken:
            try:
                # Each gets its own copy of a failure (its own traceback).
                waiter.wake(fence.failure() if failed else unexpected)
            except (KeyboardInterrupt, SystemExit) as interrupt:
                surfaced = surfaced or interrupt  # after the others are woken
            except BaseException:  # a waker must not raise; the others go on
                _logger.exception("waking a waiter of %r raised; the others are woken", fence)
        if surfaced is not None:
            raise surfaced

    def _forget(self, fence: Settles) -> None:
        """``fence`` has no waiters left on this loop.

        Settled elsewhere (an imported fence), it is in none of the sets
        below: each step is a no-op for it.
        """
        self._waiters.pop(fence, None)
        # No cast() (a call, on the wake path): a plain assignment.
        core: FenceCore = fence  # type: ignore[assignment]
        self._eager.pop(core, None)
        self._auto_only.discard(core)
        # Membership first: each call is costly on the wake path.
        if core in self._polled.members:
            self._polled.discard(core)
        parking = self._parking
        if parking is not None and core in parking.parked.members:
            parking.unpark(core)  # a no-op for one whose wake is under way: it unparks it

    def _park(self, fence: FenceCore) -> bool:
        """Park ``fence``; False if it cannot be (then it must be polled)."""
        try:
            parking = self._parking
            if parking is None:
                parking = self._parking = Parking(self, new_mailbox())
            parking.park(fence)
        except Exception:  # a backend bug: polled instead
            _logger.exception("parking %r failed; polling it instead", fence)
            return False
        return True

    # -- polling -----------------------------------------------------------------

    def _tick(self) -> float | None:
        """Check the polled fences once and wake the waiters of those settled.

        Returns:
            Seconds until the next tick (0 to yield and check again at once),
            or ``None`` when nothing is left to poll and the chain should stop.
        """
        started = time.perf_counter()
        try:
            return self._tick_at(started)
        finally:
            self._ticks += 1
            self._tick_seconds += time.perf_counter() - started

    def _tick_at(self, now: float) -> float | None:
        self._queries += self._polled.sweep(self.wake)
        if not self._polled:
            return None
        if now < self._spin_until:
            return 0.0
        # The spin budget is spent: what only "auto" waits want is parked, a
        # batch a tick, so that parking thousands never stalls the loop.
        for _ in range(min(len(self._auto_only), _PARK_BATCH)):
            fence = self._auto_only.pop()
            if self._park(fence):
                self._polled.discard(fence)
            else:  # polled on, as if its waits had asked for it
                self._eager[fence] = self._eager.get(fence, 0) + 1
        if self._auto_only:
            return 0.0
        if not self._polled:
            return None
        cap = current_config().poll_cap
        delay = min(self._next_sleep, cap)
        self._next_sleep = min(delay * 2, cap)
        return delay

    def statistics(self, stuck_after: float | None = None) -> PollerStatistics:
        """Return a snapshot of this loop's waits and counters.

        The oldest pending fence is found at once; the oldest parked one and
        the stuck ones by walking the pending fences from the oldest, only as
        far as needed.

        Args:
            stuck_after: Count the pending fences first awaited more than
                this many seconds ago (validated by the caller).
        """
        parking = self._parking
        now = _clock()
        oldest = next(iter(self._waiters.values()), None)
        oldest_parked = None
        if parking is not None and len(parking):
            oldest_parked = next(
                (waits for fence, waits in self._waiters.items() if fence in parking), None
            )
        stuck = None
        if stuck_after is not None:
            stuck = 0
            for waits in self._waiters.values():
                if now - waits.since <= stuck_after:
                    break  # and so every later one, first awaited later still
                stuck += 1
        return PollerStatistics(
            pending_fences=len(self._waiters),
            waiters=self._waiter_count,
            queues=self._polled.queue_count,
            parked=0 if parking is None else len(parking),
            ticks=self._ticks,
            queries=self._queries + (0 if parking is None else parking.queries),
            tick_seconds=self._tick_seconds,
            running=self._ticks_chain.running,
            wake_path=None if parking is None else parking.wake_path,
            armed=0 if parking is None else parking.armed,
            signals=0 if parking is None else parking.signals,
            rechecks=0 if parking is None else parking.rechecks,
            oldest_pending_age=None if oldest is None else now - oldest.since,
            oldest_parked_age=None if oldest_parked is None else now - oldest_parked.since,
            stuck_fences=stuck,
        )


def poller_of(driver: LoopDriver) -> Poller:
    """The poller of ``driver``'s loop, made on first use."""
    poller = driver.poller
    if poller is None:
        poller = driver.poller = Poller(driver)
    return poller  # type: ignore[return-value]  # no cast(): a call on every wait


def current_poller() -> Poller:
    """The running loop's poller, made on first use.

    Raises:
        RuntimeError: Called outside an asyncio or trio event loop.
    """
    return poller_of(current_driver())


def current_statistics(*, stuck_after: float | None = None) -> PollerStatistics:
    """Return a snapshot of the running loop's waits.

    The ages of the oldest pending and parked fences cost nothing to keep (a
    timestamp when a fence is first awaited); a health check reads them, or
    counts the fences pending too long with ``stuck_after``, in one call per
    check::

        stats = asyncfence.current_statistics(stuck_after=30.0)
        healthy = not stats.stuck_fences

    Args:
        stuck_after: Also count, in ``stuck_fences``, the pending fences first
            awaited more than this many seconds ago. That walks the pending
            fences from the oldest, as far as the first younger one. ``None``
            (the default) counts nothing and leaves ``stuck_fences`` ``None``.

    Raises:
        RuntimeError: Called outside an asyncio or trio event loop.
        TypeError: ``stuck_after`` is not a number.
        ValueError: ``stuck_after`` is negative, NaN or infinite.

    Thread-safety: the running loop's thread only, like the poller it reads.
    """
    bound = None if stuck_after is None else check_seconds("stuck_after", stuck_after)
    driver = existing_driver()
    poller = None if driver is None else driver.poller
    if poller is None:
        return PollerStatistics(stuck_fences=None if bound is None else 0)
    return cast("Poller", poller).statistics(bound)
