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
    from collections.abc import Callable, Hashable

    from ._watcher import NativeSignal

__all__ = [
    "Backend",
    "Marker",
    "QueueInfo",
    "backend_for",
    "register_backend",
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


class Backend(Protocol):
    """A device runtime, as the fence logic sees it.

    Thread-safety: every method may be called from any thread, concurrently.
    :meth:`release` must also be safe to call from a finalizer, so it takes no
    lock that the calling thread might already hold.
    """

    #: Short lowercase name: ``"opencl"``, ``"cuda"``.
    name: str
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

    def stream_wait(self, marker: Marker, origin: QueueInfo, stream: object) -> None:
        """Make ``stream`` wait on the device for ``marker``; never blocks the host.

        Raises:
            TypeError: ``stream`` is not one of this backend's streams.
            ValueError: ``stream`` cannot wait for a marker from ``origin``.
        """
        ...

    def arm(
        self,
        marker: Marker,
        queue: QueueInfo,
        order: int,
        notify: Callable[[], None],
        native: NativeSignal | None,
    ) -> bool:
        """Arrange a signal for when the device passes ``marker``. Never blocks.

        ``order`` is the fence's record order: on an in-order queue, a marker
        of lower order completes first.

        A backend whose runtime calls back into Python (OpenCL) calls
        ``notify()`` from its own thread; ``notify`` does next to nothing. A
        backend that can signal natively (CUDA) makes the device call
        ``native`` instead, so no Python runs on the driver's thread. The
        signal may come early or twice; the watcher re-queries.

        Returns:
            False if no signal could be armed; the watcher then polls.
        """
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
