"""The wake path: the native shim's mailboxes, and parked waits that need no thread.

With the shim, the device runtime calls it on its own thread, it writes the
waiting loop's mailbox fd, and the loop's own selector wakes the poller. CI
runs this file on the shim and again on the thread-based fallback
(``ASYNCFENCE_NATIVE=0``); tests of the shim itself skip there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import select
import subprocess
import sys
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence._native import Shim, shim
from asyncfence._poller import NativeMailbox
from asyncfence.testing import hold

from .conftest import until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from asyncfence.testing import CudaDevice, OpenCLDevice

    from .cuda_emulator import Emulator


@pytest.fixture
def native() -> Shim:
    loaded = shim()
    if loaded is None:
        pytest.skip("the native shim is not in use in this run")
    return loaded


@pytest.fixture
def only_signals_wake() -> Iterator[None]:
    """Re-check parked fences every 30 s, and poll unsignalled ones every 1 s.

    A parked wait that resumes within the test's 10 s guard was woken by its
    completion signal.
    """
    previous = asyncfence.configure()
    asyncfence.configure(recheck_interval=30, poll_cap=1)
    yield
    asyncfence.configure(recheck_interval=previous.recheck_interval, poll_cap=previous.poll_cap)


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def fire(native: Shim, slot: int) -> None:
    """Call the signal as the device runtime would (here from the calling thread)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.fire)(slot)


# -- the mailbox ------------------------------------------------------------------------


def test_a_fired_signal_makes_the_fd_readable_and_is_taken_once(native: Shim) -> None:
    mailbox = NativeMailbox(native)
    _, slot = mailbox.signal(7)
    assert not readable(mailbox.fileno())
    fire(native, slot)
    assert readable(mailbox.fileno())
    assert mailbox.take() == [7]
    assert not readable(mailbox.fileno())  # drained first
    assert mailbox.take() == []


def test_signals_from_many_threads_arrive_exactly_once(native: Shim) -> None:
    mailbox = NativeMailbox(native)
    slots = [mailbox.signal(token)[1] for token in range(4000)]
    random.Random(0).shuffle(slots)

    def fire_all(part: list[int]) -> None:
        for slot in part:
            fire(native, slot)

    threads = [threading.Thread(target=fire_all, args=(slots[i::4],)) for i in range(4)]
    taken: list[int] = []
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads) or readable(mailbox.fileno()):
        taken.extend(mailbox.take())
    for thread in threads:
        thread.join()
    taken.extend(mailbox.take())
    assert sorted(taken) == list(range(4000))


def test_a_signal_after_the_loop_let_go_is_safe_and_frees_everything(native: Shim) -> None:
    slots_before, mailboxes_before = native.live_slots(), native.live_mailboxes()
    mailbox = NativeMailbox(native)
    _, first = mailbox.signal(1)
    _, second = mailbox.signal(2)
    fd = mailbox.fileno()
    del mailbox  # the loop is gone; two signals are still armed
    assert native.live_mailboxes() == mailboxes_before + 1  # kept open for them
    fire(native, first)
    assert os.fstat(fd)  # still this mailbox's fd: never closed under a signal
    fire(native, second)
    assert native.live_mailboxes() == mailboxes_before
    assert native.live_slots() == slots_before


def test_an_unused_slot_is_freed(native: Shim) -> None:
    before = native.live_slots()
    mailbox = NativeMailbox(native)
    _, slot = mailbox.signal(1)
    assert native.live_slots() == before + 1
    mailbox.discard(slot)
    assert native.live_slots() == before


def test_a_forked_child_never_drains_its_parents_mailbox(native: Shim) -> None:
    # In a fresh process, with no other thread: forking this one is not the point.
    code = """
import ctypes, os, select
from asyncfence._native import shim
from asyncfence._poller import NativeMailbox
native = shim()
mailbox = NativeMailbox(native)
_, slot = mailbox.signal(3)
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(native.fire)(slot)
readable = lambda: bool(select.select([mailbox.fileno()], [], [], 0)[0])
pid = os.fork()
if pid == 0:  # the child: the fd is shared with the parent, the mailbox is not its own
    ok = mailbox.take() == [] and readable()
    del mailbox  # its finalizer must leave the parent's fd alone too
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, "the child touched the mailbox"
assert readable(), "the child drained the parent's wake"
assert mailbox.take() == [3]
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


# -- parked waits, woken by their own signals ------------------------------------------------


@pytest.fixture(params=["opencl", "cuda"])
def stream(request: pytest.FixtureRequest, device: OpenCLDevice) -> Iterator[Any]:
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


def asyncfence_threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if "asyncfence" in thread.name}


@pytest.mark.usefixtures("only_signals_wake")
async def test_a_parked_wait_needs_no_thread(stream: Any, wake_path: str) -> None:
    with hold(stream) as gate:
        fence = asyncfence.record(stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            if wake_path == "native":
                # (anyio runs trio tests in guest mode, whose I/O waits use a
                # "Trio thread" of trio's own: so names, not a thread count.)
                assert asyncfence_threads() == set()
                assert not asyncfence.watcher_statistics().running
            signals = asyncfence.current_statistics().signals
            gate.release()
    assert fence.done()
    if wake_path == "native":
        assert asyncfence.current_statistics().signals == signals + 1
        assert asyncfence.current_statistics().rechecks == 0


@pytest.mark.usefixtures("only_signals_wake")
async def test_an_older_fence_parked_after_a_newer_one_wakes_by_its_own_signal(
    stream: Any,
) -> None:
    with hold(stream) as gate:
        older = asyncfence.record(stream)
        with hold(stream) as later_gate:
            newer = asyncfence.record(stream)
            woken: list[str] = []

            async def wait(name: str, fence: asyncfence.Fence) -> None:
                await fence.wait(strategy="park")
                woken.append(name)

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait, "newer", newer)
                await until(lambda: asyncfence.current_statistics().parked == 1)
                tg.start_soon(wait, "older", older)
                await until(lambda: asyncfence.current_statistics().parked == 2)
                gate.release()  # the older completes; the newer is still held
                with anyio.fail_after(10):  # the re-check is 30 s away
                    await until(lambda: woken == ["older"])
                later_gate.release()
    assert woken == ["older", "newer"]


@pytest.mark.usefixtures("only_signals_wake")
async def test_64_waiters_on_64_queues_completing_in_random_order(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(64)]
    with contextlib.ExitStack() as stack:
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queue) for queue in queues]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 64)
            order = list(range(64))
            random.Random(1).shuffle(order)
            with anyio.fail_after(10):
                for index in order:
                    gates[index].release()
                    await until(lambda index=index: fences[index].done())
    assert asyncfence.current_statistics().parked == 0


async def test_a_thousand_parked_queues_add_no_thread_per_queue(device: OpenCLDevice) -> None:
    queues = [device.new_stream() for _ in range(1000)]
    threads_before = threading.active_count()
    with contextlib.ExitStack() as stack:
        gates = [stack.enter_context(hold(queue)) for queue in queues]
        fences = [asyncfence.record(queue) for queue in queues]
        async with anyio.create_task_group() as tg:
            for fence in fences:
                tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1000)
            # At most the fallback's watcher, and trio's guest-mode I/O thread.
            assert threading.active_count() - threads_before <= 2
            for gate in gates:
                gate.release()
    assert all(fence.done() for fence in fences)


# -- CUDA: the raw host-function entry points ------------------------------------------------


def _driver_version() -> int:
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    assert err == driver.CUresult.CUDA_SUCCESS
    return int(version)


@pytest.mark.usefixtures("only_signals_wake")
async def test_the_cuda_driver_gets_the_native_function_itself(
    cuda_stream: Any, emulator: Emulator, wake_path: str
) -> None:
    v1_before, v2_before = emulator.host_funcs_launched()
    with hold(cuda_stream) as gate:
        fence = asyncfence.record(cuda_stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            gate.release()
            with anyio.fail_after(10):  # poll_cap 1 s, re-check 30 s: only the signal is fast
                await fence.wait(strategy="park")
    v1_after, v2_after = emulator.host_funcs_launched()
    newer_driver = _driver_version() >= 13020
    expected = "v2" if newer_driver else "v1"
    assert asyncfence.current_statistics().cuda_signal == expected
    assert (v1_after - v1_before, v2_after - v2_before) == ((0, 1) if newer_driver else (1, 0))
    if wake_path == "native":
        native = shim()
        assert native is not None
        assert emulator.last_host_fn() == native.fire  # not a trampoline
    else:
        from asyncfence._watcher import current_watcher

        signal = current_watcher()._semaphore.signal
        assert signal is not None
        assert emulator.last_host_fn() == signal.host_function  # libc's sem_post
