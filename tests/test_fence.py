"""The fence core, on every registered backend (OpenCL, CUDA, and the tests' fake
one), under asyncio, uvloop and trio.

Nothing here knows which backend it runs on: the backends come from the
registry, and that these tests pass on all of them is what makes the seam the
whole story (see ``asyncfence/_backend.py``). Backend-specific behaviour lives
in ``test_opencl.py`` and ``test_cuda.py``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError, Fence, _blocking, _core
from asyncfence._backend import backend_for, backend_names
from asyncfence._backends import opencl as _opencl
from asyncfence.testing import StreamGate, hold, open_default_device

from .conftest import HANG_GUARD_S, let_loop_run, pause_at, until

if sys.version_info < (3, 11):
    pass

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import pyopencl as cl

    from asyncfence.testing import Device


# Every test here runs under each strategy: the semantics do not depend on it.
pytestmark = pytest.mark.usefixtures("strategy")


_devices: dict[str, Device] = {}


@pytest.fixture(params=backend_names())
def new_stream(request: pytest.FixtureRequest) -> Iterator[Callable[[], Any]]:
    """Makes fresh streams on one registered backend's device; they are closed afterwards."""
    name: str = request.param
    device = _devices.get(name)
    if device is None:
        try:
            device = _devices[name] = open_default_device(name)
        except RuntimeError as missing:
            pytest.skip(str(missing))
    made: list[Any] = []

    def make() -> Any:
        made.append(device.new_stream())
        return made[-1]

    yield make
    for stream in made:
        device.close_stream(stream)


@pytest.fixture
def queue(new_stream: Callable[[], Any]) -> Any:
    """A fresh stream on the backend under test (the name kept from OpenCL's queues)."""
    return new_stream()


#: For tests that fail a gate: the host cannot fail a CUDA stream, so they skip
#: there (tests/conftest.py; faults on CUDA are tested with the emulator's hooks).
fails_a_gate = pytest.mark.fails_a_gate


# -- pending versus done -------------------------------------------------------


async def test_fence_on_idle_queue_completes(queue: Any) -> None:
    fence = asyncfence.record(queue)
    await fence
    assert fence.done()


async def test_waiter_stays_pending_until_the_queue_is_released(queue: Any) -> None:
    resumed = anyio.Event()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)

        async def waiter() -> None:
            await fence
            resumed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            await let_loop_run()
            assert not resumed.is_set()
            assert not fence.done()
            gate.release()
            with anyio.fail_after(10):
                await resumed.wait()
    assert fence.done()


async def test_hundred_waiters_on_one_fence_all_resume(queue: Any) -> None:
    resumed = 0
    with hold(queue) as gate:
        fence = asyncfence.record(queue)

        async def waiter() -> None:
            nonlocal resumed
            await fence
            resumed += 1

        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(waiter)
            await until(lambda: asyncfence.current_statistics().waiters == 100)
            assert asyncfence.current_statistics().pending_fences == 1
            assert resumed == 0
            gate.release()
    assert resumed == 100


async def test_waiting_again_on_a_done_fence_returns(queue: Any) -> None:
    fence = asyncfence.record(queue)
    await fence
    await fence
    await fence.wait(timeout=0)
    assert fence.done()


# -- checkpoints and cancellation ------------------------------------------------


async def test_awaiting_a_done_fence_is_a_checkpoint(queue: Any) -> None:
    fence = asyncfence.record(queue)
    await fence
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await fence
        reached = True
    assert scope.cancelled_caught
    assert not reached


async def test_awaiting_a_done_fence_lets_other_tasks_run(queue: Any) -> None:
    fence = asyncfence.record(queue)
    await fence
    ran = False

    async def other() -> None:
        nonlocal ran
        ran = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        while not ran:
            await fence  # would spin forever if it never yielded
    assert ran


async def test_cancelling_one_waiter_leaves_the_others_waiting(queue: Any) -> None:
    outcomes: dict[str, str] = {}
    with hold(queue) as gate:
        fence = asyncfence.record(queue)

        async def waiter(name: str, scope: anyio.CancelScope) -> None:
            with scope:
                await fence
                outcomes[name] = "resumed"
                return
            outcomes[name] = "cancelled"

        scopes = {name: anyio.CancelScope() for name in ("a", "b", "c")}
        async with anyio.create_task_group() as tg:
            for name, scope in scopes.items():
                tg.start_soon(waiter, name, scope)
            await until(lambda: asyncfence.current_statistics().waiters == 3)
            scopes["b"].cancel()
            await until(lambda: "b" in outcomes)
            assert asyncfence.current_statistics().waiters == 2
            await let_loop_run()
            assert "a" not in outcomes
            assert "c" not in outcomes
            assert not fence.done()  # cancelling a wait cancelled no device work
            gate.release()
    assert outcomes == {"a": "resumed", "b": "cancelled", "c": "resumed"}


async def test_cancelling_every_waiter_stops_the_poller(queue: Any) -> None:
    with hold(queue):
        fence = asyncfence.record(queue)
        with anyio.move_on_after(0.01):
            await fence
        stats = asyncfence.current_statistics()
        assert (stats.waiters, stats.pending_fences) == (0, 0)
        await until(lambda: not asyncfence.current_statistics().running)
    await fence


# -- timeouts --------------------------------------------------------------------


async def test_timeout_then_a_second_await(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with pytest.raises(TimeoutError):
            await fence.wait(timeout=0.01)
        with pytest.raises(TimeoutError):
            await fence.wait(timeout=0)
        assert asyncfence.current_statistics().waiters == 0
        assert not fence.done()
        gate.release()
        await fence.wait(timeout=30)
    assert fence.done()


async def test_infinite_timeout_means_no_limit(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait, math.inf)
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            gate.release()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (-1, ValueError),
        (-0.5, ValueError),
        (math.nan, ValueError),
        ("1", TypeError),
        (True, TypeError),
    ],
)
async def test_bad_timeouts_are_refused(queue: Any, bad: object, error: type[Exception]) -> None:
    fence = asyncfence.record(queue)
    with pytest.raises(error, match="timeout"):
        await fence.wait(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="timeout"):
        fence.wait_sync(timeout=bad)  # type: ignore[arg-type]


async def test_a_timeout_beyond_a_float_means_no_limit(queue: Any) -> None:
    huge = 10**400  # float(huge) overflows
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with anyio.move_on_after(0.01) as scope:
            await fence.wait(timeout=huge)
        assert scope.cancelled_caught  # still waiting: no limit, and no OverflowError
        with pytest.raises(TimeoutError):
            fence.wait_sync(timeout=0.001)
        gate.release()
    fence.wait_sync(timeout=huge)
    await fence.wait(timeout=huge)


# -- failures -------------------------------------------------------------------


@fails_a_gate
async def test_a_failed_user_event_raises_device_error_in_every_waiter(
    queue: Any,
) -> None:
    errors: list[BaseException] = []
    with hold(queue) as gate:
        fence = asyncfence.record(queue)

        async def waiter() -> None:
            try:
                await fence
            except DeviceError as error:
                errors.append(error)

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(waiter)
            await until(lambda: asyncfence.current_statistics().waiters == 5)
            gate.fail(-5)
    assert len(errors) == 5
    assert len({id(error) for error in errors}) == 5  # each waiter its own instance
    for error in errors:
        assert isinstance(error, DeviceError)
        assert error.backend == backend_for(queue).name
        assert error.code < 0
        assert error.name
    with pytest.raises(DeviceError):
        fence.done()
    with pytest.raises(DeviceError):
        fence.wait_sync()
    with pytest.raises(DeviceError):
        await fence
    with pytest.raises(DeviceError):
        fence.enqueue_wait(queue)


@fails_a_gate
async def test_failure_reaches_fences_recorded_after_it(queue: Any) -> None:
    with hold(queue) as gate:
        fences = [asyncfence.record(queue) for _ in range(3)]
        gate.fail()
    for fence in fences:
        with pytest.raises(DeviceError):
            await fence


def test_device_error_pickles() -> None:
    import pickle

    error = DeviceError("cuda", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "detail")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.backend, copy.code, copy.name, str(copy)) == (
        "cuda",
        700,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        str(error),
    )


# -- bad input ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [object(), 3.5, "queue", None, b"", [1]])
def test_record_refuses_what_is_not_a_stream(stream: object) -> None:
    # The message names what every backend accepts.
    with pytest.raises(TypeError, match=r"pyopencl\.CommandQueue.*CUDA stream"):
        asyncfence.record(stream)


def test_fences_have_no_public_constructor() -> None:
    with pytest.raises(TypeError, match=r"asyncfence\.record"):
        Fence()


def test_awaiting_without_an_event_loop_is_a_clear_error(queue: Any) -> None:
    with hold(queue):
        fence = asyncfence.record(queue)
        coroutine = fence.wait()
        with pytest.raises(RuntimeError, match="event loop"):
            coroutine.send(None)


# -- threads --------------------------------------------------------------------


async def test_fence_recorded_on_a_worker_thread(queue: Any) -> None:
    with hold(queue) as gate:
        fence = await anyio.to_thread.run_sync(asyncfence.record, queue)
        assert not fence.done()
        gate.release()
        await fence
    assert fence.done()


async def test_fences_recorded_by_many_threads_while_the_loop_awaits(
    new_stream: Callable[[], Any],
) -> None:
    queues = [new_stream() for _ in range(4)]
    fences: list[Fence] = []
    lock = threading.Lock()
    with hold(queues[0]) as gate:

        def recorder(index: int) -> None:
            for _ in range(25):
                fence = asyncfence.record(queues[index % len(queues)])
                with lock:
                    fences.append(fence)

        threads = [threading.Thread(target=recorder, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()

        def join_all() -> None:
            for thread in threads:
                thread.join()

        await anyio.to_thread.run_sync(join_all)
        assert len(fences) == 200
        first_key = asyncfence.record(queues[0])._core.queue.key
        held = [fence for fence in fences if fence._core.queue.key == first_key]
        assert held
        assert not any(fence.done() for fence in held)
        gate.release()
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(fence.wait)
    assert all(fence.done() for fence in fences)


def test_wait_sync_blocks_until_released(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with pytest.raises(TimeoutError):
            fence.wait_sync(timeout=0.01)
        threading.Timer(0.0, gate.release).start()
        fence.wait_sync(timeout=30)
    assert fence.done()


def test_wait_sync_sleeps_on_the_completion_signal(
    queue: Any, wake_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the shim, the thread blocks on its mailbox: it queries the fence
    # when the signal comes (and every recheck_interval, an hour here), never
    # in a loop of sleeps.
    if wake_path != "native":
        pytest.skip("without the shim, wait_sync sleeps between queries")
    asyncfence.configure(recheck_interval=3600.0)
    queries = 0
    real_poll = _core.FenceCore.poll

    def counted(self: _core.FenceCore, **kwargs: Any) -> int:
        nonlocal queries
        queries += 1
        return real_poll(self, **kwargs)

    blocked = threading.Event()
    real_sleep_on_signal = _blocking._sleep_on_signal

    def noted(*args: Any) -> None:
        blocked.set()
        real_sleep_on_signal(*args)

    monkeypatch.setattr(_blocking, "_sleep_on_signal", noted)
    monkeypatch.setattr(time, "sleep", _no_sleep)
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        monkeypatch.setattr(_core.FenceCore, "poll", counted)
        waiter = threading.Thread(target=fence.wait_sync, kwargs={"timeout": 30})
        waiter.start()
        assert blocked.wait(30)
        before = queries
        gate.release()
        waiter.join(30)
    assert not waiter.is_alive()
    assert fence.done()
    # Once signalled: a query or two (the one that found it done), no more.
    assert queries - before <= 2


def _no_sleep(seconds: float) -> None:
    raise AssertionError(f"wait_sync slept {seconds} s instead of waiting on the signal")


@fails_a_gate
def test_wait_sync_sees_a_failure(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        failing = threading.Thread(target=gate.fail)  # from another thread
        failing.start()
        try:
            with pytest.raises(DeviceError):
                fence.wait_sync(timeout=30)
        finally:
            failing.join(30)


# -- enqueue_wait ---------------------------------------------------------------


async def test_enqueue_wait_holds_another_queue(new_stream: Callable[[], Any]) -> None:
    first, second = new_stream(), new_stream()
    with hold(first) as gate:
        fence = asyncfence.record(first)
        fence.enqueue_wait(second)
        later = asyncfence.record(second)
        async with anyio.create_task_group() as tg:
            tg.start_soon(later.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 1)
            await let_loop_run()
            assert not later.done()
            gate.release()
    assert fence.done()
    assert later.done()


async def test_enqueue_wait_on_a_done_fence_adds_nothing(new_stream: Callable[[], Any]) -> None:
    first, second = new_stream(), new_stream()
    fence = asyncfence.record(first)
    await fence
    fence.enqueue_wait(second)
    await asyncfence.record(second)


@pytest.mark.parametrize("state", ["pending", "done"])
def test_enqueue_wait_refuses_what_is_not_its_backends_stream(queue: Any, state: str) -> None:
    # Whatever the fence's state: whether bad input raises must not depend on
    # how fast the device was.
    backend = backend_for(queue)
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        if state == "done":
            gate.release()
            fence.wait_sync(timeout=30)
        with pytest.raises(TypeError, match=f"{backend.title} fences can only be waited on by"):
            fence.enqueue_wait(object())


def test_a_driver_call_never_holds_up_settling_other_fences(
    new_stream: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, target = new_stream(), new_stream(), new_stream()
    backend = backend_for(first)
    inside, leave = threading.Event(), threading.Event()
    real_stream_wait = backend.stream_wait

    def slow_stream_wait(marker: object, origin: object, stream: object) -> None:
        inside.set()
        leave.wait(30)  # a driver call that takes its time
        real_stream_wait(marker, origin, stream)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "stream_wait", slow_stream_wait)
    with hold(first) as gate:
        waited_on = asyncfence.record(first)
        other = asyncfence.record(second)
        thread = threading.Thread(target=waited_on.enqueue_wait, args=(target,))
        thread.start()
        try:
            assert inside.wait(30)
            other.wait_sync(timeout=30)  # settles while the driver call is under way
            assert other.done()
        finally:
            leave.set()
            thread.join(30)
            gate.release()
    waited_on.wait_sync(timeout=30)


# -- lifetime -------------------------------------------------------------------


def test_repr_names_backend_and_state(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        assert backend_for(queue).name in repr(fence)
        assert "pending" in repr(fence)
        gate.release()
    fence.wait_sync(timeout=30)
    assert "done" in repr(fence)


# -- races between threads, pinned with OpenCL queues --------------------------


def test_a_fence_settled_by_another_thread_mid_poll_reads_as_done(
    opencl_queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(opencl_queue)
    paused, go = threading.Event(), threading.Event()
    answer: list[object] = []

    def poll_in_thread() -> None:
        sys.settrace(pause_at(_core.FenceCore.poll, "marker = self._marker", paused, go))
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
    opencl_queue.finish()
    assert fence.done()  # settled here, meanwhile
    go.set()
    thread.join(HANG_GUARD_S)
    assert answer == [True]


def test_concurrent_records_are_numbered_in_queue_order(
    opencl_queue: cl.CommandQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_for(opencl_queue)
    assert isinstance(backend, _opencl.OpenCLBackend)
    inside, go = threading.Event(), threading.Event()
    known = backend._known(opencl_queue)
    enqueue_marker = known.enqueue_marker

    def slow_enqueue_marker(stream: cl.CommandQueue, wait_for: None) -> cl.Event:
        marker = enqueue_marker(stream, wait_for)
        if threading.current_thread().name == "first":
            inside.set()  # the marker is enqueued; the fence not yet numbered
            go.wait(HANG_GUARD_S)
        return marker

    monkeypatch.setattr(known, "enqueue_marker", slow_enqueue_marker)
    fences: dict[str, Fence] = {}

    def record(name: str) -> None:
        fences[name] = asyncfence.record(opencl_queue)

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
    assert fences["first"]._core.seq < fences["second"]._core.seq


def test_a_child_forked_while_a_lock_is_held_gets_fresh_locks() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("needs fork()")
    # In a fresh process: forking this multi-threaded one is what the test is not about.
    code = """
import os
from asyncfence import _config, _core
locks = lambda: (_core._settle_lock, _core._record_locks[0], _config._configure_lock)
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
