"""The one internal interface between the fence logic and a device backend.

Everything above this line (waiting, timeouts, the poller, the drop queue) is
written once against :class:`Backend`; each device runtime implements it once.
A backend knows nothing of event loops, and the loop code knows nothing of
devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Hashable

__all__ = [
    "Backend",
    "BackendStatistics",
    "Marker",
    "NativeSignal",
    "QueueInfo",
    "backend_for",
    "backend_statistics",
    "register_backend",
    "signal_path",
]

#: A backend's own completion marker: a ``pyopencl.Event``, a pooled CUDA event.
#: Opaque above this module.
Marker = object


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """What the waiting logic needs to know about the stream a fence is on.

    Attributes:
        key: Identifies the stream or queue (not the Python wrapper object).
        in_order: Whether work on it completes in submission order, so that a
            poller need only check the oldest pending fence.
        domain: Fences may be waited on by streams of the same domain only;
            ``None`` means any stream of the backend.
    """

    key: Hashable
    in_order: bool
    domain: Hashable | None = None


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    """A snapshot of what a device backend holds, process-wide.

    Attributes:
        backend: Its name, ``"opencl"`` or ``"cuda"``.
        pooled_markers: Idle markers kept for reuse (CUDA events, pooled per
            context), so that recording creates none in the steady state.
        held_markers: Markers released while still pending, kept alive until
            they settle (OpenCL: PoCL may abort the process otherwise), and
            failed ones kept for good (the most recent few thousand).
        side_streams: Streams the backend made for completion signals.
        signal_path: How completion signals reach the runtime (see
            :meth:`Backend.signal_path`); ``None`` before the first.
    """

    backend: str
    pooled_markers: int = 0
    held_markers: int = 0
    side_streams: int = 0
    signal_path: str | None = None


@dataclass(frozen=True, slots=True)
class NativeSignal:
    """A native function for the device runtime to call once a marker completes.

    It runs no Python: the runtime calls it on its own thread (a CUDA host
    function, an OpenCL event callback), and it only tells the waiting side
    that something completed. It may be called early or twice; the waiting
    side always queries the marker.

    Attributes:
        host_function: Address of a ``void f(void *argument)``: what CUDA
            calls as a host function.
        event_callback: Address of a ``void f(void *event, int32_t status,
            void *argument)``: what OpenCL calls as an event callback; 0
            where there is none.
        argument: The pointer passed to either.
    """

    host_function: int
    event_callback: int
    argument: int


class Backend(Protocol):
    """A device runtime, as the fence logic sees it.

    Thread-safety: every method may be called from any thread, concurrently.
    :meth:`release` must also be safe to call from a finalizer, so it takes no
    lock that the calling thread might already hold.
    """

    #: Short lowercase name: ``"opencl"``, ``"cuda"``.
    name: str
    #: The runtime's own name, for messages: ``"OpenCL"``, ``"CUDA"``.
    title: str
    #: Describes the stream objects the backend accepts, for error messages.
    accepts: str

    def claims(self, stream: object) -> bool:
        """Whether ``stream`` is one of this backend's stream objects."""
        ...

    def stream_key(self, stream: object) -> Hashable:
        """A cheap key for the queue behind ``stream``, taken before recording.

        Records on one queue are serialised by it, so that fences are numbered
        in the order the queue receives them. Wrappers of one queue must get
        equal keys; different queues may share one (that only serialises more).

        Raises:
            TypeError: ``stream`` is not one of this backend's streams.
        """
        ...

    def record(self, stream: object) -> tuple[Marker, QueueInfo]:
        """Mark the current end of the work queued on ``stream``."""
        ...

    def query(self, marker: Marker) -> bool:
        """Whether the device has passed ``marker``. Never blocks.

        Raises:
            DeviceError: The work before the marker failed.
        """
        ...

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        """Check that ``stream`` could wait for a marker recorded on ``origin``.

        Called before every :meth:`stream_wait`, and also where the marker has
        completed already, so that bad input is refused whatever the timing.

        Raises:
            TypeError: ``stream`` is not one of this backend's streams.
            ValueError: ``stream`` cannot wait for a marker from ``origin``.
            DeviceError: The runtime refuses the stream.
        """
        ...

    def stream_wait(self, marker: Marker, origin: QueueInfo, stream: object) -> None:
        """Make ``stream`` wait on the device for ``marker``; never blocks the host.

        ``stream`` has passed :meth:`check_stream`.
        """
        ...

    def arm(self, marker: Marker, queue: QueueInfo, signal: NativeSignal) -> bool:
        """Have the runtime call ``signal`` once the device passes ``marker``.

        Never blocks and never calls back into Python. If the marker has
        already completed, the runtime may call the signal at once, on the
        calling thread. A runtime may never call it for work that failed: the
        waiting side re-checks periodically.

        Returns:
            False if the runtime offers no way to call ``signal`` (the caller
            then polls the marker).

        Raises:
            DeviceError: The runtime refused the request.
        """
        ...

    def signal_path(self) -> str | None:
        """How :meth:`arm` reaches the runtime, for statistics; ``None`` if not yet known.

        CUDA: ``"v2"``, ``"v1"`` (the driver's raw ``cuLaunchHostFunc``
        entry points) or ``"none"``; OpenCL: ``"clSetEventCallback"``.
        """
        ...

    def statistics(self) -> BackendStatistics:
        """Return a snapshot of what the backend holds. Thread-safe."""
        ...

    def release(self, marker: Marker) -> None:
        """Give ``marker`` back; it may still be pending.

        The caller never uses ``marker`` again.
        """
        ...


_backends: list[Backend] = []
_by_type: dict[type, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend that :func:`backend_for` will consult, in order."""
    _backends.append(backend)
    _by_type.clear()


def backend_statistics() -> tuple[BackendStatistics, ...]:
    """A snapshot of every device backend: the markers and streams each holds.

    Thread-safety: safe to call from any thread.
    """
    return tuple(backend.statistics() for backend in _backends)


def signal_path(name: str) -> str | None:
    """The :meth:`Backend.signal_path` of the backend ``name``; ``None`` if unknown."""
    for backend in _backends:
        if backend.name == name:
            return backend.signal_path()
    return None


def backend_for(stream: object) -> Backend:
    """Find the backend that owns ``stream``.

    Raises:
        TypeError: No backend accepts ``stream``; the message names what each
            backend accepts.
    """
    kind = type(stream)
    backend = _by_type.get(kind)
    if backend is not None:
        return backend
    for backend in _backends:
        if backend.claims(stream):
            # Cache by type only where every instance is claimed alike.
            _by_type[kind] = backend
            return backend
    accepted = "; or ".join(b.accepts for b in _backends)
    raise TypeError(f"expected a device stream ({accepted}); got {kind.__qualname__} object")
