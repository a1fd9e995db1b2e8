"""Fences across processes: a producer process exports, the test's loop imports and awaits.

Each producer is a real process (``tests/relay_producer.py``) running its own
event loop, which serves its exports; it obeys commands on stdin, so the
test decides exactly when its device work completes, fails, or its process
dies. Nothing sleeps and hopes: the gate orders everything.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence import DeviceError, FenceError, FenceLostError, FenceToken, TokenRefusedError
from asyncfence.testing import open_default_device

from .conftest import let_loop_run, until

if TYPE_CHECKING:
    from collections.abc import Iterator

    from asyncfence.testing import Device, StreamGate

_ROOT = Path(__file__).resolve().parent.parent
_GUARD_S = 10.0
_cuda_devices: dict[str, Device] = {}


class Producer:
    """A producing process, its exported token, and its commands."""

    def __init__(
        self, loop: str, backend: str = "opencl", env: dict[str, str] | None = None
    ) -> None:
        self.backend = backend
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.relay_producer", loop, backend],
            cwd=_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(_ROOT), **(env or {})},
        )
        self.token = self.read_token()

    def read_token(self) -> FenceToken:
        """The next token the producer printed (blocks: called off the loop, or briefly)."""
        token = self.read()
        assert isinstance(token, FenceToken)
        return token

    def read(self) -> object:
        """The next value the producer printed (blocks)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the producer exited ({self.process.wait()}) before answering"
        return pickle.loads(bytes.fromhex(line.decode()))

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        self.process.stdin.flush()

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                with contextlib.suppress(BrokenPipeError):  # exiting already
                    self.send("quit")
            self.process.wait(_GUARD_S)
        finally:
            if self.process.poll() is None:  # it did not quit: the test fails, nothing leaks
                self.process.kill()
                self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture(params=["asyncio", "uvloop", "trio", "asyncio-cuda"])
def producer(request: pytest.FixtureRequest) -> Iterator[Producer]:
    """A producer whose event loop is asyncio, uvloop or trio, on OpenCL; or asyncio on CUDA.

    The relay is the same code on every backend; the CUDA producer runs on
    the emulated driver in CI (on the real one where the tests do).
    """
    loop, _, backend = request.param.partition("-")
    backend = backend or "opencl"
    env: dict[str, str] = {}
    if loop in ("trio", "uvloop"):
        pytest.importorskip(loop)
    if backend == "opencl":
        pytest.importorskip("pyopencl")  # the GPU check's machine may lack it
    if backend == "cuda":
        # The driver this run's tests use, emulated or real.
        env["LD_LIBRARY_PATH"] = request.getfixturevalue("driver_env").get("LD_LIBRARY_PATH", "")
        # This process opens the producer's interprocess events: with the
        # driver loaded, as asyncfence.warm_up() would load it.
        _cuda_devices.setdefault("cuda", open_default_device("cuda"))
        if request.node.get_closest_marker("fails_a_gate"):
            pytest.skip("the host cannot fail a CUDA stream")
    started = Producer(loop, backend, env)
    try:
        yield started
    finally:
        started.close()


async def test_the_import_resumes_after_the_producers_work_never_before(
    producer: Producer,
) -> None:
    imported = asyncfence.import_fence(producer.token)
    resumed: list[bool] = []

    async def wait() -> None:
        await imported
        resumed.append(True)

    with anyio.fail_after(_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await let_loop_run()
            assert not imported.done()
            assert resumed == []  # never before the work
            producer.send("release")
    assert resumed == [True]
    assert imported.done()
    await imported  # done stays done


@pytest.mark.fails_a_gate
async def test_the_producers_failed_work_raises_device_error(producer: Producer) -> None:
    imported = asyncfence.import_fence(producer.token)
    producer.send("fail")
    with anyio.fail_after(_GUARD_S), pytest.raises(DeviceError) as raised:
        await imported
    assert raised.value.backend == "opencl"
    with pytest.raises(DeviceError):
        imported.done()  # and again, each with its own copy


async def test_a_producer_killed_mid_work_ends_the_wait_with_a_clear_error(
    producer: Producer,
) -> None:
    imported = asyncfence.import_fence(producer.token)
    await let_loop_run()
    producer.send("die")
    with anyio.fail_after(_GUARD_S), pytest.raises(FenceLostError, match="pid"):
        await imported
    assert producer.process.wait(_GUARD_S) == 3


async def test_a_timeout_leaves_the_import_valid(producer: Producer) -> None:
    imported = asyncfence.import_fence(producer.token)
    with pytest.raises(TimeoutError):
        await imported.wait(timeout=0.01)
    producer.send("release")
    with anyio.fail_after(_GUARD_S):
        await imported.wait()


async def test_a_cancelled_wait_cancels_no_work_and_can_be_awaited_again(
    producer: Producer,
) -> None:
    imported = asyncfence.import_fence(producer.token)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(imported.wait)
            await let_loop_run()
            scope.cancel()
    assert scope.cancelled_caught
    assert not imported.done()
    producer.send("release")
    with anyio.fail_after(_GUARD_S):
        await imported


async def test_a_token_reused_after_its_fence_was_released_is_refused(
    producer: Producer,
) -> None:
    first = asyncfence.import_fence(producer.token)
    producer.send("release")
    with anyio.fail_after(_GUARD_S):
        await first
    again = asyncfence.import_fence(producer.token)
    with anyio.fail_after(_GUARD_S), pytest.raises(TokenRefusedError, match="used already"):
        await again


async def test_a_forged_token_is_refused(producer: Producer) -> None:
    forged = replace(producer.token, secret=secrets.token_bytes(len(producer.token.secret)))
    with anyio.fail_after(_GUARD_S), pytest.raises(TokenRefusedError):
        await asyncfence.import_fence(forged)
    producer.send("release")  # the real one still answers
    with anyio.fail_after(_GUARD_S):
        await asyncfence.import_fence(producer.token)


def test_a_synchronous_wait_blocks_its_thread_until_the_work_is_done(producer: Producer) -> None:
    imported = asyncfence.import_fence(producer.token)
    with pytest.raises(TimeoutError):
        imported.wait_sync(timeout=0.01)
    producer.send("release")
    imported.wait_sync(timeout=_GUARD_S)
    assert imported.done()


@pytest.mark.fails_a_gate
def test_a_synchronous_wait_raises_the_producers_failure(producer: Producer) -> None:
    imported = asyncfence.import_fence(producer.token)
    producer.send("fail")
    with pytest.raises(DeviceError):
        imported.wait_sync(timeout=_GUARD_S)


def test_a_token_pickles_and_hides_its_secret(producer: Producer) -> None:
    token = producer.token
    assert pickle.loads(pickle.dumps(token)) == token
    assert token.secret.hex() not in repr(token)
    assert token.producer_pid == producer.process.pid


def test_bad_tokens_are_refused_before_any_connection() -> None:
    with pytest.raises(TypeError, match="FenceToken"):
        asyncfence.import_fence("not a token")  # type: ignore[arg-type]


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="becoming another user needs root"
)
def test_a_token_presented_by_another_user_is_refused(producer: Producer) -> None:
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: another user, with asyncfence imported already
        outcome = "no answer"
        try:
            os.setgid(65534)
            os.setuid(65534)
            imported = asyncfence.import_fence(producer.token)
            deadline = time.monotonic() + _GUARD_S
            while time.monotonic() < deadline:
                try:
                    if imported.done():
                        outcome = "done"
                        break
                except TokenRefusedError as refused:
                    outcome = f"refused: {refused}"
                    break
                time.sleep(0.01)  # a forked child of the test, not a loop
        except BaseException as error:
            outcome = repr(error)
        finally:
            os.write(write_end, outcome.encode())
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as answer:
        outcome = answer.read().decode()
    assert outcome.startswith("refused: "), outcome
    assert "another user" in outcome

    async def the_owner_still_gets_its_answer() -> None:
        imported = asyncfence.import_fence(producer.token)  # not used up by the refusal
        producer.send("release")
        with anyio.fail_after(_GUARD_S):
            await imported

    anyio.run(the_owner_still_gets_its_answer)


@pytest.mark.usefixtures("no_thread_from_asyncfence")
async def test_no_thread_is_started_on_either_side(producer: Producer) -> None:
    imported = asyncfence.import_fence(producer.token)
    async with anyio.create_task_group() as tg:
        tg.start_soon(imported.wait)  # this side: the fixture fails a thread of asyncfence's
        await let_loop_run()
        producer.send("threads")
        # The producer's loop serves the export and waits for the fence meanwhile.
        assert producer.read() == ["MainThread"]
        producer.send("release")
    assert imported.done()


# -- in one process: the loop that exports may import too ------------------------------


async def test_an_import_on_the_exporting_loop_resumes_after_the_work(gate: StreamGate) -> None:
    fence = asyncfence.record(gate.stream)
    imported = asyncfence.import_fence(fence.export())
    await let_loop_run()
    assert not imported.done()
    gate.release()
    with anyio.fail_after(_GUARD_S):
        await imported
    assert fence.done()
    assert "done" in repr(imported)


async def test_each_export_answers_its_own_import(gate: StreamGate) -> None:
    fence = asyncfence.record(gate.stream)
    tokens = [fence.export() for _ in range(3)]
    assert len({token.secret for token in tokens}) == 3
    assert len({token.address for token in tokens}) == 1  # one relay per loop
    imported = [asyncfence.import_fence(token) for token in tokens]
    gate.release()
    with anyio.fail_after(_GUARD_S):
        for each in imported:
            await each


async def test_a_settled_import_is_still_a_checkpoint(gate: StreamGate) -> None:
    imported = asyncfence.import_fence(asyncfence.record(gate.stream).export())
    gate.release()
    with anyio.fail_after(_GUARD_S):
        await imported
    with anyio.CancelScope() as scope:
        scope.cancel()
        await imported  # done, yet the pending cancellation is delivered here
    assert scope.cancelled_caught


def test_an_export_needs_a_running_loop(queue: Any) -> None:
    fence = asyncfence.record(queue)
    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        fence.export()


async def test_an_export_off_linux_is_refused(queue: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fence = asyncfence.record(queue)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(NotImplementedError, match="needs Linux"):
        fence.export()


def test_an_import_whose_exporting_loop_ended_is_lost(queue: Any) -> None:
    fence = asyncfence.record(queue)

    async def export() -> FenceToken:
        return fence.export()

    token = anyio.run(export)
    with pytest.raises(FenceLostError, match="event loop that exported it ended"):
        asyncfence.import_fence(token)


def test_an_imported_fence_is_made_by_import_fence_and_never_pickled(gate: StreamGate) -> None:
    with pytest.raises(TypeError, match="import_fence"):
        asyncfence.ImportedFence()

    async def main() -> None:
        imported = asyncfence.import_fence(asyncfence.record(gate.stream).export())
        with pytest.raises(TypeError, match="send its FenceToken instead"):
            pickle.dumps(imported)
        gate.release()
        with anyio.fail_after(_GUARD_S):
            await imported

    anyio.run(main)


def test_a_secret_of_the_wrong_length_is_refused() -> None:
    token = FenceToken("asyncfence-nowhere", b"short", os.getpid(), "opencl")
    with pytest.raises(ValueError, match="32 bytes"):
        asyncfence.import_fence(token)


# -- CUDA: the importer's own device waits on the exporter's interprocess event ---------


@pytest.fixture
def cuda_producer(producer: Producer) -> Producer:
    if producer.backend != "cuda":
        pytest.skip("interprocess events are CUDA's")
    assert producer.token.interprocess is not None
    return producer


async def test_the_importers_device_ends_the_wait_with_the_exporters_loop_blocked(
    cuda_producer: Producer,
) -> None:
    imported = asyncfence.import_fence(cuda_producer.token)
    with anyio.fail_after(_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(imported.wait)
            await until(lambda: imported._accepted)  # the exporter took the token
            assert not imported.done()
            cuda_producer.send("release-and-block")  # its loop answers nothing from now on
        # The wait ended: this device's wait on the opened event resumed it.
    assert imported.done()
    cuda_producer.send("unblock")


@pytest.mark.usefixtures("emulated_driver")  # its hooks fault the producer's context
async def test_a_fault_in_the_exporters_context_raises_device_error(
    cuda_producer: Producer,
) -> None:
    imported = asyncfence.import_fence(cuda_producer.token)
    cuda_producer.send("fault")  # the opened event never completes now
    with anyio.fail_after(_GUARD_S), pytest.raises(DeviceError) as raised:
        await imported
    assert raised.value.backend == "cuda"
    assert raised.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"


async def test_a_stream_of_the_importer_waits_for_the_exporters_work(
    cuda_producer: Producer,
) -> None:
    stream = _cuda_devices["cuda"].new_stream()
    imported = asyncfence.import_fence(cuda_producer.token)
    imported.enqueue_wait(stream)
    after = asyncfence.record(stream)
    await let_loop_run()
    assert not after.done()  # held by the exporter's gate, in another process
    cuda_producer.send("release")
    with anyio.fail_after(_GUARD_S):
        await after
    with anyio.fail_after(_GUARD_S):
        await imported


async def test_an_opencl_import_has_no_device_wait(producer: Producer, queue: Any) -> None:
    if producer.backend != "opencl":
        pytest.skip("the relay alone carries an OpenCL fence")
    assert producer.token.interprocess is None
    imported = asyncfence.import_fence(producer.token)
    with pytest.raises(FenceError, match="no interprocess event"):
        imported.enqueue_wait(queue)
    producer.send("release")
    with anyio.fail_after(_GUARD_S):
        await imported
