"""Holding a stream from the host, so tests decide when work completes; the default device."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, final

from .. import _fork
from .._backend import backend_for, backend_named, backend_names

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._devices import Device

__all__ = ["StreamGate", "hold", "open_default_device"]


@final
class StreamGate:
    """A gate at the current end of a stream: work queued after it waits.

    Made by :func:`hold`. Each backend makes its own: on OpenCL a user event
    that a marker on the queue waits for; on CUDA, a ``cuStreamWaitValue32``
    on a flag in pinned, device-mapped memory that :meth:`release` sets.

    Thread-safety: :meth:`release` and :meth:`fail` may be called from any
    thread; the first call decides.
    """

    __slots__ = ("__weakref__", "_backend", "_lock", "_open", "_parts", "stream")

    def __init__(self, stream: object) -> None:
        #: The stream the gate holds.
        self.stream = stream
        backend = backend_for(stream)
        self._backend = backend.title
        self._parts = backend.lab().gate(stream)
        self._lock = threading.Lock()
        _fork.renew_after_fork(self, "_lock")
        self._open = False

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
            self._parts.release()

    def fail(self, code: int = -5) -> None:
        """Fail the gate with a negative OpenCL status; the failure propagates.

        Every fence recorded on the queue after the gate fails with a
        :class:`~asyncfence.DeviceError`. PoCL reports every such failure as
        ``-1`` (``CL_FAILED``), whatever ``code`` was set. A no-op once
        released or failed.

        Raises:
            TypeError: ``code`` is not an int.
            ValueError: ``code`` is not negative.
            NotImplementedError: The runtime cannot fail a stream from the
                host (CUDA).
        """
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"code must be a negative int, got {type(code).__qualname__}")
        if code >= 0:
            raise ValueError(f"code must be a negative int, got {code}")
        fail = self._parts.fail
        if fail is None:
            raise NotImplementedError(
                f"a {self._backend} stream cannot be failed from the host; release the gate instead"
            )
        with self._lock:
            if self._open:
                return
            fail(code)
            self._open = True


@contextmanager
def hold(stream: object) -> Iterator[StreamGate]:
    """Hold ``stream`` from the host until the gate is released.

    Work queued on ``stream`` inside the block waits until
    :meth:`StreamGate.release` (or :meth:`StreamGate.fail`). Leaving the block
    releases the gate if it is still held, so a failing test never leaves a
    stream stuck.

    Args:
        stream: Any stream :func:`asyncfence.record` accepts.

    Raises:
        TypeError: ``stream`` is not a stream, or one that cannot be held
            (torch's CPU streams: their work is done when it is queued).
    """
    gate = StreamGate(stream)
    try:
        yield gate
    finally:
        gate.release()


def open_default_device(backend: str | None = None) -> Device:
    """Open the default device, or the first device of ``backend``.

    The default is the first backend, in ``default_rank`` order, that has a
    device: CUDA device 0 where an NVIDIA driver and GPU are present, and
    otherwise OpenCL, preferring a GPU, else the first device (PoCL's CPU
    device where nothing else is installed).

    Args:
        backend: A registered backend's name (``"cuda"``, ``"opencl"``), or
            ``None`` for the default.

    Raises:
        ValueError: ``backend`` is not a registered backend's name.
        RuntimeError: No device of that kind (or none at all); the message
            says what to install.
    """
    if backend is not None:
        return backend_named(backend).lab().open_device()
    reasons: list[RuntimeError] = []
    for name in backend_names():
        try:
            return backend_named(name).lab().open_device()
        except RuntimeError as unavailable:
            reasons.append(unavailable)
    # Chained to the last backend's reason, whose own cause (a failed import,
    # say) says what went wrong beneath the advice.
    raise RuntimeError(
        "; ".join(str(reason) for reason in reasons) or "no device backend is registered"
    ) from (reasons[-1] if reasons else None)
