"""Races and edge cases found in review, each pinned down deterministically.

Where two threads must interleave at one exact point, one of them is paused
there (a trace function, or a lock it waits for), so the test never depends on
the scheduler's luck.
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import gc
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import asyncfence
from asyncfence import _fence, _loops, _watcher
from asyncfence._backend import backend_for
from asyncfence._backends import opencl as _opencl
from asyncfence.testing import StreamGate

from .conftest import until

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType

    import pyopencl as cl

    from asyncfence.testing import CudaDevice

HANG_GUARD_S = 30  # a hang guard, never a timing assertion


def pause_at(
    function: Callable[..., Any], text: str, paused: threading.Event, go: threading.Event
) -> Callable[[FrameType, str, object], Any]:
    """A trace function that stops this thread once, at ``function``'s line holding ``text``."""
    import inspect

    lines, first = inspect.getsourcelines(function)
    target = first + next(i for i, line in enumerate(lines) if text in line)
    code = function.__code__
    done = False

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal done
        if event == "line" and frame.f_lineno == target and not done:
            done = True
            paused.set()
            go.wait(HANG_GUARD_S)
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    return calls


@pytest.fixture
def gate(queue: cl.CommandQueue) -> Iterator[StreamGate]:
    held = StreamGate(queue)
    yield held
    if held.held:
        held.release()


# -- fences ------------------------------------------------------------------


def test_a_fence_settled_by_another_thread_mid_poll_reads_as_done(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    paused, go = threading.Event(), threading.Event()
    answer: list[object] = []

    def poll_in_thread() -> None:
        sys.settrace(pause_at(_fence.Fence._poll, "marker = self._marker", paused, go))
        try:
            answer.append(fence.done())
        except BaseException as error:
            answer.append(error)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=poll_in_thread)
    thread.start()
    assert paused.wait(HANG_GUARD_S)  # past the state check, before the marker
    gate.release()
    queue.finish()
    assert fence.done()  # settled here, meanwhile
    go.set()
    thread.join(HANG_GUARD_S)
    assert answer == [True]


def test_wait_sync_follows_the_fence_not_its_recycled_event(
    cuda_device: CudaDevice, cuda_stream: Any
) -> None:
    other_stream = cuda_device.new_stream()
    try:
        with asyncfence.testing.hold(cuda_stream) as first_gate:
            fence = asyncfence.record(cuda_stream)
            assert fence._marker is not None
            event = int(fence._marker.event)
            paused, go = threading.Event(), threading.Event()
            returned: list[bool] = []

            def wait_in_thread() -> None:
                sys.settrace(pause_at(_fence.Fence.wait_sync, "time.sleep(", paused, go))
                try:
                    fence.wait_sync(timeout=HANG_GUARD_S)
                    returned.append(True)
                finally:
                    sys.settrace(None)

            thread = threading.Thread(target=wait_in_thread)
            thread.start()
            assert paused.wait(HANG_GUARD_S)  # the waiting thread is between polls
            first_gate.release()
            fence.wait_sync(timeout=HANG_GUARD_S)  # settled here: the event is pooled
        with asyncfence.testing.hold(other_stream):
            reused = asyncfence.record(other_stream)  # the same event, held
            assert reused._marker is not None
            assert int(reused._marker.event) == event
            go.set()
            thread.join(HANG_GUARD_S)
            assert returned == [True]
            assert not reused.done()
        reused.wait_sync(timeout=HANG_GUARD_S)
    finally:
        cuda_device.close_stream(other_stream)


def test_concurrent_records_are_numbered_in_queue_order(
    queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_for(queue)
    assert isinstance(backend, _opencl.OpenCLBackend)
    inside, go = threading.Event(), threading.Event()
    queue_info = backend._queue_info

    def slow_queue_info(stream: cl.CommandQueue) -> Any:
        if threading.current_thread().name == "first":
            inside.set()  # the marker is enqueued; the fence not yet numbered
            go.wait(HANG_GUARD_S)
        return queue_info(stream)

    monkeypatch.setattr(backend, "_queue_info", slow_queue_info)
    fences: dict[str, _fence.Fence] = {}

    def record(name: str) -> None:
        fences[name] = asyncfence.record(queue)

    first = threading.Thread(target=record, args=("first",), name="first")
    first.start()
    assert inside.wait(HANG_GUARD_S)
    second = threading.Thread(target=record, args=("second",), name="second")
    second.start()
    # Without the record lock the second would finish now, numbered first.
    second.join(0.5)
    go.set()
    first.join(HANG_GUARD_S)
    second.join(HANG_GUARD_S)
    assert fences["first"]._seq < fences["second"]._seq


def test_a_child_forked_while_a_lock_is_held_gets_fresh_locks() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("needs fork()")
    # In a fresh process: forking this multi-threaded one is what the test is not about.
    code = """
import os
from asyncfence import _config, _fence
locks = lambda: (_fence._settle_lock, _fence._record_locks[0], _config._configure_lock)
a, b, c = locks()
with a, b, c:  # as other threads might hold them at the fork
    pid = os.fork()
    if pid == 0:
        fresh = not any(lock.locked() for lock in locks())
        os._exit(0 if fresh else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    result = subprocess.run([sys.executable, "-c", code], timeout=HANG_GUARD_S, check=False)
    assert result.returncode == 0


# -- enqueue_wait on OpenCL ----------------------------------------------------


def test_enqueue_wait_on_a_failed_fence_raises_and_leaves_the_stream_running(
    device: Any, queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    gate.fail(-5)
    queue.finish()
    other = device.new_stream()
    try:
        with pytest.raises(asyncfence.DeviceError) as failure:
            fence.enqueue_wait(other)  # not polled yet: found failed here
        assert failure.value.name == "CL_FAILED"
        later = asyncfence.record(other)
        later.wait_sync(timeout=HANG_GUARD_S)
    finally:
        device.close_stream(other)


def test_a_fence_that_fails_after_enqueue_wait_fails_the_waiting_stream(
    device: Any, queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    other = device.new_stream()
    try:
        fence.enqueue_wait(other)
        later = asyncfence.record(other)
        gc.collect()  # nothing but the backend keeps the barrier alive now
        gate.fail(-5)  # PoCL 3.0 aborted the process here when the barrier was gone
        with pytest.raises(asyncfence.DeviceError):
            fence.wait_sync(timeout=HANG_GUARD_S)
        with pytest.raises(asyncfence.DeviceError) as failure:
            later.wait_sync(timeout=HANG_GUARD_S)
        assert (failure.value.code, failure.value.name) == (-1, "CL_FAILED")
    finally:
        device.close_stream(other)


def test_a_fence_failing_while_enqueue_wait_runs_raises_saying_so() -> None:
    # In a fresh process, left with os._exit: the waiting queue may be wedged
    # for good, and releasing a wedged PoCL queue waits for it.
    code = """
import inspect, os, sys, threading
import asyncfence
from asyncfence import _fence
from asyncfence.testing import StreamGate, open_default_device
device = open_default_device("opencl")
queue, other = device.new_stream(), device.new_stream()
gate = StreamGate(queue)
fence = asyncfence.record(queue)
lines, first = inspect.getsourcelines(_fence.Fence.enqueue_wait)
target = first + next(i for i, line in enumerate(lines) if "marker = self._pin()" in line)
paused, go, result = threading.Event(), threading.Event(), []
def local(frame, event, arg):
    if event == "line" and frame.f_lineno == target:
        paused.set(); go.wait(30)
    return local
def calls(frame, event, arg):
    return local if frame.f_code is _fence.Fence.enqueue_wait.__code__ else None
def enqueue_wait():
    sys.settrace(calls)
    try:
        fence.enqueue_wait(other)
        result.append("returned")
    except asyncfence.DeviceError as error:
        result.append(error.detail)
    finally:
        sys.settrace(None)
thread = threading.Thread(target=enqueue_wait)
thread.start()
assert paused.wait(30)  # past its own check: the fence was still pending
gate.fail(-5)
queue.finish()  # the fence has failed now
go.set()
thread.join(30)
print(result)
sys.stdout.flush()
os._exit(0)
"""
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "failed while enqueue_wait ran" in result.stdout


# -- the OpenCL waiter threads and the watcher ----------------------------------


@pytest.mark.anyio
@pytest.mark.usefixtures("thread_wake_path")
async def test_a_huge_recheck_interval_never_spins_the_watcher(
    queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    watcher = _watcher.current_watcher()
    waits: list[float] = []
    real_wait = watcher._semaphore.wait

    def recording_wait(timeout: float) -> None:
        waits.append(timeout)
        real_wait(timeout)

    watcher.stop(timeout=HANG_GUARD_S)  # the next park starts a thread that records
    monkeypatch.setattr(watcher._semaphore, "wait", recording_wait)
    previous = asyncfence.configure()
    asyncfence.configure(recheck_interval=1e300)
    try:
        with asyncfence.testing.hold(queue) as held:
            fence = asyncfence.record(queue)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(functools.partial(fence.wait, strategy="park"))
                await until(lambda: watcher.statistics().parked == 1)
                held.release()
    finally:
        asyncfence.configure(recheck_interval=previous.recheck_interval)
        watcher._semaphore.post()  # out of its long sleep, back to the usual interval
    assert waits
    assert max(waits) <= _watcher._LONGEST_SLEEP_S


# -- loops ------------------------------------------------------------------------


def test_a_wait_abandoned_on_a_closed_loop_unparks_when_closed(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    loop = asyncio.new_event_loop()
    task = loop.create_task(fence.wait(strategy="park"))
    loop.run_until_complete(until(lambda: asyncfence.current_statistics().parked == 1))
    loop.close()  # the task is still waiting
    task.get_coro().close()  # what its destruction does: runs its finally
    driver = _loops._existing_asyncio_suspender(loop)
    assert driver is not None
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)
    assert asyncfence.watcher_statistics().parked == 0


def test_the_trio_poller_survives_a_run_that_is_shutting_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio

    async def main() -> None:
        driver = _loops._trio_driver(create=True)
        assert driver is not None
        chain = driver.chain(lambda: None)

        def closed_nursery(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Nursery is closed to new arrivals")

        monkeypatch.setattr(trio.lowlevel, "spawn_system_task", closed_nursery)
        chain.ensure(0.0)  # must not raise into trio
        assert not chain.running

    trio.run(main)


# -- settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "seconds", [np.float32(0.25), np.int64(2), fractions.Fraction(1, 4)], ids=repr
)
def test_timeouts_and_settings_take_any_real_number(seconds: object) -> None:
    previous = asyncfence.configure()
    try:
        assert asyncfence.configure(poll_cap=seconds).poll_cap == float(seconds)  # type: ignore[arg-type]
    finally:
        asyncfence.configure(poll_cap=previous.poll_cap)
    from asyncfence._config import check_timeout

    assert check_timeout(seconds) == float(seconds)  # type: ignore[arg-type]


def test_booleans_are_not_seconds() -> None:
    with pytest.raises(TypeError, match="poll_cap"):
        asyncfence.configure(poll_cap=np.bool_(True))  # type: ignore[arg-type]


# -- the drop queue and the staging pool ----------------------------------------------


@pytest.mark.anyio
async def test_drain_with_timeout_zero_returns_when_nothing_is_pending() -> None:
    async with asyncfence.DropQueue() as queue:
        await queue.drain(timeout=0)


@pytest.mark.anyio
async def test_drain_with_timeout_zero_times_out_when_something_is(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    async with asyncfence.DropQueue() as drop:
        drop.defer(asyncfence.record(queue), bytearray(8))
        with pytest.raises(TimeoutError):
            await drop.drain(timeout=0)
        gate.release()


@pytest.mark.anyio
async def test_a_closed_staging_pool_refuses_acquire_and_disposes_late_returns(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    disposed: list[bytearray] = []
    pool = asyncfence.StagingPool(lambda: bytearray(8), 2, dispose=disposed.append)
    held = await pool.acquire()  # taken before the close, returned after it
    await pool.aclose()
    assert len(disposed) == 1
    with pytest.raises(RuntimeError, match="closed"):
        await pool.acquire()
    pool.release_after(asyncfence.record(queue), held)
    assert len(disposed) == 1  # the device may still read it
    gate.release()
    await pool._returns.drain()
    assert disposed[-1] is held
    assert len(disposed) == 2


@pytest.mark.anyio
async def test_closing_a_staging_pool_wakes_its_waiting_acquirers() -> None:
    pool = asyncfence.StagingPool(lambda: bytearray(8), 1)
    await pool.acquire()
    failures: list[BaseException] = []

    async def acquire() -> None:
        try:
            await pool.acquire()
        except RuntimeError as error:
            failures.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(acquire)
        await anyio.wait_all_tasks_blocked()
        await pool.aclose()
    assert len(failures) == 1


def test_a_staging_pool_that_fails_to_fill_disposes_what_it_made() -> None:
    made: list[bytearray] = []
    disposed: list[bytearray] = []

    def make() -> bytearray:
        if len(made) == 2:
            raise MemoryError("the third allocation fails")
        made.append(bytearray(8))
        return made[-1]

    with pytest.raises(MemoryError):
        asyncfence.StagingPool(make, 3, dispose=disposed.append)
    assert disposed == made


@pytest.mark.anyio
async def test_staging_pool_disposes_every_buffer_even_when_some_dispose_raises() -> None:
    disposed: list[int] = []

    def dispose(buffer: bytearray) -> None:
        disposed.append(id(buffer))
        if len(disposed) == 1:
            raise OSError("the first free fails")

    pool = asyncfence.StagingPool(lambda: bytearray(8), 3, dispose=dispose)
    with pytest.raises(ExceptionGroup) as failures:
        await pool.aclose()
    assert len(disposed) == 3
    assert [type(e) for e in failures.value.exceptions] == [OSError]


@pytest.mark.anyio
async def test_staging_pool_close_disposes_the_pool_even_when_a_late_return_fails() -> None:
    made: list[bytearray] = []
    disposed: list[bytearray] = []

    def make() -> bytearray:
        made.append(bytearray(8))
        return made[-1]

    def dispose(buffer: bytearray) -> None:
        disposed.append(buffer)
        if buffer is made[0]:
            raise OSError("freeing the buffer that came back fails")

    pool = asyncfence.StagingPool(make, 3, dispose=dispose)
    out = await pool.acquire()
    pool.release_after([], out)  # comes back while the pool closes
    with pytest.raises(ExceptionGroup):
        await pool.aclose()
    assert sorted(map(id, disposed)) == sorted(map(id, made))
    assert pool.available == 0


def test_a_staging_pool_that_fails_to_fill_and_to_dispose_keeps_the_make_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made: list[bytearray] = []

    def make() -> bytearray:
        if made:
            raise MemoryError("the second allocation fails")
        made.append(bytearray(8))
        return made[-1]

    def dispose(buffer: bytearray) -> None:
        raise OSError("and freeing the first fails too")

    with pytest.raises(MemoryError):
        asyncfence.StagingPool(make, 2, dispose=dispose)
    assert "dispose raised" in caplog.text


def test_staging_pool_count_must_be_a_positive_int() -> None:
    with pytest.raises(TypeError, match="count must be an int"):
        asyncfence.StagingPool(bytearray, "3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 1"):
        asyncfence.StagingPool(bytearray, 0)
