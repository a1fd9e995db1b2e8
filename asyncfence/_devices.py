"""The base of every lab's device: what the demo, the benchmark and tests run on.

asyncfence itself needs no device object: it works on the user's own streams.
``asyncfence.testing`` gives the demo, the benchmark and test suites a device
to create streams and queue work on; each backend's lab provides its own (see
:mod:`asyncfence._backend`).

Busy work is a run of 1 MiB copies or memsets, calibrated once to last a given
time: every runtime executes them asynchronously like any other command, and
they need no kernel compiler (PoCL 3.0's LLVM 14 cannot build kernels for CPUs
it does not know, such as recent EPYCs).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CHUNK_BYTES", "Device"]

#: The size of one piece of busy work.
CHUNK_BYTES = 1 << 20


class Device:
    """A device to make streams on and keep busy, with the runtime's own events.

    The raw events (:meth:`raw_record` and the rest) are what code without
    asyncfence uses; the benchmark's baselines wait on them.

    Thread-safety: not thread-safe, except the ``raw_*`` methods, which the
    benchmark calls from worker threads.
    """

    #: The backend's name: ``"opencl"``, ``"cuda"``.
    backend: str
    #: The device and its platform, as the runtime names them.
    name: str
    #: Whether it is a GPU (the ``gpu`` test marker's question).
    is_gpu: bool = False

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

    def raw_record(self, stream: Any) -> Any:
        """Record one of the runtime's own events at the current end of ``stream``."""
        raise NotImplementedError

    def raw_query(self, event: Any) -> bool:
        """Whether ``event`` is complete; raises if it failed. Never blocks."""
        raise NotImplementedError

    def raw_block(self, event: Any) -> None:
        """Block the calling thread until ``event`` completes (the GIL released)."""
        raise NotImplementedError

    def raw_done(self, event: Any) -> None:
        """The caller has finished with ``event`` (a pooled one goes back)."""

    def stamp_streams(self) -> bool:
        """Have the streams created from now on stamp their events, if the runtime can.

        It cannot be undone: the benchmark asks once, before it makes any
        stream, so that every contender waits on the same kind of stream.
        OpenCL devices turn profiling on when the stamps are on a host clock.

        Returns:
            Whether :meth:`raw_finished_at` can then tell when the device
            finished an event. False here: CUDA events time only relative
            to one another, not on a host clock.
        """
        return False

    def raw_finished_at(self, event: Any) -> float | None:
        """When the device finished ``event``, on :func:`time.perf_counter`'s clock.

        Args:
            event: A complete raw event (:meth:`raw_record`).

        Returns:
            ``None`` where the runtime does not say: no stamps, or the
            event's stream was created before :meth:`stamp_streams`.
        """
        return None

    def close(self) -> None:
        """Release what the raw events hold (the streams are the caller's)."""

    def chunks_for(self, seconds: float) -> int:
        """How many 1 MiB pieces of work take about ``seconds`` (calibrated once)."""
        if not self._chunks_per_second:
            stream = self.new_stream()
            self.launch_chunks(stream, 4)  # first touch
            self._finish(stream)
            chunks = 4
            while True:
                start = time.perf_counter()
                self.launch_chunks(stream, chunks)
                self._finish(stream)
                elapsed = time.perf_counter() - start
                if elapsed > 0.02:
                    break
                chunks *= 4
            self._chunks_per_second = chunks / elapsed
        return max(1, round(self._chunks_per_second * seconds))

    def _finish(self, stream: Any) -> None:
        """Block until the work queued on ``stream`` so far is done (raw events: no fences)."""
        event = self.raw_record(stream)
        try:
            self.raw_block(event)
        finally:
            self.raw_done(event)

    def launch_busy(self, stream: Any, seconds: float) -> None:
        """Queue work that keeps ``stream`` busy for about ``seconds``."""
        self.launch_chunks(stream, self.chunks_for(seconds))
