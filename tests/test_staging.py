"""The staging pool: buffers handed out again only once the device is done with them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import asyncfence
from asyncfence import StagingPool
from asyncfence.testing import StreamGate, hold

from .conftest import let_loop_run, until

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

if TYPE_CHECKING:
    import pyopencl as cl


pytestmark = pytest.mark.usefixtures("strategy")


# -- closing, and failing to fill ----------------------------------------------


@pytest.mark.anyio
async def test_a_closed_staging_pool_refuses_acquire_and_disposes_late_returns(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    disposed: list[bytearray] = []
    pool = asyncfence.StagingPool(lambda: bytearray(8), 2, dispose=disposed.append)
    held = await pool.acquire()  # taken before the close, returned after it
    await pool.aclose()
    assert len(disposed) == 1
    with pytest.raises(asyncfence.ClosedResourceError, match="closed"):
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
        except asyncfence.ClosedResourceError as error:
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


# -- handing buffers out again -------------------------------------------------


async def test_staging_pool_hands_a_buffer_out_again_only_after_its_copy(
    queue: cl.CommandQueue,
) -> None:

    pool = StagingPool(lambda: np.zeros(16, dtype=np.uint8), 2)
    first = await pool.acquire()
    second = await pool.acquire()
    assert pool.available == 0
    with hold(queue) as gate:
        pool.release_after(asyncfence.record(queue), first)
        reacquired: list[Any] = []

        async def consumer() -> None:
            reacquired.append(await pool.acquire())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await let_loop_run()
            assert not reacquired  # the copy reading it has not run yet
            gate.release()
    assert reacquired[0] is first
    pool.release_after([], reacquired[0])
    pool.release_after([], second)
    await pool.aclose()
    assert pool.available == 0


async def test_staging_pool_retires_buffers_of_failed_work(queue: cl.CommandQueue) -> None:
    pool = StagingPool(lambda: bytearray(8), 1)
    buffer = await pool.acquire()
    with hold(queue) as gate:
        pool.release_after(asyncfence.record(queue), buffer)
        gate.fail()
    with pytest.raises(RuntimeError, match="lost to a device fault"):
        await pool.acquire()
    await pool.aclose()


async def test_staging_pool_statistics_follow_its_buffers(queue: cl.CommandQueue) -> None:
    async with StagingPool(lambda: bytearray(8), 3) as pool:
        assert pool.statistics() == asyncfence.StagingPoolStatistics(3, 3, 0, 0, 0, False)
        first, second = await pool.acquire(), await pool.acquire()
        with hold(queue) as gate:
            pool.release_after(asyncfence.record(queue), first)
            await until(lambda: pool.statistics().returning == 1)
            assert pool.statistics() == asyncfence.StagingPoolStatistics(3, 1, 1, 1, 0, False)
            gate.fail()
        await until(lambda: pool.statistics().lost == 1)
        assert pool.statistics() == asyncfence.StagingPoolStatistics(3, 1, 0, 1, 1, False)
        pool.release_after([], second)
    assert pool.statistics().closed  # async with closed it
    assert "1 lost" in repr(pool)


async def test_a_staging_pool_made_outside_a_loop_gets_buffers_back_from_threads(
    queue: cl.CommandQueue,
) -> None:
    pool = await anyio.to_thread.run_sync(lambda: StagingPool(lambda: bytearray(8), 1))
    buffer = await pool.acquire()
    fence = asyncfence.record(queue)
    await anyio.to_thread.run_sync(pool.release_after, fence, buffer)  # from a worker thread
    with anyio.fail_after(10):
        assert await pool.acquire() is buffer
    pool.release_after([], buffer)
    await pool.aclose()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"make": 5, "count": 1}, "make must be callable"),
        ({"make": bytearray, "count": 1, "dispose": 5}, "dispose must be None or callable"),
    ],
)
def test_a_staging_pool_refuses_what_is_not_callable(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        StagingPool(**kwargs)
