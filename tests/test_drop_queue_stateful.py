"""A hypothesis state machine over defer, complete, fault, cancel and drain, on PoCL.

After every step it checks the drop queue's promises: never early (no ``free``
before the object's fence completed, none ever for a failed fence), prompt
(once a stream's work completes, its objects are released with nothing else
happening) and never leaked (drained, the queue holds nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import asyncfence
from asyncfence import DropQueue
from asyncfence.testing import OpenCLDevice, StreamGate, open_default_device

STREAMS = 3
_device: OpenCLDevice | None = None


def device() -> OpenCLDevice:
    global _device
    if _device is None:
        opened = open_default_device("opencl")
        assert isinstance(opened, OpenCLDevice)
        _device = opened
    return _device


class Tracked:
    """An object whose release the machine watches."""

    def __init__(self, fence: asyncfence.Fence, stream: int, violations: list[str]) -> None:
        self.fence = fence
        self.stream = stream
        self.violations = violations
        self.freed = 0

    def free(self) -> None:
        self.freed += 1
        try:
            done = self.fence.done()
        except asyncfence.DeviceError:
            self.violations.append("freed although its work failed")
            return
        if not done:
            self.violations.append("freed before its fence completed")


class DropQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.streams = [device().new_stream() for _ in range(STREAMS)]
        self.gates = [StreamGate(stream) for stream in self.streams]
        self.retired_gates: list[StreamGate] = []  # PoCL 3.0 needs them referenced
        self.violations: list[str] = []
        self.items: list[Tracked] = []
        self.faulted: list[object] = []
        self.failed_streams: set[int] = set()

    @initialize()
    def make_queue(self) -> None:
        async def make() -> DropQueue:
            return DropQueue(on_fault=lambda obj, error: self.faulted.append(obj))

        self.dq = self.run(make())

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, 30))

    async def settle(self) -> None:
        """Let the loop run until every object whose fence settled has been dealt with."""

        def settled() -> bool:
            for item in self.items:
                if item.fence._core.poll() == 0:  # PENDING
                    continue
                if item.freed == 0 and item not in self.faulted:
                    return False
            return True

        while not settled():  # noqa: ASYNC110 (a predicate over many objects)
            await asyncio.sleep(0.001)

    def new_gate(self, stream: int) -> None:
        self.retired_gates.append(self.gates[stream])
        self.gates[stream] = StreamGate(self.streams[stream])
        self.failed_streams.discard(stream)

    @rule(stream=st.integers(0, STREAMS - 1), fences=st.integers(1, 2))
    def defer(self, stream: int, fences: int) -> None:
        recorded = [asyncfence.record(self.streams[stream]) for _ in range(fences)]
        item = Tracked(recorded[-1], stream, self.violations)
        self.dq.defer(recorded, item, free=Tracked.free)
        self.items.append(item)

    @rule(stream=st.integers(0, STREAMS - 1))
    def complete(self, stream: int) -> None:
        self.gates[stream].release()
        self.new_gate(stream)
        self.run(self.settle())  # prompt: released with nothing else happening

    @rule(stream=st.integers(0, STREAMS - 1))
    def fault(self, stream: int) -> None:
        self.gates[stream].fail()
        self.new_gate(stream)
        self.run(self.settle())

    @rule()
    def cancel_a_drain(self) -> None:
        async def cancelled_drain() -> None:
            # Nothing released early, nothing lost: the invariants check it.
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self.dq.drain(), 0.005)

        self.run(cancelled_drain())

    @rule()
    def drain(self) -> None:
        for stream in range(STREAMS):
            self.gates[stream].release()
            self.new_gate(stream)
        self.run(self.dq.drain())
        stats = self.dq.statistics()
        assert stats.pending_items == 0
        assert all(item.freed == 1 or item in self.faulted for item in self.items)

    @invariant()
    def never_early_never_twice(self) -> None:
        assert self.violations == []
        assert all(item.freed <= 1 for item in self.items)
        assert not any(item.freed and item in self.faulted for item in self.items)

    @invariant()
    def counted(self) -> None:
        if not hasattr(self, "dq"):
            return
        stats = self.dq.statistics()
        released = sum(item.freed for item in self.items)
        assert stats.released == released
        assert stats.faulted == len(self.faulted)
        assert stats.pending_items == len(self.items) - released - len(self.faulted)

    def teardown(self) -> None:
        try:
            for gate in self.gates:
                gate.release()
            if hasattr(self, "dq"):
                self.run(self.dq.aclose())
                references = [weakref.ref(item) for item in self.items if item.freed]
                self.items.clear()
                gc.collect()
                assert all(reference() is None for reference in references)  # no leaks
        finally:
            for stream in self.streams:
                stream.finish()
            self.loop.close()


DropQueueMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_drop_queue_state_machine = DropQueueMachine.TestCase
