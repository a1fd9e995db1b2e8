"""The thread-based fallback for parked waits, where the native shim is missing.

With the shim (:mod:`asyncfence._native`), each loop's poller watches its own
mailbox and no thread is involved. Without it (no C compiler at install, or
``ASYNCFENCE_NATIVE=0``), parked fences go to this module's one watcher thread:

* **CUDA**: a host function that is libc's own ``sem_post`` posts a POSIX
  semaphore (no Python, no GIL), on a side stream that first waits for the
  fence's event. The watcher sleeps on the semaphore.
* **OpenCL**: libc has no function an event callback could be, so the watcher
  polls parked OpenCL fences every ``poll_cap``.

Woken, the watcher queries the parked fences that can have completed and posts
the settled ones to their loops, one ``call_soon_threadsafe`` (or
``run_sync_soon``) per loop per batch. It also re-queries everything parked
every ``recheck_interval``: host functions never run after a CUDA context
fault. It starts on the first park and exits once nothing has been parked for
a while. This is the only module that starts a thread.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ._backend import NativeSignal
from ._config import current_config
from ._fence import ARMED, SETTLED
from ._fenceset import FenceSet

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ._fence import Fence

__all__ = ["Target", "Watcher", "WatcherStatistics", "current_watcher", "watcher_statistics"]

# The watcher thread exits after this long with nothing parked.
_IDLE_EXIT_S = 2.0
# The longest the watcher sleeps at once, whatever the configured intervals.
_LONGEST_SLEEP_S = 3600.0

_logger = logging.getLogger("asyncfence.watcher")


class Target(Protocol):
    """Where the watcher posts one loop's settled fences (its poller's mailbox)."""

    @property
    def closed(self) -> bool:
        """Whether the loop is gone; the watcher then forgets it."""
        ...

    def post(self, fences: list[Fence]) -> bool:
        """Hand ``fences`` to the loop from this thread; False if it is gone. Never raises."""
        ...


@dataclass(frozen=True, slots=True)
class WatcherStatistics:
    """A snapshot of the process's fallback watcher thread.

    With the native wake path in use it stays idle: all zeros.

    Attributes:
        running: Whether the watcher thread is alive.
        parked: Fences parked with it, across loops.
        unsignalled: Of those, fences without a completion signal, which it
            polls every ``poll_cap`` (OpenCL fences; CUDA where the driver
            has no host functions).
        wakeups: Times the thread woke (signals and re-checks).
        posts: Batches posted to loops.
    """

    running: bool = False
    parked: int = 0
    unsignalled: int = 0
    wakeups: int = 0
    posts: int = 0


class _Semaphore:
    """A POSIX semaphore in memory that is never freed, so late posts are safe."""

    _TIMESPEC = ctypes.c_long * 2
    _CLOCK_MONOTONIC = 1

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        libc.sem_post.argtypes = [ctypes.c_void_p]
        libc.sem_trywait.argtypes = [ctypes.c_void_p]
        self._clockwait = getattr(libc, "sem_clockwait", None)
        if self._clockwait is not None:
            self._clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        else:
            libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        # Host functions may still post after the interpreter is gone: plain
        # malloc, never freed (one per process).
        self.address = int(libc.malloc(64))
        if not self.address or libc.sem_init(self.address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._libc = libc
        self.signal: NativeSignal | None = NativeSignal(
            host_function=ctypes.cast(libc.sem_post, ctypes.c_void_p).value or 0,
            event_callback=0,  # no libc function has an event callback's signature
            argument=self.address,
        )

    def post(self) -> None:
        self._libc.sem_post(self.address)

    def wait(self, timeout: float) -> None:
        """Block (with the GIL released) until posted or ``timeout`` passes."""
        clockwait = self._clockwait
        now = time.clock_gettime(time.CLOCK_MONOTONIC) if clockwait else time.time()
        deadline = now + timeout
        seconds = int(deadline)
        stamp = self._TIMESPEC(seconds, int((deadline - seconds) * 1e9))
        if clockwait is not None:
            clockwait(self.address, self._CLOCK_MONOTONIC, ctypes.byref(stamp))
        else:
            self._libc.sem_timedwait(self.address, ctypes.byref(stamp))

    def drain(self) -> None:
        """Consume pending posts, so one batch of signals is one wakeup."""
        while self._libc.sem_trywait(self.address) == 0:
            pass


class _PythonSemaphore:
    """Where POSIX semaphores are missing: no native signal, so every parked fence is polled."""

    signal: NativeSignal | None = None

    def __init__(self) -> None:
        self._event = threading.Event()

    def post(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)

    def drain(self) -> None:
        self._event.clear()


def _make_semaphore() -> _Semaphore | _PythonSemaphore:
    try:
        return _Semaphore()
    except (OSError, AttributeError):
        return _PythonSemaphore()


class Watcher:
    """The process's parked fences, and the thread that watches them.

    Thread-safety: every method may be called from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked = FenceSet()
        self._targets: dict[Fence, tuple[Target, ...]] = {}
        self._saw_closed_target = False
        self._unsignalled: set[Fence] = set()
        self._armed: set[Fence] = set()
        self._semaphore = _make_semaphore()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._wakeups = 0
        self._posts = 0

    def park(self, fence: Fence, target: Target) -> None:
        """Watch ``fence`` for ``target``'s loop, arming its signal if new.

        The caller re-checks the fence after this returns, so a completion
        before the signal was armed is never lost.

        Raises:
            RuntimeError: The watcher thread could not be started; the fence
                is not parked.
        """
        with self._lock:
            targets = self._targets.get(fence, ())
            if target not in targets:
                self._targets[fence] = (*targets, target)
            new = self._parked.add(fence)
            to_arm = self._claim_signals([fence, self._parked.head(fence)]) if new else []
            if self._thread is not None and not self._thread.is_alive():
                _logger.error("asyncfence watcher thread found dead; restarting it")
                self._thread = None
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="asyncfence watcher", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    self._remove_target(fence, lambda known: known is target)
                    raise
                self._stopping = False
                self._thread = thread
        self._arm(to_arm)

    def _claim_signals(self, candidates: Iterable[Fence | None]) -> list[Fence]:
        """Under the lock: which of ``candidates`` need a signal armed now.

        Only the oldest parked fence of an in-order queue gets one; when it
        completes, the sweep finds what completed behind it and arms the new
        oldest. So arming costs one signal per queue, not one per fence.
        """
        claimed = []
        for fence in candidates:
            if (
                fence is not None
                and fence not in self._armed
                and fence not in self._unsignalled
                and self._parked.needs_own_signal(fence)
            ):
                self._armed.add(fence)
                claimed.append(fence)
        return claimed

    def _arm(self, fences: list[Fence]) -> None:
        """Arm each fence's completion signal (never under the lock)."""
        signal = self._semaphore.signal
        for fence in fences:
            outcome = None
            if signal is not None:
                try:
                    outcome = fence._arm(signal)
                except Exception as error:  # a faulted context: polling sees the fault
                    _logger.debug("arming %r failed (%s); polling it", fence, error)
            if outcome == ARMED:
                continue
            if outcome != SETTLED:
                with self._lock:
                    if fence in self._parked:
                        self._armed.discard(fence)
                        self._unsignalled.add(fence)
            self._semaphore.post()  # re-plan the wait: sweep now, poll what has no signal

    def unpark(self, fence: Fence, target: Target) -> None:
        """Stop watching ``fence`` for ``target``'s loop."""
        with self._lock:
            head = self._parked.head(fence)
            self._remove_target(fence, lambda known: known is target)
            to_arm = self._claim_signals([self._parked.head(head)] if head is fence else [])
        self._arm(to_arm)

    def _remove_target(self, fence: Fence, drop: Callable[[Target], bool]) -> None:
        """Under the lock: drop some of a fence's loops, and the fence with the last."""
        targets = tuple(target for target in self._targets.get(fence, ()) if not drop(target))
        if targets:
            self._targets[fence] = targets
            return
        self._targets.pop(fence, None)
        self._parked.discard(fence)
        self._unsignalled.discard(fence)
        self._armed.discard(fence)

    def _drop_closed_targets(self) -> None:
        """Under the lock: forget loops that are gone; other loops are unaffected."""
        self._saw_closed_target = False
        for fence in list(self._targets):
            self._remove_target(fence, lambda target: target.closed)

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException:  # never silently: a dead watcher would strand parked waits
            _logger.exception("asyncfence watcher thread failed; restarting on next park")
            with self._lock:
                self._thread = None
            raise

    def _watch(self) -> None:
        idle_since: float | None = None
        pruned_at = time.monotonic()
        while True:
            config = current_config()
            timeout = config.poll_cap if self._unsignalled else config.recheck_interval
            # Bounded: a sleep past what the OS timers can represent returns at once.
            self._semaphore.wait(min(timeout, _LONGEST_SLEEP_S))
            self._semaphore.drain()
            settled: dict[Target, list[Fence]] = {}
            collect = functools.partial(self._collect, settled)
            with self._lock:
                self._wakeups += 1
                if self._stopping:
                    self._thread = None
                    return
                now = time.monotonic()
                # Loops that went away without a post noticing (their pollers
                # collected): looked for once per re-check interval.
                if self._saw_closed_target or now - pruned_at >= config.recheck_interval:
                    pruned_at = now
                    self._drop_closed_targets()
                self._parked.sweep(collect)
                to_arm = self._claim_signals(self._parked.heads())
                if self._parked or settled:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                exiting = idle_since is not None and now - idle_since > _IDLE_EXIT_S
                if exiting:
                    self._thread = None  # a park from now on starts a new thread
            # Whatever this sweep collected is posted before anything else.
            for target, fences in settled.items():
                self._posts += 1
                if not target.post(fences):
                    self._saw_closed_target = True
            self._arm(to_arm)
            if exiting:
                return

    def _collect(
        self, settled: dict[Target, list[Fence]], fence: Fence, _unexpected: Exception | None
    ) -> None:
        """Sweep callback, under the lock: group a settled fence by loop.

        An unexpected error is left for the loop, whose poller queries again.
        """
        self._unsignalled.discard(fence)
        self._armed.discard(fence)
        for target in self._targets.pop(fence, ()):
            settled.setdefault(target, []).append(fence)

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to exit, and wait for it up to ``timeout``."""
        with self._lock:
            thread = self._thread
            self._stopping = True
        self._semaphore.post()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def statistics(self) -> WatcherStatistics:
        """Return a snapshot of the watcher's state and counters."""
        with self._lock:
            return WatcherStatistics(
                running=self._thread is not None,
                parked=len(self._parked),
                unsignalled=len(self._unsignalled),
                wakeups=self._wakeups,
                posts=self._posts,
            )


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def current_watcher() -> Watcher:
    """The process's watcher, made on first use."""
    global _watcher
    if _watcher is None:
        with _watcher_lock:
            if _watcher is None:
                _watcher = Watcher()
    return _watcher


def watcher_statistics() -> WatcherStatistics:
    """A snapshot of the process's fallback watcher; all zeros before its first use."""
    watcher = _watcher
    return watcher.statistics() if watcher is not None else WatcherStatistics()


@atexit.register
def _stop_at_exit() -> None:
    if _watcher is not None:
        _watcher.stop(timeout=0.5)


def _after_fork_in_child() -> None:
    # The parent's thread and loops do not exist here; start afresh.
    global _watcher, _watcher_lock
    _watcher = None
    _watcher_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
