"""A whole device backend in one file, for tests: proof that the seam is the whole story.

The "runtime" is host memory: a stream is a list of operations that complete
in order, gates hold them until a test releases (or fails) them, and armed
signals are native functions called, as a real runtime would, from the thread
that completes the work (the releasing one), never with the GIL. Registered
with :func:`asyncfence._backend.register_backend` by ``tests/conftest.py``;
``tests/test_fence.py`` runs its generic tests on every registered backend,
this one included.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncfence import DeviceError
from asyncfence._backend import Backend, BackendStatistics, GateParts, QueueInfo
from asyncfence._devices import Device

if TYPE_CHECKING:
    from asyncfence._native import NativeMailbox

__all__ = ["FakeBackend", "FakeDevice", "FakeStream"]

_call_host_function = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@dataclass(frozen=True)
class _Signal:
    """An armed host function, as a CUDA stream would hold it: the function and its slot."""

    host_function: int
    slot: int

    def fire(self) -> None:
        _call_host_function(self.host_function)(self.slot)


@dataclass(eq=False)
class _Op:
    """A gate, a marker or a wait for another stream's marker, in a stream's order."""

    kind: str  # "gate", "marker", "wait"
    done: bool = False
    failed: int = 0  # a negative code once failed
    signals: list[_Signal] = field(default_factory=list)
    upstream: _Op | None = None  # a "wait": the marker it waits for


class FakeStream:
    """A stream of the fake device: operations complete in order, on the host."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.ops: list[_Op] = []


class FakeDevice(Device):
    """The fake device: streams, no-op busy work, and raw events (its markers)."""

    backend = "fake"
    name = "asyncfence's fake device (tests)"

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.RLock()
        self.streams: list[FakeStream] = []

    def new_stream(self) -> FakeStream:
        stream = FakeStream(self)
        with self.lock:
            self.streams.append(stream)
        return stream

    def close_stream(self, stream: FakeStream) -> None:
        with self.lock:
            stream.ops.clear()

    def launch_chunks(self, stream: FakeStream, chunks: int) -> None:
        """Busy work completes at once: the fake device is infinitely fast."""

    def raw_record(self, stream: FakeStream) -> _Op:
        return _enqueue(stream, _Op("marker"))

    def raw_query(self, event: _Op) -> bool:
        return event.done

    def raw_block(self, event: _Op) -> None:
        while not event.done:
            threading.Event().wait(1e-4)

    def advance(self) -> None:
        """Complete what can complete, on every stream, and fire the armed signals."""
        to_fire: list[_Signal] = []
        with self.lock:
            progressed = True
            while progressed:
                progressed = False
                for stream in self.streams:
                    while stream.ops:
                        op = stream.ops[0]
                        if op.kind == "gate" and not op.done and not op.failed:
                            break
                        if op.kind == "wait":
                            upstream = op.upstream
                            assert upstream is not None
                            if upstream.failed:
                                op.failed = upstream.failed
                            elif not upstream.done:
                                break
                        stream.ops.pop(0)
                        progressed = True
                        if op.failed and stream.ops:  # a failure propagates down the stream
                            stream.ops[0].failed = stream.ops[0].failed or op.failed
                        if not op.failed:
                            op.done = True
                            to_fire.extend(op.signals)  # failures never signal, as in PoCL
                        op.signals.clear()
        for signal in to_fire:  # outside the lock, as a runtime's callback thread would
            signal.fire()


def _enqueue(stream: FakeStream, op: _Op) -> _Op:
    with stream.device.lock:
        if not stream.ops and op.kind == "marker":
            op.done = True  # an idle stream: passed at once
        else:
            stream.ops.append(op)
    return op


class FakeLab:
    """The fake backend's device and test gates."""

    fails_gates = True

    def __init__(self) -> None:
        self.device = FakeDevice()

    def open_device(self) -> FakeDevice:
        return self.device

    def gate(self, stream: Any) -> GateParts:
        assert isinstance(stream, FakeStream)
        gate = _enqueue(stream, _Op("gate"))

        def release() -> None:
            gate.done = True
            stream.device.advance()

        def fail(code: int) -> None:
            gate.failed = code
            stream.device.advance()

        return GateParts(release=release, fail=fail, keep=gate)


class FakeBackend(Backend[_Op]):
    """Fences as markers in a fake stream's list of operations."""

    name = "fake"
    title = "Fake"
    accepts = "a tests.fake_backend.FakeStream"
    default_rank = 99  # never the default device

    def __init__(self) -> None:
        self._lab = FakeLab()
        self._armed = itertools.count()

    def claims(self, stream: object) -> bool:
        return isinstance(stream, FakeStream)

    def stream_key(self, stream: object) -> int:
        return id(stream)

    def record(self, stream: object) -> tuple[_Op, QueueInfo]:
        assert isinstance(stream, FakeStream)
        marker = _enqueue(stream, _Op("marker"))
        return marker, QueueInfo(id(stream), domain=id(stream.device))

    def query(self, marker: _Op) -> bool:
        if marker.failed:
            raise DeviceError(self.name, marker.failed, "FAKE_FAILED", "a gate before it failed")
        return marker.done

    def check_stream(self, origin: QueueInfo, stream: object) -> None:
        if not isinstance(stream, FakeStream):
            raise TypeError(f"Fake fences can only be waited on by {self.accepts}")
        if id(stream.device) != origin.domain:
            raise ValueError("a fake stream can only wait for a fence of its own device")

    def stream_wait(self, marker: _Op, origin: QueueInfo, stream: object) -> None:
        assert isinstance(stream, FakeStream)
        _enqueue(stream, _Op("wait", upstream=marker))
        stream.device.advance()

    def arm(self, marker: _Op, queue: QueueInfo, mailbox: NativeMailbox, token: int) -> bool:
        next(self._armed)
        signal = _Signal(mailbox.host_function, mailbox.new_slot(token))
        with self._lab.device.lock:
            pending = not marker.done and not marker.failed
            if pending:
                marker.signals.append(signal)
        if not pending and not marker.failed:  # done already: called at once, as PoCL does
            signal.fire()
        return True

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(backend=self.name, signal_path="fake host function")

    def release(self, marker: _Op) -> None:
        """Markers are plain objects: nothing to give back."""

    def runtime_initialised(self) -> bool:
        return False  # host memory survives fork()

    def lab(self) -> FakeLab:
        return self._lab
