"""One poller per event loop: every wait on that loop goes through it.

The poller is written once; a small loop driver (:mod:`asyncfence._loops`)
gives it the loop's primitives. It runs only on its loop's thread; other
threads reach it only through a mailbox.

What it does per strategy, how parked fences cost the loop nothing until
their completion signal writes the loop's mailbox fd, and the fallback watcher
thread (:mod:`asyncfence._watcher`) where the native shim is missing:
``docs/design.md`` ("Waiting", "The wake path") and ``docs/waiting.md``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from . import _fence
from ._backend import NativeSignal, signal_path
from ._config import Strategy, current_config
from ._fence import ARMED, FAILED, PENDING, SETTLED, UNSIGNALLED
from ._fenceset import FenceSet
from ._native import Shim, shim

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable

    from ._fence import Fence

__all__ = ["Chain", "LoopDriver", "Poller", "PollerStatistics", "ThreadMailbox", "Waiter"]

_logger = logging.getLogger("asyncfence.poller")

# First sleep once the spin budget is spent; sleeps double up to the cap.
_FIRST_SLEEP_S = 50e-6
# Fences parked per tick at most, yielding to the loop between batches.
_PARK_BATCH = 128
# Fired signals taken from the native mailbox per call into the shim.
_TAKE_BATCH = 256
# While re-checks find nothing new, their interval doubles up to this many
# times recheck_interval: with every fence signalled they are only a safety
# net, and each costs a device query per parked queue.
RECHECK_BACKOFF_LIMIT = 8

WakePath = Literal["native", "thread"]


class Waiter(Protocol):
    """One suspended wait, as its event loop resumes it."""

    def wake(self, error: BaseException | None) -> None:
        """Resume the wait, raising ``error`` in it if given. Never raises."""
        ...


class Chain(Protocol):
    """A callback that reschedules itself on the loop: the poller's ticks and re-checks.

    The driver calls ``step()``; it returns the seconds until the next call (0:
    as soon as the loop has run what is ready), or ``None`` to stop.
    """

    @property
    def running(self) -> bool:
        """Whether a call of ``step`` is scheduled."""
        ...

    def ensure(self, delay: float) -> None:
        """Have ``step`` called within ``delay`` seconds (sooner if already due)."""
        ...


class LoopDriver(Protocol):
    """What the poller needs of an event loop; one small class per loop library."""

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon (loop thread). On a loop that is gone, now."""
        ...

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon, from any thread.

        Raises:
            RuntimeError: The loop is closed, or its run finished.
        """
        ...

    def chain(self, step: Callable[[], float | None]) -> Chain:
        """A chain that calls ``step`` on the loop (see :class:`Chain`)."""
        ...

    def watch_readable(self, fd: int, on_readable: Callable[[], bool]) -> bool:
        """Call ``on_readable`` on the loop whenever ``fd`` is readable, for the loop's life.

        When it returns True it left ``fd`` readable on purpose, to be called
        again once the tasks it woke have run: the driver makes sure that the
        repeat call comes after them.

        Returns:
            False if this loop cannot watch file descriptors.
        """
        ...

    def is_closed(self) -> bool:
        """Whether the loop is known to be gone (closed); safe from any thread."""
        ...


@dataclass(frozen=True, slots=True)
class PollerStatistics:
    """A snapshot of one event loop's waits.

    Attributes:
        pending_fences: Fences that at least one task on this loop awaits.
        waiters: Tasks waiting on them.
        queues: Streams or queues of the fences being polled.
        parked: Fences parked rather than polled.
        ticks: Checks made since the poller was created.
        queries: Device queries its ticks made.
        tick_seconds: Time spent in those ticks, in seconds.
        running: Whether the poller is scheduled to tick again.
        wake_path: How parked waits on this loop are woken: ``"native"`` (the
            shim writes the loop's own mailbox fd; no thread involved) or
            ``"thread"`` (the fallback watcher thread).
        armed: Parked fences whose completion signal is armed.
        signals: Completion signals received.
        rechecks: Periodic re-checks of the parked fences.
        cuda_signal: How parked CUDA fences are signalled: ``"v2"``
            (``cuLaunchHostFunc_v2``), ``"v1"`` (the driver's raw
            ``cuLaunchHostFunc``), ``"polling"`` (neither exists), or
            ``None`` before the first CUDA fence parked.
    """

    pending_fences: int = 0
    waiters: int = 0
    queues: int = 0
    parked: int = 0
    ticks: int = 0
    queries: int = 0
    tick_seconds: float = 0.0
    running: bool = False
    wake_path: WakePath = "native"
    armed: int = 0
    signals: int = 0
    rechecks: int = 0
    cuda_signal: Literal["v2", "v1", "polling"] | None = None


def _cuda_signal() -> Literal["v2", "v1", "polling"] | None:
    path = signal_path("cuda")
    if path == "none":
        return "polling"
    return path if path in ("v2", "v1") else None  # type: ignore[return-value]


# -- mailboxes: how completions reach a loop -------------------------------------------


class NativeMailbox:
    """A loop's mailbox in the shim: a fd its selector watches, and the signals that fired.

    Thread-safety: the shim's signals may fire on any thread; every method
    here belongs to the loop's thread.
    """

    def __init__(self, native: Shim) -> None:
        self._shim = native
        self._library = native.library
        self._take = native.take
        self._take_undrained = native.take_undrained
        self._generation = _fence._generation  # bumped in a forked child
        handle = self._library.af_mailbox_new()
        if not handle:
            raise OSError(ctypes.get_errno(), "cannot create the native mailbox")
        self._handle: int = handle
        self._tokens = (ctypes.c_uint64 * _TAKE_BATCH)()
        # Built once: the call on the wake path converts nothing.
        self._take_arguments = (
            ctypes.c_void_p(handle),
            self._tokens,
            ctypes.c_size_t(_TAKE_BATCH),
        )
        # Closed with its poller: the shim keeps the fd open while any
        # signal can still fire, so a late write never lands elsewhere. Never
        # at interpreter exit, from the main thread, while its loop may still
        # run on another (a daemon thread): a process's exit frees it anyway.
        self._finalizer = weakref.finalize(self, self._library.af_mailbox_close, handle)
        self._finalizer.atexit = False

    def fileno(self) -> int:
        """The fd that turns readable when a signal fired."""
        return int(self._library.af_mailbox_fd(self._handle))

    def signal(self, token: int) -> tuple[NativeSignal, int]:
        """A signal that posts ``token`` here, and its slot (to discard if unused).

        Raises:
            MemoryError: The shim could not allocate the slot.
        """
        slot = self._library.af_slot_new(self._handle, token)
        if not slot:
            raise MemoryError("the native shim could not allocate a signal slot")
        return NativeSignal(self._shim.fire, self._shim.opencl_callback, slot), slot

    def discard(self, slot: int) -> None:
        """Free a slot whose signal was never armed."""
        self._library.af_slot_discard(slot)

    def take(self) -> list[int]:
        """The tokens of the signals fired since the last take: the fd drained, then the list."""
        return self._take_with(self._take)

    def take_undrained(self) -> list[int]:
        """The same, without draining the fd: a system call less.

        If it returns any, the fd stays readable, so the loop calls back;
        :meth:`take` then drains it.
        """
        return self._take_with(self._take_undrained)

    def _take_with(self, take: Callable[..., int]) -> list[int]:
        if self._generation != _fence._generation:
            return []  # a forked child: the parent's mailbox is not ours
        count = take(*self._take_arguments)
        taken: list[int] = self._tokens[:count]
        while count == _TAKE_BATCH:
            count = take(*self._take_arguments)
            taken += self._tokens[:count]
        return taken


def _weakly(function: Callable[..., object]) -> Callable[[], Callable[..., Any] | None]:
    """A weak reference to a bound method; a strong one to anything else."""
    if hasattr(function, "__self__") and hasattr(function, "__func__"):
        return weakref.WeakMethod(function)

    def strongly() -> Callable[..., Any]:
        return function

    return strongly


class ThreadMailbox:
    """Where the fallback watcher thread posts settled fences for one event loop.

    Posts from any thread are coalesced: one call onto the loop delivers all
    that arrived meanwhile.

    Thread-safety: :meth:`post` may be called from any thread.
    """

    def __init__(
        self,
        call_soon_threadsafe: Callable[[Callable[[], None]], object],
        deliver: Callable[[list[Fence]], None],
        is_closed: Callable[[], bool] | None = None,
    ) -> None:
        # Weakly, where they are methods: the watcher thread holds mailboxes,
        # and must never keep a closed loop's poller (and, through its
        # waiters, the loop itself) alive.
        self._call_soon_threadsafe = _weakly(call_soon_threadsafe)
        self._deliver = _weakly(deliver)
        self._is_closed = None if is_closed is None else _weakly(is_closed)
        self._lock = threading.Lock()
        self._fences: list[Fence] = []
        self._scheduled = False
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the loop is gone: closed, its poller collected, or a post refused."""
        if self._closed or self._deliver() is None:
            return True
        is_closed = None if self._is_closed is None else self._is_closed()
        return is_closed is not None and is_closed()

    def post(self, fences: list[Fence]) -> bool:
        """Hand ``fences`` to the loop. Never raises.

        Returns:
            False if the loop is gone (closed, or its run finished).
        """
        with self._lock:
            if self._closed:
                return False
            self._fences.extend(fences)
            if self._scheduled:
                return True
            self._scheduled = True
        try:
            call_soon_threadsafe = self._call_soon_threadsafe()
            if call_soon_threadsafe is None:
                raise RuntimeError("the event loop is gone")
            call_soon_threadsafe(self._drain)
        except RuntimeError:  # a closed asyncio loop; trio's RunFinishedError
            with self._lock:
                self._closed = True
                self._fences.clear()
            return False
        return True

    def _drain(self) -> None:
        with self._lock:
            fences, self._fences = self._fences, []
            self._scheduled = False
        deliver = self._deliver()
        if deliver is not None:
            deliver(fences)


# -- parking: how parked fences are watched ------------------------------------------------


class _NativeParking:
    """A loop's parked fences, signalled through its native mailbox. Loop thread only."""

    wake_path: WakePath = "native"

    def __init__(self, poller: Poller, native: Shim, driver: LoopDriver) -> None:
        self._poller = poller
        self._driver = driver
        self._mailbox = NativeMailbox(native)
        self._parked = FenceSet()
        # Fences whose signal could not be armed: polled every poll_cap.
        self._unsignalled: set[Fence] = set()
        # Armed signals not yet fired, both ways: token by id(fence), fence by
        # token. Weak: a fence whose waiters left is never kept alive by its
        # signal (its collection forgets both); re-parked, it reuses it.
        self._token_of: dict[int, int] = {}
        self._fence_of: dict[int, weakref.ref[Fence]] = {}
        self._tokens = itertools.count(1)
        self._rearm_scheduled = False
        # Fences whose signal fired, for the rest of the wake.
        self._fired: list[Fence] = []
        self._rest_pending = False
        self._recheck = driver.chain(self._recheck_step)
        self._recheck_backoff = 1  # times recheck_interval; see RECHECK_BACKOFF_LIMIT
        self.signals = 0
        self.rechecks = 0
        if not driver.watch_readable(self._mailbox.fileno(), self._on_readable):
            raise OSError("this event loop cannot watch file descriptors")

    def __len__(self) -> int:
        # Not counting the fences woken whose rest of the wake has not run yet.
        woken = sum(1 for fence in self._fired if fence._state != PENDING and fence in self._parked)
        return len(self._parked) - woken

    @property
    def armed(self) -> int:
        """Parked fences with an armed signal."""
        return sum(1 for ref in self._fence_of.values() if ref() in self._parked)

    def park(self, fence: Fence) -> None:
        for fired in self._fired:
            # A task woken a moment ago parks again before the rest of its
            # wake ran: the settled fences leave the set now, so that this one
            # can be the oldest of its queue and get its signal at once.
            if fired._state != PENDING:
                self._parked.discard(fired)
        if not self._parked.add(fence):
            return
        self._recheck_backoff = 1  # a new wait gets the prompt re-check
        self._recheck.ensure(self._recheck_delay())
        # Armed first, checked second (in _arm, for the fence that gets the
        # signal); swept on the next loop turn: the waiter may not be
        # suspended yet.
        self._arm([fence])
        armed = self._has_signal(fence)  # then _arm has checked it
        if not armed and (fence._state != PENDING or self._settled_now(fence)):
            self._driver.call_soon(lambda: self._sweep([fence._queue.key]))

    @staticmethod
    def _settled_now(fence: Fence) -> bool:
        try:
            return fence._poll() != PENDING
        except Exception:  # the sweep will hand it to the waiters
            return True

    def unpark(self, fence: Fence) -> None:
        if fence not in self._parked:
            return
        was_head = self._parked.needs_own_signal(fence)
        self._parked.discard(fence)
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
        self._arm(self._parked.heads())

    def _arm(self, candidates: Iterable[Fence]) -> None:
        """Arm a signal for each candidate that needs one and has none.

        Armed first, checked second: a fence that completed meanwhile, or that
        another thread or loop settled (its marker is gone, so no signal will
        come), is swept on the next loop turn.
        """
        settled: set[Hashable] = set()
        for fence in candidates:
            if (
                self._has_signal(fence)
                or fence in self._unsignalled
                or not self._parked.needs_own_signal(fence)
            ):
                continue
            if not self._arm_one(fence):
                self._unsignalled.add(fence)
                self._recheck.ensure(current_config().poll_cap)
            if fence._state != PENDING or self._settled_now(fence):
                settled.add(fence._queue.key)
        if settled:
            self._driver.call_soon(functools.partial(self._sweep, settled))

    def _arm_one(self, fence: Fence) -> bool:
        """Arm ``fence``'s signal; False if it must be polled instead."""
        token = next(self._tokens)
        try:
            signal, slot = self._mailbox.signal(token)
        except MemoryError:
            return False
        try:
            outcome = fence._arm(signal)
        except Exception as error:  # a faulted CUDA context, say: polling sees the fault
            _logger.debug("arming %r failed (%s); polling it", fence, error)
            outcome = UNSIGNALLED
        if outcome != ARMED:
            self._mailbox.discard(slot)
            return outcome == SETTLED  # settled: the caller's check sweeps it
        self._token_of[id(fence)] = token
        self._fence_of[token] = weakref.ref(
            fence, functools.partial(self._forget_token, token, id(fence))
        )
        return True

    def _has_signal(self, fence: Fence) -> bool:
        """Whether ``fence`` has an armed signal that has not fired yet."""
        token = self._token_of.get(id(fence))
        ref = None if token is None else self._fence_of.get(token)
        return ref is not None and ref() is fence

    def _forget_token(self, token: int, fence_id: int, _dead: object) -> None:
        """A fence with an armed signal was collected: its token means nothing now."""
        self._fence_of.pop(token, None)
        self._token_of.pop(fence_id, None)

    def _on_readable(self) -> bool:
        """The mailbox fd is readable: some signals fired. Called twice per wake.

        The first call runs on a loop thread that was just woken, when every
        line costs the most, so it does only what the woken tasks need: it
        takes the signals without draining the fd, queries each fence that
        fired and wakes its waiters if it settled. It returns True: the fd
        stays readable, and the driver calls again once the woken tasks have
        run. That call drains the fd, wakes what fired meanwhile, and does the
        rest (:meth:`_after_signals`). With a single signal armed, the first
        call does not even ask the shim which fired: a foreign call is the
        costliest line there.
        """
        if self._rest_pending:
            self._rest_pending = False
            self._wake_fired(self._mailbox.take())
            self._after_signals()
            return False
        # With one signal armed, it is the one that fired: no need to ask the
        # shim. Should its fence be pending still (a collected fence's signal
        # made the fd readable, say), the rest of the wake arms it again.
        sole = list(self._fence_of) if len(self._fence_of) == 1 else None
        if self._wake_fired(sole or self._mailbox.take_undrained()):
            self._rest_pending = True
            return True
        # Nothing taken (a leftover from a wake a waker raised through): drain
        # the fd, and finish at once what that finds.
        self._wake_fired(self._mailbox.take())
        if self._fired:
            self._after_signals()
        return False

    def _wake_fired(self, tokens: list[int]) -> int:
        """Wake the waiters of the fences these signals belong to, if settled; how many."""
        poller = self._poller
        fired = self._fired
        for token in tokens:
            ref = self._fence_of.pop(token, None)
            fence = None if ref is None else ref()
            if fence is None:
                continue  # its waiters left and it is gone: harmless
            self._token_of.pop(id(fence), None)
            self.signals += 1
            fired.append(fence)
            poller._wake_if_settled(fence)
        return len(tokens)

    def _after_signals(self) -> None:
        """The rest of a wake: sweep the queues that progressed, tidy up, arm what is next.

        A fired fence's queue progressed at least that far, so it is swept
        even if that fence's own waits have left (others behind it may be
        done); a fence whose signal came early is armed again.
        """
        fired, self._fired = self._fired, []
        parked = self._parked
        keys = {fence._queue.key for fence in fired}
        try:
            parked.sweep(self._poller._parked_settled, keys)
        finally:
            for fence in fired:
                self._poller._tidy_woken(fence)
                fence._release_if_settled()
            self._arm_heads({key for key in keys if parked.has_queue(key)})

    def _sweep(self, keys: Iterable[Hashable] | None) -> None:
        """Query the parked fences of ``keys`` (every queue if ``None``) and wake the settled.

        The queues where something settled get their new oldest fence armed.
        """
        progressed: set[Hashable] = set()

        def settled(fence: Fence, unexpected: Exception | None) -> None:
            progressed.add(fence._queue.key)
            self._poller._parked_settled(fence, unexpected)

        self._parked.sweep(settled, None if keys is None else set(keys))
        if progressed:
            self._arm_heads(progressed)

    def _arm_heads(self, keys: set[Hashable] | None) -> None:
        self._arm(self._parked.heads(keys))

    def _recheck_delay(self) -> float:
        config = current_config()
        if self._unsignalled:
            return config.poll_cap
        return config.recheck_interval * self._recheck_backoff

    def _recheck_step(self) -> float | None:
        if self._fired and not self._rest_pending:
            self._after_signals()  # left by a wake that a waker raised through
        if not self._parked:
            return None
        self.rechecks += 1
        parked = len(self._parked)
        self._sweep(None)
        if len(self._parked) < parked:  # something settled: back to the prompt re-check
            self._recheck_backoff = 1
        else:
            self._recheck_backoff = min(2 * self._recheck_backoff, RECHECK_BACKOFF_LIMIT)
        return self._recheck_delay() if self._parked else None


class _ThreadParking:
    """A loop's parked fences, handed to the fallback watcher thread. Loop thread only."""

    wake_path: WakePath = "thread"

    def __init__(self, poller: Poller, driver: LoopDriver) -> None:
        from ._watcher import current_watcher

        self._current_watcher = current_watcher
        self._driver = driver
        self._mailbox = ThreadMailbox(driver.call_soon_threadsafe, poller.deliver, driver.is_closed)
        self._parked: set[Fence] = set()
        self._unpark_soon: set[Fence] = set()
        self.signals = 0
        self.rechecks = 0
        self.armed = 0

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, fence: Fence) -> None:
        if fence in self._parked:
            return
        if fence in self._unpark_soon:  # still parked with the watcher, signal armed
            self._unpark_soon.discard(fence)
            self._parked.add(fence)
            return
        self._current_watcher().park(fence, self._mailbox)  # may raise: nothing parked
        self._parked.add(fence)
        # Armed first, checked second; through the mailbox, never synchronously.
        try:
            settled = fence._poll() != PENDING
        except Exception:  # deliver() will hand it to the waiters
            settled = True
        if settled:
            self._mailbox.post([fence])

    def unpark(self, fence: Fence) -> None:
        if fence not in self._parked:
            return
        self._parked.discard(fence)
        if self._driver.is_closed():
            # A wait abandoned on a closed loop, being collected, perhaps on
            # the watcher's own thread (by the garbage collector, with the
            # watcher's lock held): never call into the watcher from here.
            # It drops a closed loop's fences itself.
            self._unpark_soon.discard(fence)
            return
        # Batched, and after the woken tasks have run: off the wake path.
        first = not self._unpark_soon
        self._unpark_soon.add(fence)
        if first:
            self._driver.call_soon(self._flush_unparks)

    def _flush_unparks(self) -> None:
        fences, self._unpark_soon = self._unpark_soon, set()
        watcher = self._current_watcher()
        for fence in fences:
            try:
                watcher.unpark(fence, self._mailbox)
            except Exception:  # the others are still unparked
                _logger.exception("unparking %r raised; the others go on", fence)


# -- the poller --------------------------------------------------------------------------------


class Poller:
    """The waits of one event loop, on the primitives its driver gives.

    Thread-safety: loop thread only.
    """

    def __init__(self, driver: LoopDriver) -> None:
        self._driver = driver
        self._waiters: dict[Fence, dict[Waiter, Strategy]] = {}
        self._waiter_count = 0
        # Fences with at least one "poll" waiter: polled for as long as they wait.
        self._eager: dict[Fence, int] = {}
        # Polled fences only "auto" waits want: parked once the spin budget is spent.
        self._auto_only: set[Fence] = set()
        self._polled = FenceSet()
        self._parking: _NativeParking | _ThreadParking | None = None
        self._ticks_chain = driver.chain(self.tick)
        self._spin_until = 0.0
        self._next_sleep = _FIRST_SLEEP_S
        self._ticks = 0
        self._queries = 0
        self._tick_seconds = 0.0
        self._warned_unparkable = False

    # -- for the drivers and the drop queue ------------------------------------------------

    @property
    def driver(self) -> LoopDriver:
        """The loop's driver."""
        return self._driver

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon (loop thread); now if the loop is gone."""
        self._driver.call_soon(callback)

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the loop soon, from any thread.

        Raises:
            RuntimeError: The loop is closed, or its run finished.
        """
        self._driver.call_soon_threadsafe(callback)

    # -- waits -------------------------------------------------------------------------------

    def add(self, fence: Fence, waiter: Waiter, strategy: Strategy) -> None:
        """Register ``waiter`` to be woken once ``fence`` settles. Never raises.

        Where a fence cannot be parked (a thread that cannot start, say), it
        is polled instead: the wait is slower, never lost.
        """
        self._waiters.setdefault(fence, {})[waiter] = strategy
        self._waiter_count += 1
        if strategy == "park":
            if self._park(fence):
                return
            strategy = "poll"  # polled instead, for as long as it waits
            self._waiters[fence][waiter] = strategy
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
        if self._parking is not None:
            self._parking.unpark(fence)

    def _park(self, fence: Fence) -> bool:
        """Park ``fence``; False if it cannot be (then it must be polled)."""
        try:
            parking = self._parking
            if parking is None:
                parking = self._parking = self._new_parking()
            parking.park(fence)
        except Exception as error:
            if not self._warned_unparkable:
                self._warned_unparkable = True
                _logger.warning("cannot park fences on this loop (%s); polling them instead", error)
            return False
        return True

    def _new_parking(self) -> _NativeParking | _ThreadParking:
        native = shim()
        if native is not None:
            try:
                parking: _NativeParking | _ThreadParking = _NativeParking(
                    self, native, self._driver
                )
            except OSError as error:
                _logger.warning(
                    "native wake path unavailable on this loop (%s); using a thread", error
                )
            else:
                _logger.debug("parked waits on this loop wake natively")
                return parking
        _logger.debug("parked waits on this loop wake through the watcher thread")
        return _ThreadParking(self, self._driver)

    def tick(self) -> float | None:
        """Check the polled fences once and wake the waiters of those settled.

        Returns:
            Seconds until the next tick (0 to yield and check again at once),
            or ``None`` when nothing is left to poll and the poller should stop.
        """
        started = time.perf_counter()
        try:
            return self._tick(started)
        finally:
            self._ticks += 1
            self._tick_seconds += time.perf_counter() - started

    def _tick(self, now: float) -> float | None:
        self._queries += self._polled.sweep(self._wake_all)
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

    def _parked_settled(self, fence: Fence, unexpected: Exception | None) -> None:
        """A parked fence found settled (the native path's sweeps)."""
        if fence in self._waiters:
            self._wake_all(fence, unexpected)

    def _wake_if_settled(self, fence: Fence) -> None:
        """Query ``fence`` and, if it settled, wake its waiters now.

        The rest waits: the fence is forgotten by :meth:`_tidy_woken`, and its
        marker released by ``fence._release_if_settled()``.
        """
        if fence not in self._waiters:
            return
        unexpected = None
        try:
            if fence._poll(keep_marker=True) == PENDING:
                return
        except Exception as error:  # a backend bug must reach the waiters
            unexpected = error
        self._wake(fence, self._take_waiters(fence), unexpected)

    def _tidy_woken(self, fence: Fence) -> None:
        """After :meth:`_wake_if_settled`: forget the fence, if nothing else waits for it."""
        if fence not in self._waiters:
            self._forget(fence)

    def _wake_all(self, fence: Fence, unexpected: Exception | None) -> None:
        waiters = self._take_waiters(fence)
        self._forget(fence)
        self._wake(fence, waiters, unexpected)

    def _take_waiters(self, fence: Fence) -> dict[Waiter, Strategy]:
        waiters = self._waiters.pop(fence, None) or {}
        self._waiter_count -= len(waiters)
        return waiters

    def _wake(
        self, fence: Fence, waiters: dict[Waiter, Strategy], unexpected: Exception | None
    ) -> None:
        if not waiters:
            return
        failed = fence._state == FAILED
        surfaced: BaseException | None = None
        for waiter in waiters:
            try:
                # Each waiter its own copy of the failure, with its own traceback.
                waiter.wake(unexpected or (fence._error() if failed else None))
            except (KeyboardInterrupt, SystemExit) as interrupt:
                surfaced = surfaced or interrupt  # after the others are woken
            except BaseException:  # a waker must not raise; the others go on
                _logger.exception("waking a waiter of %r raised; the others are woken", fence)
        if surfaced is not None:
            raise surfaced

    def statistics(self) -> PollerStatistics:
        """Return a snapshot of this loop's waits and counters."""
        parking = self._parking
        return PollerStatistics(
            pending_fences=len(self._waiters),
            waiters=self._waiter_count,
            queues=self._polled.queue_count,
            parked=0 if parking is None else len(parking),
            ticks=self._ticks,
            queries=self._queries,
            tick_seconds=self._tick_seconds,
            running=self._ticks_chain.running,
            wake_path=(
                parking.wake_path
                if parking is not None
                else ("native" if shim() is not None else "thread")
            ),
            armed=0 if parking is None else parking.armed,
            signals=0 if parking is None else parking.signals,
            rechecks=0 if parking is None else parking.rechecks,
            cuda_signal=_cuda_signal(),
        )
