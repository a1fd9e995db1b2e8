"""Holding a stream from the host, so tests decide when device work completes."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, final

from ._backend import backend_for

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["StreamGate", "hold"]

# CUDA gates wait on 4-byte flags in pinned, device-mapped pages. A flag is
# never reused, so a late read by the device can never see another gate's flag.
_FLAGS_PER_PAGE = 1024
_flag_pages: dict[int, tuple[int, int, int]] = {}  # context -> (host, device, next slot)
_flag_lock = threading.Lock()
_gates: weakref.WeakSet[StreamGate] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held them at the fork.
    global _flag_lock
    _flag_lock = threading.Lock()
    for gate in list(_gates):
        gate._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _opencl_gate(stream: Any) -> tuple[Callable[[], None], Callable[[int], None], object]:
    import pyopencl as cl

    event = cl.UserEvent(stream.context)
    # Keep the marker referenced until it settles: PoCL 3.0 aborts otherwise.
    marker = cl.enqueue_marker(stream, wait_for=[event])
    stream.flush()
    return (
        lambda: event.set_status(cl.command_execution_status.COMPLETE),
        event.set_status,
        (event, marker),
    )


def _cuda_flag(drv: Any, context: int) -> tuple[int, int]:
    from ._cuda import check

    with _flag_lock:
        host, device, slot = _flag_pages.get(context, (0, 0, _FLAGS_PER_PAGE))
        if slot == _FLAGS_PER_PAGE:
            check(drv.cuCtxPushCurrent(drv.CUcontext(context)), "cuCtxPushCurrent")
            try:
                flags = drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP
                host = check(drv.cuMemHostAlloc(4 * _FLAGS_PER_PAGE, flags), "cuMemHostAlloc")
                ctypes.memset(host, 0, 4 * _FLAGS_PER_PAGE)
                device = int(
                    check(drv.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")
                )
            finally:
                drv.cuCtxPopCurrent()
            slot = 0
        _flag_pages[context] = (host, device, slot + 1)
    return host + 4 * slot, device + 4 * slot


def _cuda_gate(stream: Any) -> tuple[Callable[[], None], Callable[[int], None], object]:
    from ._cuda import check, cuda_stream_handle, driver

    drv = driver()
    cu_stream = drv.CUstream(cuda_stream_handle(stream))
    context = int(check(drv.cuStreamGetCtx(cu_stream), "cuStreamGetCtx"))
    host, device = _cuda_flag(drv, context)
    equal = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    check(drv.cuStreamWaitValue32(cu_stream, device, 1, equal), "cuStreamWaitValue32")
    flag = ctypes.c_uint32.from_address(host)

    def open_gate() -> None:
        flag.value = 1

    def fail_gate(code: int) -> None:
        raise NotImplementedError(
            "a CUDA stream cannot be failed from the host; release the gate instead"
        )

    return open_gate, fail_gate, flag


@final
class StreamGate:
    """A gate at the current end of a stream: work queued after it waits.

    Made by :func:`hold`. On OpenCL it is a user event that a marker on the
    queue waits for; on CUDA, a ``cuStreamWaitValue32`` on a flag in pinned,
    device-mapped memory that :meth:`release` sets.

    Thread-safety: :meth:`release` and :meth:`fail` may be called from any
    thread; the first call decides.
    """

    __slots__ = ("__weakref__", "_fail", "_keep", "_lock", "_open", "_release", "stream")

    def __init__(self, stream: object) -> None:
        #: The stream the gate holds.
        self.stream = stream
        backend = backend_for(stream)
        make = _opencl_gate if backend.name == "opencl" else _cuda_gate
        self._release, self._fail, self._keep = make(stream)
        self._lock = threading.Lock()
        self._open = False
        _gates.add(self)

    @property
    def held(self) -> bool:
        """Whether work queued after the gate is still held back."""
        return not self._open

    def _settle(self) -> bool:
        with self._lock:
            was_open, self._open = self._open, True
        return not was_open

    def release(self) -> None:
        """Let the stream run on. A no-op once released or failed."""
        if self._settle():
            self._release()

    def fail(self, code: int = -5) -> None:
        """Fail the gate with a negative OpenCL status; the failure propagates.

        Every fence recorded on the queue after the gate fails with a
        :class:`~asyncfence.DeviceError`. PoCL reports every such failure as
        ``-1`` (``CL_FAILED``), whatever ``code`` was set. A no-op once
        released or failed.

        Raises:
            TypeError: ``code`` is not an int.
            ValueError: ``code`` is not negative.
            NotImplementedError: The stream is a CUDA stream, which the host
                cannot fail.
        """
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"code must be a negative int, got {type(code).__qualname__}")
        if code >= 0:
            raise ValueError(f"code must be a negative int, got {code}")
        with self._lock:
            if self._open:
                return
            self._fail(code)
            self._open = True


@contextmanager
def hold(stream: object) -> Iterator[StreamGate]:
    """Hold ``stream`` from the host until the gate is released.

    Work queued on ``stream`` inside the block waits until
    :meth:`StreamGate.release` (or :meth:`StreamGate.fail`). Leaving the block
    releases the gate if it is still held, so a failing test never leaves a
    stream stuck.

    Args:
        stream: A ``pyopencl.CommandQueue`` or any CUDA stream
            :func:`asyncfence.record` accepts.

    Raises:
        TypeError: ``stream`` is not a stream.
    """
    gate = StreamGate(stream)
    try:
        yield gate
    finally:
        gate.release()
