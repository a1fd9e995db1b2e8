"""The CUDA backend: a fence is a pooled CUDA event recorded on a CUDA stream.

Streams come from anywhere: cuda.core, PyTorch, CuPy, numba-cuda, cuda.bindings,
or a raw handle. ``cuda.bindings.driver`` is imported, and the driver loaded,
only when a CUDA stream is first used, so asyncfence imports and runs OpenCL on
machines without an NVIDIA driver.

Fences are never recorded inside a CUDA graph capture (an event recorded there
belongs to the graph and never completes), and the default streams of a stream
object that names its device work from any thread: that device's primary
context is made current around the calls that need one.
"""

from __future__ import annotations

import ctypes
import itertools
import operator
import os
import sys
import threading
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Final, Literal

from ._backend import BackendStatistics, Marker, NativeSignal, QueueInfo
from ._exceptions import DeviceError, DriverNotFoundError, FenceError

if TYPE_CHECKING:
    from collections.abc import Hashable
    from types import ModuleType

__all__ = [
    "CudaBackend",
    "check",
    "cuda_stream_handle",
    "current_context",
    "device_error",
    "driver",
    "pop_context",
    "push_context",
    "stream_device",
]

#: The special stream handles, as CUDA defines them.
NULL_STREAM: Final = 0
LEGACY_DEFAULT_STREAM: Final = 1
PER_THREAD_DEFAULT_STREAM: Final = 2

# Events kept per context beyond those in use; more are destroyed on release.
_POOL_LIMIT = 4096
# User streams whose side streams are kept, least recently used dropped first.
_SIDE_STREAM_LIMIT = 256
# Side streams ("lanes") per user stream: a signal for an older fence parked
# after a newer one needs a lane of its own, or it would queue behind the
# newer fence's wait. Past this, such a signal is not armed (it is polled).
_LANES_PER_STREAM = 4
# CU_HOST_TASK_BLOCKING: the driver thread blocks, rather than spins, around it.
_HOST_TASK_BLOCKING = 0
# cuLaunchHostFunc_v2 appeared in CUDA 13.2; cuLaunchHostFunc in 10.0.
_HOST_FUNC_V2_VERSION = 13020
_HOST_FUNC_V1_VERSION = 10000

#: Which entry point launches completion signals: ``"v2"`` (cuLaunchHostFunc_v2),
#: ``"v1"`` (the raw cuLaunchHostFunc), or ``"none"`` (neither: parked waits poll).
HostFunctionPath = Literal["v2", "v1", "none"]

_ACCEPTS = (
    "a CUDA stream: an object with __cuda_stream__ (cuda.core, PyTorch, numba-cuda, "
    "cuda.bindings CUstream), a CuPy stream, a torch.cuda.Stream, a numba-cuda stream, "
    "or an int handle (0 null, 1 legacy default, 2 per-thread default stream)"
)

_CAPTURE_ADVICE = (
    "record fences outside the capture instead: after cuStreamEndCapture, and to know "
    "when a graph's work is done, on the stream the graph is launched on, after "
    "cuGraphLaunch (see docs/graphs.md)"
)

# cuda.bindings' switch for per-thread default streams: any non-zero integer
# resolves every entry point in per-thread mode, where handle 0 is the calling
# thread's per-thread default stream rather than the legacy one.
_PER_THREAD_VARIABLE = "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"

_driver_module: ModuleType | None = None
_driver_lock = threading.Lock()
# Set in a child forked after (or while) this process initialised the driver:
# CUDA does not survive fork(), so the child is told so instead of hanging.
_forked_after_init = False
_initialising = False
_per_thread_default_stream = False


def _per_thread_mode_requested() -> bool:
    """Whether the environment asks cuda.bindings for per-thread default streams."""
    value = os.environ.get(_PER_THREAD_VARIABLE)
    if value is None:
        return False
    try:
        return int(value) != 0  # as cuda.bindings reads it
    except ValueError:  # cuda.bindings itself refuses to initialise then
        return False


def driver(needed_for: str = "CUDA streams") -> ModuleType:
    """Return ``cuda.bindings.driver``, with the driver initialised.

    Args:
        needed_for: What the caller wants the driver for, for the error
            message where there is none.

    Raises:
        DriverNotFoundError: No NVIDIA driver (``libcuda.so.1``) could be loaded.
        DeviceError: ``cuInit`` failed.
    """
    global _driver_module, _initialising
    if _driver_module is not None:
        return _driver_module
    if _forked_after_init:
        raise FenceError(
            "this process was forked after its parent initialised the CUDA driver, which "
            "does not survive fork(); start processes that use the device with the "
            "'spawn' or 'forkserver' start method"
        )
    with _driver_lock:
        if _driver_module is None:
            _initialising = True
            try:
                _driver_module = _initialise(needed_for)
            finally:
                _initialising = False
    return _driver_module


def _initialise(needed_for: str) -> ModuleType:
    """``cuInit``; called once, under the driver lock."""
    global _per_thread_default_stream
    from cuda.bindings import driver as drv

    # Read when cuda.bindings reads it: as it initialises, at the first call.
    _per_thread_default_stream = _per_thread_mode_requested()
    try:
        (err,) = drv.cuInit(0)
    except RuntimeError as missing:  # cuda.pathfinder's DynamicLibNotFoundError
        raise DriverNotFoundError(
            f"the NVIDIA driver (libcuda.so.1) was not found: {needed_for} need an "
            "NVIDIA GPU with its driver installed; without one, use OpenCL "
            "(pip install 'asyncfence[opencl]')"
        ) from missing
    if err != drv.CUresult.CUDA_SUCCESS:
        raise device_error(drv, err, "cuInit failed")
    module: ModuleType = drv
    return module


def _after_fork_in_child() -> None:
    global _driver_module, _driver_lock, _forked_after_init
    _forked_after_init = _driver_module is not None or _initialising
    _driver_module = None
    _driver_lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def device_error(drv: ModuleType, err: Any, detail: str = "") -> DeviceError:
    """A :class:`DeviceError` for the ``CUresult`` ``err``."""
    code = int(err)
    try:
        name = drv.CUresult(code).name
    except ValueError:
        name = "CUDA_ERROR_UNKNOWN"
    status, text = drv.cuGetErrorString(err)
    if status == drv.CUresult.CUDA_SUCCESS and text:
        explanation = text.decode(errors="replace")
        detail = f"{detail}: {explanation}" if detail else explanation
    return DeviceError("cuda", code, name, detail)


def check(result: tuple[Any, ...], what: str) -> Any:
    """Unpack a cuda.bindings ``(CUresult, value...)`` tuple, raising on error.

    Returns:
        The single value, or ``None`` for calls that return only a status.
    """
    drv = driver()
    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise device_error(drv, err, f"{what} failed")
    return result[1] if len(result) > 1 else None


def current_context(drv: ModuleType) -> int:
    """The handle of the context current on the calling thread; 0 if none."""
    err, context = drv.cuCtxGetCurrent()
    return int(context) if err == drv.CUresult.CUDA_SUCCESS and context is not None else 0


def push_context(drv: ModuleType, context: int, what: str) -> bool:
    """Make ``context`` current on the calling thread unless it already is.

    Args:
        drv: The driver module.
        context: The context's handle.
        what: Whose context it is, for the error message (``"the stream's"``).

    Returns:
        Whether it was pushed: if so, the caller must :func:`pop_context`.

    Raises:
        DeviceError: The driver refused it.
    """
    if current_context(drv) == context:
        return False
    (err,) = drv.cuCtxPushCurrent(drv.CUcontext(context))
    if err != drv.CUresult.CUDA_SUCCESS:
        raise device_error(drv, err, f"cannot make {what} context current")
    return True


def pop_context(drv: ModuleType) -> None:
    """Undo a :func:`push_context` that pushed."""
    drv.cuCtxPopCurrent()


def stream_device(stream: object) -> int | None:
    """The device ordinal a stream object names, or ``None`` if it names none.

    PyTorch streams name it as ``.device.index``, CuPy streams as
    ``.device_id``, cuda.core streams as ``.device.device_id``; raw handles
    and cuda.bindings ``CUstream`` objects name none.
    """
    module = type(stream).__module__
    library = module.partition(".")[0]
    try:
        if library == "torch":
            ordinal = stream.device.index  # type: ignore[attr-defined]
        elif library == "cupy":
            ordinal = stream.device_id  # type: ignore[attr-defined]
        elif module == "cuda.core" or module.startswith("cuda.core."):
            ordinal = stream.device.device_id  # type: ignore[attr-defined]
        else:
            return None
    except AttributeError:
        return None
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
        return None  # CuPy's null stream says -1: whichever device is current
    return ordinal


def cuda_stream_handle(stream: object) -> int:
    """Return the raw ``CUstream`` handle of any supported stream object.

    Raises:
        TypeError: ``stream`` is not a CUDA stream asyncfence knows.
        ValueError: The handle is negative or out of range.
    """
    if isinstance(stream, bool):
        raise TypeError(f"expected {_ACCEPTS}; got bool")
    if isinstance(stream, int):
        handle: object = stream
    elif hasattr(type(stream), "__cuda_stream__"):
        handle = _protocol_handle(stream)
    else:
        library = type(stream).__module__.partition(".")[0]
        if library == "torch" and hasattr(stream, "cuda_stream"):
            handle = stream.cuda_stream
        elif library == "cupy" and hasattr(stream, "ptr"):
            handle = stream.ptr
        elif library == "numba" and hasattr(stream, "handle"):
            raw = stream.handle
            # A ctypes c_void_p in older numba-cuda (its .value None for the
            # default stream); a cuda.bindings CUstream, which int() takes, since.
            handle = (raw.value or 0) if isinstance(raw, ctypes.c_void_p) else int(raw)
        else:
            raise TypeError(f"expected {_ACCEPTS}; got {type(stream).__qualname__} object")
    if isinstance(handle, bool) or not isinstance(handle, int):
        try:  # NumPy integers and the like; never a float, silently truncated
            handle = operator.index(handle)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"a CUDA stream handle must be an int, got {type(handle).__qualname__} "
                f"from {type(stream).__qualname__}"
            ) from None
    assert isinstance(handle, int)
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"a CUDA stream handle must be in [0, 2**64), got {handle}")
    return handle


def _protocol_handle(stream: object) -> object:
    """The handle a ``__cuda_stream__`` gives: a method since cuda.core 0.2, an attribute before.

    Raises:
        TypeError: It does not give a ``(version, handle)`` pair of ints.
        ValueError: Its protocol version is not 0.
    """
    protocol = stream.__cuda_stream__  # type: ignore[attr-defined]
    given = protocol() if callable(protocol) else protocol
    if not isinstance(given, tuple) or len(given) != 2:
        raise TypeError(
            f"{type(stream).__qualname__}.__cuda_stream__ must give a (version, handle) "
            f"tuple of two ints, got {given!r}"
        )
    version, handle = given
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(
            f"the __cuda_stream__ protocol version must be an int, got {version!r} "
            f"from {type(stream).__qualname__}"
        )
    if version != 0:
        raise ValueError(
            f"unsupported __cuda_stream__ protocol version {version} from "
            f"{type(stream).__qualname__} (asyncfence speaks version 0)"
        )
    return handle


class HostFunctionLauncher:
    """Launches a native host function through the driver's own entry point.

    Never through cuda.bindings' ``cuLaunchHostFunc``: that wrapper registers
    a trampoline that takes the GIL on the driver's thread for every call.
    The raw entry point, from ``cuGetProcAddress``, receives the native
    function itself; ctypes releases the GIL around the call.

    Attributes:
        path: Which entry point it uses (see :data:`HostFunctionPath`).
    """

    def __init__(self, drv: ModuleType) -> None:
        self.path: HostFunctionPath = "none"
        self._launch: Any = None
        err, version = drv.cuDriverGetVersion()
        if err != drv.CUresult.CUDA_SUCCESS:
            return
        if version >= _HOST_FUNC_V2_VERSION:
            address = _entry_point(drv, "cuLaunchHostFunc", _HOST_FUNC_V2_VERSION)
            if address:
                prototype = ctypes.CFUNCTYPE(
                    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint
                )
                self.path, self._launch = "v2", prototype(address)
                return
        address = _entry_point(drv, "cuLaunchHostFunc", _HOST_FUNC_V1_VERSION)
        if address:
            prototype = ctypes.CFUNCTYPE(
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
            )
            self.path, self._launch = "v1", prototype(address)

    def launch(self, stream: int, function: int, argument: int) -> int:
        """Queue ``function(argument)`` on ``stream``; returns the ``CUresult`` code.

        Raises:
            RuntimeError: No entry point (``path`` is ``"none"``).
        """
        if self._launch is None:
            raise RuntimeError("this driver offers no cuLaunchHostFunc entry point")
        if self.path == "v2":
            return int(self._launch(stream, function, argument, _HOST_TASK_BLOCKING))
        return int(self._launch(stream, function, argument))


def _entry_point(drv: ModuleType, symbol: str, version: int) -> int:
    """The driver's own address for ``symbol`` at ``version``; 0 if it has none."""
    try:
        result = drv.cuGetProcAddress(symbol.encode(), version, 0)
    except RuntimeError:  # cuGetProcAddress itself missing from the binding or driver
        return 0
    if result[0] != drv.CUresult.CUDA_SUCCESS or not result[1]:
        return 0
    return int(result[1])


def _queue_key(context: int, handle: int) -> tuple[int, ...]:
    """The key of the in-order queue that a record on ``handle`` in ``context`` joins.

    The default-stream handles name the stream they mean: 0 is the legacy
    default stream (1), or in per-thread mode the calling thread's per-thread
    default stream (2), which is another stream on every thread.
    """
    if handle == NULL_STREAM:
        handle = PER_THREAD_DEFAULT_STREAM if _per_thread_default_stream else LEGACY_DEFAULT_STREAM
    if handle == PER_THREAD_DEFAULT_STREAM:
        return (context, handle, threading.get_ident())
    return (context, handle)


class _CudaMarker:
    """A recorded event, its context, the pool it goes back to, and its record order."""

    __slots__ = ("context", "event", "order", "pool")

    def __init__(self, event: Any, context: int, pool: deque[Any], order: int) -> None:
        self.event = event
        self.context = context
        self.pool = pool
        self.order = order


class _Lane:
    """A side stream, and the record order of the newest fence it waits for."""

    __slots__ = ("last_order", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.last_order = -1


class CudaBackend:
    """Fences as ``CU_EVENT_DISABLE_TIMING`` events, pooled per context.

    In the steady state recording calls ``cuEventRecord`` and nothing else:
    events come back to their context's pool when their fence settles (or is
    dropped), so ``cuEventCreate`` runs only while the number of fences in
    flight grows.
    """

    name = "cuda"
    title = "CUDA"
    accepts = _ACCEPTS

    def __init__(self) -> None:
        self._pools: dict[int, deque[Any]] = {}
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
        if hasattr(os, "register_at_fork"):  # the parent's threads may have held them
            os.register_at_fork(after_in_child=self._renew_locks)

    def _renew_locks(self) -> None:
        self._pools_lock = threading.Lock()
        self._primary_lock = threading.Lock()
        self._side_lock = threading.Lock()

    def claims(self, stream: object) -> bool:
        if isinstance(stream, bool):
            return False
        if isinstance(stream, int) or hasattr(type(stream), "__cuda_stream__"):
            return True
        library = type(stream).__module__.partition(".")[0]
        return (
            (library == "torch" and hasattr(stream, "cuda_stream"))
            or (library == "cupy" and hasattr(stream, "ptr"))
            or (library == "numba" and hasattr(stream, "handle"))
        )

    def _cu_stream(self, stream: object) -> tuple[ModuleType, Any, int]:
        """Resolve ``stream`` to (driver, CUstream, handle)."""
        handle = cuda_stream_handle(stream)
        drv = driver()
        cu_stream = stream if type(stream) is drv.CUstream else drv.CUstream(handle)
        return drv, cu_stream, handle

    def _enter_device(self, drv: ModuleType, stream: object, handle: int) -> bool:
        """Make a default stream's own device current, where its object names one.

        A default-stream handle (0, 1, 2) means "of the current context", and
        a thread where the library did no work of its own may have none
        (PyTorch makes its primary context current only there), or that of
        another device. The primary context of the device the object names is
        then pushed. Other streams need no current context.

        Returns:
            Whether a context was pushed (the caller pops it).
        """
        if handle > PER_THREAD_DEFAULT_STREAM:
            return False
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

    def record(self, stream: object) -> tuple[Marker, QueueInfo]:
        """Record a pooled event on ``stream``.

        Raises:
            FenceError: The stream is capturing a CUDA graph.
            DeviceError: The driver refused the stream or the record.
        """
        drv, cu_stream, handle = self._cu_stream(stream)
        pushed = self._enter_device(drv, stream, handle)
        try:
            context = self._stream_context(drv, cu_stream, handle)
            self._refuse_capture(drv, cu_stream, "record a fence on")
            pool = self._pool(context)
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
        return marker, QueueInfo(_queue_key(context, handle), in_order=True)

    def query(self, marker: Marker) -> bool:
        assert isinstance(marker, _CudaMarker)
        drv = driver()
        # A query is a "potentially unsafe" call while a graph is captured: in
        # the default (global) capture mode, a capture on any thread makes the
        # driver refuse it and invalidate that capture. Relaxed mode, for this
        # one call, lets the query through and leaves every capture alone.
        relaxed, previous = drv.cuThreadExchangeStreamCaptureMode(
            drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        )
        try:
            (err,) = drv.cuEventQuery(marker.event)
        finally:
            if not relaxed:  # CUDA_SUCCESS: put the thread's own mode back
                drv.cuThreadExchangeStreamCaptureMode(previous)
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise device_error(drv, err, "the work before the fence failed")

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        # The stream's context, as record() resolves it: any context will do
        # (cuStreamWaitEvent works across contexts and devices). A capturing
        # stream is refused: a wait for uncaptured work would invalidate it.
        drv, cu_stream, handle = self._cu_stream(stream)
        pushed = self._enter_device(drv, stream, handle)
        try:
            self._stream_context(drv, cu_stream, handle)
            self._refuse_capture(drv, cu_stream, "make a fence wait on")
        finally:
            if pushed:
                pop_context(drv)

    def stream_wait(self, marker: Marker, origin: QueueInfo, stream: object) -> None:
        assert isinstance(marker, _CudaMarker)
        drv, cu_stream, handle = self._cu_stream(stream)
        pushed = self._enter_device(drv, stream, handle)
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
        lane, so that no other thread evicts and destroys it in between.

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
        check(drv.cuCtxPushCurrent(drv.CUcontext(context)), "cuCtxPushCurrent")
        try:
            flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            lane = _Lane(check(drv.cuStreamCreate(flags), "cuStreamCreate"))
        finally:
            drv.cuCtxPopCurrent()
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

    def arm(self, marker: Marker, queue: QueueInfo, signal: NativeSignal) -> bool:
        assert isinstance(marker, _CudaMarker)
        launcher = self.host_functions()
        if launcher.path == "none":
            return False
        drv = driver()
        with self._side_lock:
            lane = self._lane(drv, queue.key, marker.context, marker.order)
            if lane is None:
                return False
            check(drv.cuStreamWaitEvent(lane.stream, marker.event, 0), "cuStreamWaitEvent")
            err = launcher.launch(int(lane.stream), signal.host_function, signal.argument)
            if err == drv.CUresult.CUDA_SUCCESS:
                lane.last_order = marker.order
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, f"cuLaunchHostFunc ({launcher.path}) failed")
        return True

    def signal_path(self) -> str | None:
        return self.host_function_path()

    def release(self, marker: Marker) -> None:
        assert isinstance(marker, _CudaMarker)
        # deque.append is atomic, and this may run in a finalizer. A pending
        # event is fine to re-record: later records overwrite its state.
        if len(marker.pool) < _POOL_LIMIT:
            marker.pool.append(marker.event)
        elif _driver_module is not None and not sys.is_finalizing():
            _driver_module.cuEventDestroy(marker.event)

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
