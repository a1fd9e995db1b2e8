"""OpenCL for tests, the demo and the benchmark: a device, raw markers, a test gate."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

from ..._backend import GateParts
from ..._devices import CHUNK_BYTES, Device

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["OpenCLDevice", "OpenCLLab"]

# The host clocks a runtime's profiling stamps may come from: PoCL's is
# CLOCK_MONOTONIC_RAW; the OpenCL specification names none.
_STAMP_CLOCKS = ("CLOCK_MONOTONIC_RAW", "CLOCK_MONOTONIC")


class OpenCLDevice(Device):
    """An OpenCL device with one context: the default device when no GPU is present."""

    backend = "opencl"

    def __init__(self, context: cl.Context) -> None:
        super().__init__()
        self.context = context
        import pyopencl as cl

        device = context.devices[0]
        self.name = f"{device.name.strip()} ({device.platform.name.strip()})"
        self.is_gpu = bool(device.type & cl.device_type.GPU)
        self._buffers: tuple[cl.Buffer, cl.Buffer] | None = None
        # The host clock of the profiling stamps, once stamp_streams found it.
        self._stamp_clock: int | None = None

    def new_stream(self, *, in_order: bool = True) -> cl.CommandQueue:
        """Create a command queue, in order unless asked otherwise.

        After :meth:`stamp_streams` has found the stamps' clock, the queue
        has profiling on.
        """
        import pyopencl as cl

        props = 0 if in_order else cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
        if self._stamp_clock is not None:
            props |= cl.command_queue_properties.PROFILING_ENABLE
        # A bit field: the stubs type one flag, the runtime takes any union.
        return cl.CommandQueue(self.context, properties=cast("cl.command_queue_properties", props))

    def stamp_streams(self) -> bool:
        """Create profiling queues from now on, if their stamps are on a known host clock.

        Returns:
            True if the runtime's stamps come from ``CLOCK_MONOTONIC_RAW``
            (PoCL's) or ``CLOCK_MONOTONIC``; False otherwise (or without
            ``clock_gettime``, on Windows), and the queues stay as they were.
        """
        self._stamp_clock = self._find_stamp_clock()
        return self._stamp_clock is not None

    def _find_stamp_clock(self) -> int | None:
        """The host clock the runtime stamps events with, or ``None`` if none of the usual.

        A marker's queued stamp is taken inside the enqueue call, so on the
        right clock it falls between the readings taken on either side of
        it (of the clocks that do, the one nearest the middle); its end
        stamp falls between that and a reading taken once it is done.
        """
        import pyopencl as cl

        clocks = [int(getattr(time, name)) for name in _STAMP_CLOCKS if hasattr(time, name)]
        if not clocks or not hasattr(time, "clock_gettime_ns"):
            return None  # Windows
        props = cl.command_queue_properties.PROFILING_ENABLE
        try:
            queue = cl.CommandQueue(self.context, properties=props)
            before = [time.clock_gettime_ns(clock) for clock in clocks]
            marker = cl.enqueue_marker(queue)
            after = [time.clock_gettime_ns(clock) for clock in clocks]
            marker.wait()
            done = [time.clock_gettime_ns(clock) for clock in clocks]
            queued = marker.get_profiling_info(cl.profiling_info.QUEUED)
            end = marker.get_profiling_info(cl.profiling_info.END)
        except cl.Error:  # a runtime that cannot profile
            return None
        if not isinstance(queued, int) or not isinstance(end, int):
            return None
        fitting = [
            (abs(queued - (low + high) / 2), clock)
            for clock, low, high, finished in zip(clocks, before, after, done, strict=True)
            if low <= queued <= high and queued <= end <= finished
        ]
        return min(fitting)[1] if fitting else None

    def raw_finished_at(self, event: cl.Event) -> float | None:
        """The marker's end stamp, moved onto :func:`time.perf_counter`'s clock.

        Returns:
            ``None`` before :meth:`stamp_streams` found the clock, or for a
            marker on a queue created before it.
        """
        import pyopencl as cl

        if self._stamp_clock is None:
            return None
        try:
            end = event.get_profiling_info(cl.profiling_info.END)
        except cl.Error:  # PROFILING_INFO_NOT_AVAILABLE: a queue made before stamp_streams
            return None
        if not isinstance(end, int):
            return None
        return end / 1e9 + self._stamp_clock_offset()

    def _stamp_clock_offset(self) -> float:
        """perf_counter's reading minus the stamps' clock's, in seconds.

        From the tightest of three readings, each of the stamps' clock between
        two of perf_counter: a thread switched out between them (the GIL
        handed to another thread, say) widens only the one it hit.
        """
        assert self._stamp_clock is not None
        readings = []
        for _ in range(3):
            host_before = time.perf_counter()
            stamp_now = time.clock_gettime_ns(self._stamp_clock)
            host_after = time.perf_counter()
            readings.append((host_after - host_before, (host_before + host_after) / 2, stamp_now))
        _, host, stamp = min(readings)
        return host - stamp / 1e9

    def close_stream(self, stream: cl.CommandQueue) -> None:
        """Wait for the work queued on ``stream``; pyopencl releases it with the object."""
        stream.finish()

    def launch_chunks(self, stream: cl.CommandQueue, chunks: int) -> None:
        """Queue ``chunks`` device-side copies of 1 MiB."""
        import pyopencl as cl

        if self._buffers is None:
            flags = cl.mem_flags.READ_WRITE
            self._buffers = (
                cl.Buffer(self.context, flags, size=CHUNK_BYTES),
                cl.Buffer(self.context, flags, size=CHUNK_BYTES),
            )
        source, target = self._buffers
        for _ in range(max(1, chunks)):
            cl.enqueue_copy(stream, target, source)  # device to device: no host event to keep
        stream.flush()

    def raw_record(self, stream: cl.CommandQueue) -> cl.Event:
        """Enqueue a marker and flush."""
        import pyopencl as cl

        marker = cl.enqueue_marker(stream)
        stream.flush()
        return marker

    def raw_query(self, event: cl.Event) -> bool:
        """Whether the marker's ``command_execution_status`` is complete."""
        status: int = event.command_execution_status
        if status < 0:
            raise RuntimeError(f"OpenCL event failed with status {status}")
        return status == 0

    def raw_block(self, event: cl.Event) -> None:
        """``Event.wait()``, which releases the GIL."""
        event.wait()


class OpenCLLab:
    """The OpenCL backend's devices and test gates."""

    fails_gates = True

    def open_device(self) -> OpenCLDevice:
        """The first OpenCL device, preferring a GPU (PoCL's CPU device otherwise).

        Raises:
            RuntimeError: pyopencl or an OpenCL platform is missing.
        """
        try:
            import pyopencl as cl
        except ModuleNotFoundError as missing:
            if missing.name != "pyopencl":
                raise RuntimeError(f"pyopencl does not import: {missing}") from missing
            raise RuntimeError(
                "no device: install the opencl extra (pip install -e '.[opencl]' in a checkout) "
                "for PoCL, an OpenCL runtime that runs on the CPU"
            ) from None
        except ImportError as broken:  # installed, but broken: say so, not "install it"
            raise RuntimeError(f"pyopencl does not import: {broken}") from broken
        cause: Exception | None = None
        try:
            platforms = cl.get_platforms()
        except cl.Error as error:  # no ICD, or none that loads: kept as the cause
            platforms, cause = [], error
        devices = [device for platform in platforms for device in platform.get_devices()]
        if not devices:
            raise RuntimeError(
                "no OpenCL device found: pip install pocl-binary-distribution for one on the CPU"
            ) from cause
        gpus = [device for device in devices if device.type & cl.device_type.GPU]
        return OpenCLDevice(cl.Context([(gpus or devices)[0]]))

    def gate(self, stream: Any) -> GateParts:
        """A user event that a marker at the queue's end waits for."""
        import pyopencl as cl

        event = cl.UserEvent(stream.context)
        # Keep the marker referenced until it settles: PoCL 3.0 aborts otherwise.
        marker = cl.enqueue_marker(stream, wait_for=[event])
        stream.flush()
        return GateParts(
            release=lambda: event.set_status(cl.command_execution_status.COMPLETE),
            fail=event.set_status,
            keep=(event, marker),
        )
