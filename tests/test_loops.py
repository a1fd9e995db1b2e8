"""The loop drivers (``asyncfence._loops``): closed loops, finished runs, one wait for all loops."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

import asyncfence
from asyncfence import _loops
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
    driver = _loops._existing_asyncio_suspender(loop)
    assert driver is not None
    stats = driver.poller.statistics()
    assert (stats.parked, stats.waiters) == (0, 0)
    # On the fallback, the watcher drops a closed loop's fences itself, at its
    # next re-check: nothing calls into it from a finalizer.
    for _ in range(HANG_GUARD_S * 100):
        if asyncfence.watcher_statistics().parked == 0:
            break
        time.sleep(0.01)
    assert asyncfence.watcher_statistics().parked == 0


def test_a_closed_loops_wait_collected_on_the_watchers_thread_never_deadlocks(
    queue: cl.CommandQueue, gate: StreamGate, thread_wake_path: None
) -> None:
    # A wait abandoned on a closed loop is finalized when the garbage collector
    # finds it, on whatever thread allocates then: the watcher's own, with its
    # lock held, too. Its unpark must not take that lock.
    from asyncfence import _watcher

    fence = asyncfence.record(queue)
    loop = asyncio.new_event_loop()
    task = loop.create_task(fence.wait(strategy="park"))
    loop.run_until_complete(until(lambda: asyncfence.watcher_statistics().parked == 1))
    loop.close()
    watcher = _watcher.current_watcher()
    finished = threading.Event()

    def finalize_with_the_lock_held() -> None:
        with watcher._lock:  # as inside the watcher's sweep
            task.get_coro().close()
        finished.set()

    thread = threading.Thread(target=finalize_with_the_lock_held, daemon=True)
    thread.start()
    assert finished.wait(HANG_GUARD_S), "unparking a closed loop's wait deadlocked"
    thread.join(HANG_GUARD_S)


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


@pytest.mark.parametrize("doomed_loop", ["asyncio", "uvloop"])
def test_a_closed_loop_leaves_the_watcher_working_for_others(
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
            first_gate.release()  # its loop is closed: the watcher must shrug it off
            await asyncio.sleep(0.05)
            second_gate.release()
            await asyncio.wait_for(waiter, 10)

        asyncio.run(main())
    assert survivor.done()
    assert asyncfence.watcher_statistics().parked == 0
