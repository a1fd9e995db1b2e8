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
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import asyncfence
from asyncfence import (
    DeviceError,
    FenceError,
    FenceLostError,
    FenceToken,
    TokenRefusedError,
    _core,
)
from asyncfence._interprocess import _exporting, _protocol
from asyncfence._interprocess._peer import process_started, this_process
from asyncfence.testing import open_default_device

from .conftest import let_loop_run, until

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

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
    spare = request.node.get_closest_marker("spare_descriptors")
    if spare is not None:
        env["ASYNCFENCE_TEST_SPARE_FDS"] = str(spare.args[0])
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


needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="becoming another user needs root"
)
_NOBODY = 65534


def as_another_user(work: Callable[[], str]) -> str:
    """What ``work()`` returns, run in a forked child as the user nobody (or how it failed)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: another user, with asyncfence imported already
        outcome = "no outcome"
        try:
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            outcome = work()
        except BaseException as error:
            outcome = repr(error)
        finally:
            os.write(write_end, outcome.encode())
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as answer:
        return answer.read().decode()


def _raw_connection(token: FenceToken) -> socket.socket:
    """A connection to the token's relay that sends nothing (blocking, with a guard)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(_GUARD_S)
    connection.connect("\0" + token.address)
    return connection


def _read_answer(connection: socket.socket) -> bytes:
    """The first answer the relay sends on ``connection``, then the end of its stream."""
    received = b""
    while chunk := connection.recv(4096):
        received += chunk
    (length,) = struct.unpack_from("!I", received)
    assert len(received) == 4 + length, received
    return received[4:]


@needs_root
def test_a_token_presented_by_another_user_is_refused(producer: Producer) -> None:
    def import_it() -> str:
        try:
            asyncfence.import_fence(producer.token)
        except TokenRefusedError as refused:
            return f"refused: {refused}"
        return "imported"

    outcome = as_another_user(import_it)
    # Refused before the secret was sent: the importer checks the listener.
    assert outcome.startswith("refused: "), outcome
    assert "another user" in outcome
    assert "secret was not sent" in outcome

    async def the_owner_still_gets_its_answer() -> None:
        imported = asyncfence.import_fence(producer.token)  # not used up by the refusal
        producer.send("release")
        with anyio.fail_after(_GUARD_S):
            await imported

    anyio.run(the_owner_still_gets_its_answer)


@needs_root
def test_another_user_is_answered_at_accept_before_sending_anything(producer: Producer) -> None:
    # Not through import_fence: a raw connection that never sends a byte.
    outcome = as_another_user(lambda: _read_answer(_raw_connection(producer.token)).decode())
    assert outcome == "Rthe token was presented by a process of another user"


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


def _token_here(**fields: Any) -> FenceToken:
    """A token of this process, on this host, naming no export (fields as given)."""
    identity = this_process()
    token = FenceToken(
        address="asyncfence-nowhere",
        secret=bytes(32),
        producer_pid=identity.pid,
        backend="opencl",
        producer_started=identity.started,
        host=identity.host,
        pid_namespace=identity.pid_namespace,
    )
    return replace(token, **fields)


def test_a_secret_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        asyncfence.import_fence(_token_here(secret=b"short"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("address", b"asyncfence-nowhere"),
        ("secret", "x" * 32),
        ("producer_pid", "1"),
        ("producer_started", None),
        ("host", 7),
        ("pid_namespace", True),
        ("interprocess", "handle"),
    ],
)
def test_a_token_with_a_field_of_the_wrong_type_is_refused(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=field if field != "interprocess" else "interprocess"):
        asyncfence.import_fence(_token_here(**{field: value}))


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


# -- trust: every outcome crosses, and no other process can stop or pose as a relay ---


async def _until_the_relay_waits(producer: Producer) -> None:
    """Until the producer's relay waits on the fence (its answer is one of the loop's waits)."""
    with anyio.fail_after(_GUARD_S):
        while True:
            producer.send("waiters")
            if await anyio.to_thread.run_sync(producer.read) == 1:
                return
            await anyio.sleep(0.01)


async def test_a_failure_crosses_though_the_producer_awaits_it_and_then_blocks(
    producer: Producer, request: pytest.FixtureRequest
) -> None:
    # The producer's own task awaits the fence too, and once woken by its
    # failure never gives its loop back: the answer must be out by then.
    if producer.backend == "cuda":
        request.getfixturevalue("emulated_driver")  # its hooks fault the context
    imported = asyncfence.import_fence(producer.token)
    await _until_the_relay_waits(producer)
    producer.send("fail-await-block" if producer.backend == "opencl" else "fault-await-block")
    with anyio.fail_after(_GUARD_S), pytest.raises(DeviceError) as raised:
        await imported
    assert raised.value.backend == producer.backend
    producer.send("unblock")


def _relay_only(producer: Producer) -> None:
    """Skip the CUDA producer where a test is about the relay alone, the same on every backend.

    (The emulated driver keeps a descriptor per interprocess event: short of
    descriptors, it could not export.)
    """
    if producer.backend != "opencl":
        pytest.skip("the relay is the same on every backend; tested on OpenCL's")


@pytest.mark.spare_descriptors(24)
async def test_imports_beyond_the_producers_descriptors_wait_and_all_complete(
    producer: Producer,
) -> None:
    _relay_only(producer)
    # Each answer holds a descriptor until the work is done: most imports wait
    # in the backlog meanwhile, and none is lost, refused or called forged.
    count = 80
    tokens = []
    for _ in range(count):
        producer.send("export")
        tokens.append(await anyio.to_thread.run_sync(producer.read_token))
    imported = [asyncfence.import_fence(token) for token in tokens]
    await let_loop_run()
    producer.send("release")
    outcomes: list[str] = []

    async def wait(fence: asyncfence.ImportedFence) -> None:
        try:
            await fence
        except FenceError as error:
            outcomes.append(repr(error))
        else:
            outcomes.append("done")

    with anyio.fail_after(_GUARD_S * 3):
        async with anyio.create_task_group() as tg:
            for fence in imported:
                tg.start_soon(wait, fence)
    assert outcomes == ["done"] * count


@needs_root
@pytest.mark.spare_descriptors(24)
async def test_idle_connections_of_another_user_hold_nothing_of_the_producers(
    producer: Producer,
) -> None:
    _relay_only(producer)
    # Far more than the producer's spare descriptors, held open by another
    # user until the owner's import completes.
    ready_read, ready_write = os.pipe()
    go_read, go_write = os.pipe()
    address = producer.token.address

    def hold_connections() -> str:
        connections = []
        for _ in range(400):
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect("\0" + address)
            connections.append(connection)
        os.write(ready_write, b"r")
        os.read(go_read, 1)
        answered = sum(1 for c in connections if _answered_and_closed(c))
        return str(answered)

    child_outcome: list[str] = []

    def run_child() -> None:
        child_outcome.append(as_another_user(hold_connections))

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, run_child)
        with anyio.fail_after(_GUARD_S):
            assert await anyio.to_thread.run_sync(os.read, ready_read, 1) == b"r"
            imported = asyncfence.import_fence(producer.token)
            producer.send("release")
            await imported
        os.write(go_write, b"g")
    for fd in (ready_read, ready_write, go_read, go_write):
        os.close(fd)
    # Every one was refused and closed by the producer, none left open.
    assert child_outcome == ["400"]


def _answered_and_closed(connection: socket.socket) -> bool:
    connection.settimeout(_GUARD_S)
    try:
        answer = _read_answer(connection)
    except (OSError, struct.error):
        return False
    return answer.startswith(b"R") and b"another user" in answer


@pytest.mark.spare_descriptors(24)
async def test_idle_connections_of_the_same_user_are_cut_off_and_imports_complete(
    producer: Producer,
) -> None:
    _relay_only(producer)
    idle = [_raw_connection(producer.token) for _ in range(300)]
    try:
        imported = asyncfence.import_fence(producer.token)
        producer.send("release")
        with anyio.fail_after(_GUARD_S):
            await imported
        # Past 64 waiting for a request, the oldest were cut off to make room.
        answers = await anyio.to_thread.run_sync(
            lambda: [_read_answer(connection) for connection in idle[:-64]]
        )
        assert set(answers) == {b"Eno request came within the relay's deadline"}
    finally:
        for connection in idle:
            connection.close()


async def test_a_connection_that_sends_no_request_is_cut_off_at_its_deadline(
    gate: StreamGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_exporting, "REQUEST_DEADLINE_S", 0.05)
    token = asyncfence.record(gate.stream).export()
    idle = _raw_connection(token)
    idle.setblocking(False)
    try:
        with anyio.fail_after(_GUARD_S):
            await anyio.wait_readable(idle)
            answer = idle.recv(4096)
        assert answer == _protocol.frame(
            _protocol.ANSWER_ERROR + b"no request came within the relay's deadline"
        )
        with anyio.fail_after(_GUARD_S):
            await anyio.wait_readable(idle)
        assert idle.recv(4096) == b""  # and closed
    finally:
        idle.close()
        gate.release()
    imported = asyncfence.import_fence(token)  # the export was untouched
    with anyio.fail_after(_GUARD_S):
        await imported


def _squat(address: str, ready_write: int) -> str:
    """Listen at a dead exporter's address, answer "done" to all, report what came."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen()
    listener.settimeout(_GUARD_S)
    os.write(ready_write, b"r")
    received = b""
    with contextlib.suppress(TimeoutError):
        connection, _ = listener.accept()
        connection.settimeout(1.0)  # the importer sends at once, if ever
        # The importer may have closed already: it refused to talk to this.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            connection.sendall(_protocol.frame(_protocol.ANSWER_DONE))
        # What it sent comes first, then the end, or a reset (it closed with
        # the answer unread), or nothing more (an old importer awaits the answer).
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := connection.recv(4096):
                received += chunk
    return received.hex()


@pytest.mark.parametrize("squatter", ["another user", "the same user"])
async def test_a_process_at_a_dead_exporters_address_gets_no_secret(
    producer: Producer, squatter: str
) -> None:
    if squatter == "another user" and os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    producer.send("die")
    assert await anyio.to_thread.run_sync(producer.process.wait, _GUARD_S) == 3
    ready_read, ready_write = os.pipe()
    received: list[str] = []

    def work() -> str:
        return _squat(producer.token.address, ready_write)

    def squat() -> None:
        if squatter == "another user":
            received.append(as_another_user(work))
            return
        child = os.fork()  # of the same user, with another pid
        if child == 0:
            os.write(ready_write, work().encode() + b"\n")
            os._exit(0)
        os.waitpid(child, 0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, squat)
        with anyio.fail_after(_GUARD_S):
            assert await anyio.to_thread.run_sync(os.read, ready_read, 1) == b"r"
        with pytest.raises(FenceLostError, match=r"another process .* listens at its address"):
            asyncfence.import_fence(producer.token)
    if squatter == "the same user":
        received.append(os.read(ready_read, 4096).decode().strip())
    os.close(ready_read)
    os.close(ready_write)
    assert received == [""]  # it accepted the connection, and got not a byte


def test_a_token_from_another_host_is_refused_at_import() -> None:
    boot, _, network = this_process().host.partition("/")
    with pytest.raises(TokenRefusedError, match="another machine"):
        asyncfence.import_fence(_token_here(host=f"{boot}x/{network}"))
    with pytest.raises(TokenRefusedError, match="another network namespace"):
        asyncfence.import_fence(_token_here(host=f"{boot}/net:1"))


def test_a_token_carries_its_exporters_identity(producer: Producer) -> None:
    token = producer.token
    assert token.producer_pid == producer.process.pid
    assert token.producer_started == process_started(producer.process.pid)
    assert token.host == this_process().host
    assert token.pid_namespace == this_process().pid_namespace
    assert "host" not in repr(token)
    assert "started" not in repr(token)


# -- the settle listener the relay answers from ----------------------------------------


def test_a_settle_listener_runs_once_on_the_thread_that_settles(gate: StreamGate) -> None:
    core = asyncfence.record(gate.stream)._core
    heard: list[tuple[object, str]] = []
    forgotten: list[object] = []

    def listener(settled: object) -> None:
        heard.append((settled, threading.current_thread().name))

    assert core.on_settle(listener)
    assert core.on_settle(forgotten.append)
    core.forget_listener(forgotten.append)
    gate.release()
    while core.state == _core.PENDING:
        settler = threading.Thread(target=core.poll, name="settler")
        settler.start()
        settler.join()
    assert heard == [(core, "settler")]
    assert forgotten == []
    core.poll()
    assert heard == [(core, "settler")]  # once
    assert not core.on_settle(listener)  # settled already: nothing is called
    assert len(heard) == 1


async def test_an_imported_fences_waits_are_the_loops_like_any(producer: Producer) -> None:
    # Through the poller's one wake: counted, aged and woken as a local wait is.
    imported = asyncfence.import_fence(producer.token)
    # On CUDA the wait is parked on the opened event too: a core of its own.
    keys = 2 if producer.backend == "cuda" else 1
    async with anyio.create_task_group() as tg:
        tg.start_soon(imported.wait)
        tg.start_soon(imported.wait)
        with anyio.fail_after(_GUARD_S):
            await until(lambda: asyncfence.current_statistics().waiters == 2 * keys)
        stats = asyncfence.current_statistics(stuck_after=0)
        assert stats.pending_fences == keys
        assert stats.stuck_fences == keys
        assert stats.oldest_pending_age is not None
        producer.send("release")
    stats = asyncfence.current_statistics(stuck_after=0)
    assert (stats.waiters, stats.pending_fences, stats.stuck_fences) == (0, 0, 0)
