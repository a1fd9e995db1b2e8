from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence._backend import backend_named, register_backend
from asyncfence.testing import CudaDevice, OpenCLDevice, StreamGate, open_default_device

from .fake_backend import FakeBackend

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Iterator
    from types import FrameType

    import pyopencl as cl

# The tests' own backend, registered as any backend is: tests/test_fence.py
# runs its generic tests on every registered backend, this one included.
register_backend(FakeBackend())

_uvloop_missing = importlib.util.find_spec("uvloop") is None
_trio_missing = importlib.util.find_spec("trio") is None


_blockbuster_missing = importlib.util.find_spec("blockbuster") is None


def _uvloop_factory() -> Any:
    import uvloop

    return uvloop.new_event_loop()


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(
            ("asyncio", {"loop_factory": _uvloop_factory}),
            id="uvloop",
            marks=pytest.mark.skipif(_uvloop_missing, reason="uvloop is not installed"),
        ),
        pytest.param(
            ("trio", {}),
            id="trio",
            marks=pytest.mark.skipif(_trio_missing, reason="trio is not installed"),
        ),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    backend: tuple[str, dict[str, Any]] = request.param
    return backend


@pytest.fixture(autouse=True)
def no_blocking_call_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run each async test under blockbuster, as anyio's suite runs: asyncfence
    must never make a blocking call on a running loop (blockbuster sees asyncio
    and uvloop; trio's runs are the same code).

    Only calls from asyncfence's own frames are flagged: the tests themselves
    may block on purpose (``wait_sync`` from a coroutine, say). A test whose
    own callbacks block inside asyncfence's frames (a slow ``free``) says so:
    ``@pytest.mark.blocks_on_purpose``.
    """
    if (
        not inspect.iscoroutinefunction(request.function)
        or _blockbuster_missing
        or request.node.get_closest_marker("blocks_on_purpose") is not None
    ):
        yield
        return
    from blockbuster import blockbuster_ctx

    with blockbuster_ctx("asyncfence") as buster:
        # wait_sync is the blocking wait, by its contract: a test that calls it
        # on the loop blocks on purpose.
        for function in buster.functions.values():
            function.can_block_in("asyncfence/_fence.py", {"wait_sync"})
        yield


@pytest.fixture(scope="session")
def device() -> OpenCLDevice:
    pytest.importorskip("pyopencl")
    opened = open_default_device("opencl")
    assert isinstance(opened, OpenCLDevice)
    # Off the loop, as a server's startup would: a test's first parked wait
    # then arms its signal whatever ran before it.
    stream = opened.new_stream()
    asyncfence.warm_up(stream)
    opened.close_stream(stream)
    return opened


@pytest.fixture
def opencl_queue(device: OpenCLDevice) -> Iterator[cl.CommandQueue]:
    """A fresh in-order OpenCL queue, finished at teardown."""
    stream = device.new_stream()
    yield stream
    stream.finish()


@pytest.fixture
def queue(opencl_queue: cl.CommandQueue) -> cl.CommandQueue:
    """An OpenCL queue (``tests/test_fence.py`` has its own, of every backend)."""
    return opencl_queue


@pytest.fixture
def gate(opencl_queue: cl.CommandQueue) -> Iterator[StreamGate]:
    """A gate holding ``queue`` (released at teardown if the test did not)."""
    held = StreamGate(opencl_queue)
    yield held
    if held.held:
        held.release()


@pytest.fixture
def unordered_queue(device: OpenCLDevice) -> Iterator[cl.CommandQueue]:
    stream = device.new_stream(in_order=False)
    yield stream
    stream.finish()


@pytest.fixture(scope="session")
def wake_path() -> str:
    """How parked waits wake in this run: ``"native"`` (the shim) or ``"polling"``.

    CI runs a slice of the suite with ``ASYNCFENCE_NATIVE=0`` (see ``.ci/run``).
    """
    from asyncfence._native import shim

    return "native" if shim() is not None else "polling"


@pytest.fixture
def without_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Park as if the native shim were not built, in this test: re-checked on the loop.

    Applies to loops that park for the first time during the test (anyio
    gives every test a fresh loop).
    """
    from asyncfence import _parking

    monkeypatch.setattr(_parking, "shim", lambda: None)
    monkeypatch.setattr(_parking, "unavailable_reason", lambda: "disabled by the test")
    monkeypatch.setattr(_parking, "unavailable_for_good", lambda: True)


@pytest.fixture(params=["auto", "poll", "park"])
def strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with each waiting strategy as the process-wide default."""
    previous = asyncfence.configure().strategy
    asyncfence.configure(strategy=request.param)
    yield request.param
    asyncfence.configure(strategy=previous)


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


@pytest.fixture
def no_thread_from_asyncfence(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if asyncfence's own code starts a thread during it.

    ``threading.Thread.start`` is wrapped: a call whose caller is a module of
    the ``asyncfence`` package is noted (threads of the test, of trio or of
    the device runtime are not asyncfence's).
    """
    import sys
    import threading

    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "asyncfence" or caller.startswith("asyncfence."):
            started.append(f"{caller} started {thread.name}")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    yield
    assert started == []


HANG_GUARD_S = 30  # a hang guard, never a timing assertion


def pause_at(
    function: Callable[..., Any], text: str, paused: threading.Event, go: threading.Event
) -> Callable[[FrameType, str, object], Any]:
    """A trace function that stops this thread once, at ``function``'s line holding ``text``."""
    import inspect

    lines, first = inspect.getsourcelines(function)
    target = first + next(i for i, line in enumerate(lines) if text in line)
    code = function.__code__
    done = False

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal done
        if event == "line" and frame.f_lineno == target and not done:
            done = True
            paused.set()
            go.wait(HANG_GUARD_S)
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    return calls


async def poller_ticks(count: int) -> None:
    """Let the running loop's poller tick ``count`` more times (it must be running)."""
    target = asyncfence.current_statistics().ticks + count
    with anyio.fail_after(10):
        while asyncfence.current_statistics().ticks < target:  # noqa: ASYNC110 (a counter)
            await anyio.sleep(0.0005)


async def let_loop_run() -> None:
    """Give the loop and its poller time to act, under any strategy.

    For asserting that something does *not* happen (a waiter resuming while its
    stream is held); the order of events is always fixed by held streams.
    """
    for _ in range(10):
        await anyio.sleep(0.001)


async def until(predicate: Any) -> None:
    """Yield to the loop until ``predicate()`` holds; a guard fails a hang after 10 s."""
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 (a predicate, not an event)
            await anyio.sleep(0.0005)


# -- CUDA: the real driver on a GPU, else the emulated one -------------------------

_cuda_mode = "none"
_cuda_none_reason = "no CUDA driver in this run (ASYNCFENCE_CUDA_DRIVER=none)"
_emulator: Any = None
# Where the emulated driver is loaded, the folder of its libcuda.so.1, for the
# subprocesses that must load the same driver; None on the real one.
_emulated_library_dir: str | None = None
# ASYNCFENCE_EMULATOR_HOOKS=hidden runs on the emulated driver as on the real
# one: cuda_mode says "real" and its hooks are hidden, so only the tests that
# need them skip. A check that everything else runs on a real driver.
_HOOKS_HIDDEN = os.environ.get("ASYNCFENCE_EMULATOR_HOOKS") == "hidden"


def _real_driver_present() -> bool:
    return os.path.exists("/dev/nvidiactl")


def pytest_configure(config: pytest.Config) -> None:
    """Choose the CUDA driver before anything loads one: it cannot change later."""
    global _cuda_mode, _emulator, _cuda_none_reason, _emulated_library_dir
    requested = os.environ.get("ASYNCFENCE_CUDA_DRIVER", "auto")
    if requested not in ("auto", "real", "emulated", "none"):
        raise pytest.UsageError(
            f"ASYNCFENCE_CUDA_DRIVER must be auto, real, emulated or none; got {requested!r}"
        )
    if requested == "auto":
        requested = "real" if _real_driver_present() else "emulated"
    if requested == "emulated":
        from .cuda_emulator import EmulatorUnavailable, load

        try:
            _emulator = load()
        except EmulatorUnavailable as unavailable:
            if os.environ.get("ASYNCFENCE_CUDA_DRIVER") == "emulated":
                raise pytest.UsageError(str(unavailable)) from None
            # A machine without a C compiler: the CUDA tests skip, saying why.
            _cuda_none_reason = f"the emulated CUDA driver could not be built: {unavailable}"
            requested = "none"
        else:
            _emulated_library_dir = str(_emulator.path.parent)
            if _HOOKS_HIDDEN:
                _emulator, requested = None, "real"
    _cuda_mode = requested


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, at each test, the runs of ``fails_a_gate`` tests on backends that cannot."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = None if callspec is None else callspec.params.get("new_stream")
        if backend is None or item.get_closest_marker("fails_a_gate") is None:
            continue
        if not backend_named(backend).lab().fails_gates:
            reason = f"the host cannot fail a {backend_named(backend).title} stream"
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config: pytest.Config) -> str:
    if _cuda_mode == "emulated":
        return f"asyncfence CUDA driver: emulated ({_emulator.path})"
    if _cuda_mode == "real" and _emulated_library_dir is not None:
        return (
            f"asyncfence CUDA driver: emulated ({_emulated_library_dir}), run as the real "
            "one: its hooks hidden (ASYNCFENCE_EMULATOR_HOOKS=hidden)"
        )
    if _cuda_mode == "real":
        return "asyncfence CUDA driver: real (NVIDIA)"
    return f"asyncfence CUDA driver: none, CUDA tests skip ({_cuda_none_reason})"


@pytest.fixture(scope="session")
def cuda_mode() -> str:
    """``"real"`` or ``"emulated"``; CUDA tests skip with no driver."""
    if _cuda_mode == "none":
        pytest.skip(_cuda_none_reason)
    return _cuda_mode


#: The reason a test that needs the emulated driver's hooks skips on a real driver.
NEEDS_HOOKS = "needs the emulated driver's hooks"
#: The reason a test of the emulated driver itself skips on a real driver.
TESTS_THE_EMULATOR = "tests the emulated driver itself"


@pytest.fixture
def emulator(cuda_mode: str) -> Any:
    """The emulated driver's test hooks (fault injection, counters); skips on a real driver.

    Only a test that calls them takes this fixture: every other CUDA test runs
    on a real driver too (``ASYNCFENCE_EMULATOR_HOOKS=hidden`` checks it).
    """
    if cuda_mode != "emulated":
        pytest.skip(NEEDS_HOOKS)
    return _emulator


@pytest.fixture(scope="session")
def driver_is_emulated() -> bool:
    """Whether this run's CUDA driver is the emulated one, its hooks hidden or not."""
    return _emulated_library_dir is not None


@pytest.fixture
def emulated_driver(cuda_mode: str) -> None:
    """For the tests of the emulated driver itself; skips on a real driver."""
    if cuda_mode != "emulated":
        pytest.skip(TESTS_THE_EMULATOR)


@pytest.fixture
def two_cuda_devices(cuda_device: CudaDevice) -> None:
    """Skips unless the driver has at least two devices (the emulated one has two)."""
    from cuda.bindings import driver

    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count < 2:
        pytest.skip("needs two CUDA devices")


@pytest.fixture
def driver_env(cuda_mode: str) -> dict[str, str]:
    """The environment a subprocess needs to load this run's CUDA driver.

    The emulated one is found on ``LD_LIBRARY_PATH``; the real one as
    installed. ``ASYNCFENCE_CUDA_DRIVER=none`` keeps a nested pytest from
    loading a driver of its own.
    """
    env = {**os.environ, "ASYNCFENCE_CUDA_DRIVER": "none"}
    if _emulated_library_dir is not None:
        env["LD_LIBRARY_PATH"] = f"{_emulated_library_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    return env


@pytest.fixture(scope="session")
def cuda_device_session(cuda_mode: str) -> CudaDevice:
    return CudaDevice(0)


@pytest.fixture
def cuda_device(cuda_device_session: CudaDevice) -> CudaDevice:
    cuda_device_session.make_current()
    return cuda_device_session


@pytest.fixture
def cuda_stream(cuda_device: CudaDevice) -> Iterator[Any]:
    from cuda.bindings import driver

    stream = cuda_device.new_stream()
    yield stream
    driver.cuStreamDestroy(stream)


@pytest.fixture(autouse=True)
def settings_restored() -> Iterator[None]:
    """Put every setting back after each test, whatever the test configured."""
    from dataclasses import asdict

    previous = asyncfence.configure()
    yield
    asyncfence.configure(**asdict(previous))


#: The loggers of the wait machinery: an error there means a wait went wrong.
_WAIT_LOGGERS = ("asyncfence.poller", "asyncfence.loops")


@pytest.fixture(autouse=True)
def no_wait_errors_logged(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> Iterator[None]:
    """Fail any test during which the poller or a loop driver logged an error.

    A test that makes them raise on purpose says so: ``@pytest.mark.logs_wait_errors``.
    """
    yield
    if request.node.get_closest_marker("logs_wait_errors") is not None:
        return
    errors = [
        record
        for record in caplog.get_records("call")
        if record.name in _WAIT_LOGGERS and record.levelno >= logging.ERROR
    ]
    assert not errors, [record.getMessage() for record in errors]


pytest_plugins = ["pytester"]
