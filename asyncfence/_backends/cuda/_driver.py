"""The CUDA driver, as the backend uses it: loading it, its errors, contexts, stream handles.

``cuda.bindings.driver`` is imported, and the driver loaded, only when CUDA is
first used, so asyncfence imports and runs OpenCL on machines without an
NVIDIA driver. Host functions are launched through the driver's own entry
points (:class:`HostFunctionLauncher`), never through cuda.bindings' wrapper.
"""

from __future__ import annotations

import ctypes
import operator
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Final, Literal, SupportsInt, cast

from ... import _fork
from ..._exceptions import DeviceError, DriverNotFoundError
from ..._validation import type_name

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "ACCEPTS",
    "EVENTS_ACCEPTED",
    "LEGACY_DEFAULT_STREAM",
    "NULL_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "TORCH_GENERIC_STREAM",
    "HostFunctionLauncher",
    "HostFunctionPath",
    "as_cu_stream",
    "check",
    "cuda_event_handle",
    "cuda_stream_handle",
    "current_context",
    "device_error",
    "driver",
    "is_cuda_stream",
    "loaded_driver",
    "per_thread_default_stream",
    "pop_context",
    "push_context",
    "stream_device",
]

#: The special stream handles, as CUDA defines them.
NULL_STREAM: Final = 0
LEGACY_DEFAULT_STREAM: Final = 1
PER_THREAD_DEFAULT_STREAM: Final = 2

# CU_HOST_TASK_BLOCKING: the driver thread blocks, rather than spins, around it.
_HOST_TASK_BLOCKING = 0
# cuLaunchHostFunc_v2 appeared in CUDA 13.2; cuLaunchHostFunc in 10.0.
_HOST_FUNC_V2_VERSION = 13020
_HOST_FUNC_V1_VERSION = 10000

#: Which entry point launches completion signals: ``"v2"`` (cuLaunchHostFunc_v2),
#: ``"v1"`` (the raw cuLaunchHostFunc), or ``"none"`` (neither: parked waits
#: are re-checked).
HostFunctionPath = Literal["v2", "v1", "none"]

#: The stream objects the backend accepts, for error messages.
ACCEPTS = (
    "a CUDA stream: an object with __cuda_stream__ (cuda.core, PyTorch, numba-cuda, "
    "cuda.bindings CUstream), a CuPy stream, a torch.cuda.Stream, a torch.Stream on CUDA "
    "(torch.accelerator.current_stream()), a numba-cuda stream, or an int handle "
    "(0 null, 1 legacy default, 2 per-thread default stream)"
)

# cuda.bindings' switch for per-thread default streams: any non-zero integer
# resolves every entry point in per-thread mode, where handle 0 is the calling
# thread's per-thread default stream rather than the legacy one.
_PER_THREAD_VARIABLE = "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"

_driver_module: ModuleType | None = None
_driver_lock = threading.Lock()
# CUDA does not survive fork(): a child forked after (or while) this process
# initialised the driver is told so by driver() instead of hanging.
_fork.clear_after_fork(sys.modules[__name__], "_driver_module")
_fork.renew_after_fork(sys.modules[__name__], "_driver_lock")
_per_thread_default_stream = False


def loaded_driver() -> ModuleType | None:
    """The driver module if loaded already; never loads it (safe in finalizers)."""
    return _driver_module


def per_thread_default_stream() -> bool:
    """Whether handle 0 means each thread's per-thread default stream (read at load)."""
    return _per_thread_default_stream


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
        FenceError: This process was forked after (or while) its parent
            initialised the driver.
    """
    global _driver_module
    if _driver_module is not None:
        return _driver_module
    _fork.check_unused_by_parent("cuda", "the CUDA driver")
    with _driver_lock:
        if _driver_module is None:
            _fork.note_used("cuda")  # from the start: a fork during cuInit is caught too
            _driver_module = _initialise(needed_for)
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
            "(its opencl extra: pip install -e '.[opencl]' in a checkout)"
        ) from missing
    if err != drv.CUresult.CUDA_SUCCESS:
        raise device_error(drv, err, "cuInit failed")
    module: ModuleType = drv
    return module


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


# The stream objects of libraries without __cuda_stream__ (or of their older
# versions): the library (the top of the type's module) and the attribute that
# holds the raw handle.
_HANDLE_ATTRIBUTES = {"torch": "cuda_stream", "cupy": "ptr", "numba": "handle"}


def _is_torch_generic_stream(kind: type) -> bool:
    """Whether ``kind`` is PyTorch's device-generic ``torch.Stream`` (device in the object)."""
    return kind.__module__ == "torch" and kind.__qualname__ == "Stream"


#: PyTorch's device-generic ``torch.Stream``, as (module, qualified name): the
#: backend is chosen by the object (its ``device_type``), never by its type.
TORCH_GENERIC_STREAM: Final = ("torch", "Stream")


def is_cuda_stream(stream: object) -> bool:
    """Whether ``stream`` is a stream object :func:`cuda_stream_handle` takes.

    By type, except for PyTorch's generic ``torch.Stream``: one whose device
    is CUDA.
    """
    if isinstance(stream, bool):
        return False
    kind = type(stream)
    if isinstance(stream, int) or hasattr(kind, "__cuda_stream__"):
        return True
    if _is_torch_generic_stream(kind):
        return getattr(getattr(stream, "device", None), "type", None) == "cuda"
    return _handle_attribute(stream) is not None


def _handle_attribute(stream: object) -> str | None:
    attribute = _HANDLE_ATTRIBUTES.get(type(stream).__module__.partition(".")[0])
    return attribute if attribute is not None and hasattr(stream, attribute) else None


def cuda_stream_handle(stream: object) -> int:
    """Return the raw ``CUstream`` handle of any supported stream object.

    Raises:
        TypeError: ``stream`` is not a CUDA stream asyncfence knows.
        ValueError: The handle is negative or out of range.
    """
    if isinstance(stream, bool):
        raise TypeError(f"expected {ACCEPTS}; got bool")
    kind = type_name(stream)
    if isinstance(stream, int):
        handle: object = stream
        source = "the handle given"
    elif hasattr(type(stream), "__cuda_stream__"):
        handle = _protocol_handle(stream)
        source = f"{kind}.__cuda_stream__"
    elif _is_torch_generic_stream(type(stream)) and is_cuda_stream(stream):
        handle = _torch_generic_handle(stream)
        source = "torch.Stream.stream_id"
    elif (attribute := _handle_attribute(stream)) is not None:
        handle = getattr(stream, attribute)
        source = f"{kind}.{attribute}"
        if isinstance(handle, ctypes.c_void_p):  # older numba-cuda; None: the default stream
            handle = handle.value or 0
        elif attribute == "handle":  # numba-cuda since: a cuda.bindings CUstream
            handle = int(cast("SupportsInt", handle))
    else:
        raise TypeError(f"expected {ACCEPTS}; got {kind} object")
    if isinstance(handle, bool):  # an int to Python, never a stream: True would be stream 1
        raise TypeError(f"a CUDA stream handle must be an int, got bool {handle} from {source}")
    if not isinstance(handle, int):
        try:  # NumPy integers and the like; never a float, silently truncated
            handle = operator.index(handle)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"a CUDA stream handle must be an int, got {type_name(handle)} "
                f"{handle!r} from {source}"
            ) from None
    assert isinstance(handle, int)
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"a CUDA stream handle must be in [0, 2**64), got {handle} from {source}")
    return handle


def _torch_generic_handle(stream: Any) -> int:
    """The ``cudaStream_t`` of a ``torch.Stream`` on CUDA, as PyTorch decodes its id.

    PyTorch's stream ids (c10's ``CUDAStream``): 0 is the device's default
    stream (handle 0, as ``torch.cuda.default_stream().cuda_stream``); an
    even id is an external stream's handle itself (``torch.cuda.ExternalStream``);
    an odd one names a stream of PyTorch's own pools, which only PyTorch's
    CUDA build can resolve (``torch.cuda.Stream(stream_id=...)``, its own
    advice for a generic stream).

    Raises:
        TypeError: A pooled stream, and this PyTorch has no CUDA.
    """
    stream_id: int = stream.stream_id
    if stream_id == 0 or not stream_id & 1:
        return stream_id
    torch = sys.modules["torch"]  # a torch.Stream exists, so torch is imported
    if not torch.backends.cuda.is_built():
        raise TypeError(
            f"this torch.Stream (cuda:{stream.device_index}, stream_id {stream_id}) names a "
            "stream of PyTorch's own CUDA pools, which this PyTorch, built without CUDA, "
            "cannot resolve"
        )
    cuda_stream = torch.cuda.Stream(
        stream_id=stream_id, device_index=stream.device_index, device_type=stream.device_type
    )
    return int(cuda_stream.cuda_stream)


def as_cu_stream(drv: ModuleType, stream: object) -> tuple[Any, int]:
    """``stream`` as a cuda.bindings ``CUstream``, and its raw handle.

    Raises:
        TypeError: ``stream`` is not a CUDA stream asyncfence knows.
        ValueError: The handle is out of range.
    """
    handle = cuda_stream_handle(stream)
    return (stream if type(stream) is drv.CUstream else drv.CUstream(handle)), handle


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
            f"{type_name(stream)}.__cuda_stream__ must give a (version, handle) "
            f"tuple of two ints, got {given!r}"
        )
    version, handle = given
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(
            f"the __cuda_stream__ protocol version must be an int, got {version!r} "
            f"from {type_name(stream)}"
        )
    if version != 0:
        raise ValueError(
            f"unsupported __cuda_stream__ protocol version {version} from "
            f"{type_name(stream)} (asyncfence speaks version 0)"
        )
    return handle


#: The CUDA events :func:`cuda_event_handle` takes, for error messages.
EVENTS_ACCEPTED = (
    "a CUDA event: a cuda.bindings.driver.CUevent, a torch.cuda.Event, a torch.Event "
    "on CUDA, a cupy.cuda.Event, a cuda.core Event, or a numba-cuda event"
)


def cuda_event_handle(event: object) -> tuple[int, int | None] | None:
    """The raw ``CUevent`` handle of a library's CUDA event, and the device it names.

    By the type's module, without importing any library: a
    ``cuda.bindings`` ``CUevent``; cuda.core's ``Event`` (``.handle``);
    PyTorch's ``torch.cuda.Event`` (``.cuda_event``) and ``torch.Event`` on
    CUDA (``.event_id``); CuPy's ``Event`` (``.ptr``); numba-cuda's
    (``.handle``). Handle 0 is an event its library has not created yet
    (PyTorch creates one at its first record): one never recorded.

    Returns:
        ``(handle, device ordinal or None)``, or ``None`` when ``event`` is
        no CUDA event of a library asyncfence knows.

    Raises:
        TypeError: A library's event that is not a CUDA event (a
            ``torch.Event`` on the CPU), a closed one, or one whose handle
            is not an int.
        ValueError: The handle is out of range.
    """
    kind = type(event)
    module = kind.__module__
    library = module.partition(".")[0]
    device: object = None
    if module == "cuda.bindings.driver" and kind.__qualname__ == "CUevent":
        handle: object = int(cast("SupportsInt", event))
    elif (module == "cuda.core" or module.startswith("cuda.core.")) and hasattr(event, "handle"):
        if getattr(event, "is_closed", False) or event.handle is None:
            raise TypeError(f"this {type_name(event)} is closed")
        handle = int(cast("SupportsInt", event.handle))
        device = getattr(getattr(event, "device", None), "device_id", None)
    elif library == "torch" and hasattr(event, "cuda_event"):  # torch.cuda.Event
        handle = event.cuda_event
        device = getattr(getattr(event, "device", None), "index", None)
    elif library == "torch" and hasattr(event, "event_id"):  # torch.Event, device-generic
        where = getattr(event, "device", None)
        if getattr(where, "type", None) != "cuda":
            raise TypeError(
                f"expected {EVENTS_ACCEPTED}; got a torch.Event on {where}, not a CUDA event"
            )
        handle = event.event_id
        device = getattr(where, "index", None)
    elif library == "cupy" and hasattr(event, "ptr"):
        handle = event.ptr
    elif library == "numba" and hasattr(event, "handle"):
        handle = event.handle
        if isinstance(handle, ctypes.c_void_p):  # older numba-cuda's ctypes binding
            handle = handle.value or 0
        else:
            handle = int(cast("SupportsInt", handle))
    else:
        return None
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            f"a CUDA event handle must be an int, got {type_name(handle)} {handle!r} "
            f"from {type_name(event)}"
        )
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"a CUDA event handle must be in [0, 2**64), got {handle}")
    ordinal = device if isinstance(device, int) and not isinstance(device, bool) else None
    return handle, ordinal if ordinal is None or ordinal >= 0 else None


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
