"""A loop's parked fences, and their wake: the completion signals, the sweeps, the re-checks.

A parked fence costs its loop nothing until its completion signal writes the
loop's mailbox fd (the native shim, :mod:`asyncfence._native`); without the
shim, or where the runtime could not arm a signal, it is re-checked on the
loop after sleeps that double up to ``poll_cap``. A loop timer re-checks
each parked stream regardless, on its own schedule
(:class:`~asyncfence._recheck.RecheckSchedule`), a bounded slice per loop
turn: no signal comes for a device fault. Every wake it finds goes to the
poller's :meth:`~asyncfence._poller.Poller.wake`, the one route to the
waiters.

The poller (:mod:`asyncfence._poller`) owns one :class:`Parking` per loop
and hands it the fences its waits park. Design: ``docs/design.md`` ("The
wake path").

Thread-safety: loop thread only.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Literal, Protocol

from ._config import current_config
from ._core import PENDING
from ._fenceset import FenceSet
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

    from ._core import ArmResult, FenceCore
    from ._loops import LoopDriver

__all__ = [
    "FIRST_SLEEP_S",
    "RECHECK_RATE",
    "Parking",
    "Waits",
    "WakePath",
    "new_mailbox",
    "settled_now",
]

_logger = logging.getLogger("asyncfence.poller")


class Waits(Protocol):
    """What the parking needs of its poller: the loop, who waits, and the one wake.

    The poller (:class:`~asyncfence._poller.Poller`) is the one that does.
    """

    @property
    def driver(self) -> LoopDriver:
        """The loop's driver."""

    @property
    def awaited(self) -> Collection[object]:
        """What some wait on this loop waits for (``in`` it, without a call)."""

    def wake(self, fence: FenceCore, unexpected: Exception | None = None) -> None:
        """Resume every wait on the settled ``fence``."""


#: First sleep of an unsignalled parked fence's re-checks (and of polling
#: once the spin budget is spent); sleeps double up to poll_cap.
FIRST_SLEEP_S = 50e-6
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

# Streams of unsignalled fences re-checked per step at most (no shim: every
# parked fence is unsignalled), so that a round over thousands is spread.
_UNSIGNALLED_SLICE = 64
# The clock of the re-check schedule; apart from the fences' ages (the
# poller's) so that each can be set alone.
_recheck_clock = time.monotonic


def new_mailbox() -> NativeMailbox | None:
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


class Parking:
    """A loop's parked fences. Loop thread only.

    With a mailbox, the oldest parked fence of each stream has a completion
    signal armed, which makes the mailbox readable once the device passes it
    (the others complete behind it, and the sweep it triggers finds them). Fences without one
    (no mailbox, or the runtime could not arm it) are *unsignalled*: they are
    re-checked on the loop after sleeps that double up to ``poll_cap``.
    Every parked stream is re-checked as well, on its own schedule.
    """

    def __init__(self, poller: Waits, mailbox: NativeMailbox | None) -> None:
        self._poller = poller
        self._driver = poller.driver
        #: The parked fences (read by the poller; changed here only).
        self.parked = FenceSet()
        self._unsignalled: set[FenceCore] = set()
        self._unsignalled_sleep = FIRST_SLEEP_S
        self._unsignalled_due = 0.0
        # The streams of unsignalled fences a round of re-checks has yet to
        # query (a slice a step), and whether that round found anything.
        self._unsignalled_round: list[Hashable] = []
        self._unsignalled_found = False
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
        return fence in self.parked and fence not in self._poller.awaited

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
            self._unsignalled_sleep = FIRST_SLEEP_S
            self._unsignalled_due = _recheck_clock() + FIRST_SLEEP_S
            self._recheck.ensure(FIRST_SLEEP_S)
        return result == "settled" or settled_now(fence)

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
            self._recheck_unsignalled(now)
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

    def _recheck_unsignalled(self, now: float) -> None:
        """Query a slice of the streams of unsignalled fences; the next slice comes next turn.

        A round takes every such stream, :data:`_UNSIGNALLED_SLICE` a step,
        so that thousands of them (no shim) never hold the loop at once;
        the next round comes after a sleep that doubles, up to ``poll_cap``,
        while rounds find nothing.
        """
        round_left = self._unsignalled_round
        if not round_left:
            round_left.extend({fence.queue.key for fence in self._unsignalled})
            self._unsignalled_found = False
        batch = round_left[-_UNSIGNALLED_SLICE:]
        del round_left[-_UNSIGNALLED_SLICE:]
        if self._progress(batch):
            self._unsignalled_found = True
        if round_left:
            self._unsignalled_due = now  # the rest of the round: on the next turn
            return
        cap = current_config().poll_cap
        found = self._unsignalled_found
        sleep = FIRST_SLEEP_S if found else min(2 * self._unsignalled_sleep, cap)
        self._unsignalled_sleep = sleep
        self._unsignalled_due = now + sleep

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
            token: fence for token, fence in self._armed.items() if not settled_now(fence)
        }


def settled_now(fence: FenceCore) -> bool:
    """Whether ``fence`` has settled, querying it if need be (a raise counts: sweeps report it)."""
    try:
        return fence.poll() != PENDING
    except Exception:
        return True
