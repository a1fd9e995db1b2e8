"""The ``park`` and ``auto`` strategies: completion signals, the watcher, its lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError
from asyncfence._poller import ThreadMailbox as Mailbox
from asyncfence.testing import hold

from .conftest import let_loop_run, until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from asyncfence.testing import CudaDevice, OpenCLDevice

    from .cuda_emulator import Emulator

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def quick_recheck() -> Iterator[None]:
    """Re-check parked fences every 10 ms, so fault tests finish quickly."""
    previous = asyncfence.configure().recheck_interval
    asyncfence.configure(recheck_interval=0.01)
    yield
    asyncfence.configure(recheck_interval=previous)


@pytest.fixture(params=["opencl", "cuda"])
def stream(request: pytest.FixtureRequest, device: OpenCLDevice) -> Iterator[Any]:
    """A stream on each backend: a PoCL queue, and a CUDA stream."""
    if request.param == "opencl":
        queue = device.new_stream()
        yield queue
        queue.finish()
        return
    cuda_device: CudaDevice = request.getfixturevalue("cuda_device")
    from cuda.bindings import driver

    cuda_stream = cuda_device.new_stream()
    yield cuda_stream
    driver.cuStreamDestroy(cuda_stream)


async def test_park_leaves_the_loop_idle_while_the_work_runs(stream: Any, wake_path: str) -> None:
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            before = asyncfence.current_statistics()
            await let_loop_run()
            after = asyncfence.current_statistics()
            assert after.ticks == before.ticks == 0  # not one poll
            assert not after.running
            assert after.wake_path == wake_path
            if wake_path == "native":  # the loop's own mailbox: no thread at all
                assert after.armed == 1
                assert not asyncfence.watcher_statistics().running
            else:
                assert asyncfence.watcher_statistics().parked >= 1
            assert not fence.done()
            gate.release()
    assert fence.done()
    stats = asyncfence.current_statistics()
    assert (stats.waiters, stats.parked) == (0, 0)


async def test_auto_spins_then_parks(stream: Any) -> None:
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="auto"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            assert asyncfence.current_statistics().ticks >= 1  # it spun first
            await until(lambda: not asyncfence.current_statistics().running)
            ticks = asyncfence.current_statistics().ticks
            await let_loop_run()
            assert asyncfence.current_statistics().ticks == ticks  # parked: no polling
            gate.release()
    assert fence.done()


async def test_auto_sees_work_done_within_the_spin_budget(queue: Any) -> None:
    fence = asyncfence.record(queue)  # an idle queue: done almost at once
    await fence.wait(strategy="auto")
    assert fence.done()
    assert asyncfence.current_statistics().parked == 0


async def test_many_parked_waiters_on_many_streams(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(8)]
    with contextlib.ExitStack() as stack:
        gates = [stack.enter_context(hold(q)) for q in queues]
        fences = [asyncfence.record(q) for q in queues for _ in range(10)]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == len(fences))
            for gate in reversed(gates):
                gate.release()
    assert all(fence.done() for fence in fences)


# -- faults -----------------------------------------------------------------------


async def test_a_failed_opencl_event_reaches_parked_waiters(queue: Any) -> None:
    errors: list[DeviceError] = []
    with hold(queue) as gate:
        fence = asyncfence.record(queue)

        async def waiter(strategy: str) -> None:
            try:
                await fence.wait(strategy=strategy)  # type: ignore[arg-type]
            except DeviceError as error:
                errors.append(error)

        async with anyio.create_task_group() as tg:
            for strategy in ("park", "auto", "park"):
                tg.start_soon(waiter, strategy)
            await until(lambda: asyncfence.current_statistics().parked == 1)
            await until(lambda: asyncfence.current_statistics().waiters == 3)
            gate.fail()  # PoCL sends no callback for a failure: the re-check finds it
    assert len(errors) == 3


async def test_a_cuda_fault_reaches_parked_waiters(
    cuda_device: CudaDevice, cuda_stream: Any, emulator: Emulator
) -> None:
    try:
        with hold(cuda_stream):
            fence = asyncfence.record(cuda_stream)
            async with anyio.create_task_group() as tg:

                async def waiter() -> None:
                    with pytest.raises(DeviceError) as caught:
                        await fence.wait(strategy="park")
                    assert caught.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"

                tg.start_soon(waiter)
                tg.start_soon(waiter)
                await until(lambda: asyncfence.current_statistics().parked == 1)
                # Host functions never run after a fault: only the re-check can see it.
                emulator.inject_fault(int(cuda_device.context), 700)
    finally:
        emulator.clear_fault(int(cuda_device.context))


# -- the CUDA completion signal ------------------------------------------------------


async def test_one_signal_per_cuda_stream_not_per_fence(
    cuda_stream: Any, emulator: Emulator
) -> None:
    v1_before, v2_before = emulator.host_funcs_launched()
    fences = []
    with hold(cuda_stream) as gate:
        fences = [asyncfence.record(cuda_stream) for _ in range(20)]
        async with anyio.create_task_group() as tg:
            for parked, fence in enumerate(fences, start=1):  # parked in record order
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda n=parked: asyncfence.current_statistics().parked == n)
            gate.release()
    assert all(fence.done() for fence in fences)
    v1_after, v2_after = emulator.host_funcs_launched()
    # One signal, for the oldest fence of the stream: the sweep it triggers
    # finds the other 19, which completed behind it. (Which entry point took
    # it, and that it got the native function itself: tests/test_wake.py.)
    assert (v1_after - v1_before) + (v2_after - v2_before) == 1
    await until(lambda: emulator.pending_host_funcs() == 0)


async def test_cuda_signal_never_holds_the_users_stream(
    cuda_device: CudaDevice, emulator: Emulator
) -> None:
    from cuda.bindings import driver

    # The signal runs on a side stream; the user's stream runs on even while a
    # parked fence's host function has not run yet.
    first, second = cuda_device.new_stream(), cuda_device.new_stream()
    try:
        with hold(first) as gate:
            parked = asyncfence.record(first)
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(parked.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                other = asyncfence.record(second)
                await other.wait(strategy="park")  # another stream's signal is not delayed
                gate.release()
    finally:
        driver.cuStreamDestroy(first)
        driver.cuStreamDestroy(second)


async def test_when_the_oldest_leaves_the_next_one_is_signalled(stream: Any) -> None:
    asyncfence.configure(recheck_interval=30)  # only a signal can wake it in time
    with hold(stream) as gate:
        oldest, behind = asyncfence.record(stream), asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            oldest_scope = anyio.CancelScope()
            tg.start_soon(partial(_wait_in, oldest_scope, oldest))
            tg.start_soon(partial(behind.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 2)
            oldest_scope.cancel()
            await until(lambda: asyncfence.current_statistics().parked == 1)
            gate.release()
            with anyio.fail_after(10):  # the re-check is 30 s away: this is the signal
                await behind.wait(strategy="park")
    assert behind.done()


async def _wait_in(scope: anyio.CancelScope, fence: asyncfence.Fence) -> None:
    with scope:
        await fence.wait(strategy="park")


# -- lifecycle ------------------------------------------------------------------------


async def test_cancellation_racing_completion(queue: Any) -> None:
    for _ in range(50):
        gate_cm = hold(queue)
        gate = gate_cm.__enter__()
        fence = asyncfence.record(queue)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(fence.wait, strategy="park"))
                await until(lambda: asyncfence.current_statistics().parked == 1)
                threading.Thread(target=gate.release).start()
                scope.cancel()
        gate_cm.__exit__(None, None, None)
        await fence.wait(strategy="park")  # the late signal hurt nothing
        stats = asyncfence.current_statistics()
        assert (stats.waiters, stats.parked, stats.pending_fences) == (0, 0, 0)
    await until(lambda: asyncfence.watcher_statistics().parked == 0)


async def test_a_signal_after_the_waiter_left_is_harmless(queue: Any) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        with anyio.move_on_after(0.02):
            await fence.wait(strategy="park")
        assert asyncfence.current_statistics().parked == 0
        gate.release()
    await let_loop_run()
    await fence.wait(strategy="park")


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


@pytest.mark.parametrize("runner", ["asyncio", "uvloop", "trio"])
@pytest.mark.parametrize("backend", ["opencl", "cuda"])
def test_exit_with_fences_pending(backend: str, runner: str, cuda_mode: str) -> None:
    if backend == "cuda" and cuda_mode != "emulated":
        pytest.skip("runs the subprocess on the emulated driver")
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    if backend == "cuda":
        from .cuda_emulator import build

        env["LD_LIBRARY_PATH"] = f"{build().parent}:{env.get('LD_LIBRARY_PATH', '')}"
    code = textwrap.dedent(
        f"""
        import asyncio, threading, time
        import asyncfence
        from asyncfence.testing import StreamGate, open_default_device
        if {runner!r} == "trio":
            import trio

        device = open_default_device({backend!r})
        stream = device.new_stream()
        gate = StreamGate(stream)  # never released
        fences = [asyncfence.record(stream) for _ in range(3)]
        parked = threading.Event()

        async def until_parked():
            while asyncfence.current_statistics().parked < 1:
                await (trio.sleep(0.001) if {runner!r} == "trio" else asyncio.sleep(0.001))
            parked.set()

        async def wait_forever():
            if {runner!r} == "trio":
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(until_parked)
                    for fence in fences:
                        await fence.wait(strategy="park")
            else:
                watch = asyncio.ensure_future(until_parked())
                for fence in fences:
                    await fence.wait(strategy="park")

        def background():
            if {runner!r} == "trio":
                trio.run(wait_forever)
            elif {runner!r} == "uvloop":
                import uvloop
                uvloop.run(wait_forever())
            else:
                asyncio.run(wait_forever())

        threading.Thread(target=background, daemon=True).start()
        assert parked.wait(30)
        assert not any(fence.done() for fence in fences)
        print("parked", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=30,  # a hang guard, not a timing assertion
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "parked" in result.stdout


# -- choosing a strategy ----------------------------------------------------------------


async def test_unknown_strategies_are_refused(queue: Any) -> None:
    fence = asyncfence.record(queue)
    with pytest.raises(ValueError, match="'auto', 'poll', 'park'"):
        await fence.wait(strategy="spin")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strategy"):
        await fence.wait(strategy=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        asyncfence.configure(strategy="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["spin_budget", "poll_cap", "recheck_interval"])
def test_settings_beyond_a_float_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number of seconds"):
        asyncfence.configure(**{name: 10**400})  # type: ignore[arg-type]


def test_configure_sets_the_default_strategy() -> None:
    previous = asyncfence.configure()
    try:
        assert previous.strategy == "auto"
        assert asyncfence.configure(strategy="park").strategy == "park"
        assert asyncfence.configure(recheck_interval=0.2).recheck_interval == 0.2
        with pytest.raises(ValueError, match="recheck_interval"):
            asyncfence.configure(recheck_interval=0)
    finally:
        asyncfence.configure(strategy=previous.strategy, recheck_interval=previous.recheck_interval)


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


def test_a_driver_without_host_functions_falls_back_to_polling(cuda_mode: str) -> None:
    if cuda_mode != "emulated":
        pytest.skip("pretends to be an older emulated driver")
    from .cuda_emulator import build

    env = {
        **os.environ,
        "ASYNCFENCE_CUDA_DRIVER": "none",
        "LD_LIBRARY_PATH": f"{build().parent}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "ASYNCFENCE_EMULATED_HIDE": "cuLaunchHostFunc",  # a driver without host functions
    }
    code = textwrap.dedent(
        """
        import asyncio
        import asyncfence
        from asyncfence.testing import hold, open_default_device

        device = open_default_device("cuda")
        stream = device.new_stream()

        async def main():
            with hold(stream) as gate:
                fence = asyncfence.record(stream)
                waiter = asyncio.ensure_future(fence.wait(strategy="park"))
                while asyncfence.current_statistics().parked < 1:
                    await asyncio.sleep(0.001)
                stats = asyncfence.current_statistics()
                print("signal", stats.cuda_signal, "armed", stats.armed)
                gate.release()
                await asyncio.wait_for(waiter, 30)
            print("done", fence.done())

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "signal polling armed 0" in result.stdout  # no host function: it is polled
    assert "done True" in result.stdout
