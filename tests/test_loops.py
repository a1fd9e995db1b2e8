"""The loop drivers (``asyncfence._loops``): closed loops, finished runs, one wait for all loops."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import TYPE_CHECKING

import pytest

import asyncfence
from asyncfence._loops import _asyncio, _trio
from asyncfence._poller import Poller
from asyncfence.testing import StreamGate, hold

from .conftest import HANG_GUARD_S, until

if sys.version_info < (3, 11):
    pass

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import OpenCLDevice


def test_a_wait_abandoned_on_a_closed_loop_unparks_when_closed(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    fence = asyncfence.record(queue)
    loop = asyncio.new_event_loop()
    task = loop.create_task(fence.wait(strategy="park"))
    loop.run_until_complete(until(lambda: asyncfence.current_statistics().parked == 1))
    loop.close()  # the task is still waiting
    task.get_coro().close()  # what its destruction does: runs its finally
    driver = _asyncio.driver_of(loop, create=False)
    assert driver is not None
    assert isinstance(driver.poller, Poller)
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)


def test_a_closed_loops_wait_collected_on_another_thread_unparks_without_raising(
    queue: cl.CommandQueue, gate: StreamGate
) -> None:
    # A wait abandoned on a closed loop is finalized when the garbage collector
    # finds it, on whatever thread allocates then: its unpark runs there, and
    # must neither raise nor schedule anything on the closed loop.
    fence = asyncfence.record(queue)
    loop = asyncio.new_event_loop()
    task = loop.create_task(fence.wait(strategy="park"))
    loop.run_until_complete(until(lambda: asyncfence.current_statistics().parked == 1))
    loop.close()
    finished = threading.Event()
    raised: list[BaseException] = []

    def finalize() -> None:
        try:
            task.get_coro().close()
        except BaseException as error:
            raised.append(error)
        finished.set()

    thread = threading.Thread(target=finalize, daemon=True)
    thread.start()
    assert finished.wait(HANG_GUARD_S), "unparking a closed loop's wait hung"
    thread.join(HANG_GUARD_S)
    assert raised == []
    driver = _asyncio.driver_of(loop, create=False)
    assert driver is not None
    assert isinstance(driver.poller, Poller)
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)


def test_the_trio_poller_survives_a_run_that_is_shutting_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio

    async def main() -> None:
        driver = _trio.driver_of_run(create=True)
        assert driver is not None
        chain = driver.chain(lambda: None)

        def closed_nursery(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Nursery is closed to new arrivals")

        monkeypatch.setattr(trio.lowlevel, "spawn_system_task", closed_nursery)
        chain.ensure(0.0)  # must not raise into trio
        assert not chain.running

    trio.run(main)


@pytest.mark.parametrize("doomed_loop", ["asyncio", "uvloop"])
def test_a_closed_loop_leaves_the_waits_of_other_loops_working(
    device: OpenCLDevice, doomed_loop: str
) -> None:
    first, second = device.new_stream(), device.new_stream()
    with hold(first) as first_gate, hold(second) as second_gate:
        orphan = asyncfence.record(first)
        survivor = asyncfence.record(second)
        if doomed_loop == "uvloop":
            uvloop = pytest.importorskip("uvloop")
            doomed = uvloop.new_event_loop()
        else:
            doomed = asyncio.new_event_loop()
        orphan_task = doomed.create_task(orphan.wait(strategy="park"))
        doomed.run_until_complete(asyncio.sleep(0.01))  # the orphan is parked
        assert not orphan_task.done()
        doomed.close()  # with its task still waiting
        orphan_task._log_destroy_pending = False  # its loop is closed: by design

        async def main() -> None:
            waiter = asyncio.create_task(survivor.wait(strategy="park"))
            await asyncio.sleep(0.01)
            first_gate.release()  # its signal goes to a closed loop's mailbox: harmless
            await asyncio.sleep(0.05)
            second_gate.release()
            await asyncio.wait_for(waiter, 10)
            stats = asyncfence.current_statistics()
            assert (stats.parked, stats.waiters) == (0, 0)

        asyncio.run(main())
    assert survivor.done()
