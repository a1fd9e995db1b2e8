"""Fences that cross processes: export a fence in one process, await it in another.

The relay works for every backend. The exporting process's event loop serves
its exports on a Unix socket in Linux's abstract namespace (no file to leave
behind), which admits only processes of the same user (``SO_PEERCRED``). An
importing process connects at :func:`import_fence` and presents its token's
secret; the exporter's loop awaits the fence (parked like any wait, with no
thread), answers with how the work ended, and closes. The importer's loop
watches its end of the connection: it becomes readable with the answer, or
at end of stream if the exporter went away (exited, crashed, or its loop
ended), which no answer can then follow. Design: ``docs/design.md``
("Fences across processes").

A token is a capability for one wait and nothing more: 32 random bytes
that name one export, answered once, then forgotten. Nothing a token holder
sends can make the exporter free, fail or run anything.

Thread-safety: an exporting loop's relay belongs to its loop's thread; an
:class:`ImportedFence` to the thread of the loop that awaits it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import secrets
import socket
import struct
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, final

from ._config import check_timeout
from ._exceptions import DeviceError, FenceError, FenceLostError, TokenRefusedError
from ._loops import current_driver
from ._validation import type_name

if TYPE_CHECKING:
    from collections.abc import Generator

    from ._core import FenceCore
    from ._loops import LoopDriver, Waiter

__all__ = ["FenceToken", "ImportedFence", "export_core", "import_fence"]

_logger = logging.getLogger("asyncfence.relay")

# A request: the protocol's tag, then the token's secret.
_PROTOCOL: Final = b"AF1"
_SECRET_BYTES: Final = 32
_REQUEST_BYTES: Final = len(_PROTOCOL) + _SECRET_BYTES
# An answer: one of these bytes, then its details; the connection's end ends it.
_DONE: Final = b"D"
_FAILED: Final = b"F"  # then a DeviceError as JSON
_REFUSED: Final = b"R"  # then why, in UTF-8
_ERROR: Final = b"E"  # then a FenceError's message, in UTF-8
# Answers are a few hundred bytes; anything longer is not one.
_ANSWER_LIMIT: Final = 64 * 1024
_PEER_CREDENTIALS: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class FenceToken:
    """A capability to await, in another process on this machine, one exported fence.

    Made by :meth:`asyncfence.Fence.export`; picklable and small, to send
    however the processes talk (a pipe, a queue, an HTTP request). Turn it
    back into an awaitable fence with :func:`asyncfence.import_fence`. Its
    secret is unguessable and answers one import; ``repr()`` leaves it out.

    Attributes:
        address: The exporting loop's relay socket, in Linux's abstract
            namespace (without the leading NUL byte).
        secret: The 32 random bytes that name the export.
        producer_pid: The exporting process, for messages.
        backend: The exported fence's backend, ``"opencl"`` or ``"cuda"``.

    Thread-safety: immutable; any thread.
    """

    address: str
    secret: bytes = field(repr=False)
    producer_pid: int
    backend: str


class _Relay:
    """One loop's exports, and the socket its system task serves them on. Loop thread only."""

    def __init__(self, driver: LoopDriver) -> None:
        self._driver = driver
        self._exports: dict[bytes, FenceCore] = {}
        self.address = f"asyncfence-{os.getpid()}-{secrets.token_hex(12)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.setblocking(False)
            listener.bind("\0" + self.address)  # abstract: no file system call
            listener.listen(socket.SOMAXCONN)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._connections: set[socket.socket] = set()
        if not driver.spawn_system_task(self._serve, "asyncfence relay"):
            listener.close()
            raise RuntimeError("cannot export a fence: the event loop is shutting down")
        _live_relays.add(self)

    def export(self, core: FenceCore) -> FenceToken:
        secret = secrets.token_bytes(_SECRET_BYTES)
        self._exports[secret] = core
        return FenceToken(self.address, secret, os.getpid(), core.backend.name)

    async def _serve(self) -> None:
        """Accept importers for as long as the loop runs; each gets a task of its own."""
        listener = self._listener
        try:
            while True:
                await self._driver.wait_readable(listener.fileno())
                while True:
                    try:
                        connection, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        # Out of descriptors, say. Closing the socket ends the
                        # waits of those queued behind it (end of stream):
                        # better than leaving them to hang.
                        _logger.exception("asyncfence: the fence relay cannot accept; it stops")
                        return
                    connection.setblocking(False)
                    self._connections.add(connection)
                    if not self._driver.spawn_system_task(
                        lambda connection=connection: self._answer(connection),  # type: ignore[misc]
                        "asyncfence relay answer",
                    ):
                        self._close(connection)
        finally:
            # Cancelled with its loop, or stopped: the importers still waiting
            # see the end of the stream, and the exports are gone.
            listener.close()
            self._exports.clear()
            if self._driver.relay is self:
                self._driver.relay = None
            _live_relays.discard(self)

    async def _answer(self, connection: socket.socket) -> None:
        try:
            try:
                answer = await self._answer_for(connection)
            except FenceError as error:  # the wait itself failed (forked, say)
                answer = _ERROR + str(error).encode()
            except Exception:
                _logger.exception("asyncfence: the fence relay failed to answer an import")
                answer = _ERROR + b"the exporting process failed to answer"
            with contextlib.suppress(OSError):  # the importer went away
                connection.send(answer)  # a few hundred bytes on a fresh socket: never blocks
        finally:
            self._close(connection)

    def _close(self, connection: socket.socket) -> None:
        self._connections.discard(connection)
        connection.close()

    async def _answer_for(self, connection: socket.socket) -> bytes:
        _pid, uid, _gid = _PEER_CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
        )
        # Read before any answer: a socket closed with a request unread
        # resets, and the importer would lose the answer.
        request = await self._request(connection)
        if uid != os.geteuid():
            return _REFUSED + b"the token was presented by a process of another user"
        if len(request) != _REQUEST_BYTES or not request.startswith(_PROTOCOL):
            return _REFUSED + b"that is not an asyncfence token"
        core = self._exports.pop(request[len(_PROTOCOL) :], None)
        if core is None:
            return _REFUSED + b"no such export: the token is forged, or was used already"
        from ._fence import Fence

        try:
            await Fence._of(core).wait()
        except DeviceError as error:
            return (
                _FAILED
                + json.dumps(
                    {
                        "backend": error.backend,
                        "code": error.code,
                        "name": error.name,
                        "detail": error.detail,
                    }
                ).encode()
            )
        return _DONE

    async def _request(self, connection: socket.socket) -> bytes:
        """The importer's request: up to its length, or what came before the end of stream."""
        request = b""
        while len(request) < _REQUEST_BYTES:
            try:
                chunk = connection.recv(_REQUEST_BYTES - len(request))
            except (BlockingIOError, InterruptedError):
                await self._driver.wait_readable(connection.fileno())
                continue
            if not chunk:
                break
            request += chunk
        return request

    def close_in_forked_child(self) -> None:
        """A forked child must not hold the parent's relay open: importers would hang on it."""
        self._listener.close()
        for connection in self._connections:
            connection.close()
        self._connections.clear()
        self._exports.clear()


_live_relays: weakref.WeakSet[_Relay] = weakref.WeakSet()


def _close_relays_in_child() -> None:
    for relay in list(_live_relays):
        relay.close_in_forked_child()
    _live_relays.clear()


os.register_at_fork(after_in_child=_close_relays_in_child)


def export_core(core: FenceCore) -> FenceToken:
    """Export ``core`` on the running loop's relay (see :meth:`asyncfence.Fence.export`)."""
    if not sys.platform.startswith("linux"):
        raise NotImplementedError(
            "exporting a fence needs Linux: its relay is a Unix socket in Linux's abstract "
            f"namespace that checks its peers with SO_PEERCRED (this is {sys.platform})"
        )
    try:
        driver = current_driver()
    except RuntimeError:
        raise RuntimeError(
            "exporting a fence needs a running asyncio or trio event loop: that loop "
            "answers the importing process"
        ) from None
    relay = driver.relay
    if not isinstance(relay, _Relay):
        relay = driver.relay = _Relay(driver)
    return relay.export(core)


def import_fence(token: FenceToken) -> ImportedFence:
    """Turn a token from another process's :meth:`~asyncfence.Fence.export` into a fence here.

    Connects to the exporting loop's relay and presents the token; it never
    blocks, and may be called off a loop or on one. What the exporter
    answers, the await of the returned fence raises: the work's
    :class:`~asyncfence.DeviceError`, or
    :class:`~asyncfence.TokenRefusedError`.

    Args:
        token: A :class:`FenceToken`, unpickled in this process.

    Returns:
        An :class:`ImportedFence` to await on this process's loop.

    Raises:
        TypeError: ``token`` is not a :class:`FenceToken`, or its fields
            have the wrong types.
        ValueError: Its secret is not 32 bytes long.
        FenceLostError: No process serves the token any more: its exporter
            exited, or its event loop ended.

    Thread-safety: any thread.
    """
    if not isinstance(token, FenceToken):
        raise TypeError(
            "import_fence() expects an asyncfence.FenceToken (from Fence.export()), "
            f"got {type_name(token)}"
        )
    if not isinstance(token.address, str) or not isinstance(token.secret, bytes):
        raise TypeError("a FenceToken's address must be a str and its secret bytes")
    if len(token.secret) != _SECRET_BYTES:
        raise ValueError(
            f"a FenceToken's secret is {_SECRET_BYTES} bytes long, got {len(token.secret)}"
        )
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        connection.setblocking(False)
        # A Unix socket connects at once, or refuses: no wait on either.
        connection.connect("\0" + token.address)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # Into an empty buffer: never blocks. The exporter may have
            # answered and closed already (a refusal needs no request): what
            # it sent, or the end of stream, is what the fence reads.
            connection.send(_PROTOCOL + token.secret, socket.MSG_NOSIGNAL)
    except (ConnectionRefusedError, FileNotFoundError):
        connection.close()
        raise FenceLostError(
            f"no process serves this token: its exporter (pid {token.producer_pid}) "
            "exited, or the event loop that exported it ended"
        ) from None
    except BlockingIOError:
        connection.close()
        raise FenceError(
            f"the exporting process (pid {token.producer_pid}) has too many imports "
            "waiting to be accepted; try again"
        ) from None
    except BaseException:
        connection.close()
        raise
    return ImportedFence._of(connection, token)


@final
class ImportedFence:
    """A fence that another process exported, to await on this process's loop.

    Made by :func:`asyncfence.import_fence`. ``await fence`` (or
    :meth:`wait`) resumes once the exporting process has seen its fence
    complete, and never before. No thread is spent: this loop watches the
    connection to the exporter, and the exporter's loop parks its own wait.

    Cancellation: cancelling a wait cancels nothing in either process and
    leaves other waits on the fence waiting; the fence can be awaited again.

    Thread-safety: the thread of the event loop that awaits it, one loop at
    a time.
    """

    __slots__ = (
        "__weakref__",
        "_answer",
        "_failure",
        "_reader",
        "_settled",
        "_socket",
        "_token",
        "_waiters",
    )

    _socket: socket.socket
    _token: FenceToken
    _answer: bytearray
    _settled: bool
    _failure: FenceError | None
    _reader: LoopDriver | None  # the driver of the loop whose system task reads
    _waiters: list[Waiter]

    def __new__(cls, *args: object, **kwargs: object) -> ImportedFence:
        raise TypeError("imported fences are made by asyncfence.import_fence(token)")

    @classmethod
    def _of(cls, connection: socket.socket, token: FenceToken) -> ImportedFence:
        fence = object.__new__(cls)
        fence._socket = connection
        fence._token = token
        fence._answer = bytearray()
        fence._settled = False
        fence._failure = None
        fence._reader = None
        fence._waiters = []
        return fence

    def __del__(self) -> None:
        connection = getattr(self, "_socket", None)
        if connection is not None:
            connection.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "an ImportedFence cannot be pickled: send its FenceToken instead (a token "
            "answers one import)"
        )

    def __repr__(self) -> str:
        state = "pending" if not self._settled else ("failed" if self._failure else "done")
        token = self._token
        return f"<asyncfence.ImportedFence {token.backend} from pid {token.producer_pid} {state}>"

    @property
    def token(self) -> FenceToken:
        """The token this fence was imported with."""
        return self._token

    def done(self) -> bool:
        """Whether the exporting process has seen the fence complete. Never blocks.

        Raises:
            DeviceError: The work before the fence failed.
            FenceLostError: The exporting process went away first.
            TokenRefusedError: The exporting process refused the token.
        """
        if not self._settled and self._reader is None:
            self._receive()
        if self._failure is not None:
            raise self._fresh_failure()
        return self._settled

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until the exporting process has seen the fence complete.

        Always a checkpoint, even when the answer is in already.

        Cancellation: as for the class; the cancellation propagates.

        Args:
            timeout: Seconds to wait at most; ``None`` waits without limit.

        Raises:
            TimeoutError: The timeout expired first; the fence can be awaited again.
            DeviceError: The work before the fence failed (the exporter's
                backend, code and name).
            FenceLostError: The exporting process exited, crashed or stopped
                serving (its event loop ended) before the fence completed.
            TokenRefusedError: The exporting process refused the token
                (forged, used already, or presented by another user).
            RuntimeError: No asyncio or trio loop runs the calling task, or
                another loop awaits this fence.
        """
        seconds = check_timeout(timeout)
        driver = current_driver()
        if self._settled or seconds == 0 or (self._reader is None and self._receive()):
            await driver.checkpoint()
            self._outcome(seconds)
            return
        self._ensure_reader(driver)
        waiter = driver.new_waiter()
        self._waiters.append(waiter)
        woken = False
        try:
            woken = await driver.suspend(waiter, seconds)
        finally:
            if not woken and waiter in self._waiters:
                self._waiters.remove(waiter)
        self._outcome(seconds)

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    # -- the answer ----------------------------------------------------------------

    def _ensure_reader(self, driver: LoopDriver) -> None:
        if self._reader is driver:
            return
        if self._reader is not None:
            raise RuntimeError(f"{self!r} is awaited on another event loop already")
        if not driver.spawn_system_task(self._read, "asyncfence imported fence"):
            raise RuntimeError("the event loop is shutting down")
        self._reader = driver

    async def _read(self) -> None:
        """The reader's system task: until the answer is in, then wake every wait."""
        driver = self._reader
        assert driver is not None
        try:
            while not self._receive():
                await driver.wait_readable(self._socket.fileno())
        finally:
            self._reader = None
            if self._settled:
                self._socket.close()
                waiters, self._waiters = self._waiters, []
                for waiter in waiters:
                    waiter.wake(None)  # each raises its own copy of the outcome

    def _receive(self) -> bool:
        """Read what the exporter sent, without blocking; whether the answer is complete."""
        if self._settled:
            return True
        while True:
            try:
                chunk = self._socket.recv(4096)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as error:
                self._settle(self._lost(f"reading its answer failed: {error}"))
                return True
            if not chunk:
                break
            self._answer += chunk
            if len(self._answer) > _ANSWER_LIMIT:
                self._settle(FenceError("the exporting process sent no asyncfence answer"))
                return True
        self._settle(self._parse(bytes(self._answer)))
        return True

    def _settle(self, failure: FenceError | None) -> None:
        self._failure = failure
        self._settled = True
        self._answer = bytearray()

    def _parse(self, answer: bytes) -> FenceError | None:
        kind, details = answer[:1], answer[1:]
        if kind == _DONE and not details:
            return None
        if kind == _FAILED:
            try:
                fields = json.loads(details)
                return DeviceError(
                    str(fields["backend"]),
                    int(fields["code"]),
                    str(fields["name"]),
                    str(fields["detail"]),
                )
            except (ValueError, KeyError, TypeError):
                return FenceError("the exporting process sent a malformed failure")
        if kind == _REFUSED:
            reason = details.decode(errors="replace")
            return TokenRefusedError(f"the exporting process refused the token: {reason}")
        if kind == _ERROR:
            return FenceError(details.decode(errors="replace"))
        if not answer:
            return self._lost("it went away before the fence completed")
        return FenceError("the exporting process sent no asyncfence answer")

    def _lost(self, why: str) -> FenceLostError:
        return FenceLostError(
            f"the exporting process (pid {self._token.producer_pid}) cannot tell how the "
            f"work ended: {why} (it exited or crashed, or its event loop ended)"
        )

    def _fresh_failure(self) -> FenceError:
        failure = self._failure
        assert failure is not None
        return copy.copy(failure).with_traceback(None)

    def _outcome(self, seconds: float) -> None:
        if self._failure is not None:
            raise self._fresh_failure()
        if not self._settled:
            raise TimeoutError(f"{self!r} did not complete within {seconds} s")
