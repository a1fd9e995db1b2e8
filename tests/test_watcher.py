"""The thread-based fallback for parked waits (``asyncfence._watcher``), shim or not.

Each test parks on the watcher thread (the ``thread_wake_path`` fixture),
whether or not the native shim is built.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import pytest

import asyncfence
from asyncfence import _watcher
from asyncfence._poller import ThreadMailbox as Mailbox
from asyncfence.testing import hold

from .conftest import HANG_GUARD_S, until

if sys.version_info < (3, 11):
    pass

if TYPE_CHECKING:
    import pyopencl as cl


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


def test_a_finished_trio_run_refuses_posts_without_raising(queue: Any) -> None:
    trio = pytest.importorskip("trio")
    mailboxes: list[Mailbox] = []
    with hold(queue):
        fence = asyncfence.record(queue)

        async def main() -> None:
            from asyncfence._loops import _trio_driver

            driver = _trio_driver(create=True)
            assert driver is not None
            mailboxes.append(Mailbox(driver.call_soon_threadsafe, driver.poller.deliver))

        trio.run(main)
    # A late signal for a run that is over: RunFinishedError must not escape.
    assert mailboxes[0].post([fence]) is False
    assert mailboxes[0].closed


@pytest.mark.usefixtures("thread_wake_path")
def test_the_watcher_exits_when_idle(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncfence import _watcher

    monkeypatch.setattr(_watcher, "_IDLE_EXIT_S", 0.02)

    async def main() -> None:
        fence = asyncfence.record(queue)
        await fence.wait(strategy="park")
        while asyncfence.watcher_statistics().running:  # noqa: ASYNC110 (a thread's state)
            await asyncio.sleep(0.005)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert not asyncfence.watcher_statistics().running
    assert not any(t.name == "asyncfence watcher" for t in threading.enumerate())


def test_mailbox_coalesces_posts_from_many_threads() -> None:
    delivered: list[object] = []
    drains = 0
    loop = asyncio.new_event_loop()

    def deliver(fences: list[Any]) -> None:
        nonlocal drains
        drains += 1
        delivered.extend(fences)

    mailbox = Mailbox(loop.call_soon_threadsafe, deliver)
    threads = [
        threading.Thread(target=lambda i=i: [mailbox.post([cast(Any, (i, n))]) for n in range(250)])
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    loop.run_until_complete(asyncio.sleep(0))
    assert sorted(cast(list[tuple[int, int]], delivered)) == [
        (i, n) for i in range(4) for n in range(250)
    ]
    assert drains < 1000  # posts that arrive together are one call onto the loop
    loop.close()
    assert mailbox.post([cast(Any, object())]) is False  # a closed loop: refused, never raised


@pytest.mark.usefixtures("thread_wake_path")
async def test_the_watcher_never_exits_with_fences_it_collected(
    queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncfence import _watcher

    # Exit as soon as idle, re-check constantly: a sweep that collects the last
    # parked fences must still post them before the thread goes.
    monkeypatch.setattr(_watcher, "_IDLE_EXIT_S", 0.0)
    asyncfence.configure(recheck_interval=0.001)
    for _ in range(100):
        with hold(queue) as gate, anyio.fail_after(10):  # a lost wake fails here
            fence = asyncfence.record(queue)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                gate.release()
