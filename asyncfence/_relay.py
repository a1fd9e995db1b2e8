"""Fences that cross processes: the exporting side, its relay, and their protocol.

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

The importing side is :mod:`asyncfence._imported`.

Thread-safety: an exporting loop's relay belongs to its loop's thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple

from ._exceptions import DeviceError, FenceError
from ._loops import current_driver

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._core import FenceCore
    from ._loops import LoopDriver

# The protocol's names are shared with the importing side (``_imported.py``).
__all__ = [
    "ANSWER_ACCEPTED",
    "ANSWER_DONE",
    "ANSWER_ERROR",
    "ANSWER_FAILED",
    "ANSWER_LIMIT",
    "ANSWER_REFUSED",
    "LENGTH",
    "PROTOCOL",
    "SECRET_BYTES",
    "FenceToken",
    "export_core",
    "frame",
]

_logger = logging.getLogger("asyncfence.relay")

# A request: the protocol's tag, then the token's secret.
PROTOCOL: Final = b"AF1"
SECRET_BYTES: Final = 32
REQUEST_BYTES: Final = len(PROTOCOL) + SECRET_BYTES
# An answer: its length (4 bytes, big-endian), then one of these bytes and its
# details. The connection stays open after an answer where the importer may
# still wait on an interprocess handle: it closes, and the exporter then frees it.
# Before the answer, where the export has an interprocess handle: the token is
# good. Until then the importer's own device may not end its wait: a handle
# can outlive its token (used already, or presented twice).
ANSWER_ACCEPTED: Final = b"A"
ANSWER_DONE: Final = b"D"
ANSWER_FAILED: Final = b"F"  # then a DeviceError as JSON
ANSWER_REFUSED: Final = b"R"  # then why, in UTF-8
ANSWER_ERROR: Final = b"E"  # then a FenceError's message, in UTF-8
# Answers are a few hundred bytes; anything longer is not one.
ANSWER_LIMIT: Final = 64 * 1024
_PEER_CREDENTIALS: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
LENGTH: Final = struct.Struct("!I")


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
        interprocess: Where the backend has interprocess events (CUDA), the
            handle of one that completes with the fence, which the importer's
            own device waits on; ``None`` elsewhere, or once the fence was done.

    Thread-safety: immutable; any thread.
    """

    address: str
    secret: bytes = field(repr=False)
    producer_pid: int
    backend: str
    interprocess: bytes | None = field(default=None, repr=False)


class _Export(NamedTuple):
    """An exported fence, how to await it, and what keeps its interprocess handle valid."""

    core: FenceCore
    settled: Callable[[], Awaitable[None]]  # Fence.wait: returns once done, raises if failed
    kept: object  # or None


class _Relay:
    """One loop's exports, and the socket its system task serves them on. Loop thread only."""

    def __init__(self, driver: LoopDriver) -> None:
        self._driver = driver
        self._exports: dict[bytes, _Export] = {}
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

    def export(self, core: FenceCore, settled: Callable[[], Awaitable[None]]) -> FenceToken:
        secret = secrets.token_bytes(SECRET_BYTES)
        exported = core.export_marker()  # DeviceError: the fence cannot be exported
        handle, kept = (None, None) if exported is None else exported
        self._exports[secret] = _Export(core, settled, kept)
        return FenceToken(self.address, secret, os.getpid(), core.backend.name, handle)

    def _release_export(self, export: _Export) -> None:
        if export.kept is not None:
            try:
                export.core.backend.release_export(export.kept)
            except Exception:
                _logger.exception("asyncfence: releasing an exported fence's handle failed")

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
            # Never imported, so never opened: nobody can wait on their handles.
            exports, self._exports = self._exports, {}
            for export in exports.values():
                self._release_export(export)
            if self._driver.relay is self:
                self._driver.relay = None
            _live_relays.discard(self)

    async def _answer(self, connection: socket.socket) -> None:
        export: _Export | None = None
        try:
            try:
                answer, export = await self._answer_for(connection)
            except FenceError as error:  # the wait itself failed (forked, say)
                answer = ANSWER_ERROR + str(error).encode()
            except Exception:
                _logger.exception("asyncfence: the fence relay failed to answer an import")
                answer = ANSWER_ERROR + b"the exporting process failed to answer"
            with contextlib.suppress(OSError):  # the importer went away
                # A few hundred bytes on a fresh socket: never blocks.
                connection.send(frame(answer))
            if export is not None and export.kept is not None:
                # The importer may still wait on the handle with its device:
                # it is freed once the importer closes (or dies). Cancelled
                # before that (this loop ends), it is left to the process's
                # end: freeing it under a waiting importer is undefined.
                await self._until_closed(connection)
                self._release_export(export)
        finally:
            self._close(connection)

    async def _until_closed(self, connection: socket.socket) -> None:
        """Until the importer closes its end: a request is all it ever sends."""
        while True:
            try:
                if not connection.recv(64):
                    return
            except (BlockingIOError, InterruptedError):
                await self._driver.wait_readable(connection.fileno())
            except OSError:  # reset: gone as well
                return

    def _close(self, connection: socket.socket) -> None:
        self._connections.discard(connection)
        connection.close()

    async def _answer_for(self, connection: socket.socket) -> tuple[bytes, _Export | None]:
        _pid, uid, _gid = _PEER_CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
        )
        # Read before any answer: a socket closed with a request unread
        # resets, and the importer would lose the answer.
        request = await self._request(connection)
        if uid != os.geteuid():
            return ANSWER_REFUSED + b"the token was presented by a process of another user", None
        if len(request) != REQUEST_BYTES or not request.startswith(PROTOCOL):
            return ANSWER_REFUSED + b"that is not an asyncfence token", None
        export = self._exports.pop(request[len(PROTOCOL) :], None)
        if export is None:
            return (
                ANSWER_REFUSED + b"no such export: the token is forged, or was used already",
                None,
            )
        if export.kept is not None:
            with contextlib.suppress(OSError):  # the importer went away
                connection.send(frame(ANSWER_ACCEPTED))
        try:
            await export.settled()
        except DeviceError as error:
            return (
                ANSWER_FAILED
                + json.dumps(
                    {
                        "backend": error.backend,
                        "code": error.code,
                        "name": error.name,
                        "detail": error.detail,
                    }
                ).encode()
            ), export
        return ANSWER_DONE, export

    async def _request(self, connection: socket.socket) -> bytes:
        """The importer's request: up to its length, or what came before the end of stream."""
        request = b""
        while len(request) < REQUEST_BYTES:
            try:
                chunk = connection.recv(REQUEST_BYTES - len(request))
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


def frame(message: bytes) -> bytes:
    return LENGTH.pack(len(message)) + message


_live_relays: weakref.WeakSet[_Relay] = weakref.WeakSet()


def _close_relays_in_child() -> None:
    for relay in list(_live_relays):
        relay.close_in_forked_child()
    _live_relays.clear()


os.register_at_fork(after_in_child=_close_relays_in_child)


def export_core(core: FenceCore, settled: Callable[[], Awaitable[None]]) -> FenceToken:
    """Export ``core`` on the running loop's relay (see :meth:`asyncfence.Fence.export`).

    ``settled`` waits for it on this loop (its fence's ``wait``): the relay
    awaits it to answer the importer, and needs nothing else of the fence.
    """
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
    return relay.export(core, settled)
