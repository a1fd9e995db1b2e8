"""The ``poll`` strategy: one poller per loop, one query per in-order queue per tick."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import anyio
import pytest

import asyncfence
from asyncfence.testing import hold

from .conftest import let_loop_run, poller_ticks, until

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice


@pytest.fixture(autouse=True)
def poll_by_default() -> Iterator[None]:
    previous = asyncfence.configure().strategy
    asyncfence.configure(strategy="poll")
    yield
    asyncfence.configure(strategy=previous)


async def test_poller_checks_one_fence_per_in_order_queue_per_tick(
    device: OpenCLDevice,
) -> None:
    queues = [device.new_stream() for _ in range(3)]
    gates = [hold(q) for q in queues]
    handles = [gate.__enter__() for gate in gates]
    try:
        fences = [asyncfence.record(q) for q in queues for _ in range(50)]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == len(fences))
            before = asyncfence.current_statistics()
            await poller_ticks(5)
            after = asyncfence.current_statistics()
            assert after.pending_fences == 150
            assert after.queues == 3
            assert after.queries - before.queries == 3 * (after.ticks - before.ticks)
            for handle in handles:
                handle.release()
    finally:
        for gate in gates:
            gate.__exit__(None, None, None)
    assert all(fence.done() for fence in fences)


async def test_poller_checks_every_fence_on_an_out_of_order_queue(
    unordered_queue: cl.CommandQueue,
) -> None:
    with hold(unordered_queue) as gate:
        fences = [asyncfence.record(unordered_queue) for _ in range(5)]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 5)
            before = asyncfence.current_statistics()
            await poller_ticks(5)
            after = asyncfence.current_statistics()
            assert after.queries - before.queries == 5 * (after.ticks - before.ticks)
            gate.release()
    assert all(fence.done() for fence in fences)


async def test_fences_awaited_out_of_record_order(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fences = [asyncfence.record(queue) for _ in range(10)]
        async with anyio.create_task_group() as tg:
            for fence in reversed(fences):
                tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().waiters == 10)
            gate.release()
    assert all(fence.done() for fence in fences)


async def test_idle_poller_does_no_work(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait)
            await until(lambda: asyncfence.current_statistics().running)
            gate.release()
    await until(lambda: not asyncfence.current_statistics().running)
    idle = asyncfence.current_statistics()
    for _ in range(20):
        await anyio.sleep(0.001)
    assert asyncfence.current_statistics() == idle
    assert (idle.pending_fences, idle.waiters, idle.queues) == (0, 0, 0)


async def test_statistics_before_any_wait_are_zero() -> None:
    stats = asyncfence.current_statistics()
    assert stats == asyncfence.PollerStatistics()


async def test_mixed_strategies_on_one_fence(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        poll_scope = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_wait_in, poll_scope, fence, "poll")
            tg.start_soon(partial(fence.wait, strategy="park"))
            tg.start_soon(partial(fence.wait, strategy="auto"))
            await until(lambda: asyncfence.current_statistics().waiters == 3)
            assert asyncfence.current_statistics().parked == 1
            await let_loop_run()
            assert asyncfence.current_statistics().queues == 1  # polled for "poll"
            poll_scope.cancel()  # the poll waiter leaves: nothing needs polling any more
            await until(lambda: not asyncfence.current_statistics().running)
            assert asyncfence.current_statistics().queues == 0
            gate.release()
    assert fence.done()


async def _wait_in(scope: anyio.CancelScope, fence: asyncfence.Fence, strategy: str) -> None:
    with scope:
        await fence.wait(strategy=strategy)  # type: ignore[arg-type]
