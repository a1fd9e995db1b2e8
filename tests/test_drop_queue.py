"""The drop queue: never early, prompt, isolated failures, faults, close, no leaks."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import weakref
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError, DropQueue, FenceError
from asyncfence.testing import StreamGate, hold

from .conftest import HANG_GUARD_S, let_loop_run, until

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import CudaDevice, OpenCLDevice

    from .cuda_emulator import Emulator


pytestmark = pytest.mark.usefixtures("strategy")


class Buffer:
    """A stand-in for a staging buffer: it records when it was freed."""

    def __init__(self, name: str, nbytes: int = 0) -> None:
        self.name = name
        self.nbytes = nbytes
        self.freed = 0

    def free(self) -> None:
        self.freed += 1

    def __repr__(self) -> str:
        return f"Buffer({self.name!r})"


# -- never early, prompt ---------------------------------------------------------------


async def test_released_only_once_its_fence_completes(queue: cl.CommandQueue) -> None:
    async with DropQueue() as dq:
        with hold(queue) as gate:
            buffer = Buffer("staging", 64)
            dq.defer(asyncfence.record(queue), buffer, free=Buffer.free)
            await let_loop_run()
            assert buffer.freed == 0  # never early
            stats = dq.statistics()
            assert (stats.pending_items, stats.pending_bytes) == (1, 64)
            assert stats.oldest_pending_age > 0
            gate.release()
            await until(lambda: buffer.freed == 1)  # prompt: nothing else needed
        stats = dq.statistics()
        assert (stats.pending_items, stats.pending_bytes, stats.released) == (0, 0, 1)
        assert stats.oldest_pending_age == 0
    assert buffer.freed == 1


async def test_every_fence_given_must_complete(device: OpenCLDevice) -> None:
    first, second = device.new_stream(), device.new_stream()
    async with DropQueue() as dq:
        with hold(first) as first_gate, hold(second) as second_gate:
            buffer = Buffer("shared")
            dq.defer(
                [asyncfence.record(first), asyncfence.record(second)], buffer, free=Buffer.free
            )
            first_gate.release()
            await asyncfence.record(first)
            await let_loop_run()
            assert buffer.freed == 0
            second_gate.release()
            await until(lambda: buffer.freed == 1)


async def test_a_pending_stream_never_holds_back_another(device: OpenCLDevice) -> None:
    stuck, moving = device.new_stream(), device.new_stream()
    async with DropQueue() as dq:
        with hold(stuck):
            behind = Buffer("behind the stuck stream")
            dq.defer(asyncfence.record(stuck), behind, free=Buffer.free)
            ahead = [Buffer(f"on the moving stream {i}") for i in range(5)]
            for buffer in ahead:
                device.launch_chunks(moving, 1)
                dq.defer(asyncfence.record(moving), buffer, free=Buffer.free)
            await until(lambda: all(buffer.freed for buffer in ahead))
            assert behind.freed == 0
            assert dq.statistics().pending_items == 1


async def test_no_fences_releases_at_once() -> None:
    async with DropQueue() as dq:
        buffer = Buffer("no work reads it")
        dq.defer([], buffer, free=Buffer.free)
        await dq.drain()
    assert buffer.freed == 1


async def test_done_fences_and_dropped_references(queue: cl.CommandQueue) -> None:
    fence = asyncfence.record(queue)
    await fence
    async with DropQueue() as dq:
        buffer = Buffer("done already")
        reference = weakref.ref(buffer)
        dq.defer(fence, buffer)  # no free: the queue just lets go
        del buffer
        await dq.drain()
        gc.collect()
        assert reference() is None


# -- failures ---------------------------------------------------------------------------


async def test_a_free_that_raises_is_isolated(
    queue: cl.CommandQueue, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(buffer: Buffer) -> None:
        raise OSError(f"cannot free {buffer.name}")

    dq = DropQueue()
    good = Buffer("good")
    with hold(queue) as gate:
        dq.defer(asyncfence.record(queue), Buffer("bad"), free=broken)
        dq.defer(asyncfence.record(queue), good, free=Buffer.free)
        gate.release()
    with pytest.raises(ExceptionGroup) as caught:
        await dq.drain()
    assert [str(error) for error in caught.value.exceptions] == ["cannot free bad"]
    assert good.freed == 1
    stats = dq.statistics()
    assert (stats.released, stats.failed_frees, stats.pending_items) == (2, 1, 0)
    assert any("free(Buffer('bad')) failed" in record.getMessage() for record in caplog.records)
    await dq.drain()  # the errors were reported once
    await dq.aclose()


class NotAnException(BaseException):
    """A BaseException a buggy free() might raise."""


@pytest.mark.parametrize("raised", [NotAnException, KeyboardInterrupt, SystemExit])
async def test_a_free_raising_a_base_exception_is_isolated_too(
    queue: cl.CommandQueue, raised: type[BaseException]
) -> None:
    def broken(buffer: Buffer) -> None:
        raise raised(f"free of {buffer.name}")

    dq = DropQueue()
    good = Buffer("good")
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        dq.defer(fence, Buffer("bad"), free=broken)
        dq.defer(fence, good, free=Buffer.free)  # another waiter on the same fence
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait)  # and a task
            gate.release()
    # The queue frees on a loop turn of its own, which on trio may come after
    # the waiting task has resumed.
    await until(lambda: good.freed)
    assert good.freed == 1  # the others went on
    with anyio.fail_after(10):  # never a hang
        if raised is NotAnException:
            with pytest.raises(BaseExceptionGroup) as group:
                await dq.drain()
            assert [type(error) for error in group.value.exceptions] == [NotAnException]
        else:  # surfaced as itself, never swallowed
            with pytest.raises(raised):
                await dq.drain()
        await dq.drain()  # reported once
        stats = dq.statistics()
        assert (stats.released, stats.failed_frees, stats.pending_items) == (2, 1, 0)
        await dq.aclose()


async def test_an_on_fault_raising_a_base_exception_keeps_the_object(
    queue: cl.CommandQueue,
) -> None:
    def on_fault(buffer: Buffer, error: BaseException) -> None:
        raise NotAnException("on_fault broke")

    dq = DropQueue(on_fault=on_fault)
    kept, other = Buffer("kept"), Buffer("other")
    with hold(queue) as gate:
        dq.defer(asyncfence.record(queue), kept, free=Buffer.free)
        gate.fail()
    with anyio.fail_after(10):
        await dq.drain()
    assert [obj for obj, _ in dq.faulted_objects] == [kept]
    assert kept.freed == 0
    dq.defer([], other, free=Buffer.free)
    await dq.aclose()
    assert other.freed == 1


async def test_a_close_that_raises_still_closes(queue: cl.CommandQueue) -> None:
    def broken(buffer: Buffer) -> None:
        raise OSError("cannot free")

    dq = DropQueue()
    dq.defer(asyncfence.record(queue), Buffer("bad"), free=broken)
    with pytest.raises(ExceptionGroup):
        await dq.aclose()
    with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
        dq.defer([], Buffer("late"))
    other = DropQueue()
    with pytest.raises(ExceptionGroup):
        async with other:
            other.defer(asyncfence.record(queue), Buffer("bad"), free=broken)
    with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
        other.defer([], Buffer("late"))


async def test_a_closed_queue_refuses_new_work_and_closes_twice_fine(
    queue: cl.CommandQueue,
) -> None:
    # As trio's closed channels: adding work, or waiting for room to add it,
    # is an error from the start of aclose(); draining and closing again are not.
    dq = DropQueue(max_items=1)
    buffer = Buffer("pending")
    with hold(queue) as gate:
        dq.defer(asyncfence.record(queue), buffer, free=Buffer.free)  # the budget is full
        refused: list[BaseException] = []

        async def wait_for_room() -> None:
            try:
                await dq.wait_for_room()
            except anyio.ClosedResourceError as error:  # asyncfence's is anyio's
                refused.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_room)
            await let_loop_run()
            assert not refused  # waiting: no room yet
            tg.start_soon(dq.aclose)  # drains, so it waits for the held queue
            await until(lambda: bool(refused))  # the wait for room failed at once
            assert "closed" in str(refused[0])
            assert isinstance(refused[0], asyncfence.ClosedResourceError)
            with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
                dq.defer([], Buffer("late"))
            assert buffer.freed == 0
            gate.release()
    assert buffer.freed == 1
    with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
        await dq.wait_for_room()
    with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
        async with dq:
            pass
    await dq.drain()  # nothing pending: returns
    await dq.aclose()  # closing twice is fine
    assert dq.statistics().pending_items == 0


async def test_a_fault_goes_to_on_fault_not_free(queue: cl.CommandQueue) -> None:
    faults: list[tuple[Buffer, BaseException]] = []
    dq = DropQueue(on_fault=lambda obj, error: faults.append((obj, error)))
    victim = Buffer("read by failed work")
    with hold(queue) as gate:
        dq.defer(asyncfence.record(queue), victim, free=Buffer.free)
        gate.fail()
    await dq.drain()
    assert victim.freed == 0
    assert len(faults) == 1
    assert faults[0][0] is victim
    assert isinstance(faults[0][1], DeviceError)
    assert dq.statistics().faulted == 1
    await dq.aclose()


async def test_by_default_faulted_objects_are_logged_and_kept(
    queue: cl.CommandQueue, caplog: pytest.LogCaptureFixture
) -> None:
    async with DropQueue() as dq:
        victim = Buffer("kept")
        with hold(queue) as gate:
            dq.defer(asyncfence.record(queue), victim, free=Buffer.free)
            gate.fail()
        await dq.drain()
        assert victim.freed == 0
        [(kept, error)] = dq.faulted_objects
        assert kept is victim
        assert isinstance(error, DeviceError)
    assert any(
        record.levelno == logging.WARNING and "keeping Buffer('kept')" in record.getMessage()
        for record in caplog.records
    )


async def test_a_failing_on_fault_keeps_the_object(queue: cl.CommandQueue) -> None:
    def on_fault(obj: object, error: BaseException) -> None:
        raise RuntimeError("handler bug")

    async with DropQueue(on_fault=on_fault) as dq:
        with hold(queue) as gate:
            dq.defer(asyncfence.record(queue), Buffer("x"))
            gate.fail()
        await dq.drain()
        assert len(dq.faulted_objects) == 1


# -- close ------------------------------------------------------------------------------


async def test_close_drains_and_then_refuses(queue: cl.CommandQueue) -> None:
    dq = DropQueue()
    buffer = Buffer("drained on close")
    with hold(queue) as gate:
        dq.defer(asyncfence.record(queue), buffer, free=Buffer.free)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dq.aclose)
            await let_loop_run()
            assert buffer.freed == 0
            gate.release()
    assert buffer.freed == 1
    with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
        dq.defer([], Buffer("late"))


async def test_close_with_cancel_pending_hands_them_to_on_fault(queue: cl.CommandQueue) -> None:
    faults: list[tuple[object, BaseException]] = []
    dq = DropQueue(on_fault=lambda obj, error: faults.append((obj, error)))
    pending = [Buffer(f"pending {i}") for i in range(3)]
    with hold(queue):
        for buffer in pending:
            dq.defer(asyncfence.record(queue), buffer, free=Buffer.free)
        await until(lambda: asyncfence.current_statistics().pending_fences == 3)
        await dq.aclose(cancel_pending=True)
        assert [obj for obj, _ in faults] == pending  # never dropped silently
        assert all(isinstance(error, FenceError) for _, error in faults)
        assert asyncfence.current_statistics().waiters == 0  # no longer watched
    assert all(buffer.freed == 0 for buffer in pending)
    assert dq.statistics().pending_items == 0


async def test_drain_timeout_leaves_the_queue_as_it_was(queue: cl.CommandQueue) -> None:
    async with DropQueue() as dq:
        with hold(queue) as gate:
            buffer = Buffer("slow")
            dq.defer(asyncfence.record(queue), buffer, free=Buffer.free)
            with pytest.raises(TimeoutError):
                await dq.drain(timeout=0.01)
            assert dq.statistics().pending_items == 1
            gate.release()
    assert buffer.freed == 1


async def test_drain_waits_only_for_what_came_before(device: OpenCLDevice) -> None:
    early, late = device.new_stream(), device.new_stream()
    async with DropQueue() as dq:
        with hold(late):
            with hold(early) as early_gate:
                dq.defer(asyncfence.record(early), Buffer("early"))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(dq.drain)
                    await let_loop_run()  # the drain has begun
                    dq.defer(asyncfence.record(late), Buffer("late, after drain began"))
                    early_gate.release()
            assert dq.statistics().pending_items == 1
            await dq.aclose(cancel_pending=True)


# -- no leaks -----------------------------------------------------------------------------


async def test_no_references_after_drain(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(4)]
    dq = DropQueue()
    references = []
    with ExitStack() as stack:
        gates = [stack.enter_context(hold(q)) for q in queues]
        for index in range(40):
            buffer = Buffer(f"b{index}")
            references.append(weakref.ref(buffer))
            dq.defer(asyncfence.record(queues[index % 4]), buffer, free=Buffer.free)
            del buffer
        for gate in gates:
            gate.release()
        await dq.drain()
    gc.collect()
    assert [reference() for reference in references] == [None] * 40
    assert dq.statistics().pending_items == 0
    await dq.aclose()


# -- backpressure ---------------------------------------------------------------------------


async def test_wait_for_room_keeps_producers_within_the_budget(queue: cl.CommandQueue) -> None:
    async with DropQueue(max_items=2, max_bytes=100) as dq:
        await dq.wait_for_room(60)  # empty: room
        with hold(queue) as gate:
            dq.defer(asyncfence.record(queue), Buffer("a", 60))
            dq.defer(asyncfence.record(queue), Buffer("b", 30))
            got_room = anyio.Event()

            async def producer() -> None:
                await dq.wait_for_room(10)
                got_room.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(producer)
                await let_loop_run()
                assert not got_room.is_set()  # two items pending: max_items reached
                gate.release()
            assert got_room.is_set()


async def test_an_oversized_object_fits_once_the_queue_is_empty(queue: cl.CommandQueue) -> None:
    async with DropQueue(max_bytes=100) as dq:
        with hold(queue) as gate:
            dq.defer(asyncfence.record(queue), Buffer("small", 10))
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.02):
                    await dq.wait_for_room(500)
            gate.release()
        await dq.wait_for_room(500)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_bytes": 0}, ValueError),
        ({"max_items": -1}, ValueError),
        ({"max_items": 1.5}, TypeError),
        ({"on_fault": 3}, TypeError),
    ],
)
def test_bad_budgets_are_refused(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        DropQueue(**kwargs)


async def test_bad_defers_are_refused(queue: cl.CommandQueue) -> None:
    fence = asyncfence.record(queue)
    async with DropQueue() as dq:
        with pytest.raises(TypeError, match="Fence"):
            dq.defer("not a fence", Buffer("x"))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="Fence"):
            dq.defer([fence, 3], Buffer("x"))  # type: ignore[list-item]
        with pytest.raises(TypeError, match="free"):
            dq.defer(fence, Buffer("x"), free=3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="nbytes"):
            dq.defer(fence, Buffer("x"), nbytes=-1)
        with pytest.raises(ValueError, match="nbytes"):
            await dq.wait_for_room(-1)
        assert dq.statistics().pending_items == 0


# -- threads ---------------------------------------------------------------------------------


async def test_defer_from_eight_threads(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(4)]
    buffers = [[Buffer(f"{t}-{i}") for i in range(200)] for t in range(8)]
    async with DropQueue() as dq:

        def producer(thread: int) -> None:
            for index, buffer in enumerate(buffers[thread]):
                fence = asyncfence.record(queues[(thread + index) % 4])
                dq.defer(fence, buffer, free=Buffer.free)

        threads = [threading.Thread(target=producer, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()

        def join() -> None:
            for thread in threads:
                thread.join()

        await anyio.to_thread.run_sync(join)
        await dq.drain()
        assert dq.statistics().released == 1600
    assert all(buffer.freed == 1 for row in buffers for buffer in row)


async def test_a_free_may_defer_again(queue: cl.CommandQueue) -> None:
    async with DropQueue() as dq:
        second = Buffer("second")

        def free_first(buffer: Buffer) -> None:
            buffer.free()
            dq.defer(asyncfence.record(queue), second, free=Buffer.free)

        first = Buffer("first")
        dq.defer(asyncfence.record(queue), first, free=free_first)
        await until(lambda: second.freed == 1)
    assert first.freed == 1


def test_deferred_before_any_loop_then_drained(queue: cl.CommandQueue) -> None:

    dq = DropQueue()  # made outside any loop
    buffer = Buffer("early")
    dq.defer(asyncfence.record(queue), buffer, free=Buffer.free)

    async def main() -> None:
        async with dq:
            pass

    asyncio.run(main())
    assert buffer.freed == 1


# -- staging pool ------------------------------------------------------------------------------


# -- CUDA --------------------------------------------------------------------------------


async def test_cuda_buffers_freed_after_their_fence(
    cuda_stream: Any, cuda_device: CudaDevice, emulator: Emulator
) -> None:
    from asyncfence import DeviceBuffer, PinnedBuffer

    async with DropQueue() as dq:
        with hold(cuda_stream) as gate:
            allocations_before = emulator.live_host_allocs()  # the gate's flag page counts
            pinned = PinnedBuffer(4096)
            device_buffer = DeviceBuffer(4096)
            pinned.view()[:4] = b"data"
            fence = asyncfence.record(cuda_stream)
            dq.defer(fence, pinned, free=PinnedBuffer.free)
            dq.defer(fence, device_buffer, free=DeviceBuffer.free)
            await let_loop_run()
            assert (pinned.freed, device_buffer.freed) == (False, False)
            assert emulator.live_host_allocs() == allocations_before + 1
            gate.release()
        await dq.drain()
    assert (pinned.freed, device_buffer.freed) == (True, True)
    assert emulator.live_host_allocs() == allocations_before
    with pytest.raises(ValueError, match="freed"):
        _ = pinned.address


async def test_a_cuda_fault_sends_buffers_to_on_fault(
    cuda_stream: Any, cuda_device: CudaDevice, emulator: Emulator
) -> None:
    from asyncfence import PinnedBuffer

    faults: list[object] = []
    try:
        async with DropQueue(on_fault=lambda obj, error: faults.append(obj)) as dq:
            with hold(cuda_stream):
                pinned = PinnedBuffer(64)
                dq.defer(asyncfence.record(cuda_stream), pinned, free=PinnedBuffer.free)
                await until(lambda: asyncfence.current_statistics().pending_fences == 1)
                emulator.inject_fault(int(cuda_device.context), 700)
                await dq.drain()
        assert faults == [pinned]
        assert not pinned.freed
    finally:
        emulator.clear_fault(int(cuda_device.context))


# -- drain with no time --------------------------------------------------------


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


async def test_a_queue_made_off_the_loop_and_bound_frees_what_threads_deferred(
    queue: cl.CommandQueue,
) -> None:
    # Made and deferred to from another thread before any use on the loop:
    # bind() makes this loop its own, and the objects are released when done.
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        buffer = Buffer("from a thread")

        def make_and_defer() -> DropQueue:
            made = DropQueue()
            made.defer(fence, buffer, free=Buffer.free)
            return made

        dq = await anyio.to_thread.run_sync(make_and_defer)
        dq.bind()
        dq.bind()  # again: the same loop, a no-op
        gate.release()
    with anyio.fail_after(HANG_GUARD_S):
        await until(lambda: buffer.freed == 1)
    assert dq.statistics().pending_items == 0
    await dq.aclose()


def test_a_queue_bound_to_one_loop_refuses_another(queue: cl.CommandQueue) -> None:
    dq = DropQueue()
    anyio.run(_bind, dq)
    with pytest.raises(RuntimeError, match="another event loop"):
        anyio.run(_bind, dq)


async def _bind(dq: DropQueue) -> None:
    dq.bind()
