"""One poller per event loop: every wait on that loop goes through it.

The poller composes its loop's driver (:mod:`asyncfence._loops`) and runs
only on the loop's thread; other threads reach it only through the driver's
``call_soon_threadsafe`` or the native mailbox. It watches fences two ways:

* **polled** fences are checked by a tick chain: at once while the spin
  budget lasts, then after sleeps that double up to ``poll_cap``;
* **parked** fences (:class:`_Parking`) cost the loop nothing until their
  completion signal writes the loop's mailbox fd (the native shim). Without
  the shim they are re-checked on the loop instead, after sleeps that double
  up to ``poll_cap``. A loop timer re-checks each parked stream regardless,
  on its own schedule (:class:`~asyncfence._recheck.RecheckSchedule`), a
  bounded slice per loop turn: no signal comes for a device fault.

How each strategy uses them, and the wake path: ``docs/design.md``
("Waiting", "The wake path") and ``docs/waiting.md``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from ._config import check_seconds, current_config
from ._core import FAILED, PENDING
from ._fenceset import FenceSet
from ._loops import current_driver, existing_driver
from ._native import (
    HOW_TO_BUILD,
    NativeMailbox,
    shim,
    unavailable_for_good,
    unavailable_reason,
)
from ._recheck import RecheckSchedule

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable, Iterable

    from ._config import Strategy
    from ._core import ArmResult, FenceCore
    from ._loops import LoopDriver, Waiter

__all__ = [
    "Poller",
    "PollerStatistics",
    "WakePath",
    "current_poller",
    "current_statistics",
    "poller_of",
]

_logger = logging.getLogger("asyncfence.poller")

# First sleep once the spin budget is spent (and of an unsignalled parked
# fence's re-checks); sleeps double up to poll_cap.
_FIRST_SLEEP_S = 50e-6
# Fences parked per tick at most, yielding to the loop between batches.
_PARK_BATCH = 128
# Streams re-checked per step at most, yielding to the loop between slices:
# about 0.1 ms of queries and bookkeeping on a slow core, so that a wake that
# arrives meanwhile waits no longer than that.
_RECHECK_SLICE = 16
# A step also takes the streams due within this fraction of recheck_interval.
_RECHECK_EARLY = 1 / 16
#: Streams re-checked per second at most, once more are due than a slice fits:
#: a few percent of a core. With more streams parked than this many times
#: 8 * recheck_interval (4,000 by default), each waits its turn, and is
#: re-checked every streams / RECHECK_RATE seconds (16,384: 1.6 s).
RECHECK_RATE = 10_000

#: How a loop's parked waits are woken: ``"native"`` (the shim writes the
#: loop's own mailbox fd) or ``"polling"`` (no shim: re-checked on the loop).
WakePath = Literal["native", "polling"]

_shim_warned = False
_shim_warned_lock = threading.Lock()

# The clock of the fences' ages, whatever the loop (asyncio's loop clock is
# this one; trio's is its own): a module attribute so that tests can set it.
_clock = time.monotonic
# The clock of the re-check schedule; apart from the ages' so that each can be
# set alone.
_recheck_clock = time.monotonic


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
        self._waiters: dict[FenceCore, _Waits] = {}
        #: The fences some wait on this loop waits for (``in`` it: :meth:`is_awaited`
        #: without its call); read it, never change it.
        self.awaited: Collection[FenceCore] = self._waiters.keys()
        self._waiter_count = 0
        # Fences with at least one "poll" waiter: polled for as long as they wait.
        self._eager: dict[FenceCore, int] = {}
        # Polled fences only "auto" waits want: parked once the spin budget is spent.
        self._auto_only: set[FenceCore] = set()
        self._polled = FenceSet()
        self._parking: _Parking | None = None
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

    def discard(self, fence: FenceCore, waiter: Waiter) -> None:
        """Forget ``waiter`` (cancelled or timed out); a no-op if already woken."""
        waiters = self._waiters.get(fence)
        if waiters is None:
            return
        strategy = waiters.pop(waiter)
        if strategy is None:
            return
        self._waiter_count -= 1
        if strategy == "poll":
            self._eager[fence] -= 1
            if not self._eager[fence]:
                del self._eager[fence]
                if waiters.wants("auto"):
                    self._auto_only.add(fence)
                else:  # only "park" waits are left, and they are parked
                    self._polled.discard(fence)
        if not waiters:
            self._forget(fence)

    def is_awaited(self, fence: FenceCore) -> bool:
        """Whether any wait on this loop still waits for ``fence``."""
        return fence in self._waiters

    def wake(self, fence: FenceCore, unexpected: Exception | None = None) -> None:
        """Resume every wait on the settled ``fence``, and stop watching it.

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

    def _forget(self, fence: FenceCore) -> None:
        """``fence`` has no waiters left on this loop."""
        self._waiters.pop(fence, None)
        self._eager.pop(fence, None)
        self._auto_only.discard(fence)
        # Membership first: each call is costly on the wake path.
        if fence in self._polled.members:
            self._polled.discard(fence)
        parking = self._parking
        if (
            parking is not None
            and fence in parking.parked.members
            and fence not in parking._fired  # the rest of its wake unparks it
        ):
            parking.unpark(fence)

    def _park(self, fence: FenceCore) -> bool:
        """Park ``fence``; False if it cannot be (then it must be polled)."""
        try:
            parking = self._parking
            if parking is None:
                parking = self._parking = _Parking(self, _new_mailbox())
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


def _new_mailbox() -> NativeMailbox | None:
    """A mailbox for a loop about to park its first fence; ``None`` where it can have none.

    Why is said as a warning: once per process where the shim is not built
    (or disabled), and once per loop where it is but this loop cannot have a
    mailbox (no file descriptor left, say): a later loop may.
    """
    native = shim()
    if native is None:
        reason = unavailable_reason()
        if unavailable_for_good():
            _warn_once(f"the native wake shim is not in use: {reason}; {HOW_TO_BUILD}")
        else:  # a later loop may load it
            _logger.warning("asyncfence: no native wake path on this loop: %s", reason)
        return None
    try:
        return NativeMailbox(native)
    except OSError as error:
        _logger.warning(
            "asyncfence: no native wake path on this loop (%s); its parked waits are "
            "re-checked on the loop",
            error,
        )
        return None


def _warn_once(message: str) -> None:
    global _shim_warned
    with _shim_warned_lock:
        warned, _shim_warned = _shim_warned, True
    if not warned:
        _logger.warning("asyncfence: %s", message)


class _Parking:
    """A loop's parked fences. Loop thread only.

    With a mailbox, the oldest parked fence of each stream has a completion
    signal armed, which makes the mailbox readable once the device passes it
    (the others complete behind it, and the sweep it triggers finds them). Fences without one
    (no mailbox, or the runtime could not arm it) are *unsignalled*: they are
    re-checked on the loop after sleeps that double up to ``poll_cap``.
    Every parked stream is re-checked as well, on its own schedule.
    """

    def __init__(self, poller: Poller, mailbox: NativeMailbox | None) -> None:
        self._poller = poller
        self._driver = poller.driver
        #: The parked fences (read by the poller; changed here only).
        self.parked = FenceSet()
        self._unsignalled: set[FenceCore] = set()
        self._unsignalled_sleep = _FIRST_SLEEP_S
        self._unsignalled_due = 0.0
        # Armed signals not yet fired, by token: a signal's token is its
        # fence's record number, unique in the process, so a token names one
        # fence for good. The fence is held until its signal fires (its waits
        # may leave first; re-parked, it reuses the signal): a weak reference
        # would cost a parked wait a twentieth of its memory, and a token could
        # then outlive its fence.
        self._armed: dict[int, FenceCore] = {}
        self._rearm_scheduled = False
        # Fences whose signal fired, left for the rest of the wake (in order).
        self._fired: dict[FenceCore, None] = {}
        self._rest_pending = False
        self._recheck = self._driver.chain(self._recheck_step)
        self._schedule = RecheckSchedule()
        # After a full slice, no stream re-check before this (RECHECK_RATE).
        self._throttled_until = 0.0
        self.signals = 0
        self.rechecks = 0
        self.queries = 0
        if mailbox is not None and not self._driver.watch_readable(
            mailbox.fileno(), self._on_readable
        ):
            _logger.warning(
                "asyncfence: this event loop cannot watch file descriptors; its parked "
                "waits are re-checked on the loop"
            )
            mailbox = None
        self._mailbox = mailbox
        self.wake_path: WakePath = "polling" if mailbox is None else "native"

    def __len__(self) -> int:
        # Not counting the fences woken whose rest of the wake has not run yet.
        return len(self.parked) - sum(1 for fence in self._fired if self._woken(fence))

    def __contains__(self, fence: object) -> bool:
        """Whether ``fence`` is parked (a woken one whose wake has not finished, too)."""
        return fence in self.parked

    def _woken(self, fence: FenceCore) -> bool:
        """Whether ``fence`` is parked with no wait left on it (its waiters woken or gone)."""
        return fence in self.parked and not self._poller.is_awaited(fence)

    @property
    def armed(self) -> int:
        """Parked fences with an armed signal."""
        return sum(1 for fence in self._armed.values() if fence in self.parked)

    def park(self, fence: FenceCore) -> None:
        """Watch ``fence`` for its waiters; what it finds settled, it wakes on the next turn."""
        parked = self.parked
        awaited = self._poller.awaited
        for fired in self._fired:
            # A task woken a moment ago parks again before the rest of its
            # wake ran: the fences woken leave the set now, so that this one
            # can be the oldest of its queue and get its signal at once. One
            # that settled but whose waiters were not woken yet stays.
            if fired not in awaited and fired in parked.members:
                parked.discard(fired)
        if not parked.add(fence):
            return
        # A new wait gets its stream's prompt re-check; a running chain is
        # already due by then unless that made it sooner.
        interval = current_config().recheck_interval
        sooner = self._schedule.parked(fence.queue.key, _recheck_clock(), interval)
        if sooner or not self._recheck.running:
            self._recheck.ensure(self._recheck_delay())
        # The oldest fence of its stream gets a signal; a younger one is found
        # by the sweep that its stream's oldest brings (a signal, or the
        # re-checks of an unsignalled one). Not _arm([fence]): every park
        # comes here, and that loop costs a third more. (fence.seq in _armed:
        # _has_signal without its call.)
        if fence.seq in self._armed or not parked.needs_own_signal(fence):
            return
        result = self._arm_one(fence)
        if result != "armed" and self._not_armed(fence, result):
            self._driver.call_soon(functools.partial(self._sweep, {fence.queue.key}))

    def unpark(self, fence: FenceCore) -> None:
        """Stop watching ``fence``: no wait on this loop is left on it."""
        if fence not in self.parked or fence in self._fired:
            return  # not parked, or the rest of its wake unparks it
        was_head = self.parked.needs_own_signal(fence)
        self.parked.discard(fence)
        self._unsignalled.discard(fence)
        if self._driver.is_closed():
            return  # a wait abandoned on a closed loop, being collected: nothing to arm
        if was_head and not self._rearm_scheduled:
            # Batched: when many waits are cancelled at once, one pass arms
            # the new oldest fence of each stream.
            self._rearm_scheduled = True
            self._driver.call_soon(self._rearm)

    def _rearm(self) -> None:
        self._rearm_scheduled = False
        self._arm(self.parked.heads())

    # -- signals -------------------------------------------------------------------

    def _arm(self, candidates: Iterable[FenceCore]) -> None:
        """Arm a signal for each candidate that needs one and has none.

        A signal armed comes even if the fence completed meanwhile: its
        marker was kept valid while the signal was armed on it (pinned, or
        held by the arm's own reference). A fence
        that another thread or loop settled first (its marker gone, so no
        signal can come), and one that got no signal but has completed, are
        swept on the next loop turn: the waiter may not be suspended yet.
        """
        settled: set[Hashable] = set()
        for fence in candidates:
            if (
                self._has_signal(fence)
                or fence in self._unsignalled
                or not self.parked.needs_own_signal(fence)
            ):
                continue
            result = self._arm_one(fence)
            if result != "armed" and self._not_armed(fence, result):
                settled.add(fence.queue.key)
        if settled:
            self._driver.call_soon(functools.partial(self._sweep, settled))

    def _not_armed(self, fence: FenceCore, result: ArmResult) -> bool:
        """``fence`` got no signal: re-check it if need be; whether its stream needs a sweep."""
        if result == "unsignalled":
            self._unsignalled.add(fence)
            self._unsignalled_sleep = _FIRST_SLEEP_S
            self._unsignalled_due = _recheck_clock() + _FIRST_SLEEP_S
            self._recheck.ensure(_FIRST_SLEEP_S)
        return result == "settled" or _settled_now(fence)

    def _arm_one(self, fence: FenceCore) -> ArmResult:
        """Arm ``fence``'s signal: ``"unsignalled"`` if it must be re-checked instead."""
        mailbox = self._mailbox
        if mailbox is None:
            return "unsignalled"
        token = fence.seq
        try:
            result = fence.arm(mailbox, token)
        except Exception as error:  # a faulted CUDA context, say: re-checks see the fault
            _logger.debug("arming %r failed (%s); re-checking it", fence, error)
            return "unsignalled"
        if result == "armed":
            self._armed[token] = fence
        return result

    def _has_signal(self, fence: FenceCore) -> bool:
        """Whether ``fence`` has an armed signal that has not fired yet."""
        return fence.seq in self._armed

    # -- the wake ------------------------------------------------------------------

    def _on_readable(self) -> bool:
        """The mailbox fd is readable: some signals fired. Called twice per wake.

        The first call runs on a loop thread that was just woken, when every
        line costs the most, so it does only what the woken tasks need: it
        takes the signals without draining the fd, queries each fence that
        fired and wakes its waiters if it settled. It returns True: the fd
        stays readable, and the driver calls again once the woken tasks have
        run. That call drains the fd, wakes what fired meanwhile, and does the
        rest (:meth:`_finish_wake`). With a single signal armed, the first
        call does not even ask the shim which fired: a foreign call is the
        costliest line there.
        """
        # Guarded here rather than by the driver: a frame less per call.
        try:
            mailbox = self._mailbox
            assert mailbox is not None
            if self._rest_pending:
                self._rest_pending = False
                tokens = mailbox.take()
                if tokens:
                    self._wake_signalled(tokens)
                self._finish_wake()
                return False
            # With one signal armed, it is the one that fired: no need to ask
            # the shim. Should its fence be pending still (a collected fence's
            # signal made the fd readable, say), the rest of the wake arms it
            # again.
            sole = list(self._armed) if len(self._armed) == 1 else None
            if self._wake_signalled(sole or mailbox.take_undrained()):
                self._rest_pending = True
                return True
            # Nothing taken (a leftover from a wake a waker raised through):
            # drain the fd, and finish at once what that finds.
            self._wake_signalled(mailbox.take())
            if self._fired:
                self._finish_wake()
        except Exception:
            _logger.exception("asyncfence: the native mailbox's reader raised; the loop goes on")
        return False

    def _wake_signalled(self, tokens: list[int]) -> int:
        """Wake the waits on the fences whose signals these are, where settled; how many."""
        poller = self._poller
        fired = self._fired
        armed = self._armed
        for token in tokens:
            fence = armed.pop(token, None)
            if fence is None:
                continue  # forgotten settled, when nothing was parked: harmless
            self.signals += 1
            fired[fence] = None
            if fence.state == PENDING:
                self.queries += 1
                try:
                    if fence.poll(keep_marker=True) == PENDING:
                        continue  # early: the rest of the wake arms it again
                except Exception as unexpected:  # a backend bug must reach the waiters
                    poller.wake(fence, unexpected)
                    continue
            poller.wake(fence)
        return len(tokens)

    def _finish_wake(self) -> None:
        """The rest of a wake: sweep the streams that progressed, tidy up, arm what is next.

        A fired fence's stream progressed at least that far, so it is swept
        even if that fence's own waits have left (others behind it may be
        done, or it settled elsewhere with its waiters not woken yet), unless
        its oldest parked fence has a signal armed: that signal brings the
        sweep. A fence whose signal came early is armed again. It costs what
        fired, not what is parked: at most one sweep per stream that
        progressed, none where the woken task parked its next fence already.
        """
        fired, self._fired = self._fired, {}
        parked = self.parked
        awaited = self._poller.awaited
        keys: set[Hashable] = set()
        for fence in fired:
            keys.add(fence.queue.key)
            if fence not in awaited:  # woken, or its waits left
                if fence in parked.members:
                    parked.discard(fence)
                self._unsignalled.discard(fence)
            fence.release_marker()
        to_sweep = []
        for key in keys:  # a loop, not a comprehension: that would be a call more
            oldest = parked.oldest(key)
            if oldest is not None and oldest.seq not in self._armed:  # no signal armed
                to_sweep.append(key)
        if to_sweep:
            try:
                self.queries += parked.sweep(self._settled, to_sweep)
            finally:
                self._arm(parked.heads(to_sweep))

    def _settled(self, fence: FenceCore, unexpected: Exception | None) -> None:
        """A sweep found ``fence`` settled (and took it out of the parked set)."""
        self._unsignalled.discard(fence)
        self._poller.wake(fence, unexpected)

    def _sweep(self, keys: Iterable[Hashable]) -> None:
        """Query the parked fences of ``keys`` and wake the settled (see :meth:`_progress`)."""
        self._progress(keys)

    def _progress(self, keys: Iterable[Hashable]) -> set[Hashable]:
        """Query the parked fences of ``keys`` and wake the settled.

        The queues where something settled get their new oldest fence armed.

        Returns:
            The keys of those queues.
        """
        progressed: set[Hashable] = set()

        def settled(fence: FenceCore, unexpected: Exception | None) -> None:
            progressed.add(fence.queue.key)
            self._settled(fence, unexpected)

        self.queries += self.parked.sweep(settled, set(keys))
        if progressed:
            self._arm(self.parked.heads(progressed))
        return progressed

    # -- re-checks -----------------------------------------------------------------

    def _recheck_delay(self) -> float:
        """Seconds until the next re-check is due (of an unsignalled fence, or a stream)."""
        now = _recheck_clock()
        due = self._schedule.next_due()
        if due is not None:
            due = max(due, self._throttled_until)
        if self._unsignalled:
            due = self._unsignalled_due if due is None else min(due, self._unsignalled_due)
        if due is None:  # nothing scheduled: only a new park schedules again
            return current_config().recheck_interval
        return max(due - now, 0.0)

    def _recheck_step(self) -> float | None:
        """Re-check what is due: the unsignalled fences, and a slice of the due streams.

        Each stream has its own schedule (:class:`~asyncfence._recheck.RecheckSchedule`),
        and a step takes at most a slice of the due ones, at most
        :data:`RECHECK_RATE` a second, so it costs what is due, never what is
        parked.
        """
        if self._fired and not self._rest_pending:
            self._finish_wake()  # left by a wake that a waker raised through
        parked = self.parked
        if not parked:
            self._stop_rechecks()
            return None
        now = _recheck_clock()
        queried = False
        if self._unsignalled and now >= self._unsignalled_due:
            queried = True
            found = self._progress({fence.queue.key for fence in self._unsignalled})
            cap = current_config().poll_cap
            sleep = _FIRST_SLEEP_S if found else min(2 * self._unsignalled_sleep, cap)
            self._unsignalled_sleep = sleep
            self._unsignalled_due = now + sleep
        interval = current_config().recheck_interval
        due: list[Hashable] = []
        if now >= self._throttled_until:
            # What falls due a little later comes along: fewer, fuller steps.
            due = self._schedule.take_due(now + interval * _RECHECK_EARLY, _RECHECK_SLICE)
        if due:
            queried = True
            progressed: set[Hashable] = set()
            try:
                progressed = self._progress(due)
            finally:  # however the sweep ended, each stream taken is scheduled again
                for key in due:
                    if parked.has_queue(key):
                        self._schedule.checked(key, key in progressed, now, interval)
                    else:
                        self._schedule.forget(key)
            if len(due) == _RECHECK_SLICE:  # more may be due: they wait their turn
                self._throttled_until = now + _RECHECK_SLICE / RECHECK_RATE
        self.rechecks += queried
        if parked:
            return self._recheck_delay()
        self._stop_rechecks()
        return None

    def _stop_rechecks(self) -> None:
        """Nothing is parked: the chain stops, so what the schedule holds must go too.

        A stale entry would make the next park on its stream look scheduled
        already, with no chain to run it.
        """
        self._schedule = RecheckSchedule()
        # Only the fences of abandoned waits can be armed now. Those settled
        # are let go: a signal that never fires (a faulted context runs no
        # host function) would otherwise hold its fence until the loop ends.
        self._armed = {
            token: fence for token, fence in self._armed.items() if not _settled_now(fence)
        }


def _settled_now(fence: FenceCore) -> bool:
    """Whether ``fence`` has settled, querying it if need be (a raise counts: sweeps report it)."""
    try:
        return fence.poll() != PENDING
    except Exception:
        return True


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
