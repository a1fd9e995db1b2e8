"""Fences: recorded points on a device stream that code can wait for."""

from __future__ import annotations

import copy
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Final, NoReturn, final

from ._backend import Backend, QueueInfo, backend_for
from ._config import Strategy, check_strategy, check_timeout, current_config
from ._exceptions import DeviceError, FenceError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Generator

    from typing_extensions import Self

    from ._backend import NativeSignal

__all__ = ["ARMED", "DONE", "FAILED", "PENDING", "SETTLED", "UNSIGNALLED", "Fence", "record"]

PENDING: Final = 0
DONE: Final = 1
FAILED: Final = 2

# What Fence._arm found: a signal armed, none possible (poll it), or settled already.
ARMED: Final = "armed"
UNSIGNALLED: Final = "unsignalled"
SETTLED: Final = "settled"

# Guards state changes only, never a driver call: the one-way transition out
# of PENDING (so that exactly one thread releases a marker), and the pins that
# keep a marker from being released while a driver call uses it (a pooled
# CUDA event may be recording other work once released).
_settle_lock = threading.Lock()
# Record order within a queue; a global counter is enough to order each queue.
# Taken with the record, under the queue's lock: two threads recording on one
# queue must number their fences in the order the queue received them, since
# waits trust that order (the oldest fence of an in-order queue completes
# first). Striped, so that records on different queues rarely wait for each
# other (a record may block in the driver while its stream's queue is full).
_sequence = itertools.count()
_RECORD_STRIPES = 64
_record_locks = tuple(threading.Lock() for _ in range(_RECORD_STRIPES))

# wait_sync sleeps between polls, the sleep doubling up to this.
_BLOCKING_SLEEP_CAP_S = 1e-3

# fork(): device runtimes do not survive it (their threads stay behind, their
# locks may be held), so a child must not touch what the parent used. The
# poller's native mailboxes read _generation too.
_generation = 0
_used_backends: set[str] = set()
_backends_of_parent: frozenset[str] = frozenset()

_FORK_ADVICE = (
    "device runtimes do not survive fork(); start processes that use the device "
    "with the 'spawn' or 'forkserver' start method"
)


def _after_fork_in_child() -> None:
    global _generation, _backends_of_parent, _settle_lock, _record_locks
    _generation += 1
    _backends_of_parent = frozenset(_used_backends)
    # Another thread of the parent may have held them at the fork.
    _settle_lock = threading.Lock()
    _record_locks = tuple(threading.Lock() for _ in range(_RECORD_STRIPES))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@final
class Fence:
    """A point on a device stream; awaiting it resumes once the device passed it.

    Make one with :func:`asyncfence.record`. A fence is recorded when it is
    made, so there is no empty fence to wait on by mistake. Once the device
    has passed it, it stays done: waiting again returns at once.

    Cancellation: cancelling a wait cancels no device work and leaves other
    waiters on the same fence waiting.

    Thread-safety: :meth:`done`, :meth:`wait_sync` and :meth:`enqueue_wait`
    may be called from any thread. ``await`` it from any event loop; several
    loops may await one fence at once.
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_failure",
        "_generation",
        "_marker",
        "_pins",
        "_queue",
        "_seq",
        "_state",
    )

    _backend: Backend[Any]
    _marker: Any
    _pins: int
    _queue: QueueInfo
    _seq: int
    _state: int
    _failure: DeviceError | None
    _generation: int

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        raise TypeError("fences are made by asyncfence.record(stream)")

    @classmethod
    def _new(cls, backend: Backend[Any], marker: Any, queue: QueueInfo, seq: int) -> Self:
        fence = object.__new__(cls)
        fence._backend = backend
        fence._marker = marker
        fence._pins = 0
        fence._queue = queue
        fence._seq = seq
        fence._state = PENDING
        fence._failure = None
        fence._generation = _generation
        return fence

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<asyncfence.Fence {self._backend.name} #{self._seq} {state}>"

    def __del__(self) -> None:
        marker = self._marker
        # In a forked child the parent's runtime may hold locks: leave it be.
        if marker is not None and self._generation == _generation:
            self._backend.release(marker)

    # -- state ----------------------------------------------------------------

    def _poll(self, *, keep_marker: bool = False) -> int:
        """Query the device unless already settled; returns the state.

        Args:
            keep_marker: Leave the marker of a fence this call settles
                unreleased, for :meth:`_release_if_settled` to release later
                (off a loop's wake path).

        Raises:
            FenceError: The fence was recorded before this process forked.
        """
        if self._state != PENDING:
            return self._state
        if self._generation != _generation:
            raise FenceError(f"{self!r} was recorded before fork(): {_FORK_ADVICE}")
        marker = self._marker
        if marker is None:  # settled by another thread since the check above
            return self._state
        try:
            if not self._backend.query(marker):
                # Re-read: settled meanwhile by another thread, the marker may
                # since answer for someone else's work.
                return self._state
        except DeviceError as error:
            self._settle(FAILED, error, keep_marker=keep_marker)
        else:
            self._settle(DONE, None, keep_marker=keep_marker)
        return self._state

    def _settle(
        self, state: int, failure: DeviceError | None, *, keep_marker: bool = False
    ) -> None:
        with _settle_lock:
            if self._state != PENDING:
                return
            # State first, marker last: a thread reading without the lock that
            # finds no marker then always finds the fence settled.
            self._failure = failure
            self._state = state
            if self._pins or keep_marker:
                return  # a driver call still uses the marker, or it is released later
            marker, self._marker = self._marker, None
        assert marker is not None
        self._backend.release(marker)

    def _release_if_settled(self) -> None:
        """Release the marker of a settled fence, unless a driver call still uses it."""
        with _settle_lock:
            if self._pins or self._state == PENDING:
                return
            marker, self._marker = self._marker, None
        if marker is not None:
            self._backend.release(marker)

    def _pin(self) -> Any:
        """The marker, kept from release until :meth:`_unpin`; ``None`` if settled."""
        with _settle_lock:
            marker = self._marker
            if marker is None or self._state != PENDING:
                return None
            self._pins += 1
            return marker

    def _unpin(self) -> None:
        with _settle_lock:
            self._pins -= 1
        self._release_if_settled()

    def _error(self) -> DeviceError:
        """A fresh copy of the failure, so each waiter gets its own traceback."""
        failure = self._failure
        assert failure is not None
        return copy.copy(failure).with_traceback(None)

    def _arm(self, signal: NativeSignal) -> str:
        """Have the runtime call ``signal`` once the device passes this fence.

        Returns:
            :data:`ARMED`, :data:`UNSIGNALLED` (the runtime cannot call it:
            poll instead), or :data:`SETTLED` (nothing to wait for).

        Raises:
            DeviceError: The runtime refused (a faulted CUDA context, say).
        """
        marker = self._pin()
        if marker is None:
            return SETTLED
        try:
            armed = self._backend.arm(marker, self._queue, signal)
        finally:
            self._unpin()
        return ARMED if armed else UNSIGNALLED

    def _raise_failure(self) -> NoReturn:
        raise self._error()

    # -- public API ------------------------------------------------------------

    def done(self) -> bool:
        """Whether the device has passed this fence. Never blocks.

        Raises:
            DeviceError: The work before the fence failed.
        """
        state = self._poll()
        if state == FAILED:
            self._raise_failure()
        return state == DONE

    def wait_sync(self, timeout: float | None = None) -> None:
        """Block the calling thread until the device has passed this fence.

        For synchronous code and worker threads; in a coroutine, ``await`` the
        fence instead. The wait stays interruptible (``KeyboardInterrupt``).

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.

        Raises:
            TimeoutError: The timeout expired first. The fence stays valid.
            DeviceError: The work before the fence failed.
        """
        limit = check_timeout(timeout)
        # The runtimes' own blocking waits cannot be timed out or interrupted
        # (cuEventSynchronize busy-waits; clWaitForEvents takes no timeout), so
        # this sleeps between polls, doubling from 20 µs up to a millisecond:
        # next to no CPU, and Ctrl-C gets through. It polls the fence, never
        # its marker: another thread may settle the fence meanwhile, and a
        # pooled CUDA event is then recording someone else's work.
        deadline = time.monotonic() + limit
        sleep = 20e-6
        while True:
            state = self._poll()
            if state == DONE:
                return
            if state == FAILED:
                self._raise_failure()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self!r} did not complete within {timeout} s")
            time.sleep(min(sleep, remaining))
            sleep = min(sleep * 2, _BLOCKING_SLEEP_CAP_S)

    def enqueue_wait(self, stream: object) -> None:
        """Make ``stream`` wait on the device for this fence. Never blocks the host.

        Work queued on ``stream`` after this call starts only once the device
        has passed the fence. A fence already done adds nothing. Should the
        work before the fence fail later, the device fails or stops that
        stream's later work too (OpenCL propagates the failure; CUDA errors
        are sticky for the whole context).

        Args:
            stream: A stream of the same backend as the fence. OpenCL queues
                must also share the fence's context; CUDA streams may be on
                any context or device.

        Raises:
            TypeError: ``stream`` is not a stream of the fence's backend.
            ValueError: ``stream`` cannot wait for this fence (other context).
            DeviceError: The work before the fence failed. On OpenCL, if it
                failed while this call ran, the waiting queue may never run
                its later work: PoCL never fails a command queued behind an
                event that had already failed.
        """
        if not self._backend.claims(stream):
            raise TypeError(
                f"{self._backend.title} fences can only be waited on by "
                f"{self._backend.accepts}; got {type(stream).__qualname__} object"
            )
        # Whatever the fence's state: whether a program errors must not
        # depend on how fast the device was.
        self._backend.check_stream(self._queue, stream)
        # Settled first: a stream told to wait for a fence that already failed
        # may never run again (OpenCL), so that failure is raised instead.
        if self._poll() == FAILED:
            self._raise_failure()
        marker = self._pin()
        if marker is not None:
            try:
                self._backend.stream_wait(marker, self._queue, stream)
            finally:
                self._unpin()
            return
        if self._state == FAILED:
            self._raise_failure()

    async def wait(self, timeout: float | None = None, *, strategy: Strategy | None = None) -> None:
        """Wait until the device has passed this fence, without blocking the loop.

        Works under asyncio (uvloop included) and trio, and so under anyio. No
        thread is spent on the wait. It is always a checkpoint, even when the
        fence is already done.

        Cancellation: cancelling the wait cancels no device work and does not
        disturb other tasks waiting on the fence; the cancellation propagates.

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.
            strategy: ``"auto"``, ``"poll"`` or ``"park"``; ``None`` uses the
                process-wide default (see :func:`asyncfence.configure`).

        Raises:
            TimeoutError: The timeout expired first. The fence stays valid and
                can be awaited again.
            DeviceError: The work before the fence failed.
            ValueError: ``strategy`` is not a known strategy.
        """
        seconds = check_timeout(timeout)
        chosen = current_config().strategy if strategy is None else check_strategy(strategy)
        await (_wait_for_fence or _bind_wait())(self, seconds, chosen)

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()


# The loops' wait, bound on first use: _loops imports this module, and this
# is the one call back up (waiting needs the loop layer; fences do not).
_wait_for_fence: Callable[[Fence, float, Strategy], Awaitable[None]] | None = None


def _bind_wait() -> Callable[[Fence, float, Strategy], Awaitable[None]]:
    global _wait_for_fence
    from ._loops import wait_for_fence

    _wait_for_fence = wait_for_fence
    return wait_for_fence


def record(stream: object) -> Fence:
    """Record a fence at the current end of the work queued on ``stream``.

    Args:
        stream: A ``pyopencl.CommandQueue``, or a CUDA stream.

    Returns:
        A fence that completes once the device has passed all work queued on
        ``stream`` before this call.

    Raises:
        TypeError: ``stream`` is not a stream any backend accepts; the message
            names the accepted types.
        DeviceError: The backend failed to record.
        FenceError: This process was forked after the backend was used.

    Thread-safety: safe to call from any thread; the fence may be awaited on
    any loop.
    """
    backend = backend_for(stream)
    if backend.name in _backends_of_parent:
        raise FenceError(f"{backend.name} was in use before fork(): {_FORK_ADVICE}")
    with _record_locks[hash(backend.stream_key(stream)) % _RECORD_STRIPES]:
        marker, queue = backend.record(stream)
        seq = next(_sequence)
    _used_backends.add(backend.name)
    return Fence._new(backend, marker, queue, seq)
