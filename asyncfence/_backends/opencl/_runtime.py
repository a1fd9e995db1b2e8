"""The OpenCL backend's runtime side: markers, their status, barriers, event callbacks.

pyopencl is imported only when a caller hands us one of its queues, so
asyncfence never needs OpenCL installed to import or to use CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import operator
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ... import _fork
from ..._backend import Backend, BackendStatistics, QueueInfo
from ..._exceptions import DeviceError
from ..._native import shim
from ..._validation import type_name
from ._lab import OpenCLLab

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    import pyopencl as cl

    from ..._native import NativeMailbox

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
# Numbers the queues of adopted events (from_event): one queue each.
_adopted = itertools.count()


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


class OpenCLBackend(Backend["cl.Event"]):
    """Fences as ``clEnqueueMarkerWithWaitList`` markers.

    A marker enqueued with no wait list completes once every command enqueued
    before it on the queue has, on in-order and out-of-order queues alike: a
    queue's markers complete in the order they were enqueued.
    """

    name = "opencl"
    title = "OpenCL"
    default_rank = 1  # after a GPU's
    accepts = "a pyopencl.CommandQueue"
    refcounted_markers = True  # a cl.Event lives while referenced (see release_done)

    def __init__(self) -> None:
        # Markers released while still pending. PoCL 3.0 aborts the process if
        # a user event fails after a dependent event was released, so we hold
        # them until they have completed or failed; failed ones, the most
        # recent few thousand, for good.
        self._graveyard: deque[cl.Event] = deque()
        self._failed: deque[cl.Event] = deque(maxlen=_FAILED_KEPT)
        self._sweep_at = _GRAVEYARD_MIN_SWEEP
        self._sweep_lock = threading.Lock()
        _fork.renew_after_fork(self, "_sweep_lock")
        self._platform_loaded = False

    def claims(self, stream: object) -> bool:
        cl = sys.modules.get("pyopencl")
        return cl is not None and isinstance(stream, cl.CommandQueue)

    def stream_key(self, stream: object) -> Hashable:
        known: _KnownQueue | None = getattr(stream, _KNOWN_QUEUE_ATTRIBUTE, None)
        if known is not None:
            return known.info.key
        return stream.int_ptr  # type: ignore[attr-defined,no-any-return]

    def _known(self, queue: cl.CommandQueue) -> _KnownQueue:
        # Kept on the queue (which takes no weak reference): its context is a
        # property that makes a wrapper on every read, and its version one
        # that runs Python.
        known: _KnownQueue | None = getattr(queue, _KNOWN_QUEUE_ATTRIBUTE, None)
        if known is None:
            known = _KnownQueue(queue)
            with contextlib.suppress(AttributeError):  # a queue without a __dict__
                setattr(queue, _KNOWN_QUEUE_ATTRIBUTE, known)
        return known

    def _queue_info(self, queue: cl.CommandQueue) -> QueueInfo:
        return self._known(queue).info

    def record(self, stream: object) -> tuple[cl.Event, QueueInfo]:
        # Only a queue seen before has one (a record, or _queue_info): the
        # type check, and the import it needs, are for the first record.
        known: _KnownQueue | None = getattr(stream, _KNOWN_QUEUE_ATTRIBUTE, None)
        if known is None:
            known = self._known(self._checked_queue(stream))
        queue: cl.CommandQueue = stream  # type: ignore[assignment]  # it has a _KnownQueue
        marker = known.enqueue_marker(queue, None)
        # Without a flush the marker may never reach the device, and a wait on
        # it would hang.
        queue.flush()
        if len(self._graveyard) >= self._sweep_at:
            self._sweep()
        return marker, known.info

    def adopt_event(self, event: object) -> tuple[cl.Event, QueueInfo] | None:
        kind = type(event)
        if kind.__module__.partition(".")[0] != "pyopencl":
            return None  # pyopencl is never imported for another library's object
        import pyopencl as cl

        if not isinstance(event, cl.Event):
            return None
        queue = cast("cl.CommandQueue | None", event.get_info(cl.event_info.COMMAND_QUEUE))
        if queue is not None:  # None for a UserEvent
            # Without a flush the command may never reach the device.
            queue.flush()
        context = cast("cl.Context", event.get_info(cl.event_info.CONTEXT))
        # A queue of its own: the event may stand anywhere in its stream.
        return event, QueueInfo(("event", next(_adopted)), domain=context.int_ptr)

    def _checked_queue(self, stream: object) -> cl.CommandQueue:
        import pyopencl as cl

        if not isinstance(stream, cl.CommandQueue):
            raise TypeError(f"expected {self.accepts}; got {type_name(stream)} object")
        return stream

    def query(self, marker: cl.Event) -> bool:
        status = _execution_status(marker)
        if status < 0:
            raise DeviceError(
                self.name,
                status,
                _execution_status_name(status),
                "a command before the fence ended with a negative execution status",
            )
        return status == 0

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        import pyopencl as cl

        if not isinstance(stream, cl.CommandQueue):
            raise TypeError(
                f"OpenCL fences can only be waited on by {self.accepts}; "
                f"got {type_name(stream)} object"
            )
        if stream.context.int_ptr != origin.domain:
            raise ValueError(
                "an OpenCL queue can only wait for a fence recorded in the same "
                "context; this queue belongs to another context"
            )

    def stream_wait(self, marker: cl.Event, origin: QueueInfo, stream: object) -> None:
        import pyopencl as cl

        assert isinstance(stream, cl.CommandQueue)
        barrier = cl.enqueue_barrier(stream, wait_for=[marker])
        stream.flush()
        # Held until it settles, as markers are (PoCL 3.0 aborts the process
        # if the marker fails once the barrier is released).
        self.release(barrier)
        # The caller found the fence not failed just before. Failed since: the
        # barrier may have been enqueued behind an event that had already
        # failed, and PoCL never fails (nor runs) such a command.
        status = _execution_status(marker)
        if status < 0:
            raise DeviceError(
                self.name,
                status,
                _execution_status_name(status),
                "the work before the fence failed while enqueue_wait ran; the "
                "waiting queue may never run its later work",
            )

    def arm(self, marker: cl.Event, queue: QueueInfo, mailbox: NativeMailbox, token: int) -> bool:
        if not _shim_has_entry:
            _give_entry_to_shim()
        # One call into the shim: the slot and clSetEventCallback.
        code = mailbox.arm_event_callback(marker.int_ptr, token)
        if code != 0:
            raise DeviceError(self.name, code, _status_name(code), "clSetEventCallback failed")
        return True

    def warm_up(self, stream: object) -> None:
        # The first armed signal would find the OpenCL library pyopencl
        # loaded (reading /proc/self/maps, globbing its folder): on a running
        # loop, a blocking call.
        _give_entry_to_shim()

    def runtime_initialised(self) -> bool:
        # A platform was made once the ICD loader has loaded a vendor library
        # (PoCL's, say): pyopencl's import alone loads only the loader.
        if not self._platform_loaded and "pyopencl._cl" in sys.modules:
            self._platform_loaded = _platform_library_loaded()
        return self._platform_loaded

    def lab(self) -> OpenCLLab:
        return OpenCLLab()

    def release(self, marker: cl.Event) -> None:
        # Atomic deque operations only: this may run in a finalizer.
        status = _execution_status(marker)
        if status > 0:
            self._graveyard.append(marker)
        elif status < 0:
            # PoCL 3.0 may still be propagating the failure through the event
            # on another thread; releasing it now can crash the process.
            self._failed.append(marker)

    def release_done(self, marker: cl.Event) -> None:
        # Complete: nothing can fail behind it any more, so it is let go as
        # it is, without another query.
        pass

    def _sweep(self) -> None:
        if not self._sweep_lock.acquire(blocking=False):
            return
        try:
            for _ in range(len(self._graveyard)):
                marker = self._graveyard.popleft()
                status = _execution_status(marker)
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

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            backend=self.name,
            held_markers=len(self._graveyard) + len(self._failed),
            signal_path="clSetEventCallback",
        )


# An event's CL_EVENT_COMMAND_EXECUTION_STATUS (0x11D3) through get_info
# itself: its property runs a Python function of pyopencl's on each read.
_execution_status: Callable[[cl.Event], int] = operator.methodcaller("get_info", 0x11D3)
# Where a queue keeps its _KnownQueue.
_KNOWN_QUEUE_ATTRIBUTE = "_asyncfence_queue"


class _KnownQueue:
    """What a record on one queue needs, found once per queue."""

    __slots__ = ("enqueue_marker", "info")

    def __init__(self, queue: cl.CommandQueue) -> None:
        import pyopencl as cl
        from pyopencl import _cl

        # Out-of-order queues too: a marker with no wait list waits for every
        # command enqueued before it, earlier markers included.
        self.info = QueueInfo(queue.int_ptr, domain=queue.context.int_ptr)
        # pyopencl's enqueue_marker without its version checks on each call.
        self.enqueue_marker: Callable[[cl.CommandQueue, None], cl.Event]
        if queue._get_cl_version() >= (1, 2) and cl.get_cl_header_version() >= (1, 2):
            self.enqueue_marker = _cl._enqueue_marker_with_wait_list
        else:
            self.enqueue_marker = cl.enqueue_marker


_set_event_callback_function: Any = None


def _opencl_library() -> ctypes.CDLL:
    """The OpenCL library pyopencl loaded (its bundled ICD loader, or the system's)."""
    import pyopencl

    loaded = {path for path in _mapped_libraries() if "libOpenCL" in path}
    bundled = sorted(Path(pyopencl.__file__).parent.glob(".libs/libOpenCL*.so*"))
    for path in [*sorted(loaded), *map(str, bundled), ctypes.util.find_library("OpenCL")]:
        if path:
            return ctypes.CDLL(path)
    raise OSError("no OpenCL library found")


def _mapped_libraries() -> set[str]:
    """The paths of the shared libraries mapped into this process."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if ".so" in line and "/" in line}


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def _defining_file(function: Any) -> str | None:
    """The file that defines ``function`` (dlsym also finds a library's dependencies')."""
    info = _DlInfo()
    address = ctypes.cast(function, ctypes.c_void_p)
    if not ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def _platform_library_loaded() -> bool:
    """Whether an OpenCL platform (ICD vendor) library is loaded; never loads one.

    The ICD loader loads its vendors' libraries (PoCL's, say) when asked for
    platforms; each defines ``clGetExtensionFunctionAddress``, as the loader
    itself (``libOpenCL``) does.
    """
    try:
        paths = _mapped_libraries()
    except OSError:  # no /proc: nothing can be told
        return False
    for path in paths:
        if "libOpenCL" in Path(path).name:
            continue
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            function = library.clGetExtensionFunctionAddress
        except (OSError, AttributeError):
            continue
        if _defining_file(function) == os.path.realpath(path):
            return True
    return False


def _set_event_callback() -> Any:
    """``clSetEventCallback`` through ctypes, which releases the GIL around it, found once.

    The runtime may call the callback inside this call, on this thread (the
    event already completed): the callback runs no Python, so that is safe.
    """
    global _set_event_callback_function
    if _set_event_callback_function is None:
        function = _opencl_library().clSetEventCallback
        function.restype = ctypes.c_int32
        function.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
        _set_event_callback_function = function
    return _set_event_callback_function


# Whether the shim was given clSetEventCallback (_give_entry_to_shim).
_shim_has_entry = False


def _give_entry_to_shim() -> None:
    """Give the native shim ``clSetEventCallback``, with which it arms parked waits' signals.

    Once per process, on the first arm (or in ``warm_up``, which also finds
    the library off the loop); where the shim is not loaded yet, the next
    call tries again.
    """
    global _shim_has_entry
    function = _set_event_callback()
    native = shim()
    if native is not None:
        native.set_opencl_entry(ctypes.cast(function, ctypes.c_void_p).value or 0)
        _shim_has_entry = True
