"""The default device, and what the demo, the benchmark and tests run on it.

asyncfence itself needs no device object: it works on the user's own streams.
This module gives the tools that ship with it (``python -m asyncfence demo``,
the benchmark, the test fixtures) a device to create streams and queue work on.

Busy work is a run of 1 MiB copies or memsets, calibrated once to last a given
time: every runtime executes them asynchronously like any other command, and
they need no kernel compiler (PoCL 3.0's LLVM 14 cannot build kernels for CPUs
it does not know, such as recent EPYCs).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["CudaDevice", "Device", "OpenCLDevice", "open_default_device"]

_CHUNK_BYTES = 1 << 20


class Device:
    """A device to make streams on and keep busy. Not thread-safe."""

    #: ``"opencl"`` or ``"cuda"``.
    backend: str
    #: The device and its platform, as the runtime names them.
    name: str

    def __init__(self) -> None:
        self._chunks_per_second = 0.0

    def new_stream(self) -> Any:
        """Create a stream (a command queue on OpenCL) on the device."""
        raise NotImplementedError

    def close_stream(self, stream: Any) -> None:
        """Wait for the work queued on ``stream``, then release it."""
        raise NotImplementedError

    def launch_chunks(self, stream: Any, chunks: int) -> None:
        """Queue ``chunks`` pieces of 1 MiB of work on ``stream``."""
        raise NotImplementedError

    def chunks_for(self, seconds: float) -> int:
        """How many 1 MiB pieces of work take about ``seconds`` (calibrated once)."""
        if not self._chunks_per_second:
            from ._fence import record

            stream = self.new_stream()
            self.launch_chunks(stream, 4)  # first touch
            record(stream).wait_sync()
            chunks = 4
            while True:
                start = time.perf_counter()
                self.launch_chunks(stream, chunks)
                record(stream).wait_sync()
                elapsed = time.perf_counter() - start
                if elapsed > 0.02:
                    break
                chunks *= 4
            self._chunks_per_second = chunks / elapsed
        return max(1, round(self._chunks_per_second * seconds))

    def launch_busy(self, stream: Any, seconds: float) -> None:
        """Queue work that keeps ``stream`` busy for about ``seconds``."""
        self.launch_chunks(stream, self.chunks_for(seconds))


class OpenCLDevice(Device):
    """An OpenCL device with one context: the default device when no GPU is present."""

    backend = "opencl"

    def __init__(self, context: cl.Context) -> None:
        super().__init__()
        self.context = context
        device = context.devices[0]
        self.name = f"{device.name.strip()} ({device.platform.name.strip()})"
        self._buffers: tuple[cl.Buffer, cl.Buffer] | None = None

    def new_stream(self, *, in_order: bool = True) -> cl.CommandQueue:
        """Create a command queue, in order unless asked otherwise."""
        import pyopencl as cl

        if in_order:
            return cl.CommandQueue(self.context)
        props = cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
        return cl.CommandQueue(self.context, properties=props)

    def close_stream(self, stream: cl.CommandQueue) -> None:
        """Wait for the work queued on ``stream``; pyopencl releases it with the object."""
        stream.finish()

    def launch_chunks(self, stream: cl.CommandQueue, chunks: int) -> None:
        """Queue ``chunks`` copies of 1 MiB."""
        import pyopencl as cl

        if self._buffers is None:
            flags = cl.mem_flags.READ_WRITE
            self._buffers = (
                cl.Buffer(self.context, flags, size=_CHUNK_BYTES),
                cl.Buffer(self.context, flags, size=_CHUNK_BYTES),
            )
        source, target = self._buffers
        for _ in range(max(1, chunks)):
            cl.enqueue_copy(stream, target, source)
        stream.flush()


class CudaDevice(Device):
    """A CUDA device, through its primary context."""

    backend = "cuda"

    def __init__(self, ordinal: int = 0) -> None:
        super().__init__()
        from ._cuda import check, driver

        drv = driver()
        self._drv = drv
        device = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ordinal = ordinal
        self.context = check(drv.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        raw_name = check(drv.cuDeviceGetName(256, device), "cuDeviceGetName")
        self.name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self._buffer = 0

    def make_current(self) -> None:
        """Make the device's context current on the calling thread."""
        from ._cuda import check

        check(self._drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def new_stream(self) -> Any:
        """Create a non-blocking ``CUstream``; the caller destroys it."""
        from ._cuda import check

        self.make_current()
        flags = self._drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        return check(self._drv.cuStreamCreate(flags), "cuStreamCreate")

    def close_stream(self, stream: Any) -> None:
        """Wait for the work queued on ``stream``, then destroy it."""
        from ._cuda import check

        check(self._drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
        check(self._drv.cuStreamDestroy(stream), "cuStreamDestroy")

    def launch_chunks(self, stream: Any, chunks: int) -> None:
        """Queue ``chunks`` memsets of 1 MiB of device memory."""
        from ._cuda import check

        if not self._buffer:
            self.make_current()
            self._buffer = check(self._drv.cuMemAlloc(_CHUNK_BYTES), "cuMemAlloc")
        for index in range(max(1, chunks)):
            check(
                self._drv.cuMemsetD8Async(self._buffer, index & 0xFF, _CHUNK_BYTES, stream),
                "cuMemsetD8Async",
            )


def open_default_device(backend: str | None = None) -> Device:
    """Open the default device, or the first device of ``backend``.

    The default is CUDA device 0 where an NVIDIA driver and GPU are present,
    and otherwise OpenCL, preferring a GPU, else the first device (PoCL's CPU
    device where nothing else is installed).

    Args:
        backend: ``"cuda"``, ``"opencl"``, or ``None`` for the default.

    Raises:
        ValueError: ``backend`` is not one of those.
        RuntimeError: No device of that kind; the message says what to install.
    """
    if backend not in (None, "cuda", "opencl"):
        raise ValueError(f"backend must be 'cuda', 'opencl' or None, got {backend!r}")
    if backend in (None, "cuda"):
        from ._exceptions import FenceError

        try:
            return CudaDevice(0)
        except FenceError as unavailable:
            if backend == "cuda":
                raise RuntimeError(f"no CUDA device: {unavailable}") from unavailable
    return _open_opencl_device()


def _open_opencl_device() -> OpenCLDevice:
    try:
        import pyopencl as cl
    except ImportError:
        raise RuntimeError(
            "no device: install the opencl extra (pip install 'asyncfence[opencl]') "
            "for PoCL, an OpenCL runtime that runs on the CPU"
        ) from None
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        platforms = []
    devices = [device for platform in platforms for device in platform.get_devices()]
    if not devices:
        raise RuntimeError(
            "no OpenCL device found: pip install pocl-binary-distribution for one on the CPU"
        )
    gpus = [device for device in devices if device.type & cl.device_type.GPU]
    return OpenCLDevice(cl.Context([(gpus or devices)[0]]))
