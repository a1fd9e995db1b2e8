"""The OpenCL backend: a fence is a marker on a ``pyopencl.CommandQueue``.

pyopencl is imported only when a caller hands us one of its queues, so
asyncfence never needs OpenCL installed to import or to use CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ._backend import Marker, QueueInfo
from ._exceptions import DeviceError

if TYPE_CHECKING:
    from collections.abc import Callable

    import pyopencl as cl

    from ._watcher import NativeSignal

__all__ = ["OpenCLBackend"]

# The completion callback only signals completion; a failed event never fires
# it on PoCL 3.0, so a blocking wait also re-checks the status this often.
_FAILURE_RECHECK_S = 0.01
# Bound on parked markers between two sweeps; the bound doubles with the
# survivors, so sweeping stays amortised O(1) per release.
_GRAVEYARD_MIN_SWEEP = 64


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
        # them until they have completed or failed.
        self._graveyard: deque[cl.Event] = deque()
        self._sweep_at = _GRAVEYARD_MIN_SWEEP
        self._sweep_lock = threading.Lock()
        self._callbacks: _EventCallbacks | Literal[False] | None = None

    def claims(self, stream: object) -> bool:
        cl = sys.modules.get("pyopencl")
        return cl is not None and isinstance(stream, cl.CommandQueue)

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
                _status_name(status),
                "a command before the fence ended with a negative execution status",
            )
        return status == 0

    def synchronize(self, marker: Marker, timeout: float) -> bool:
        import pyopencl as cl

        event: cl.Event = marker  # type: ignore[assignment]
        signalled = threading.Event()
        # Runs on a PoCL thread; it only sets a flag.
        event.set_callback(cl.command_execution_status.COMPLETE, lambda _status: signalled.set())
        deadline = math.inf if timeout == math.inf else time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if signalled.wait(min(remaining, _FAILURE_RECHECK_S)):
                return True
            if event.command_execution_status <= 0:
                return True

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
        cl.enqueue_barrier(stream, wait_for=[marker])  # type: ignore[list-item]
        stream.flush()

    def arm(
        self,
        marker: Marker,
        queue: QueueInfo,
        notify: Callable[[], None],
        native: NativeSignal | None,
    ) -> bool:
        import pyopencl as cl

        event: cl.Event = marker  # type: ignore[assignment]
        callbacks = self._native_callbacks()
        if callbacks is not None:
            return callbacks.arm(event.int_ptr, notify)
        # pyopencl's own set_callback starts a thread per callback: slower.
        event.set_callback(cl.command_execution_status.COMPLETE, lambda _status: notify())
        return True

    def _native_callbacks(self) -> _EventCallbacks | None:
        if self._callbacks is None:
            try:
                self._callbacks = _EventCallbacks()
            except (OSError, AttributeError):
                self._callbacks = False
        return self._callbacks or None

    def release(self, marker: Marker) -> None:
        # Atomic dict and deque operations only: this may run in a finalizer.
        if self._callbacks:
            self._callbacks.disarm(marker.int_ptr)  # type: ignore[attr-defined]
        if marker.command_execution_status > 0:  # type: ignore[attr-defined]
            self._graveyard.append(marker)  # type: ignore[arg-type]

    def _sweep(self) -> None:
        if not self._sweep_lock.acquire(blocking=False):
            return
        try:
            for _ in range(len(self._graveyard)):
                marker = self._graveyard.popleft()
                if marker.command_execution_status > 0:
                    self._graveyard.append(marker)
            self._sweep_at = max(_GRAVEYARD_MIN_SWEEP, 2 * len(self._graveyard))
        finally:
            self._sweep_lock.release()

    def parked_markers(self) -> int:
        """How many released markers are still held until they settle."""
        return len(self._graveyard)


_CL_COMPLETE = 0
_EVENT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p)


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


class _EventCallbacks:
    """``clSetEventCallback`` with a ctypes callback.

    The callback runs on a PoCL thread and takes the GIL (OpenCL offers no
    native signal); it only hands the fence to its loops. pyopencl's own
    ``Event.set_callback`` would start a thread per callback.
    """

    def __init__(self) -> None:
        library = _opencl_library()
        self._set_callback = library.clSetEventCallback
        self._set_callback.restype = ctypes.c_int32
        self._set_callback.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int32,
            _EVENT_CALLBACK,
            ctypes.c_void_p,
        ]
        # Keyed by the event's address; an entry lives until the callback
        # fires or the marker is released (PoCL never calls back on failure).
        self._pending: dict[int, Callable[[], None]] = {}
        # Kept for the life of the process: the runtime may call it any time.
        self._trampoline = _EVENT_CALLBACK(self._fire)
        self._registered_threads: set[int] = set()

    def _fire(self, _event: int, _status: int, key: int | None) -> None:
        thread = threading.get_ident()
        if thread not in self._registered_threads:
            # ctypes creates and destroys a Python thread state around every
            # callback on a foreign thread, tens of µs each time. One extra
            # GIL-state reference keeps this runtime thread's state alive.
            ctypes.pythonapi.PyGILState_Ensure()
            self._registered_threads.add(thread)
        notify = self._pending.pop(key or 0, None)
        if notify is not None:
            notify()

    def arm(self, event: int, notify: Callable[[], None]) -> bool:
        self._pending[event] = notify
        if self._set_callback(event, _CL_COMPLETE, self._trampoline, event) != 0:
            self._pending.pop(event, None)
            return False
        return True

    def disarm(self, event: int) -> None:
        self._pending.pop(event, None)
