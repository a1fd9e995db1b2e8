"""The seam: the one internal interface between the fence logic and a device backend.

Everything above it (fences, waiting, the poller, the drop queue) is written
once against :class:`Backend`; each device runtime implements it once, in its
own package under :mod:`asyncfence._backends`, and nothing outside that
package names the runtime. A backend only talks to its runtime: record,
query, stream-wait, release, and arrange for a native signal when a marker
completes. It knows nothing of event loops, starts no thread and never calls
back into Python. ``asyncfence.testing``, the demo and the benchmark reach a
backend's devices and test gates through :meth:`Backend.lab`. Design:
``docs/design.md`` ("The seam").

Adding a backend:

1. Write a package under ``asyncfence/_backends/`` with a class that
   implements :class:`Backend` over the runtime's own marker type, and a
   :class:`Lab` (a device to make streams on and keep busy, and a gate that
   holds a stream from the host). Import the runtime's bindings only when a
   caller hands the backend one of its streams (or opens its device), so that
   ``import asyncfence`` never loads the runtime.
2. Register an instance: one line in ``asyncfence/_backends/__init__.py``,
   ``register_backend(MyBackend())``. :func:`backend_for`, the default
   device, the pytest plugin's ``--fence-device`` choices and the command
   line's ``--device`` choices all read the registry. A backend whose
   streams have no device of their own to open or hold (torch's CPU
   streams, whose work is done when the call returns) registers with
   ``devices=False``: it records and waits as any other, and stays out of
   the device choices and :func:`backend_statistics`.
3. The generic fence tests (``tests/test_fence.py``) run on every registered
   backend; ``tests/fake_backend.py`` is a whole backend in one file,
   registered by the tests' ``conftest.py`` with that one line.

Requirement on :meth:`Backend.claims`: it depends on the stream's type only,
so that :func:`backend_for` can remember the answer per type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, TypeVar

from . import _fork
from ._exceptions import FenceError
from ._validation import type_name

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from ._devices import Device
    from ._native import NativeMailbox

__all__ = [
    "Backend",
    "BackendStatistics",
    "GateParts",
    "Lab",
    "QueueInfo",
    "backend_for",
    "backend_named",
    "backend_names",
    "backend_statistics",
    "cached_backend",
    "register_backend",
    "unregister_backend",
]

#: A backend's own completion marker (a ``pyopencl.Event``, a pooled CUDA
#: event): opaque above the seam.
MarkerT = TypeVar("MarkerT")


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """What the waiting logic needs to know about the stream a fence is on.

    A marker stands for everything queued before it on its stream, so the
    device passes a stream's markers in the order they were recorded: a
    poller need only check the oldest pending fence of each stream.

    Attributes:
        key: Identifies the stream or queue (not the Python wrapper object).
        domain: Fences may be waited on by streams of the same domain only;
            ``None`` means any stream of the backend.
    """

    key: Hashable
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
        signal_path: How completion signals reach the runtime, in its own
            terms; ``None`` until known. CUDA: ``"v2"`` or ``"v1"`` (the
            driver's raw ``cuLaunchHostFunc`` entry points) or ``"none"``
            (neither: parked CUDA waits are re-checked); OpenCL:
            ``"clSetEventCallback"``.
    """

    backend: str
    pooled_markers: int = 0
    held_markers: int = 0
    side_streams: int = 0
    signal_path: str | None = None


@dataclass(frozen=True, slots=True)
class GateParts:
    """How a backend holds one stream from the host (see :func:`asyncfence.testing.hold`).

    Attributes:
        release: Lets the stream run on.
        fail: Fails the gate with a negative code, where the runtime can
            (OpenCL); ``None`` where it cannot (CUDA).
        keep: What must stay alive while the gate exists.
    """

    release: Callable[[], None]
    fail: Callable[[int], None] | None
    keep: object


class Lab(Protocol):
    """What ``asyncfence.testing``, the demo and the benchmark need of a backend, beyond fences."""

    #: Whether its gates can fail a stream from the host (``GateParts.fail``).
    fails_gates: bool

    def open_device(self) -> Device:
        """The backend's first device.

        Raises:
            RuntimeError: No device (the message says what to install).
        """
        ...

    def gate(self, stream: Any) -> GateParts:
        """Hold ``stream`` at its current end until the gate is released."""
        ...


class Backend(Protocol[MarkerT]):
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
    #: Where :func:`asyncfence.testing.open_default_device` looks first: lower first.
    default_rank: int
    #: Whether a forked child may record where its parent did: the backend
    #: keeps no runtime state a child could inherit (torch's CPU streams).
    #: Otherwise a backend the parent used is refused in the child.
    fork_safe: bool = False
    #: Whether a marker is a reference-counted handle (an OpenCL event): valid
    #: for as long as a reference to it is held, never recorded again for
    #: other work, and given back, once the device has passed it, by dropping
    #: the reference (:meth:`release_done` does nothing). A driver call then
    #: needs no pin on it, and a fence found done lets it go without the
    #: settle lock; so :meth:`release` may run while another thread's driver
    #: call still uses the marker through its own reference, and must leave
    #: the handle usable. ``False`` for pooled markers (CUDA's events,
    #: recorded again once released): a driver call that uses one pins it
    #: first.
    refcounted_markers: bool = False
    #: Stream types, as ``(module, qualified name)``, that this backend claims
    #: by the object rather than by its type: PyTorch's device-generic
    #: ``torch.Stream``, whose device is in the object. No backend is cached
    #: for them; :meth:`claims` is asked for each.
    claimed_by_object: ClassVar[frozenset[tuple[str, str]]] = frozenset()

    def claims(self, stream: object) -> bool:
        """Whether ``stream`` is one of this backend's stream objects.

        By its type only, except for the types named in
        :attr:`claimed_by_object`.
        """
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

    def record(self, stream: object) -> tuple[MarkerT, QueueInfo]:
        """Mark the current end of the work queued on ``stream``.

        The marker completes once everything queued on ``stream`` before it
        has, earlier markers included: a stream's markers complete in the
        order they were recorded.
        """
        ...

    def query(self, marker: MarkerT) -> bool:
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

    def stream_wait(self, marker: MarkerT, origin: QueueInfo, stream: object) -> None:
        """Make ``stream`` wait on the device for ``marker``; never blocks the host.

        ``stream`` has passed :meth:`check_stream`.
        """
        ...

    def arm(self, marker: MarkerT, queue: QueueInfo, mailbox: NativeMailbox, token: int) -> bool:
        """Have the runtime post ``token`` to ``mailbox`` once the device passes ``marker``.

        The runtime calls one of the shim's native functions, which runs no
        Python: an OpenCL event callback (armed with
        :meth:`~asyncfence._native.NativeMailbox.arm_event_callback`), or a CUDA
        host function (:attr:`~asyncfence._native.NativeMailbox.host_function`
        with a slot from :meth:`~asyncfence._native.NativeMailbox.new_slot`,
        discarded unless the launch succeeded). Never blocks and never calls
        back into Python. The runtime calls it exactly once, or never: a
        runtime may never call it for work that failed (the waiting side
        re-checks periodically). It may come before the marker has completed
        (PoCL calls back for a failed event as complete), so the waiting side
        always queries the marker. If the marker has already completed, it
        may come at once, on the calling thread.

        Returns:
            False if the runtime offers no way to signal (the caller then
            polls the marker).

        Raises:
            DeviceError: The runtime refused the request.
            MemoryError: The shim could not allocate the signal.
        """
        ...

    def statistics(self) -> BackendStatistics:
        """Return a snapshot of what the backend holds. Thread-safe."""
        ...

    def release(self, marker: MarkerT) -> None:
        """Give ``marker`` back; it may still be pending.

        The caller never uses ``marker`` again.
        """
        ...

    def release_done(self, marker: MarkerT) -> None:
        """Give back ``marker``, which a query found the device had passed.

        The same as :meth:`release` unless the backend has a cheaper way for
        a marker known to have completed; as safe to call from a finalizer.
        """
        self.release(marker)

    def lab(self) -> Lab:
        """Its devices and test gates."""
        ...

    def warm_up(self, stream: object) -> None:
        """Load now what the first record and parked wait on ``stream`` would load.

        Driver libraries, entry points, a pooled marker: whatever would
        otherwise block a running loop the first time. Blocks; never called
        on a loop by asyncfence. By default there is nothing to load.

        Raises:
            DeviceError: The runtime refused; as a record would.
        """
        return None  # noqa: RET501 (a body: a default, not an abstract member)

    def export_marker(self, marker: MarkerT, queue: QueueInfo) -> tuple[bytes, object] | None:
        """A handle by which another process's runtime can wait for ``marker``'s point.

        For runtimes with interprocess events (CUDA). The exporter keeps the
        second item, and gives it to :meth:`release_export` only once no
        importer may still use the handle. By default there is none: the
        relay alone carries the fence's end (:mod:`asyncfence._interprocess`).

        Raises:
            DeviceError: The runtime refused.
        """
        return None

    def adopt_event(self, event: object) -> tuple[MarkerT, QueueInfo] | None:
        """A marker for an event the user's code recorded with this runtime; else ``None``.

        By the event's type only, without importing the runtime for another
        library's object. The marker keeps the user's event alive until it
        is released; its queue is one of its own (a user's event may stand
        anywhere in its stream, so no completion order is assumed with the
        fences recorded there). By default the backend adopts no event.

        Raises:
            TypeError: It is this runtime's event, of a kind that cannot be
                adopted; the message says why.
        """
        return None

    def import_marker(self, handle: bytes) -> tuple[MarkerT, QueueInfo]:
        """A marker of this process for another process's :meth:`export_marker` handle.

        Its :meth:`release` frees what opening it made.

        Raises:
            FenceError: The handle's device is not visible in this process.
            DeviceError: The runtime refused to open it.
        """
        raise FenceError(f"{self.title} has no interprocess markers")

    def release_export(self, kept: object) -> None:
        """Free what :meth:`export_marker` kept, once no importer may use its handle."""
        return None  # noqa: RET501 (a body: a default, not an abstract member)

    def runtime_initialised(self) -> bool:
        """Whether this process has initialised the runtime, through asyncfence or not.

        Asked in the parent just before each ``fork()``: a forked child then
        refuses the runtime, which does not survive the fork, instead of
        hanging in it. Quick, lock-free, and calls nothing of the runtime.
        """
        ...


_backends: list[Backend[Any]] = []
_by_type: dict[type, Backend[Any]] = {}
# The types some backend claims by the object (Backend.claimed_by_object).
_by_object: set[tuple[str, str]] = set()
#: The backend that claimed a stream of this type before, or ``None``: the
#: record path's lookup, a call less than :func:`backend_for`.
cached_backend: Final = _by_type.get
# The names of the backends registered with devices=False.
_deviceless: set[str] = set()


def register_backend(backend: Backend[Any], *, devices: bool = True) -> None:
    """Add a backend that :func:`backend_for` will consult, in order.

    Args:
        backend: The backend.
        devices: Whether it has devices to open and streams to hold (its
            :meth:`Backend.lab`). ``False`` keeps it out of
            :func:`backend_names`, :func:`backend_named` and
            :func:`backend_statistics`: the default device, the pytest
            plugin's and the command line's device choices.

    Raises:
        ValueError: A backend of that name is registered already.
    """
    if any(known.name == backend.name for known in _backends):
        raise ValueError(f"a backend named {backend.name!r} is registered already")
    _backends.append(backend)
    _by_object.update(backend.claimed_by_object)
    if not devices:
        _deviceless.add(backend.name)
    _by_type.clear()
    _fork.watch_runtime(backend.name, backend.runtime_initialised)


def unregister_backend(name: str) -> None:
    """Remove the backend ``name`` (tests register and remove their own)."""
    _backends[:] = [backend for backend in _backends if backend.name != name]
    _by_object.clear()
    for backend in _backends:
        _by_object.update(backend.claimed_by_object)
    _deviceless.discard(name)
    _by_type.clear()
    _fork.unwatch_runtime(name)


def _device_backends() -> list[Backend[Any]]:
    return [backend for backend in _backends if backend.name not in _deviceless]


def backend_names() -> tuple[str, ...]:
    """The names of the registered device backends, in default-device order."""
    ranked = sorted(_device_backends(), key=lambda b: b.default_rank)
    return tuple(backend.name for backend in ranked)


def backend_named(name: str) -> Backend[Any]:
    """The registered device backend ``name``.

    Raises:
        ValueError: No device backend of that name; the message lists them.
    """
    for backend in _device_backends():
        if backend.name == name:
            return backend
    known = ", ".join(map(repr, backend_names()))
    raise ValueError(f"backend must be one of {known}; got {name!r}")


def backend_statistics() -> tuple[BackendStatistics, ...]:
    """A snapshot of every device backend: the markers and streams each holds.

    Backends without devices (torch's CPU streams) hold nothing and are left
    out.

    Thread-safety: safe to call from any thread.
    """
    return tuple(backend.statistics() for backend in _device_backends())


#: What :func:`asyncfence.from_event` accepts, for its ``TypeError``.
ACCEPTED_EVENTS = (
    "a pyopencl.Event (a marker's, a copy's or a kernel's; a UserEvent) or a CUDA event "
    "(a cuda.bindings.driver.CUevent, a torch.cuda.Event, a torch.Event on CUDA, a "
    "cupy.cuda.Event, a cuda.core Event, a numba-cuda event)"
)


def adopt_event(event: object) -> tuple[Backend[Any], Any, QueueInfo]:
    """The backend that adopts ``event``, its marker and its queue.

    Raises:
        TypeError: No backend adopts ``event``; the message names what is
            accepted.
    """
    for backend in _backends:
        adopted = backend.adopt_event(event)
        if adopted is not None:
            return (backend, *adopted)
    raise TypeError(f"from_event() expects {ACCEPTED_EVENTS}; got {type_name(event)} object")


def backend_for(stream: object) -> Backend[Any]:
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
            if (kind.__module__, kind.__qualname__) not in _by_object:
                _by_type[kind] = backend  # claims depends on the type only (see above)
            return backend
    accepted = "; or ".join(b.accepts for b in _backends)
    raise TypeError(f"expected a device stream ({accepted}); got {type_name(stream)} object")
