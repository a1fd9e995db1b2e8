"""CUDA for tests, the demo and the benchmark: a device, raw events, a test gate."""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from ... import _fork
from ..._backend import GateParts
from ..._devices import CHUNK_BYTES, Device
from ..._exceptions import FenceError
from ..._native import NativeMailbox, shim, unavailable_reason
from ._driver import HostFunctionLauncher, as_cu_stream, check, device_error, driver

__all__ = ["CudaDevice", "CudaLab"]

# Gates wait on 4-byte flags in pinned, device-mapped pages. A flag is never
# reused, so a late read by the device can never see another gate's flag.
_FLAGS_PER_PAGE = 1024
_flag_pages: dict[int, tuple[int, int, int]] = {}  # context -> (host, device, next slot)
_flag_lock = threading.Lock()
_fork.renew_after_fork(sys.modules[__name__], "_flag_lock")


class CudaDevice(Device):
    """A CUDA device, through its primary context."""

    backend = "cuda"
    is_gpu = True

    def __init__(self, ordinal: int = 0) -> None:
        super().__init__()
        drv = driver()
        self._drv = drv
        device = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ordinal = ordinal
        self.context = check(drv.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        raw_name = check(drv.cuDeviceGetName(256, device), "cuDeviceGetName")
        self.name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self._buffer = 0
        self._events: list[Any] = []
        self._mailbox: NativeMailbox | None = None
        self._launcher: HostFunctionLauncher | None = None

    def make_current(self) -> None:
        """Make the device's context current on the calling thread."""
        check(self._drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def new_stream(self) -> Any:
        """Create a non-blocking ``CUstream``; :meth:`close_stream` destroys it."""
        self.make_current()
        flags = self._drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        return check(self._drv.cuStreamCreate(flags), "cuStreamCreate")

    def close_stream(self, stream: Any) -> None:
        """Wait for the work queued on ``stream``, then destroy it."""
        check(self._drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
        check(self._drv.cuStreamDestroy(stream), "cuStreamDestroy")

    def launch_chunks(self, stream: Any, chunks: int) -> None:
        """Queue ``chunks`` memsets of 1 MiB of device memory."""
        if not self._buffer:
            self.make_current()
            self._buffer = check(self._drv.cuMemAlloc(CHUNK_BYTES), "cuMemAlloc")
        for index in range(max(1, chunks)):
            check(
                self._drv.cuMemsetD8Async(self._buffer, index & 0xFF, CHUNK_BYTES, stream),
                "cuMemsetD8Async",
            )

    def raw_record(self, stream: Any) -> Any:
        """``cuEventRecord`` of a pooled timing-disabled event."""
        drv = self._drv
        if self._events:
            event = self._events.pop()
        else:
            flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
            event = check(drv.cuEventCreate(flags), "cuEventCreate")
        check(drv.cuEventRecord(event, stream), "cuEventRecord")
        return event

    def raw_query(self, event: Any) -> bool:
        """``cuEventQuery``."""
        (err,) = self._drv.cuEventQuery(event)
        if err == self._drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != self._drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuEventQuery failed: {err}")
        return True

    def raw_block(self, event: Any) -> None:
        """``cuEventSynchronize``."""
        self._drv.cuEventSynchronize(event)

    def raw_done(self, event: Any) -> None:
        """Back to the pool."""
        self._events.append(event)

    def launch_wake_signal(self, stream: Any) -> str:
        """Queue asyncfence's completion signal on ``stream``, as a parked wait queues it.

        That is the native shim's host function, through the driver's own
        ``cuLaunchHostFunc`` entry point: no Python runs on the driver's
        thread. It posts to a mailbox of this device's that no loop watches,
        emptied at each call. For measuring how long the signal holds the
        stream it runs on (the benchmark's ``signal_hold``); parked waits
        launch it on side streams, never on the user's.

        Returns:
            The entry point it went through: ``"v2"`` or ``"v1"``.

        Raises:
            RuntimeError: The shim is not built, or the driver has no
                ``cuLaunchHostFunc``.
            DeviceError: The driver refused the launch.
        """
        native = shim()
        if native is None:
            raise RuntimeError(f"the native wake shim is not in use: {unavailable_reason()}")
        if self._launcher is None:
            self._launcher = HostFunctionLauncher(self._drv)  # as the backend resolves it
        launcher = self._launcher
        if launcher.path == "none":
            raise RuntimeError("the driver offers no cuLaunchHostFunc entry point")
        if self._mailbox is None:
            self._mailbox = NativeMailbox(native)
        self._mailbox.take()  # frees the slots of the signals fired so far
        slot = self._mailbox.new_slot(0)
        _, handle = as_cu_stream(self._drv, stream)
        err = launcher.launch(handle, self._mailbox.host_function, slot)
        if err != self._drv.CUresult.CUDA_SUCCESS:
            self._mailbox.discard(slot)
            raise device_error(self._drv, err, f"cuLaunchHostFunc ({launcher.path}) failed")
        return launcher.path

    def close(self) -> None:
        """Destroy the pooled raw events."""
        for event in self._events:
            self._drv.cuEventDestroy(event)
        self._events.clear()


def _flag(drv: Any, context: int) -> tuple[int, int]:
    """A fresh flag's host and device addresses, in a page of ``context``'s."""
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


class CudaLab:
    """The CUDA backend's devices and test gates."""

    fails_gates = False  # the host cannot fail a CUDA stream

    def open_device(self) -> CudaDevice:
        """CUDA device 0.

        Raises:
            RuntimeError: No NVIDIA driver or device.
        """
        try:
            return CudaDevice(0)
        except FenceError as unavailable:
            raise RuntimeError(f"no CUDA device: {unavailable}") from unavailable

    def gate(self, stream: Any) -> GateParts:
        """A ``cuStreamWaitValue32`` on a flag in pinned, device-mapped memory.

        The host cannot fail a CUDA stream: the gate only releases.
        """
        drv = driver()
        stream_object, _ = as_cu_stream(drv, stream)
        context = int(check(drv.cuStreamGetCtx(stream_object), "cuStreamGetCtx"))
        host, device = _flag(drv, context)
        equal = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        check(drv.cuStreamWaitValue32(stream_object, device, 1, equal), "cuStreamWaitValue32")
        flag = ctypes.c_uint32.from_address(host)

        def release() -> None:
            flag.value = 1

        return GateParts(release=release, fail=None, keep=flag)
