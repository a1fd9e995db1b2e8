"""A fence's core: its marker, where it is, and its state and outcome.

The public :class:`~asyncfence.Fence` is a handle on one; the waiting
machinery (the fence set, the poller, the drop queue) works on cores, through
the methods below, and never needs the handle. Design: ``docs/design.md``
("Fences").
"""

from __future__ import annotations

import copy
import itertools
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any, Final, Literal, NoReturn, final

from . import _fork
from ._backend import adopt_event, backend_for, cached_backend
from ._exceptions import DeviceError, FenceError
from ._validation import type_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._backend import Backend, QueueInfo
    from ._native import NativeMailbox

__all__ = [
    "DONE",
    "FAILED",
    "PENDING",
    "ArmResult",
    "FenceCore",
    "adopt_core",
    "import_core",
    "record_core",
]

_logger = logging.getLogger("asyncfence")

PENDING: Final = 0
DONE: Final = 1
FAILED: Final = 2

#: What :meth:`FenceCore.arm` found: a signal armed, none possible (poll it
#: instead), or the fence settled already (nothing to wait for).
ArmResult = Literal["armed", "unsignalled", "settled"]

# Guards state changes only, never a driver call: the one-way transition out
# of PENDING (so that exactly one thread releases a marker), and the pins that
# keep a marker from being released while a driver call uses it (a pooled
# CUDA event may be recording other work once released). Always taken in a
# with statement, never acquire() then try: a KeyboardInterrupt landing
# between the two would leave it held, and every later wait hung.
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
_fork.renew_after_fork(sys.modules[__name__], "_settle_lock", "_record_locks")


@final
class FenceCore:
    """One recorded marker, and what became of the work before it.

    It moves once from :data:`PENDING` to :data:`DONE` or :data:`FAILED`.

    Attributes:
        backend: The backend that recorded it.
        queue: The stream it is on.
        seq: Its record order: on an in-order queue, fences complete in it.
        state: :data:`PENDING`, :data:`DONE` or :data:`FAILED`; read without
            a lock, it may lag a settle by another thread, never lead it.

    Thread-safety: every method may be called from any thread.
    """

    __slots__ = (
        "__weakref__",
        "_failure",
        "_generation",
        "_listeners",
        "_marker",
        "_pins",
        "backend",
        "queue",
        "seq",
        "state",
    )

    def __init__(self, backend: Backend[Any], marker: Any, queue: QueueInfo, seq: int) -> None:
        self.backend = backend
        self.queue = queue
        self.seq = seq
        self.state: int = PENDING
        self._marker: Any = marker
        self._pins = 0
        self._failure: DeviceError | None = None
        self._generation = _fork.fork_count
        self._listeners: list[Callable[[FenceCore], None]] | None = None

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self.state]
        return f"<asyncfence.Fence {self.backend.name} #{self.seq} {state}>"

    def __lt__(self, other: FenceCore) -> bool:
        # Record order, for the parked and polled sets' heaps: no (seq, fence)
        # tuple per member.
        return self.seq < other.seq

    def __del__(self) -> None:
        marker = self._marker
        # In a forked child the parent's runtime may hold locks: leave it be.
        if marker is not None and self._generation == _fork.fork_count:
            self.backend.release(marker)

    @property
    def marker_released(self) -> bool:
        """Whether the marker went back to its backend (only once settled)."""
        return self._marker is None

    def poll(self, *, keep_marker: bool = False) -> int:
        """Query the device unless already settled; returns the state.

        Args:
            keep_marker: Leave the marker of a fence this call settles
                unreleased, for :meth:`release_marker` to release later (off
                a loop's wake path).

        Raises:
            FenceError: It was recorded before this process forked.
        """
        if self.state != PENDING:
            return self.state
        if self._generation != _fork.fork_count:
            raise FenceError(f"{self!r} was recorded before fork(): {_fork.ADVICE}")
        marker = self._marker
        if marker is None:  # settled by another thread since the check above
            return self.state
        try:
            if not self.backend.query(marker):
                # Re-read: settled meanwhile by another thread, the marker may
                # since answer for someone else's work.
                return self.state
        except DeviceError as error:
            self._settle(FAILED, error, keep_marker=keep_marker)
        else:
            self._settle(DONE, None, keep_marker=keep_marker)
        return self.state

    def _settle(self, state: int, failure: DeviceError | None, *, keep_marker: bool) -> None:
        with _settle_lock:
            if self.state != PENDING:
                return
            # State first, marker last: a thread reading without the lock that
            # finds no marker then always finds the fence settled.
            self._failure = failure
            self.state = state
            listeners, self._listeners = self._listeners, None
            if self._pins or keep_marker:
                # A driver call still uses the marker, or it is released later.
                marker = None
            else:
                marker, self._marker = self._marker, None
        if listeners is not None:
            self._tell(listeners)
        if marker is None:  # kept, or let go already by a lockless release_marker()
            return
        if state == DONE:
            self.backend.release_done(marker)
        else:
            self.backend.release(marker)

    def on_settle(self, listener: Callable[[FenceCore], None]) -> bool:
        """Have ``listener(self)`` called once this fence settles, by whoever settles it.

        It runs on the thread that settles the fence (a loop's wake, any
        wait's query, ``wait_sync`` in a worker thread), before that thread
        goes on: it must be quick, thread-safe, and never raise.

        Returns:
            False, and nothing is called, if the fence has settled already.
        """
        with _settle_lock:
            if self.state != PENDING:
                return False
            if self._listeners is None:
                self._listeners = [listener]
            else:
                self._listeners.append(listener)
        return True

    def forget_listener(self, listener: Callable[[FenceCore], None]) -> None:
        """Undo :meth:`on_settle` (a no-op once the fence settled)."""
        with _settle_lock:
            listeners = self._listeners
            if listeners is not None and listener in listeners:
                listeners.remove(listener)

    def _tell(self, listeners: list[Callable[[FenceCore], None]]) -> None:
        for listener in listeners:
            try:
                listener(self)
            except Exception:  # a listener must not raise; the settle goes on
                _logger.exception("asyncfence: a settle listener of %r raised", self)

    def release_marker(self) -> None:
        """Release the marker of a settled fence, unless a driver call still uses it.

        A done fence on a backend with reference-counted markers drops its
        marker at once: a call using it holds a reference of its own.
        """
        if self.state == DONE and self.backend.refcounted_markers:
            # Dropping the reference is its release: no lock (an OpenCL wake).
            # A settle still finishing on another thread then finds no marker.
            self._marker = None
            return
        with _settle_lock:
            if self._pins or self.state == PENDING:
                return
            marker, self._marker = self._marker, None
        if marker is None:
            return
        if self.state == DONE:
            self.backend.release_done(marker)
        else:
            self.backend.release(marker)

    def _take_unused_marker(self) -> Any:
        """The marker, taken from a settled fence no driver call uses; else ``None``.

        Called with ``_settle_lock`` held.
        """
        if self._pins or self.state == PENDING:
            return None
        marker, self._marker = self._marker, None
        return marker

    def _pin(self) -> Any:
        """The marker, kept from release until :meth:`_unpin`; ``None`` if settled."""
        with _settle_lock:
            marker = self._marker
            if marker is None or self.state != PENDING:
                return None
            self._pins += 1
            return marker

    def _unpin(self) -> None:
        """Let the marker go again; released at once if the fence settled meanwhile."""
        with _settle_lock:
            self._pins -= 1
            marker = self._take_unused_marker()
        if marker is not None:
            self.backend.release(marker)

    def failure(self) -> DeviceError:
        """A fresh copy of the failure, so each waiter gets its own traceback."""
        failure = self._failure
        assert failure is not None
        return copy.copy(failure).with_traceback(None)

    def raise_failure(self) -> NoReturn:
        """Raise a fresh copy of the failure."""
        raise self.failure()

    def outcome(self) -> DeviceError | None:
        """For a settled fence: ``None`` if done, else a fresh copy of its failure."""
        return self.failure() if self.state == FAILED else None

    def arm(self, mailbox: NativeMailbox, token: int) -> ArmResult:
        """Have the runtime post ``token`` to ``mailbox`` once the device passes this fence.

        Raises:
            DeviceError: The runtime refused (a faulted CUDA context, say).
            MemoryError: The shim could not allocate the signal.
        """
        backend = self.backend
        if backend.refcounted_markers:
            # This reference keeps the marker valid, whoever releases it
            # meanwhile: no pin, and so no lock (an OpenCL park).
            marker = self._marker
            if marker is None or self.state != PENDING:
                return "settled"
            return "armed" if backend.arm(marker, self.queue, mailbox, token) else "unsignalled"
        # _pin() and _unpin(), written out: this runs on every park.
        with _settle_lock:
            marker = self._marker
            if marker is None or self.state != PENDING:
                return "settled"
            self._pins += 1
        try:
            armed = backend.arm(marker, self.queue, mailbox, token)
        finally:
            with _settle_lock:
                self._pins -= 1
                # Settled meanwhile, by another thread: the release left it to us.
                settled_meanwhile = not self._pins and self.state != PENDING
                if settled_meanwhile:
                    marker, self._marker = self._marker, None
            if settled_meanwhile and marker is not None:
                backend.release(marker)
        return "armed" if armed else "unsignalled"

    def export_marker(self) -> tuple[bytes, object] | None:
        """An interprocess handle for this fence's point, and what keeps it valid.

        ``None`` if the fence settled, or its backend has no interprocess
        markers (see ``Backend.export_marker``).

        Raises:
            DeviceError: The runtime refused.
        """
        marker = self._pin()
        if marker is None:
            return None
        try:
            return self.backend.export_marker(marker, self.queue)
        finally:
            self._unpin()

    def enqueue_wait(self, stream: object) -> None:
        """Make ``stream`` wait on the device for this fence (see ``Fence.enqueue_wait``)."""
        backend = self.backend
        if not backend.claims(stream):
            raise TypeError(
                f"{backend.title} fences can only be waited on by "
                f"{backend.accepts}; got {type_name(stream)} object"
            )
        # Whatever the fence's state: whether a program errors must not
        # depend on how fast the device was.
        backend.check_stream(self.queue, stream)
        # Settled first: a stream told to wait for a fence that already failed
        # may never run again (OpenCL), so that failure is raised instead.
        if self.poll() == FAILED:
            self.raise_failure()
        marker = self._pin()
        if marker is not None:
            try:
                backend.stream_wait(marker, self.queue, stream)
            finally:
                self._unpin()
            return
        if self.state == FAILED:
            self.raise_failure()


def record_core(stream: object) -> FenceCore:
    """Record a marker at the current end of the work queued on ``stream``.

    Raises:
        TypeError: No backend accepts ``stream``.
        DeviceError: The backend failed to record.
        FenceError: This process was forked after the backend was used.
    """
    backend = cached_backend(type(stream)) or backend_for(stream)
    if _fork.used_by_parent:  # only ever in a forked child
        _fork.check_unused_by_parent(backend.name, backend.title)
    with _record_locks[hash(backend.stream_key(stream)) % _RECORD_STRIPES]:
        marker, queue = backend.record(stream)
        seq = next(_sequence)
    if not backend.fork_safe and backend.name not in _fork.used:  # it does not survive fork()
        _fork.note_used(backend.name)
    return FenceCore(backend, marker, queue, seq)


def adopt_core(event: object) -> FenceCore:
    """A fence at an event the user's code recorded (see :func:`asyncfence.from_event`).

    Raises:
        TypeError: No backend adopts ``event``.
        FenceError: This process was forked after the backend was used.
    """
    backend, marker, queue = adopt_event(event)
    if _fork.used_by_parent:  # only ever in a forked child
        _fork.check_unused_by_parent(backend.name, backend.title)
    if not backend.fork_safe and backend.name not in _fork.used:
        _fork.note_used(backend.name)
    return FenceCore(backend, marker, queue, next(_sequence))


def import_core(backend: Backend[Any], handle: bytes) -> FenceCore:
    """A fence of this process on another process's exported marker (``Backend.import_marker``).

    Raises:
        FenceError: The handle cannot be opened here (its device is not
            visible), or this process was forked after the backend was used.
        DeviceError: The runtime refused to open it.
    """
    _fork.check_unused_by_parent(backend.name, backend.title)
    marker, queue = backend.import_marker(handle)
    if not backend.fork_safe:
        _fork.note_used(backend.name)
    return FenceCore(backend, marker, queue, next(_sequence))
