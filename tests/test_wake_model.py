"""A model of the wake protocol: no waiter of a settled fence stays suspended.

Hypothesis drives random sequences of what the wake path must survive, on the
tests' fake backend (whose signals are the native shim's, called as a runtime
would, when a gate is released): fences recorded behind gates on a few
streams, parked and polled waits, waits abandoned, fences collected with their
signals still armed, gates released or failed, and fences polled outside any
sweep (``done()``), each wait written ``await fence.wait(strategy=...)`` or
``await fence``. When a step says so, the loop runs until settled, and at
the end: every wait on a fence the device has passed has resumed. The
re-check that would hide a lost wake is 30 s away. (A failed fence sends no
signal, in PoCL as in the fake: only the re-check finds it, as tests in
``test_poller.py`` show. Nor does a stream run on after a failure, in PoCL or
CUDA: once a gate fails, the model takes a new stream in its place.)

A random search finds such interleavings rarely, so it is steered (hypothesis'
``target``) towards the states where wakes get lost: this model, at its
default of 1,000 sequences of 15 steps, found the lost wake of December 2026
in five runs out of five, when the fix was undone. ``WAKE_MODEL_EXAMPLES`` and
``WAKE_MODEL_STEPS`` search longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import time
import weakref
from typing import Any

import pytest
from hypothesis import HealthCheck, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
)

import asyncfence
from asyncfence._backend import backend_named
from asyncfence._core import PENDING
from asyncfence._loops._asyncio import driver_of
from asyncfence._native import shim
from asyncfence._poller import Poller
from asyncfence.testing import StreamGate

from .fake_backend import FakeDevice, FakeStream

pytestmark = pytest.mark.skipif(shim() is None, reason="the native shim is not in use")

_STREAMS = 2
_STRATEGIES = st.sampled_from(["park", "park", "park", "auto", "poll"])
_SETTLE_GUARD_S = 0.5  # a hang guard for the invariant, never a timing assertion


class _Wait:
    def __init__(self, key: int, marker: Any, task: asyncio.Task[None]) -> None:
        self.key = key
        self.marker = marker  # the fake backend's own op: the device's truth
        self.task = task


class WakeProtocol(RuleBasedStateMachine):
    """Random park, abandon, collect, fire, poll-without-sweep and wake.

    Each fence is recorded behind a gate of its own, on one of two streams.
    The loop runs only when a rule says so (one turn, two, or until settled),
    so that steps can fall between the two calls of a wake; the fences live
    here, not in hypothesis' bundles, so that collecting one really frees it.
    """

    fences = Bundle("fences")

    def __init__(self) -> None:
        super().__init__()
        self.previous = asyncfence.configure()
        asyncfence.configure(recheck_interval=30, poll_cap=0.001)
        self.loop = asyncio.new_event_loop()
        device = backend_named("fake").lab().open_device()
        assert isinstance(device, FakeDevice)
        self.device = device
        self.streams: list[FakeStream] = [device.new_stream() for _ in range(_STREAMS)]
        self.live: dict[int, asyncfence.Fence] = {}
        self.gates: dict[int, StreamGate] = {}
        self.markers: dict[int, Any] = {}
        self.waits: list[_Wait] = []
        self.keys = itertools.count()
        self.failed_streams: set[int] = set()
        self.steering = 0
        self.stream_of: dict[int, int] = {}

    def _turns(self, count: int) -> None:
        """Run the loop ``count`` iterations: one selector poll and one ready batch each."""
        for _ in range(count):
            self.loop.call_soon(self.loop.stop)
            self.loop.run_forever()

    def _wait(self, key: int, strategy: str, written_bare: bool) -> None:
        fence = self.live[key]

        async def wait() -> None:
            with contextlib.suppress(asyncfence.DeviceError):
                if written_bare:  # `await fence`: no coroutine frame of asyncfence's
                    await fence
                else:
                    await fence.wait(strategy=strategy)  # type: ignore[arg-type]

        self.waits.append(_Wait(key, self.markers[key], self.loop.create_task(wait())))
        default = asyncfence.configure().strategy
        asyncfence.configure(strategy=strategy)  # type: ignore[arg-type]
        try:
            self._turns(1)  # the task runs: it parks (or starts polling)
        finally:
            asyncfence.configure(strategy=default)

    @rule(
        target=fences,
        stream=st.integers(0, _STREAMS - 1),
        strategy=_STRATEGIES,
        written_bare=st.booleans(),
    )
    def park(self, stream: int, strategy: str, written_bare: bool) -> int:
        if stream in self.failed_streams:  # the app opens a new one
            self.failed_streams.discard(stream)
            self.streams[stream] = self.device.new_stream()
        key = next(self.keys)
        self.stream_of[key] = stream
        self.gates[key] = StreamGate(self.streams[stream])
        fence = self.live[key] = asyncfence.record(self.streams[stream])
        self.markers[key] = fence._core._marker
        self._wait(key, strategy, written_bare)
        return key

    def _abandon(self, key: int) -> None:
        for wait in self.waits:
            if wait.key == key:
                wait.task.cancel()
        self._turns(1)

    @rule(key=fences)  # the key stays: its gate can still be released
    def collect(self, key: int) -> None:
        # Its waits abandoned, and the fence dropped with its signal perhaps
        # still armed.
        self._abandon(key)
        self._turns(1)
        self.waits = [wait for wait in self.waits if wait.key != key]
        self.markers.pop(key, None)
        fence = self.live.pop(key, None)
        if fence is None:
            return
        core = weakref.ref(fence._core)
        del fence
        for generation in (0, 1):  # young cycles; a full collection is too slow per step
            if core() is None:
                break
            gc.collect(generation)
        # Still alive: something holds it (a fence set's stale entry behind the
        # stream's oldest, say), and its signal's token stays known.

    @rule(key=fences, fail=st.sampled_from([False, False, False, True]))
    def release(self, key: int, fail: bool) -> None:
        gate = self.gates[key]  # the fake device fires the armed signals, natively, now
        if fail:
            self.failed_streams.add(self.stream_of[key])
            gate.fail(-5)
        else:
            gate.release()

    @rule(key=fences)
    def completes_and_is_seen_elsewhere(self, key: int) -> None:
        """Its work completes, and a poll that is no sweep sees it (another thread's done())."""
        self.release(key, fail=False)
        self.poll_without_sweep(key)

    @rule(key=fences)
    def poll_without_sweep(self, key: int) -> None:
        fence = self.live.get(key)
        if fence is not None:
            with contextlib.suppress(asyncfence.DeviceError):
                fence.done()

    @rule(turns=st.sampled_from([1, 1, 2, 0]))
    def run(self, turns: int) -> None:
        """Run the loop a turn or two; 0: until settled, checking that nothing is lost."""
        if turns:
            self._turns(turns)
        else:
            self.check_no_waiter_of_a_settled_fence_is_suspended()

    @invariant()
    def steer_towards_interleaved_wakes(self) -> None:
        """Note how close this run came to where wakes get lost, to steer the search.

        The stages: a signal armed for no fence (orphaned), with one other
        armed (the wake would guess which fired), a wake that looked and left
        its rest for later, and then a settled fence still awaited.
        """
        driver = driver_of(self.loop, create=False)
        poller = None if driver is None else driver.poller
        if not isinstance(poller, Poller):
            return
        parking = poller._parking
        if parking is None:
            return
        native = shim()
        assert native is not None
        awaited_fired = [fence for fence in parking._fired if poller.is_awaited(fence)]
        if parking._rest_pending and any(fence.state != PENDING for fence in awaited_fired):
            score = 4  # a fence settled elsewhere, its waiters not woken, the rest pending
        elif parking._rest_pending and awaited_fired:
            score = 3  # the wake looked, found it pending, and left the rest for later
        elif native.live_slots() > len(parking._armed):  # a signal armed for no one
            score = 2 if len(parking._armed) == 1 else 1  # 2: the wake would guess
        else:
            score = 0
        self.steering = max(self.steering, score)

    def check_no_waiter_of_a_settled_fence_is_suspended(self) -> None:
        deadline = time.monotonic() + _SETTLE_GUARD_S
        while True:
            self._turns(3)
            stuck = [wait for wait in self.waits if wait.marker.done and not wait.task.done()]
            if not stuck:
                return
            assert time.monotonic() < deadline, f"lost wakes: fences {[w.key for w in stuck]}"
            time.sleep(0.001)

    def teardown(self) -> None:
        target(self.steering, label="interleaved wakes")  # once per case: its best
        try:
            self.check_no_waiter_of_a_settled_fence_is_suspended()
        finally:
            for gate in self.gates.values():
                gate.release()
            for wait in self.waits:
                wait.task.cancel()
            self._turns(3)
            self.loop.close()
            for stream in self.streams:
                self.device.close_stream(stream)
            asyncfence.configure(
                recheck_interval=self.previous.recheck_interval, poll_cap=self.previous.poll_cap
            )


WakeProtocol.TestCase.settings = settings(
    max_examples=int(os.environ.get("WAKE_MODEL_EXAMPLES", 1000)),
    stateful_step_count=int(os.environ.get("WAKE_MODEL_STEPS", 15)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_wake_protocol_loses_no_wake = WakeProtocol.TestCase
