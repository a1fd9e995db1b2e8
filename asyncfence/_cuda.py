"""The CUDA backend: a fence is a pooled CUDA event recorded on a CUDA stream.

Streams come from anywhere: cuda.core, PyTorch, CuPy, numba-cuda, cuda.bindings,
or a raw handle. ``cuda.bindings.driver`` is imported, and the driver loaded,
only when a CUDA stream is first used, so asyncfence imports and runs OpenCL on
machines without an NVIDIA driver.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Final, Literal

from ._backend import Marker, NativeSignal, QueueInfo
from ._exceptions import DeviceError, DriverNotFoundError

if TYPE_CHECKING:
    from collections.abc import Hashable
    from types import ModuleType

__all__ = ["CudaBackend", "check", "cuda_stream_handle", "device_error", "driver"]

#: The special stream handles, as CUDA defines them.
NULL_STREAM: Final = 0
LEGACY_DEFAULT_STREAM: Final = 1
PER_THREAD_DEFAULT_STREAM: Final = 2

# Events kept per context beyond those in use; more are destroyed on release.
_POOL_LIMIT = 4096
# Side streams kept for completion signals, least recently used dropped first.
_SIDE_STREAM_LIMIT = 256
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

_driver_module: ModuleType | None = None
_driver_lock = threading.Lock()


def driver() -> ModuleType:
    """Return ``cuda.bindings.driver``, with the driver initialised.

    Raises:
        DriverNotFoundError: No NVIDIA driver (``libcuda.so.1``) could be loaded.
        DeviceError: ``cuInit`` failed.
    """
    global _driver_module
    if _driver_module is not None:
        return _driver_module
    with _driver_lock:
        if _driver_module is None:
            from cuda.bindings import driver as drv

            try:
                (err,) = drv.cuInit(0)
            except RuntimeError as missing:  # cuda.pathfinder's DynamicLibNotFoundError
                raise DriverNotFoundError(
                    "the NVIDIA driver (libcuda.so.1) was not found: CUDA streams need an "
                    "NVIDIA GPU with its driver installed; without one, use OpenCL "
                    "(pip install 'asyncfence[opencl]')"
                ) from missing
            if err != drv.CUresult.CUDA_SUCCESS:
                raise device_error(drv, err, "cuInit failed")
            _driver_module = drv
    return _driver_module


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


def cuda_stream_handle(stream: object) -> int:
    """Return the raw ``CUstream`` handle of any supported stream object.

    Raises:
        TypeError: ``stream`` is not a CUDA stream asyncfence knows.
        ValueError: The handle is negative or out of range.
    """
    if isinstance(stream, bool):
        raise TypeError(f"expected {_ACCEPTS}; got bool")
    if isinstance(stream, int):
        handle = stream
    elif hasattr(type(stream), "__cuda_stream__"):
        protocol = stream.__cuda_stream__  # type: ignore[attr-defined]
        # A method since cuda.core 0.2; an attribute before.
        version, handle = protocol() if callable(protocol) else protocol
        if version != 0:
            raise ValueError(f"unsupported __cuda_stream__ protocol version {version}")
    else:
        library = type(stream).__module__.partition(".")[0]
        if library == "torch" and hasattr(stream, "cuda_stream"):
            handle = stream.cuda_stream
        elif library == "cupy" and hasattr(stream, "ptr"):
            handle = stream.ptr
        elif library == "numba" and hasattr(stream, "handle"):
            handle = stream.handle.value or 0  # a c_void_p; None is the default stream
        else:
            raise TypeError(f"expected {_ACCEPTS}; got {type(stream).__qualname__} object")
    handle = int(handle)
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"a CUDA stream handle must be in [0, 2**64), got {handle}")
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


class _CudaMarker:
    """A recorded event, its context, and the pool it goes back to."""

    __slots__ = ("context", "event", "pool")

    def __init__(self, event: Any, context: int, pool: deque[Any]) -> None:
        self.event = event
        self.context = context
        self.pool = pool


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
        # Completion signals run on side streams, one per user stream, that
        # wait for the fence's event first: the user's stream is never held
        # by a signal, and one slow stream never delays another's signals.
        self._side_streams: OrderedDict[Hashable, Any] = OrderedDict()
        self._side_lock = threading.Lock()
        self._launcher: HostFunctionLauncher | None = None

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

    def _stream(self, stream: object) -> tuple[ModuleType, Any, int, int]:
        """Resolve ``stream`` to (driver, CUstream, handle, context handle)."""
        handle = cuda_stream_handle(stream)
        drv = driver()
        cu_stream = stream if type(stream) is drv.CUstream else drv.CUstream(handle)
        err, context = drv.cuStreamGetCtx(cu_stream)
        if err != drv.CUresult.CUDA_SUCCESS:
            detail = "cannot find the stream's context"
            if handle <= PER_THREAD_DEFAULT_STREAM:
                detail += " (the default streams need a current context on this thread)"
            raise device_error(drv, err, detail)
        return drv, cu_stream, handle, int(context)

    def _pool(self, context: int) -> deque[Any]:
        pool = self._pools.get(context)
        if pool is None:
            with self._pools_lock:
                pool = self._pools.setdefault(context, deque())
        return pool

    def _create_event(self, drv: ModuleType, context: int) -> Any:
        err, current = drv.cuCtxGetCurrent()
        switch = err != drv.CUresult.CUDA_SUCCESS or int(current) != context
        if switch:
            (err,) = drv.cuCtxPushCurrent(drv.CUcontext(context))
            if err != drv.CUresult.CUDA_SUCCESS:
                raise device_error(drv, err, "cannot make the stream's context current")
        try:
            err, event = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        finally:
            if switch:
                drv.cuCtxPopCurrent()
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, "cuEventCreate failed")
        return event

    def stream_key(self, stream: object) -> Hashable:
        # The handle alone: the default streams (0, 1, 2) of every context and
        # thread share a key, which only serialises their records more.
        return cuda_stream_handle(stream)

    def record(self, stream: object) -> tuple[Marker, QueueInfo]:
        drv, cu_stream, handle, context = self._stream(stream)
        pool = self._pool(context)
        try:
            event = pool.pop()
        except IndexError:
            event = self._create_event(drv, context)
        (err,) = drv.cuEventRecord(event, cu_stream)
        if err != drv.CUresult.CUDA_SUCCESS:
            pool.append(event)
            raise device_error(drv, err, "cuEventRecord failed")
        if handle == PER_THREAD_DEFAULT_STREAM:
            key: tuple[int, ...] = (context, handle, threading.get_ident())
        else:
            key = (context, handle)
        return _CudaMarker(event, context, pool), QueueInfo(key, in_order=True)

    def query(self, marker: Marker) -> bool:
        assert isinstance(marker, _CudaMarker)
        drv = driver()
        (err,) = drv.cuEventQuery(marker.event)
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise device_error(drv, err, "the work before the fence failed")

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        # The stream's context, as record() resolves it: any context will do
        # (cuStreamWaitEvent works across contexts and devices).
        self._stream(stream)

    def stream_wait(self, marker: Marker, origin: QueueInfo, stream: object) -> None:
        assert isinstance(marker, _CudaMarker)
        handle = cuda_stream_handle(stream)
        drv = driver()
        cu_stream = stream if type(stream) is drv.CUstream else drv.CUstream(handle)
        (err,) = drv.cuStreamWaitEvent(cu_stream, marker.event, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, "cuStreamWaitEvent failed")

    def _side_stream(self, drv: ModuleType, key: Hashable, context: int) -> Any:
        """The side stream of the stream ``key``; the caller holds ``_side_lock``.

        Held until the caller has queued its work on it, so that no other
        thread evicts and destroys it in between.
        """
        side = self._side_streams.get(key)
        if side is not None:
            self._side_streams.move_to_end(key)
            return side
        check(drv.cuCtxPushCurrent(drv.CUcontext(context)), "cuCtxPushCurrent")
        try:
            flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            side = check(drv.cuStreamCreate(flags), "cuStreamCreate")
        finally:
            drv.cuCtxPopCurrent()
        self._side_streams[key] = side
        if len(self._side_streams) > _SIDE_STREAM_LIMIT:
            # Destroying a stream with queued work is allowed: the driver
            # frees it once that work is done.
            drv.cuStreamDestroy(self._side_streams.popitem(last=False)[1])
        return side

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
            side = self._side_stream(drv, queue.key, marker.context)
            check(drv.cuStreamWaitEvent(side, marker.event, 0), "cuStreamWaitEvent")
            err = launcher.launch(int(side), signal.host_function, signal.argument)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise device_error(drv, err, f"cuLaunchHostFunc ({launcher.path}) failed")
        return True

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
