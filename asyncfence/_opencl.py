"""The OpenCL backend: a fence is a marker on a ``pyopencl.CommandQueue``.

pyopencl is imported only when a caller hands us one of its queues, so
asyncfence never needs OpenCL installed to import or to use CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import heapq
import itertools
import sys
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._backend import Marker, QueueInfo
from ._exceptions import DeviceError

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    import pyopencl as cl

    from ._watcher import NativeSignal

__all__ = ["OpenCLBackend"]

# Bound on parked markers between two sweeps; the bound doubles with the
# survivors, so sweeping stays amortised O(1) per release.
_GRAVEYARD_MIN_SWEEP = 64
# Failed markers kept alive (see OpenCLBackend.release).
_FAILED_KEPT = 4096


# The execution status PoCL gives a command that failed or whose wait list
# did (its own name for it). CL_DEVICE_NOT_FOUND shares the value, but that is
# an API error, never the status of a command.
_CL_FAILED = -1


def _execution_status_name(code: int) -> str:
    """The name of a negative execution status, as the runtime means it."""
    return "CL_FAILED" if code == _CL_FAILED else _status_name(code)


def _status_name(code: int) -> str:
    import pyopencl as cl

    try:
        name: str = cl.status_code.to_string(code)  # type: ignore[operator]
    except ValueError:
        return "CL_UNKNOWN_ERROR"
    return f"CL_{name}"


class OpenCLBackend:
    """Fences as ``clEnqueueMarkerWithWaitList`` markers.

    A marker enqueued with no wait list completes once every command enqueued
    before it on the queue has, on in-order and out-of-order queues alike.
    """

    name = "opencl"
    accepts = "a pyopencl.CommandQueue"

    def __init__(self) -> None:
        # Markers released while still pending. PoCL 3.0 aborts the process if
        # a user event fails after a dependent event was released, so we hold
        # them until they have completed or failed; failed ones, the most
        # recent few thousand, for good.
        self._graveyard: deque[cl.Event] = deque()
        self._failed: deque[cl.Event] = deque(maxlen=_FAILED_KEPT)
        self._sweep_at = _GRAVEYARD_MIN_SWEEP
        self._sweep_lock = threading.Lock()
        self._waiters: dict[Hashable, _QueueWaiter] = {}
        self._waiters_lock = threading.Lock()

    def claims(self, stream: object) -> bool:
        cl = sys.modules.get("pyopencl")
        return cl is not None and isinstance(stream, cl.CommandQueue)

    def stream_key(self, stream: object) -> Hashable:
        return stream.int_ptr  # type: ignore[attr-defined,no-any-return]

    def _queue_info(self, queue: cl.CommandQueue) -> QueueInfo:
        import pyopencl as cl

        out_of_order = queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
        return QueueInfo(queue.int_ptr, in_order=not out_of_order, domain=queue.context.int_ptr)

    def record(self, stream: object) -> tuple[Marker, QueueInfo]:
        import pyopencl as cl

        assert isinstance(stream, cl.CommandQueue)
        marker = cl.enqueue_marker(stream)
        # Without a flush the marker may never reach the device, and a wait on
        # it would hang.
        stream.flush()
        if len(self._graveyard) >= self._sweep_at:
            self._sweep()
        return marker, self._queue_info(stream)

    def query(self, marker: Marker) -> bool:
        status: int = marker.command_execution_status  # type: ignore[attr-defined]
        if status < 0:
            raise DeviceError(
                self.name,
                status,
                _execution_status_name(status),
                "a command before the fence ended with a negative execution status",
            )
        return status == 0

    def stream_wait(self, marker: Marker, origin: QueueInfo, stream: object) -> None:
        import pyopencl as cl

        if not isinstance(stream, cl.CommandQueue):
            raise TypeError(
                f"an OpenCL fence can only be waited on by {self.accepts}; "
                f"got {type(stream).__qualname__} object"
            )
        if stream.context.int_ptr != origin.domain:
            raise ValueError(
                "an OpenCL queue can only wait for a fence recorded in the same "
                "context; this queue belongs to another context"
            )
        barrier = cl.enqueue_barrier(stream, wait_for=[marker])  # type: ignore[list-item]
        stream.flush()
        # Held until it settles, as markers are (PoCL 3.0 aborts the process
        # if the marker fails once the barrier is released).
        self.release(barrier)
        # The caller found the fence not failed just before. Failed since: the
        # barrier may have been enqueued behind an event that had already
        # failed, and PoCL never fails (nor runs) such a command.
        status = marker.command_execution_status  # type: ignore[attr-defined]
        if status < 0:
            raise DeviceError(
                self.name,
                status,
                _execution_status_name(status),
                "the work before the fence failed while enqueue_wait ran; the "
                "waiting queue may never run its later work",
            )

    def arm(
        self,
        marker: Marker,
        queue: QueueInfo,
        order: int,
        notify: Callable[[], None],
        native: NativeSignal | None,
    ) -> bool:
        # OpenCL has no native signal a callback could post, and a Python
        # callback would run on PoCL's worker thread, stalling the device
        # while it waits for the GIL. A thread per queue waits natively instead.
        with self._waiters_lock:
            waiter = self._waiters.get(queue.key)
            if waiter is None or not waiter.alive:
                waiter = self._waiters[queue.key] = _QueueWaiter(self, queue.key)
        return waiter.watch(marker, order, notify)  # type: ignore[arg-type]

    def _waiter_exited(self, key: Hashable, waiter: _QueueWaiter) -> None:
        with self._waiters_lock:
            if self._waiters.get(key) is waiter:
                del self._waiters[key]

    def release(self, marker: Marker) -> None:
        # Atomic deque operations only: this may run in a finalizer.
        status = marker.command_execution_status  # type: ignore[attr-defined]
        if status > 0:
            self._graveyard.append(marker)  # type: ignore[arg-type]
        elif status < 0:
            # PoCL 3.0 may still be propagating the failure through the event
            # on another thread; releasing it now can crash the process.
            self._failed.append(marker)  # type: ignore[arg-type]

    def _sweep(self) -> None:
        if not self._sweep_lock.acquire(blocking=False):
            return
        try:
            for _ in range(len(self._graveyard)):
                marker = self._graveyard.popleft()
                status = marker.command_execution_status
                if status > 0:
                    self._graveyard.append(marker)
                elif status < 0:
                    self._failed.append(marker)
            self._sweep_at = max(_GRAVEYARD_MIN_SWEEP, 2 * len(self._graveyard))
        finally:
            self._sweep_lock.release()

    def parked_markers(self) -> int:
        """How many released markers are still held until they settle."""
        return len(self._graveyard)


# A queue's waiter thread exits after this long with nothing to wait for.
_WAITER_IDLE_S = 2.0
# How long a waiter pauses when the runtime refuses to wait on a pending event.
_REFUSED_WAIT_BACKOFF_S = 1e-3


def _opencl_library() -> ctypes.CDLL:
    """The OpenCL library pyopencl loaded (its bundled ICD loader, or the system's)."""
    import pyopencl

    with open("/proc/self/maps") as maps:
        loaded = {line.split()[-1] for line in maps if "libOpenCL" in line}
    bundled = sorted(Path(pyopencl.__file__).parent.glob(".libs/libOpenCL*.so*"))
    for path in [*sorted(loaded), *map(str, bundled), ctypes.util.find_library("OpenCL")]:
        if path:
            return ctypes.CDLL(path)
    raise OSError("no OpenCL library found")


_wait_for_events: Any = None


def _native_wait(marker: cl.Event) -> bool:
    """``clWaitForEvents`` on one event through ctypes: the GIL is released throughout.

    pyopencl's own ``Event.wait`` raises on a failed event; here a failure just
    returns, and the caller reads the status.

    Returns:
        False if the runtime returned at once without waiting, the event
        still pending.
    """
    global _wait_for_events
    if _wait_for_events is None:
        function = _opencl_library().clWaitForEvents
        function.restype = ctypes.c_int32
        function.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p)]
        _wait_for_events = function
    handle = ctypes.c_void_p(marker.int_ptr)
    if _wait_for_events(1, ctypes.byref(handle)) == 0:
        return True
    return bool(marker.command_execution_status <= 0)


class _QueueWaiter:
    """One thread per OpenCL queue with parked fences, waiting natively.

    It waits, GIL released, for the oldest marker it was asked to watch; fences
    on an in-order queue complete in order, so one wait at a time is enough.
    Then it calls the ``notify`` of every watched marker that has settled
    (completed or failed) and waits for the next. No Python ever runs on the
    OpenCL runtime's own threads.

    Thread-safety: :meth:`watch` may be called from any thread.
    """

    def __init__(self, backend: OpenCLBackend, key: Hashable) -> None:
        self._backend = backend
        self._key = key
        self._condition = threading.Condition()
        # (record order, tie-break, marker, notify), oldest at the top.
        self._watched: list[tuple[int, int, cl.Event, Callable[[], None]]] = []
        self._tie_break = itertools.count()
        self._thread = threading.Thread(
            target=self._run, name="asyncfence OpenCL waiter", daemon=True
        )
        self._exited = False
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread still takes work."""
        with self._condition:
            return not self._exited and self._thread.is_alive()

    def watch(self, marker: cl.Event, order: int, notify: Callable[[], None]) -> bool:
        """Call ``notify()`` once ``marker`` settles; False if this waiter has exited."""
        with self._condition:
            if self._exited:
                return False
            heapq.heappush(self._watched, (order, next(self._tie_break), marker, notify))
            self._condition.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._condition:
                if not self._watched:
                    self._condition.wait(_WAITER_IDLE_S)
                    if not self._watched:
                        self._exited = True
                        break
                # The oldest completes first on an in-order queue. One armed
                # later but older waits until this wait returns.
                oldest = self._watched[0][2]
            if not _native_wait(oldest):
                # The runtime refused to wait on a pending event: back off
                # rather than spin; the watcher's re-check still sees it settle.
                with self._condition:
                    self._condition.wait(_REFUSED_WAIT_BACKOFF_S)
            with self._condition:
                settled = [e for e in self._watched if e[2].command_execution_status <= 0]
                if settled:
                    self._watched = [e for e in self._watched if e[2].command_execution_status > 0]
                    heapq.heapify(self._watched)
            for _, _, _, notify in settled:
                notify()
        # Outside the condition: OpenCLBackend.arm takes the backend's lock,
        # then ours (through ``alive``).
        self._backend._waiter_exited(self._key, self)
