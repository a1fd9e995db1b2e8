"""The CUDA backend: a fence is a pooled CUDA event recorded on a CUDA stream.

Streams come from anywhere: cuda.core, PyTorch, CuPy, numba-cuda, cuda.bindings,
or a raw handle. Fences are never recorded inside a CUDA graph capture (an
event recorded there belongs to the graph and never completes), and the
streams work from any thread: the stream's context (for a default stream, the
primary context of the device its object names) is made current around every
call that queues work.
Completion signals run on side streams that wait for the fence's event, so the
user's stream is never held by a signal.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from ... import _fork
from ..._backend import Backend, BackendStatistics, QueueInfo
from ..._exceptions import FenceError
from . import _driver
from ._driver import (
    ACCEPTS,
    LEGACY_DEFAULT_STREAM,
    NULL_STREAM,
    PER_THREAD_DEFAULT_STREAM,
    TORCH_GENERIC_STREAM,
    HostFunctionLauncher,
    HostFunctionPath,
    as_cu_stream,
    check,
    cuda_event_handle,
    cuda_stream_handle,
    current_context,
    device_error,
    driver,
    is_cuda_stream,
    pop_context,
    push_context,
    stream_device,
)
from ._lab import CudaLab

if TYPE_CHECKING:
    from collections.abc import Hashable
    from types import ModuleType

    from ..._native import NativeMailbox


__all__ = ["CudaBackend"]

# Events kept per context beyond those in use; more are destroyed on release.
_POOL_LIMIT = 4096
# User streams whose side streams are kept, least recently used dropped first.
_SIDE_STREAM_LIMIT = 256
# Side streams ("lanes") per user stream: a signal for an older fence parked
# after a newer one needs a lane of its own, or it would queue behind the
# newer fence's wait. Past this, such a signal is not armed (it is polled).
_LANES_PER_STREAM = 4

_CAPTURE_ADVICE = (
    "record fences outside the capture instead: after cuStreamEndCapture, and to know "
    "when a graph's work is done, on the stream the graph is launched on, after "
    "cuGraphLaunch (see docs/graphs.md)"
)


_thread_numbers = itertools.count()
_this_thread = threading.local()


def _thread_number() -> int:
    """A number for the calling thread, never given to another (unlike thread idents).

    An exited thread's ident goes to the next thread started, while work its
    per-thread default stream queued may still be pending.
    """
    try:
        number: int = _this_thread.number
    except AttributeError:
        number = _this_thread.number = next(_thread_numbers)
    return number


def _queue_key(context: int, handle: int) -> tuple[int, ...]:
    """The key of the in-order queue that a record on ``handle`` joins.

    ``context`` is the context's id, never reused (unlike its address, which
    a context made after a reset may share).

    The default-stream handles name the stream they mean: 0 is the legacy
    default stream (1), or in per-thread mode the calling thread's per-thread
    default stream (2), which is another stream on every thread.
    """
    if handle == NULL_STREAM:
        per_thread = _driver.per_thread_default_stream()
        handle = PER_THREAD_DEFAULT_STREAM if per_thread else LEGACY_DEFAULT_STREAM
    if handle == PER_THREAD_DEFAULT_STREAM:
        return (context, handle, _thread_number())
    return (context, handle)


# An imported marker's pool: its event is destroyed, never pooled.
_NOT_POOLED: deque[Any] = deque(maxlen=0)
# A device's UUID (CUuuid), then its CUipcEventHandle, in an exported handle.
_UUID_BYTES = 16
_IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


def _query_relaxed(drv: ModuleType, event: Any) -> Any:
    """``cuEventQuery(event)``'s result, queried in relaxed capture mode.

    A query is a "potentially unsafe" call while a graph is captured: in the
    default (global) capture mode, a capture on any thread makes the driver
    refuse it and invalidate that capture. Relaxed mode, for this one call,
    lets the query through and leaves every capture alone.
    """
    relaxed, previous = drv.cuThreadExchangeStreamCaptureMode(
        drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    )
    try:
        (err,) = drv.cuEventQuery(event)
    finally:
        if not relaxed:  # CUDA_SUCCESS: put the thread's own mode back
            drv.cuThreadExchangeStreamCaptureMode(previous)
    return err


class _CudaMarker:
    """A recorded event, its context, the pool it goes back to, and its record order."""

    __slots__ = ("context", "event", "order", "pool")

    def __init__(self, event: Any, context: int, pool: deque[Any], order: int) -> None:
        self.event = event
        self.context = context
        self.pool = pool
        self.order = order


class _AdoptedMarker(_CudaMarker):
    """An adopted event's marker (``from_event``): it also keeps the user's event object."""

    __slots__ = ("source",)

    def __init__(self, event: Any, context: int, pool: deque[Any], order: int, source: object):
        super().__init__(event, context, pool, order)
        self.source = source


class _Lane:
    """A side stream, and the record order of the newest fence it waits for."""

    __slots__ = ("last_order", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.last_order = -1


class CudaBackend(Backend[_CudaMarker]):
    """Fences as ``CU_EVENT_DISABLE_TIMING`` events, pooled per context.

    In the steady state recording calls ``cuEventRecord`` and nothing else:
    events come back to their context's pool when their fence settles (or is
    dropped), so ``cuEventCreate`` runs only while the number of fences in
    flight grows.
    """

    name = "cuda"
    title = "CUDA"
    accepts = ACCEPTS
    default_rank = 0  # a GPU, where one is present
    claimed_by_object = frozenset({TORCH_GENERIC_STREAM})  # a torch.Stream on CUDA

    def __init__(self) -> None:
        # Keyed by context id (cuCtxGetId): a context reset (cuDevicePrimaryCtxReset,
        # numba's cuda.close()) destroys its events and streams, and the context
        # after it may have the same address but never the same id.
        self._pools: dict[int, deque[Any]] = {}
        self._context_ids: dict[int, int] = {}  # the latest id seen at each address
        self._pools_lock = threading.Lock()
        # Primary contexts by device ordinal, retained once for the process.
        self._primary: dict[int, int] = {}
        self._primary_lock = threading.Lock()
        # Completion signals run on side streams, one per user stream, that
        # wait for the fence's event first: the user's stream is never held
        # by a signal, and one slow stream never delays another's signals.
        self._side_streams: OrderedDict[Hashable, list[_Lane]] = OrderedDict()
        # Record order across the backend; records on one stream are
        # serialised (asyncfence.record), so it orders each stream's fences.
        self._orders = itertools.count()
        self._side_lock = threading.Lock()
        self._launcher: HostFunctionLauncher | None = None
        self._ordinals_by_uuid: dict[bytes, int] = {}
        _fork.renew_after_fork(self, "_pools_lock", "_primary_lock", "_side_lock")

    def claims(self, stream: object) -> bool:
        return is_cuda_stream(stream)

    def _cu_stream(self, stream: object) -> tuple[ModuleType, Any, int]:
        """Resolve ``stream`` to (driver, CUstream, handle)."""
        drv = driver()
        return (drv, *as_cu_stream(drv, stream))

    def _enter_stream_context(
        self, drv: ModuleType, stream: object, cu_stream: Any, handle: int
    ) -> tuple[tuple[int, int], bool]:
        """Make the stream's context current for the calls that queue work on it.

        ``cuda.h`` lists ``CUDA_ERROR_INVALID_CONTEXT`` for ``cuEventRecord``
        and ``cuStreamWaitEvent``: they need a current context, and the
        calling thread may have none (one where the library did no work of
        its own: PyTorch makes its primary context current only there) or
        another. A stream of its own knows its context; a default-stream
        handle (0, 1, 2) means "of the current context", so the primary
        context of the device its object names is made current first.

        Returns:
            The stream's context (its handle and its id), and whether one was
            pushed (the caller pops it with :func:`pop_context`, also when
            this raises later).

        Raises:
            DeviceError: The stream's context cannot be found or made current.
        """
        pushed = False
        if handle <= PER_THREAD_DEFAULT_STREAM:
            pushed = self._enter_device(drv, stream)
        try:
            context = self._stream_context(drv, cu_stream, handle)
            if not pushed:
                pushed = push_context(drv, context, "the stream's")
            identity = self._context_id(drv, context)
        except BaseException:
            if pushed:
                pop_context(drv)
            raise
        return (context, identity), pushed

    def _context_id(self, drv: ModuleType, context: int) -> int:
        """The context's id; a new id at a known address drops what the old one left.

        Per-context state (the event pool, the side streams) is keyed by the
        id. A reset destroyed the old context's events and streams: they are
        forgotten, never destroyed again nor reused.
        """
        err, identity = drv.cuCtxGetId(drv.CUcontext(context))
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, "cuCtxGetId failed")
        identity = int(identity)
        previous = self._context_ids.get(context)
        if previous != identity:
            self._context_ids[context] = identity
            if previous is not None:
                self._forget_context(previous)
        return identity

    def _forget_context(self, identity: int) -> None:
        """Drop the pool and side streams of the context ``identity``: a reset destroyed them."""
        with self._pools_lock:
            self._pools.pop(identity, None)
        with self._side_lock:
            stale = [k for k in self._side_streams if isinstance(k, tuple) and k[0] == identity]
            for key in stale:
                del self._side_streams[key]

    def _enter_device(self, drv: ModuleType, stream: object) -> bool:
        """Make the device a default stream's object names current, unless it is.

        Returns:
            Whether a context was pushed (the caller pops it).
        """
        ordinal = stream_device(stream)
        if ordinal is None:
            return False
        if current_context(drv):
            err, device = drv.cuCtxGetDevice()
            if err == drv.CUresult.CUDA_SUCCESS and int(device) == ordinal:
                return False
        context = self._primary_context(drv, ordinal)
        return push_context(drv, context, f"device {ordinal}'s primary")

    def _primary_context(self, drv: ModuleType, ordinal: int) -> int:
        """Device ``ordinal``'s primary context, retained on first use."""
        context = self._primary.get(ordinal)
        if context is None:
            with self._primary_lock:
                context = self._primary.get(ordinal)
                if context is None:
                    device = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
                    retained = check(
                        drv.cuDevicePrimaryCtxRetain(device),
                        f"cuDevicePrimaryCtxRetain (device {ordinal})",
                    )
                    context = self._primary[ordinal] = int(retained)
        return context

    def _stream_context(self, drv: ModuleType, cu_stream: Any, handle: int) -> int:
        """The handle of the stream's context."""
        err, context = drv.cuStreamGetCtx(cu_stream)
        if err != drv.CUresult.CUDA_SUCCESS:
            detail = "cannot find the stream's context"
            if handle <= PER_THREAD_DEFAULT_STREAM:
                detail += (
                    " (a default stream needs a current context on this thread, or a "
                    "stream object that names its device, as PyTorch, CuPy and "
                    "cuda.core streams do)"
                )
            raise device_error(drv, err, detail)
        return int(context)

    def _refuse_capture(self, drv: ModuleType, cu_stream: Any, action: str) -> None:
        """Raise if the stream is capturing a CUDA graph; one driver call.

        Raises:
            FenceError: It captures, or it is the legacy default stream while a
                blocking stream of its context captures.
            DeviceError: ``cuStreamIsCapturing`` failed.
        """
        err, status = drv.cuStreamIsCapturing(cu_stream)
        if not err and not status:  # CUDA_SUCCESS, CU_STREAM_CAPTURE_STATUS_NONE: the fast path
            return
        if err == drv.CUresult.CUDA_SUCCESS:
            raise FenceError(
                f"cannot {action} a stream that is capturing a CUDA graph (between "
                "cuStreamBeginCapture and cuStreamEndCapture): work queued there is not "
                "run but recorded into the graph, and an event recorded there never "
                f"completes; {_CAPTURE_ADVICE}"
            )
        if err == drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
            raise FenceError(
                f"cannot {action} the legacy default stream while a blocking stream of "
                "its context is capturing a CUDA graph: the legacy stream would depend on "
                f"the capture and invalidate it; {_CAPTURE_ADVICE}"
            )
        raise device_error(drv, err, "cuStreamIsCapturing failed")

    def _pool(self, context: int) -> deque[Any]:
        pool = self._pools.get(context)
        if pool is None:
            with self._pools_lock:
                pool = self._pools.setdefault(context, deque())
        return pool

    def _create_event(self, drv: ModuleType, context: int) -> Any:
        switch = push_context(drv, context, "the stream's")
        try:
            err, event = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        finally:
            if switch:
                pop_context(drv)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, "cuEventCreate failed")
        return event

    def stream_key(self, stream: object) -> Hashable:
        # The handle alone: the default streams (0, 1, 2) of every context and
        # thread share a key, which only serialises their records more.
        return cuda_stream_handle(stream)

    def record(self, stream: object) -> tuple[_CudaMarker, QueueInfo]:
        """Record a pooled event on ``stream``.

        Raises:
            FenceError: The stream is capturing a CUDA graph.
            DeviceError: The driver refused the stream or the record.
        """
        drv, cu_stream, handle = self._cu_stream(stream)
        (context, identity), pushed = self._enter_stream_context(drv, stream, cu_stream, handle)
        try:
            self._refuse_capture(drv, cu_stream, "record a fence on")
            pool = self._pool(identity)
            try:
                event = pool.pop()
            except IndexError:
                event = self._create_event(drv, context)
            (err,) = drv.cuEventRecord(event, cu_stream)
        finally:
            if pushed:
                pop_context(drv)
        if err != drv.CUresult.CUDA_SUCCESS:
            pool.append(event)
            raise device_error(drv, err, "cuEventRecord failed")
        marker = _CudaMarker(event, context, pool, next(self._orders))
        return marker, QueueInfo(_queue_key(identity, handle))

    def query(self, marker: _CudaMarker) -> bool:
        drv = driver()
        err = _query_relaxed(drv, marker.event)
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise device_error(drv, err, "the work before the fence failed")

    def adopt_event(self, event: object) -> tuple[_CudaMarker, QueueInfo] | None:
        """A pooled event that completes with the latest record of ``event``.

        ``event`` is any library's CUDA event (:func:`cuda_event_handle`).
        As ``cuStreamWaitEvent`` does: a new stream waits for ``event`` as
        recorded now, and a pooled event is recorded behind that wait; the
        user may record ``event`` again at once. An event never recorded is
        done. The stream is made in the calling thread's context, else in the
        primary context of the device the event's object names (or device 0).

        Raises:
            FenceError: ``event`` was last recorded inside a CUDA graph
                capture (it belongs to the graph and never completes).
            DeviceError: The driver refused the wait (an invalid event, or a
                context that faulted).
            TypeError: A library's event that is not a CUDA event.
        """
        found = cuda_event_handle(event)
        if found is None:
            return None
        handle, ordinal = found
        drv = driver("CUDA events")
        context = current_context(drv) or self._primary_context(drv, ordinal or 0)
        identity = self._context_id(drv, context)
        pool = self._pool(identity)
        pushed = push_context(drv, context, "the current")
        try:
            user_event = None
            if handle:  # 0: never created by its library, so never recorded
                user_event = event if type(event) is drv.CUevent else drv.CUevent(handle)
                self._refuse_captured_event(drv, user_event)
            flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            stream = check(drv.cuStreamCreate(flags), "cuStreamCreate")
            try:
                try:
                    ours = pool.pop()
                except IndexError:
                    ours = self._create_event(drv, context)
                err = drv.CUresult.CUDA_SUCCESS
                if user_event is not None:
                    (err,) = drv.cuStreamWaitEvent(stream, user_event, 0)
                if err == drv.CUresult.CUDA_SUCCESS:
                    (err,) = drv.cuEventRecord(ours, stream)
                if err != drv.CUresult.CUDA_SUCCESS:
                    pool.append(ours)
                    raise device_error(drv, err, "cannot wait for the event")
            finally:
                # Allowed with work queued: the driver frees it once that is done.
                drv.cuStreamDestroy(stream)
        finally:
            if pushed:
                pop_context(drv)
        order = next(self._orders)
        # The user's event lives as long as the marker; a queue of its own:
        # no other fence is ordered with it.
        marker = _AdoptedMarker(ours, context, pool, order, event)
        return marker, QueueInfo(("adopted", identity, order))

    def _refuse_captured_event(self, drv: ModuleType, event: Any) -> None:
        """Raise if ``event`` was last recorded in a graph capture; one relaxed query.

        A wait for it from a stream outside the capture would join that
        stream to the capture, not wait. ``cuEventQuery`` says
        ``CUDA_ERROR_CAPTURED_EVENT`` for it, in relaxed mode without
        disturbing any capture.

        Raises:
            FenceError: It was.
            DeviceError: The query failed otherwise (a faulted context).
        """
        err = _query_relaxed(drv, event)
        if err in (drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_NOT_READY):
            return
        if err == drv.CUresult.CUDA_ERROR_CAPTURED_EVENT:
            raise FenceError(
                "cannot make a fence of an event last recorded inside a CUDA graph capture: "
                "it belongs to the graph and never completes as such; record the event "
                f"again outside the capture, or {_CAPTURE_ADVICE}"
            )
        raise device_error(drv, err, "cannot query the event")

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        # The stream's context, as record() resolves it: any context will do
        # (cuStreamWaitEvent works across contexts and devices). A capturing
        # stream is refused: a wait for uncaptured work would invalidate it.
        drv, cu_stream, handle = self._cu_stream(stream)
        _, pushed = self._enter_stream_context(drv, stream, cu_stream, handle)
        try:
            self._refuse_capture(drv, cu_stream, "make a fence wait on")
        finally:
            if pushed:
                pop_context(drv)

    def stream_wait(self, marker: _CudaMarker, origin: QueueInfo, stream: object) -> None:
        drv, cu_stream, handle = self._cu_stream(stream)
        _, pushed = self._enter_stream_context(drv, stream, cu_stream, handle)
        try:
            (err,) = drv.cuStreamWaitEvent(cu_stream, marker.event, 0)
        finally:
            if pushed:
                pop_context(drv)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, "cuStreamWaitEvent failed")

    def _lane(self, drv: ModuleType, key: Hashable, context: int, order: int) -> _Lane | None:
        """A side stream of the stream ``key`` free to wait for a fence of ``order``.

        The caller holds ``_side_lock`` until it has queued its work on the
        lane, so that no other thread evicts and destroys it in between, and
        has made the fence's context (``context``) current: a new lane is
        made in it.

        Returns:
            ``None`` if every lane already waits for a newer fence.
        """
        lanes = self._side_streams.get(key)
        if lanes is None:
            lanes = self._side_streams[key] = []
            if len(self._side_streams) > _SIDE_STREAM_LIMIT:
                # Destroying a stream with queued work is allowed: the driver
                # frees it once that work is done.
                for lane in self._side_streams.popitem(last=False)[1]:
                    drv.cuStreamDestroy(lane.stream)
        else:
            self._side_streams.move_to_end(key)
        # The lane that waited for the newest fence older than this one.
        usable = [lane for lane in lanes if lane.last_order < order]
        if usable:
            return max(usable, key=lambda lane: lane.last_order)
        if len(lanes) == _LANES_PER_STREAM:
            return None
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        lane = _Lane(check(drv.cuStreamCreate(flags), "cuStreamCreate"))
        lanes.append(lane)
        return lane

    def host_function_path(self) -> HostFunctionPath | None:
        """The entry point completion signals use; ``None`` before the first."""
        launcher = self._launcher
        return None if launcher is None else launcher.path

    def host_functions(self) -> HostFunctionLauncher:
        """The process's launcher, resolved on first use.

        Raises:
            DriverNotFoundError: No NVIDIA driver.
        """
        if self._launcher is None:
            drv = driver()
            with self._side_lock:
                if self._launcher is None:
                    self._launcher = HostFunctionLauncher(drv)
        return self._launcher

    def arm(
        self, marker: _CudaMarker, queue: QueueInfo, mailbox: NativeMailbox, token: int
    ) -> bool:
        launcher = self.host_functions()
        if launcher.path == "none":
            return False
        drv = driver()
        slot = mailbox.new_slot(token)
        # Whose the slot is: ours (freed here) until the launch is tried, the
        # driver's once it accepted it. An interrupt during the launch leaves
        # that unknown: the slot is then kept (a few bytes), never freed under
        # a host function that may still run.
        owner = "ours"
        try:
            with self._side_lock:
                # The wait and the launch queue work: they need the fence's
                # context current, and the arming thread (the loop's) may have none.
                pushed = push_context(drv, marker.context, "the fence's")
                try:
                    lane = self._lane(drv, queue.key, marker.context, marker.order)
                    if lane is None:
                        return False
                    check(drv.cuStreamWaitEvent(lane.stream, marker.event, 0), "cuStreamWaitEvent")
                    owner = "unknown"
                    err = launcher.launch(int(lane.stream), mailbox.host_function, slot)
                    owner = "driver" if err == drv.CUresult.CUDA_SUCCESS else "ours"
                    if owner == "driver":
                        lane.last_order = marker.order
                finally:
                    if pushed:
                        pop_context(drv)
        finally:
            if owner == "ours":  # the driver will never call it
                mailbox.discard(slot)
        if owner != "driver":
            raise device_error(drv, err, f"cuLaunchHostFunc ({launcher.path}) failed")
        return True

    # -- across processes ------------------------------------------------------

    def export_marker(self, marker: _CudaMarker, queue: QueueInfo) -> tuple[bytes, object]:
        """An interprocess event that completes with ``marker``: its device's UUID and handle.

        The event is recorded on one of the stream's side streams after a wait
        for the fence's event, so it completes when the fence does, never
        before (later only if every side stream already waits for a newer
        fence). It never goes back to the pool: an importer may wait on it
        until :meth:`release_export` destroys it.
        """
        drv = driver()
        flags = drv.CUevent_flags.CU_EVENT_INTERPROCESS | drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with self._side_lock:
            pushed = push_context(drv, marker.context, "the fence's")
            try:
                event = check(drv.cuEventCreate(flags), "cuEventCreate (interprocess)")
                try:
                    lane = self._lane(drv, queue.key, marker.context, marker.order)
                    if lane is None:  # each waits for a newer fence: later, never sooner
                        lane = max(self._side_streams[queue.key], key=lambda one: one.last_order)
                    else:
                        lane.last_order = marker.order
                    check(drv.cuStreamWaitEvent(lane.stream, marker.event, 0), "cuStreamWaitEvent")
                    check(drv.cuEventRecord(event, lane.stream), "cuEventRecord (interprocess)")
                    handle = check(drv.cuIpcGetEventHandle(event), "cuIpcGetEventHandle")
                    device = check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
                    uuid = check(drv.cuDeviceGetUuid(device), "cuDeviceGetUuid")
                except BaseException:
                    drv.cuEventDestroy(event)
                    raise
            finally:
                if pushed:
                    pop_context(drv)
        # The handle's 64 bytes, through its address: cuda.bindings releases
        # name its field differently, or not at all.
        return bytes(uuid.bytes) + ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES), event

    def import_marker(self, handle: bytes) -> tuple[_CudaMarker, QueueInfo]:
        """Open another process's interprocess event in its device's primary context here.

        Raises:
            FenceError: The driver is not loaded in this process yet (loading
                it would block the loop: :func:`asyncfence.warm_up` first), or
                the exporter's device is not visible here.
        """
        drv = _driver.loaded_driver()
        if drv is None:
            raise FenceError(
                "the CUDA driver is not loaded in this process yet: loading it blocks, so "
                "call asyncfence.warm_up(stream) off the loop first"
            )
        uuid, reserved = handle[:_UUID_BYTES], handle[_UUID_BYTES:]
        ordinal = self._device_with_uuid(drv, uuid)
        context = self._primary_context(drv, ordinal)
        pushed = push_context(drv, context, f"device {ordinal}'s primary")
        try:
            if len(reserved) != _IPC_HANDLE_BYTES:
                raise FenceError("not a CUDA interprocess event handle")
            opaque = drv.CUipcEventHandle()
            ctypes.memmove(opaque.getPtr(), reserved, _IPC_HANDLE_BYTES)
            event = check(drv.cuIpcOpenEventHandle(opaque), "cuIpcOpenEventHandle")
            identity = self._context_id(drv, context)
        finally:
            if pushed:
                pop_context(drv)
        order = next(self._orders)
        # Not pooled (release destroys it), and a stream of its own: no
        # other fence is ordered with it.
        marker = _CudaMarker(event, context, _NOT_POOLED, order)
        return marker, QueueInfo(("imported", identity, order))

    def _device_with_uuid(self, drv: ModuleType, uuid: bytes) -> int:
        ordinal = self._ordinals_by_uuid.get(uuid)
        if ordinal is not None:
            return ordinal
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        for ordinal in range(count):
            device = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
            if bytes(check(drv.cuDeviceGetUuid(device), "cuDeviceGetUuid").bytes) == uuid:
                self._ordinals_by_uuid[uuid] = ordinal  # a process's devices never change
                return ordinal
        raise FenceError(
            "the exporting process's CUDA device is not visible in this process "
            "(CUDA_VISIBLE_DEVICES?): an interprocess event works only between "
            "processes that share its device"
        )

    def release_export(self, kept: object) -> None:
        loaded = _driver.loaded_driver()
        if loaded is not None and not sys.is_finalizing():
            loaded.cuEventDestroy(kept)

    def warm_up(self, stream: object) -> None:
        """The driver, the host-function entry point, an event pooled in its context."""
        drv, cu_stream, handle = self._cu_stream(stream)
        self.host_functions()
        (context, identity), pushed = self._enter_stream_context(drv, stream, cu_stream, handle)
        try:
            pool = self._pool(identity)
            if not pool:
                pool.append(self._create_event(drv, context))
        finally:
            if pushed:
                pop_context(drv)

    def runtime_initialised(self) -> bool:
        if _driver.loaded_driver() is not None:
            return True
        torch = sys.modules.get("torch")  # PyTorch initialised CUDA (it says so, no call)
        try:
            return torch is not None and bool(torch.cuda.is_initialized())
        except AttributeError:
            return False

    def lab(self) -> CudaLab:
        return CudaLab()

    def release(self, marker: _CudaMarker) -> None:
        # deque.append is atomic, and this may run in a finalizer. A pending
        # event is fine to re-record: later records overwrite its state.
        if marker.pool is _NOT_POOLED:  # an opened interprocess event
            if (loaded := _driver.loaded_driver()) is not None and not sys.is_finalizing():
                loaded.cuEventDestroy(marker.event)
        elif len(marker.pool) < _POOL_LIMIT:
            marker.pool.append(marker.event)
        elif (loaded := _driver.loaded_driver()) is not None and not sys.is_finalizing():
            loaded.cuEventDestroy(marker.event)

    def pooled_events(self) -> int:
        """How many idle events the pools hold, across contexts."""
        return sum(len(pool) for pool in list(self._pools.values()))

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            backend=self.name,
            pooled_markers=self.pooled_events(),
            side_streams=sum(len(lanes) for lanes in list(self._side_streams.values())),
            signal_path=self.host_function_path(),
        )
