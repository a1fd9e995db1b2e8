"""The fence core on OpenCL (PoCL), under asyncio, uvloop and trio."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError, Fence
from asyncfence.testing import hold

from .conftest import let_loop_run, until

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice

# Every test here runs under each strategy: the semantics do not depend on it.
pytestmark = pytest.mark.usefixtures("strategy")


# -- pending versus done -------------------------------------------------------


async def test_fence_on_idle_queue_completes(queue: cl.CommandQueue) -> None:
    fence = asyncfence.record(queue)
    await fence
    assert fence.done()


async def test_waiter_stays_pending_until_the_queue_is_released(queue: cl.CommandQueue) -> None:
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


async def test_fence_waits_for_work_queued_before_it(
    device: OpenCLDevice, queue: cl.CommandQueue
) -> None:
    import numpy as np
    import pyopencl as cl

    size = 8 << 20
    buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE, size=size)
    result = np.zeros(size, dtype=np.uint8)
    # No gate here: PoCL 3.0 blocks a non-blocking read enqueued behind a user event.
    cl.enqueue_fill_buffer(queue, buffer, np.full(1, 7, dtype=np.uint8), 0, size)
    cl.enqueue_copy(queue, result, buffer, is_blocking=False)
    fence = asyncfence.record(queue)
    await fence
    assert (result == 7).all()


async def test_hundred_waiters_on_one_fence_all_resume(queue: cl.CommandQueue) -> None:
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


async def test_waiting_again_on_a_done_fence_returns(queue: cl.CommandQueue) -> None:
    fence = asyncfence.record(queue)
    await fence
    await fence
    await fence.wait(timeout=0)
    assert fence.done()


# -- checkpoints and cancellation ------------------------------------------------


async def test_awaiting_a_done_fence_is_a_checkpoint(queue: cl.CommandQueue) -> None:
    fence = asyncfence.record(queue)
    await fence
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await fence
        reached = True
    assert scope.cancelled_caught
    assert not reached


async def test_awaiting_a_done_fence_lets_other_tasks_run(queue: cl.CommandQueue) -> None:
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


async def test_cancelling_one_waiter_leaves_the_others_waiting(queue: cl.CommandQueue) -> None:
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


async def test_cancelling_every_waiter_stops_the_poller(queue: cl.CommandQueue) -> None:
    with hold(queue):
        fence = asyncfence.record(queue)
        with anyio.move_on_after(0.01):
            await fence
        stats = asyncfence.current_statistics()
        assert (stats.waiters, stats.pending_fences) == (0, 0)
        await until(lambda: not asyncfence.current_statistics().running)
    await fence


# -- timeouts --------------------------------------------------------------------


async def test_timeout_then_a_second_await(queue: cl.CommandQueue) -> None:
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


async def test_infinite_timeout_means_no_limit(queue: cl.CommandQueue) -> None:
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
async def test_bad_timeouts_are_refused(
    queue: cl.CommandQueue, bad: object, error: type[Exception]
) -> None:
    fence = asyncfence.record(queue)
    with pytest.raises(error, match="timeout"):
        await fence.wait(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="timeout"):
        fence.wait_sync(timeout=bad)  # type: ignore[arg-type]


async def test_a_timeout_beyond_a_float_means_no_limit(queue: cl.CommandQueue) -> None:
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


async def test_a_failed_user_event_raises_device_error_in_every_waiter(
    queue: cl.CommandQueue,
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
        assert error.backend == "opencl"
        assert error.code < 0
        assert error.name.startswith("CL_")
    with pytest.raises(DeviceError):
        fence.done()
    with pytest.raises(DeviceError):
        fence.wait_sync()
    with pytest.raises(DeviceError):
        await fence
    with pytest.raises(DeviceError):
        fence.enqueue_wait(queue)


async def test_failure_reaches_fences_recorded_after_it(queue: cl.CommandQueue) -> None:
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
    with pytest.raises(TypeError, match=r"pyopencl\.CommandQueue"):
        asyncfence.record(stream)


def test_fences_have_no_public_constructor() -> None:
    with pytest.raises(TypeError, match=r"asyncfence\.record"):
        Fence()


def test_awaiting_without_an_event_loop_is_a_clear_error(queue: cl.CommandQueue) -> None:
    with hold(queue):
        fence = asyncfence.record(queue)
        coroutine = fence.wait()
        with pytest.raises(RuntimeError, match="event loop"):
            coroutine.send(None)


# -- threads --------------------------------------------------------------------


async def test_fence_recorded_on_a_worker_thread(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = await anyio.to_thread.run_sync(asyncfence.record, queue)
        assert not fence.done()
        gate.release()
        await fence
    assert fence.done()


async def test_fences_recorded_by_many_threads_while_the_loop_awaits(
    device: OpenCLDevice,
) -> None:
    queues = [device.new_stream() for _ in range(4)]
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
        held = [fence for fence in fences if fence._queue.key == queues[0].int_ptr]
        assert held
        assert not any(fence.done() for fence in held)
        gate.release()
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(fence.wait)
    assert all(fence.done() for fence in fences)


def test_wait_sync_blocks_until_released(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with pytest.raises(TimeoutError):
            fence.wait_sync(timeout=0.01)
        threading.Timer(0.0, gate.release).start()
        fence.wait_sync(timeout=30)
    assert fence.done()


def test_wait_sync_sees_a_failure(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        threading.Timer(0.0, gate.fail).start()
        with pytest.raises(DeviceError):
            fence.wait_sync(timeout=30)


# -- enqueue_wait ---------------------------------------------------------------


async def test_enqueue_wait_holds_another_queue(device: OpenCLDevice) -> None:
    first, second = device.new_stream(), device.new_stream()
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


async def test_enqueue_wait_on_a_done_fence_adds_nothing(device: OpenCLDevice) -> None:
    first, second = device.new_stream(), device.new_stream()
    fence = asyncfence.record(first)
    await fence
    fence.enqueue_wait(second)
    await asyncfence.record(second)


@pytest.mark.parametrize("state", ["pending", "done"])
def test_enqueue_wait_refuses_other_streams(device: OpenCLDevice, state: str) -> None:
    import pyopencl as cl

    # Whatever the fence's state: whether bad input raises must not depend on
    # how fast the device was.
    queue = device.new_stream()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        if state == "done":
            gate.release()
            fence.wait_sync(timeout=30)
        with pytest.raises(TypeError, match=r"OpenCL fences .* pyopencl\.CommandQueue"):
            fence.enqueue_wait(object())
        other_context = cl.CommandQueue(cl.Context(device.context.devices))
        with pytest.raises(ValueError, match="context"):
            fence.enqueue_wait(other_context)


def test_a_driver_call_never_holds_up_settling_other_fences(
    device: OpenCLDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from asyncfence._backend import backend_for

    first, second, target = device.new_stream(), device.new_stream(), device.new_stream()
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


def test_dropping_a_pending_fence_keeps_its_marker_until_it_settles(
    queue: cl.CommandQueue,
) -> None:
    import gc

    def held() -> int:
        (stats,) = [s for s in asyncfence.backend_statistics() if s.backend == "opencl"]
        return stats.held_markers

    held_before = held()
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        del fence
        gc.collect()
        assert held() == held_before + 1
        # Failing the gate with the marker released would abort on PoCL 3.0.
        gate.fail()
    survivor = asyncfence.record(queue)
    survivor.wait_sync(timeout=30)


def test_repr_names_backend_and_state(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        assert "opencl" in repr(fence)
        assert "pending" in repr(fence)
        gate.release()
    fence.wait_sync(timeout=30)
    assert "done" in repr(fence)
