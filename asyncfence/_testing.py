"""Holding a stream from the host, so tests decide when device work completes."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, final

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["StreamGate", "hold"]


@final
class StreamGate:
    """A gate at the current end of a stream: work queued after it waits.

    Made by :func:`hold`. On OpenCL it is a user event that a marker on the
    queue waits for.

    Thread-safety: :meth:`release` and :meth:`fail` may be called from any
    thread; the first call decides.
    """

    __slots__ = ("_event", "_lock", "_marker", "_open")

    def __init__(self, stream: object) -> None:
        cl = sys.modules.get("pyopencl")
        if cl is None or not isinstance(stream, cl.CommandQueue):
            raise TypeError(
                f"hold() expected a pyopencl.CommandQueue; got {type(stream).__qualname__} object"
            )
        self._event: Any = cl.UserEvent(stream.context)
        # Keep the marker referenced until it settles (PoCL 3.0 aborts otherwise).
        self._marker: Any = cl.enqueue_marker(stream, wait_for=[self._event])
        stream.flush()
        self._open = False
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether work queued after the gate is still held back."""
        return not self._open

    def release(self) -> None:
        """Let the stream run on. A no-op once released or failed."""
        import pyopencl as cl

        self._settle(cl.command_execution_status.COMPLETE)

    def fail(self, code: int = -5) -> None:
        """Fail the gate with a negative OpenCL status; the failure propagates.

        Every fence recorded on the stream after the gate fails with a
        :class:`~asyncfence.DeviceError`.

        Raises:
            ValueError: ``code`` is not negative.
        """
        if code >= 0:
            raise ValueError(f"a failure code must be negative, got {code}")
        self._settle(code)

    def _settle(self, status: int) -> None:
        with self._lock:
            if self._open:
                return
            self._open = True
        self._event.set_status(status)


@contextmanager
def hold(stream: object) -> Iterator[StreamGate]:
    """Hold ``stream`` from the host until the gate is released.

    Work queued on ``stream`` inside the block waits until
    :meth:`StreamGate.release` (or :meth:`StreamGate.fail`). Leaving the block
    releases the gate if it is still held, so a failing test never leaves a
    stream stuck.

    Args:
        stream: A ``pyopencl.CommandQueue``.
    """
    gate = StreamGate(stream)
    try:
        yield gate
    finally:
        gate.release()
