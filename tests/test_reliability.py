"""Faults, fork, interrupts, dying streams, several loops: nothing lost, nothing hung."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence import DropQueue
from asyncfence.testing import hold

from .conftest import until

if TYPE_CHECKING:
    import pyopencl as cl

    from asyncfence.testing import CudaDevice

    from .cuda_emulator import Emulator


ROOT = Path(__file__).resolve().parent.parent


def run_script(code: str, backend: str, cuda_mode: str) -> subprocess.CompletedProcess[str]:
    if backend == "cuda" and cuda_mode != "emulated":
        pytest.skip("runs the subprocess on the emulated driver")
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    if backend == "cuda":
        from .cuda_emulator import build

        env["LD_LIBRARY_PATH"] = f"{build().parent}:{env.get('LD_LIBRARY_PATH', '')}"
    prelude = f"""
        import asyncio, os, signal, sys, threading, time
        import asyncfence
        from asyncfence.testing import StreamGate, open_default_device
        device = open_default_device({backend!r})
        stream = device.new_stream()
    """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,  # a hang guard, not a timing assertion
    )


@pytest.mark.parametrize("backend", ["opencl", "cuda"])
def test_fork_while_a_wait_is_parked_gives_the_child_a_clear_error(
    backend: str, cuda_mode: str
) -> None:
    result = run_script(
        """
        gate = StreamGate(stream)
        fence = asyncfence.record(stream)
        loop = asyncio.new_event_loop()
        parked = threading.Event()
        async def wait():
            waiter = asyncio.ensure_future(fence.wait(strategy="park"))
            while asyncfence.current_statistics().parked < 1:
                await asyncio.sleep(0.001)
            parked.set()
            await waiter
        threading.Thread(target=lambda: loop.run_until_complete(wait()), daemon=True).start()
        assert parked.wait(30)
        pid = os.fork()
        if pid == 0:
            errors = []
            for attempt in (fence.done, lambda: fence.wait_sync(timeout=5),
                            lambda: asyncfence.record(stream)):
                try:
                    attempt()
                except asyncfence.FenceError as error:
                    errors.append(str(error))
            ok = len(errors) == 3 and all("fork()" in e for e in errors)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        gate.release()
        fence.wait_sync(timeout=30)
        print("child exit status", os.waitstatus_to_exitcode(status))
        """,
        backend,
        cuda_mode,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "child exit status 0" in result.stdout


_FORKED_WORKER = """
import asyncio, os, sys
import pyopencl as cl
import asyncfence

if sys.argv[1] == "preloaded":  # as an app imported by a gunicorn master under --preload
    context = cl.Context([cl.get_platforms()[0].get_devices()[0]])
    queue = cl.CommandQueue(context)
pid = os.fork()
if pid == 0:
    try:
        if sys.argv[1] != "preloaded":  # a worker that opens its device after the fork
            context = cl.Context([cl.get_platforms()[0].get_devices()[0]])
            queue = cl.CommandQueue(context)
        fence = asyncfence.record(queue)
        asyncio.run(fence.wait(timeout=30))
        print("child: awaited", flush=True)
    except asyncfence.FenceError as error:
        print("child:", error, flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("opened", ["preloaded", "after the fork"])
def test_a_runtime_initialised_before_fork_is_refused_in_the_child_saying_why(
    opened: str,
) -> None:
    # Not through asyncfence: the app made its context itself, before forking.
    if not hasattr(os, "fork"):
        pytest.skip("needs fork()")
    result = subprocess.run(
        [sys.executable, "-c", _FORKED_WORKER, opened.split()[0]],
        capture_output=True,
        text=True,
        env={**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"},
        timeout=60,  # a hang guard: the bug was a wait that never ended
    )
    assert result.returncode == 0, result.stderr[-2000:]
    if opened == "preloaded":
        assert "OpenCL was initialised before fork(), in the parent process" in result.stdout
        assert "--preload" in result.stdout
        assert "lifespan" in result.stdout
    else:  # a parent that touched no platform: its child's device works
        assert "child: awaited" in result.stdout


@pytest.mark.parametrize("backend", ["opencl", "cuda"])
def test_keyboard_interrupt_during_wait_sync(backend: str, cuda_mode: str) -> None:
    result = run_script(
        """
        # Ctrl-C as a terminal delivers it: a process started in the background
        # of a non-interactive shell (CI run with &, say) inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        gate = StreamGate(stream)  # never released: only the interrupt ends the wait
        fence = asyncfence.record(stream)
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            fence.wait_sync()
        except KeyboardInterrupt:
            print("interrupted; the fence is still", "done" if fence.done() else "pending")
        gate.release()
        fence.wait_sync(timeout=30)
        """,
        backend,
        cuda_mode,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "interrupted; the fence is still pending" in result.stdout


@pytest.mark.parametrize("launch", ["refused", "interrupted"])
def test_a_cuda_arm_frees_its_slot_only_where_the_driver_will_never_call_it(
    launch: str, cuda_mode: str
) -> None:
    # Refused: the slot is freed. Interrupted after the driver took it (a
    # Ctrl-C as the launch returns): it is kept, since the host function will
    # still fire it; freeing it would let that write freed memory.
    from asyncfence._native import shim, unavailable_reason

    if shim() is None:
        pytest.skip(f"the native shim is not in use in this run: {unavailable_reason()}")
    result = run_script(
        f"""
        import select
        from asyncfence import DeviceError
        from asyncfence._native import NativeMailbox, shim
        native = shim()
        mailbox = NativeMailbox(native)
        gate = StreamGate(stream)
        core = asyncfence.record(stream)._core
        launcher = core.backend.host_functions()
        driver_launch = launcher.launch
        before = native.live_slots()
        if {launch!r} == "refused":
            launcher.launch = lambda stream, function, argument: 1  # CUDA_ERROR_INVALID_VALUE
            try:
                core.arm(mailbox, 7)
            except DeviceError as error:
                print("refused:", error.name)
            print("slots left:", native.live_slots() - before)
        else:
            def interrupted(stream, function, argument):
                driver_launch(stream, function, argument)  # taken by the driver
                raise KeyboardInterrupt
            launcher.launch = interrupted
            try:
                core.arm(mailbox, 7)
            except KeyboardInterrupt:
                print("interrupted")
            print("slots left:", native.live_slots() - before)
        gate.release()
        if {launch!r} == "interrupted":
            assert select.select([mailbox.fileno()], [], [], 30)[0], "the host function never fired"
            print("fired:", mailbox.take(), "slots left:", native.live_slots() - before)
        """,
        "cuda",
        cuda_mode,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    if launch == "refused":
        assert result.stdout.splitlines() == ["refused: CUDA_ERROR_INVALID_VALUE", "slots left: 0"]
    else:
        assert result.stdout.splitlines() == [
            "interrupted",
            "slots left: 1",
            "fired: [7] slots left: 0",
        ]


_INTERRUPTED_RECORDS = """
import random
from asyncfence import _core


class Interrupt(BaseException):
    pass


armed = False


def interrupt(signum, frame):
    global armed
    if armed:  # once per timer, wherever Python is when it fires
        armed = False
        raise Interrupt


signal.signal(signal.SIGALRM, interrupt)
rng = random.Random(1)
interrupts = left_held = 0
deadline = time.monotonic() + 2.0
while time.monotonic() < deadline:
    armed = True
    try:
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, 0.002))
        for _ in range(2000):
            asyncfence.record(stream).done()  # the record's stripe lock, the settle lock
    except Interrupt:
        interrupts += 1
        for lock in (_core._settle_lock, *_core._record_locks):
            if lock.locked():
                left_held += 1
                lock.release()
armed = False
signal.setitimer(signal.ITIMER_REAL, 0)
print("interrupts", interrupts, "left held", left_held)
"""


def test_an_interrupt_anywhere_in_a_record_or_settle_leaves_no_lock_held(cuda_mode: str) -> None:
    # Ctrl-C (or trio's KeyboardInterrupt in task code) can land at any
    # bytecode; a lock left held would hang every later record and wait of
    # the process. A with statement leaves no gap between taking the lock
    # and the block that releases it; acquire() then try: does.
    result = run_script(_INTERRUPTED_RECORDS, "opencl", cuda_mode)
    assert result.returncode == 0, result.stderr[-2000:]
    words = result.stdout.split()
    interrupts, left_held = int(words[1]), int(words[4])
    assert interrupts > 100, result.stdout  # enough to have landed everywhere
    assert left_held == 0, result.stdout


async def test_a_queue_dropped_while_its_fences_are_pending(device: Any) -> None:
    queue = device.new_stream()
    gate_holder = hold(queue)
    gate = gate_holder.__enter__()
    fences = [asyncfence.record(queue) for _ in range(3)]
    del queue  # the markers keep the queue alive in OpenCL
    gc.collect()
    gate.release()
    with anyio.fail_after(30):
        for fence in fences:
            await fence
    gate_holder.__exit__(None, None, None)


async def test_a_cuda_stream_destroyed_while_its_fences_are_pending(
    cuda_device: CudaDevice,
) -> None:
    from cuda.bindings import driver

    stream = cuda_device.new_stream()
    with hold(stream) as gate:
        fences = [asyncfence.record(stream) for _ in range(3)]
        assert driver.cuStreamDestroy(stream)[0] == 0  # returns at once; the work stays queued
        gate.release()
        with anyio.fail_after(30):
            for fence in fences:
                await fence


async def test_one_fence_awaited_on_two_loops_at_once(queue: cl.CommandQueue) -> None:
    with hold(queue) as gate:
        fence = asyncfence.record(queue)
        other: dict[str, Any] = {}

        parked = threading.Event()

        def other_loop() -> None:
            async def wait() -> None:
                waiter = asyncio.ensure_future(fence.wait(strategy="park"))
                while asyncfence.current_statistics().parked < 1:  # noqa: ASYNC110 (a counter)
                    await asyncio.sleep(0.001)
                parked.set()
                await waiter
                other["resumed"] = True

            asyncio.run(wait())

        thread = threading.Thread(target=other_loop)
        thread.start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(fence.wait, strategy="park"))
            await until(lambda: asyncfence.current_statistics().parked == 1)
            await anyio.to_thread.run_sync(parked.wait, 30)
            gate.release()
        await anyio.to_thread.run_sync(thread.join)
    assert other == {"resumed": True}
    assert fence.done()


@pytest.mark.blocks_on_purpose
async def test_a_free_that_blocks_delays_but_loses_nothing(queue: cl.CommandQueue) -> None:
    import time

    freed: list[int] = []

    def slow_free(index: int) -> None:
        time.sleep(0.005)  # blocks the loop, as documented: frees run on it
        freed.append(index)

    async with DropQueue() as dq:
        with hold(queue) as gate:
            for index in range(10):
                dq.defer(asyncfence.record(queue), index, free=slow_free)
            gate.release()
    assert sorted(freed) == list(range(10))


async def test_a_fault_while_the_drop_queue_holds_buffers(
    cuda_device: CudaDevice, cuda_stream: Any, emulator: Emulator
) -> None:
    faulted: list[object] = []
    freed: list[object] = []
    other = cuda_device.new_stream()
    try:
        async with DropQueue(on_fault=lambda obj, error: faulted.append(obj)) as dq:
            with hold(cuda_stream):
                held = [object() for _ in range(5)]
                for obj in held:
                    dq.defer(asyncfence.record(cuda_stream), obj, free=freed.append)
                await until(lambda: asyncfence.current_statistics().pending_fences == 5)
                emulator.launch_fault(int(other), 700)  # the context faults, from elsewhere
                await dq.drain(timeout=30)
        # Every one handed to on_fault (in whatever order the faults were
        # seen), none freed as if its work were done.
        assert sorted(map(id, faulted)) == sorted(map(id, held))
        assert freed == []
    finally:
        emulator.clear_fault(int(cuda_device.context))
        from cuda.bindings import driver

        driver.cuStreamDestroy(other)


# -- exit ----------------------------------------------------------------------


ROOT = Path(__file__).resolve().parent.parent


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
