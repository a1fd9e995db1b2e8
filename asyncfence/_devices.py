"""The default device, and what the demo, the benchmark and tests run on it.

asyncfence itself needs no device object: it works on the user's own streams.
This module gives the tools that ship with it (``python -m asyncfence demo``,
the benchmark, the test fixtures) a device to create streams and work on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["OpenCLDevice", "open_default_device"]

# Busy work is buffer copies: PoCL runs them on its worker threads like any
# command, and they need no kernel compiler (PoCL 3.0's LLVM 14 cannot build
# kernels on CPUs it does not know, such as recent EPYCs).
_CHUNK_BYTES = 1 << 20


@dataclass
class OpenCLDevice:
    """An OpenCL device with one context, as the default device when no GPU is present."""

    context: cl.Context
    backend: str = "opencl"
    _source: cl.Buffer | None = field(default=None, repr=False)
    _target: cl.Buffer | None = field(default=None, repr=False)
    _chunks_per_second: float = field(default=0.0, repr=False)

    @property
    def name(self) -> str:
        """The device and platform, as the runtime names them."""
        device = self.context.devices[0]
        return f"{device.name.strip()} ({device.platform.name.strip()})"

    def new_stream(self, *, in_order: bool = True) -> cl.CommandQueue:
        """Create a command queue on the device."""
        import pyopencl as cl

        if in_order:
            return cl.CommandQueue(self.context)
        props = cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
        return cl.CommandQueue(self.context, properties=props)

    def _buffers(self) -> tuple[cl.Buffer, cl.Buffer]:
        import numpy as np
        import pyopencl as cl

        if self._source is None or self._target is None:
            flags = cl.mem_flags.READ_WRITE
            self._source = cl.Buffer(self.context, flags, size=_CHUNK_BYTES)
            self._target = cl.Buffer(self.context, flags, size=_CHUNK_BYTES)
            queue = cl.CommandQueue(self.context)
            for buffer in (self._source, self._target):
                pattern = np.ones(1, dtype=np.uint8)
                cl.enqueue_fill_buffer(queue, buffer, pattern, 0, _CHUNK_BYTES)
            queue.finish()
        return self._source, self._target

    def launch_chunks(self, stream: cl.CommandQueue, chunks: int) -> cl.Event:
        """Queue ``chunks`` copies of 1 MiB; returns the last one's event."""
        import pyopencl as cl

        source, target = self._buffers()
        event: cl.Event | None = None
        for _ in range(max(1, chunks)):
            event = cl.enqueue_copy(stream, target, source)
        stream.flush()
        assert event is not None
        return event

    def chunks_for(self, seconds: float) -> int:
        """How many 1 MiB copies take about ``seconds`` on this device (calibrated once)."""
        if not self._chunks_per_second:
            stream = self.new_stream()
            self.launch_chunks(stream, 4).wait()  # first touch
            chunks = 4
            while True:
                start = time.perf_counter()
                self.launch_chunks(stream, chunks).wait()
                elapsed = time.perf_counter() - start
                if elapsed > 0.02:
                    break
                chunks *= 4
            self._chunks_per_second = chunks / elapsed
        return max(1, round(self._chunks_per_second * seconds))

    def launch_busy(self, stream: cl.CommandQueue, seconds: float) -> cl.Event:
        """Queue work that keeps ``stream`` busy for about ``seconds``."""
        return self.launch_chunks(stream, self.chunks_for(seconds))


def open_default_device() -> OpenCLDevice:
    """Open the default device: OpenCL, preferring a GPU, else the first device.

    Raises:
        RuntimeError: No OpenCL platform is installed; the message says how to
            get PoCL, which runs on any CPU.
    """
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
